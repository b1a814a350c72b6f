"""Linear layers whose weights are reordered once into oneDNN's blocked layout.

Why: eager ``F.linear`` on a bf16 CPU tensor hands oneDNN a plain row-major weight, which
it reorders into its blocked (AVX512-BF16 / AMX) layout on every call. At decode-sized
inputs that reorder costs as much as the matmul: on this project's 2-core AVX512-BF16
machine, a 576x3072 projection takes 158 us plain vs 47 us pre-packed for one row and
~0.8-0.9x at 64 rows, with
the same results (the same oneDNN kernel, minus the reorder: bit-identical on the AMX and
AVX512-BF16 CPUs tried, though oneDNN may pick another kernel elsewhere). Inductor's
``freezing`` pass does the same for compiled models; this applies it to eager layers.

bf16 weights are packed on CPUs where oneDNN runs bf16, float32 weights wherever oneDNN is
built in: on the 2-core AMD EPYC Zen 3 (AVX2), one forward's worth of SmolLM2's projections
took 0.42-0.44x the time of ``F.linear`` (MKL) at 2-8 rows, 0.62-0.84x at 16-64 and the same
from 256 rows (``bench/packed_linear.py``); MKL's own packed path had measured 0.99-1.05x of
``F.linear`` on the Intel Xeon. Other dtypes and devices keep ``F.linear``.

Row counts come in buckets (:func:`padded_rows`). oneDNN builds and caches a kernel for every
input shape it meets: on the AMX test machine a 576->1536 projection took 2.9 ms and ~0.9 MiB
of memory per new row count, and ideep's cache keeps up to 1024 of them (``LRU_CACHE_CAPACITY``).
A server meets every row count from 1 to ``max_num_batched_tokens``: its RSS grew by ~370 MiB
in a 6-minute soak (``bench/soak.py``), and each first-seen count stalled its step. Inputs are
zero-padded to one of 20-32 bucket sizes up to 1024 rows instead (at most 25% extra rows above
128), and :meth:`PackedLinear.prime` builds every bucket's kernel up front. Below 128 rows
the bf16 buckets step by 16 rows on CPUs with AMX, whose tiles hold 16 rows (a bf16 matmul of 1
or 16 rows costs the same, 80 us), and by 8 elsewhere: with AVX512-BF16 alone, one
forward's projections of SmolLM2 take 16-18 ms for 1 to 8 rows and 27.6 ms for 16, so
padding a lone decode row to 16 cost a third of its step. float32 steps by 2 rows (below 16):
its cost grows from 2 rows on (on the Zen 3, 15.8 ms for 2 rows, 22.4 ms for 8).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from flexpage.backends.cpu.description import describe
from flexpage.model.gguf_linear import MAX_BLOCK_ROWS, MAX_TILE_ROWS, block_linear, blocks_at_every_row

__all__ = ["PackedLinear", "can_prepack", "padded_rows", "row_step", "tiled_linear", "tiled_rows"]

#: the row count oneDNN tunes the packed layout for (a decode batch); any count works
_BATCH_HINT = 64


def row_step(dtype: torch.dtype) -> int:
    """Packed inputs of ``dtype`` are padded to a multiple of this many rows at least: bf16 16
    where AMX tiles hold 16 rows (fewer cost as much), 8 where the vector kernels' cost grows
    with the rows; float32 2 (its cost grows from 2 rows; and the compiled step needs 2)."""
    return describe().row_step(dtype)


#: the row step of bf16 weights, the dtype most callers pad for
ROW_STEP = row_step(torch.bfloat16)


def padded_rows(rows: int, row_step: int = ROW_STEP) -> int:
    """The bucket a packed linear computes ``rows`` inputs as: multiples of ``row_step`` up to
    ``8 * row_step`` rows, then four sizes per doubling (with 16: 16, 32, ..., 128, 160, 192,
    224, 256, 320, ...)."""
    octave = 1 << max(0, rows - 1).bit_length()  # the smallest power of two >= rows
    step = max(row_step, octave // 8)
    return -(-max(rows, 1) // step) * step


def can_prepack(weight: Tensor) -> bool:
    """True when ``weight`` would run faster packed for oneDNN (on the CPU: float32 wherever
    oneDNN is built in, bf16 where oneDNN has bf16 kernels)."""
    return weight.device.type == "cpu" and describe().can_prepack(weight.dtype)


def tiled_rows(matmul: Callable[[Tensor], Tensor], x: Tensor, row_tile: int) -> Tensor:
    """``matmul(x)`` computed ``row_tile`` rows at a time (the last tile zero-padded), so that
    every row goes through the same kernel whatever the row count.

    Why: oneDNN and MKL pick their kernel and its blocking of the summed dimension by the row
    count, so one row's result depends on how many rows share the call (in bf16 on the AMX
    test machine, most row counts from 48 to 1,024 gave other bits than 16-row calls).
    Calls of one shape run one kernel, and rows in it are summed alike: deterministic mode
    (``EngineConfig.deterministic``) uses this for every projection.
    """
    rows = x.shape[0]
    padded = -(-max(rows, 1) // row_tile) * row_tile
    x = F.pad(x, (0, 0, 0, padded - rows)) if padded != rows else x.contiguous()
    out = torch.cat([matmul(x[start:start + row_tile]) for start in range(0, padded, row_tile)])
    return out[:rows] if padded != rows else out


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None, packed: bool) -> Tensor:
    if packed:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _tiled_linear(x: Tensor, weight: Tensor, bias: Tensor | None, packed: bool, row_tile: int) -> Tensor:
    if x.shape[0] == row_tile:  # one tile: the common decode step, no padding or concatenation
        return _linear(x, weight, bias, packed)
    return tiled_rows(lambda rows: _linear(rows, weight, bias, packed), x, row_tile)


# A compiled graph cannot loop over a run-time number of tiles, and Inductor would fuse or
# re-tile a plain matmul: as an operator of its own, the tiled projection stays one opaque
# call in the graph (registered directly on a Library: ``torch.library.custom_op``'s wrapper
# cost ~45 us per call on the 2-core machine, this ~15-40 us).
_LIBRARY = torch.library.Library("flexpage", "DEF")
_LIBRARY.define("tiled_linear(Tensor x, Tensor weight, Tensor? bias, bool packed, int row_tile) -> Tensor")
_LIBRARY.impl("tiled_linear", _tiled_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("flexpage::tiled_linear")
def _tiled_linear_shape(x: Tensor, weight: Tensor, bias: Tensor | None, packed: bool, row_tile: int) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def tiled_linear(x: Tensor, weight: Tensor, bias: Tensor | None, packed: bool, row_tile: int) -> Tensor:
    """``x @ weight.T + bias`` in calls of exactly ``row_tile`` rows (:func:`tiled_rows`), as one
    operator that ``torch.compile`` keeps whole; ``packed``: ``weight`` is packed for oneDNN."""
    return torch.ops.flexpage.tiled_linear(x, weight, bias, packed, row_tile)


class PackedLinear:
    """``y = x @ weight.T + bias``, with the weight pre-packed where :func:`can_prepack` says so.

    ``row_tile``: compute in calls of exactly this many rows (:func:`tiled_rows`): every row's
    result is then the same bits in any batch.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None = None, *, prepack: bool = True,
                 row_tile: int | None = None, blocks: Tensor | None = None) -> None:
        """``blocks``: ``weight`` as GGUF blocks (:mod:`~flexpage.model.gguf_linear`), used where
        packing is allowed and there is no row tile. Where the block kernel is as fast as oneDNN
        at every row count (:func:`~flexpage.model.gguf_linear.blocks_at_every_row`: float32, and
        bf16 on CPUs with AVX512-BF16 but no AMX) the layer keeps the blocks only and ``weight``
        is None. Elsewhere a bf16 layer packed for oneDNN keeps both and reads the blocks for up
        to ``MAX_BLOCK_ROWS`` rows only (batch-1 decode reads 40% of bf16's bytes)."""
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.row_tile = row_tile
        usable = prepack and row_tile is None and (
            weight.dtype == torch.float32 or weight.dtype == torch.bfloat16 and can_prepack(weight))
        self.blocks = blocks if usable else None
        blocks_only = self.blocks is not None and blocks_at_every_row(weight.dtype)
        # the block kernel's work grows with every row, as float32's does
        self.row_step = row_step(torch.float32 if blocks_only else weight.dtype)
        self.packed = not blocks_only and prepack and can_prepack(weight)
        self.weight = (torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT) if self.packed
                       else None if self.blocks is not None else weight)
        self._record_path(weight, blocks is not None)

    def _record_path(self, weight: Tensor, offered_blocks: bool) -> None:
        """Say in the CPU description's paths which path this projection takes, and why."""
        dtype = str(weight.dtype).removeprefix("torch.")
        if self.blocks is not None:
            choice = (f"GGUF blocks ({dtype})" if self.weight is None
                      else f"GGUF blocks up to {MAX_BLOCK_ROWS} rows ({MAX_TILE_ROWS} where AMX tiles run them), oneDNN packed {dtype} beyond")
            reason = ("the block kernel covers every row count here" if self.weight is None
                      else "AMX: oneDNN's bf16 tiles outrun the blocks' panels on many rows")
        elif self.row_tile is not None:
            choice = f"{'oneDNN packed' if self.packed else 'F.linear'} {dtype} in tiles of {self.row_tile} rows"
            reason = "deterministic: every row through the same kernel"
        elif self.packed:
            choice, reason = f"oneDNN packed {dtype}", f"rows padded to buckets of {self.row_step}"
        else:
            choice = f"F.linear {dtype}"
            reason = ("not packed (prepack off)" if weight.device.type == "cpu" and describe().can_prepack(weight.dtype)
                      else f"oneDNN has no packed {dtype} kernel here")
        if offered_blocks and self.blocks is None:
            reason += "; the GGUF blocks unused (deterministic, or the dtype)"
        describe().paths.record("projections", choice, reason)

    @property
    def owns_weight(self) -> bool:
        """True when the layer computes from a copy of its own (packed, or blocks): the weight it
        was made from is no longer needed."""
        return self.packed or self.blocks is not None

    def __call__(self, x: Tensor) -> Tensor:
        """``x``: ``[rows, in_features]`` -> ``[rows, out_features]``."""
        if self.blocks is not None and (self.weight is None or x.shape[0] <= MAX_BLOCK_ROWS):
            return block_linear(x.contiguous(), self.blocks, self.bias)
        if self.row_tile is not None:
            return _tiled_linear(x, self.weight, self.bias, self.packed, self.row_tile)
        if not self.packed:
            return F.linear(x, self.weight, self.bias)
        rows = x.shape[0]
        padded = padded_rows(rows, self.row_step)
        x = F.pad(x, (0, 0, 0, padded - rows)) if padded != rows else x.contiguous()
        out = _linear(x, self.weight, self.bias, True)
        return out[:rows] if padded != rows else out

    def prime(self, max_rows: int) -> None:
        """Build the kernel of every row bucket up to ``max_rows`` now, not on a request's path."""
        if not self.packed:
            return
        if self.row_tile is not None:  # one shape
            self(torch.zeros(self.row_tile, self.in_features, dtype=self.weight.dtype))
            return
        x = torch.zeros(padded_rows(max_rows, self.row_step), self.in_features, dtype=self.weight.dtype)
        for rows in sorted({padded_rows(r, self.row_step) for r in range(1, max_rows + 1)}):
            self(x[:rows])
