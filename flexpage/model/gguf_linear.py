"""Projections that read a GGUF's quantised blocks (Q4_0, Q4_1, Q8_0, Q6_K) instead of float32 weights.

Why: a batch-1 decode step streams every weight from memory once. The default model's GGUF
stores its projections as Q4_1 (32 weights in 20 bytes) and its embedding, which is also its
LM head, as Q8_0 (34 bytes): dequantised to float32, 425 + 113 MB per forward; as the
kernel's blocks (scales widened to float32: 24 and 36 bytes), 80 + 31 MB. The op
(``flexpage::block_linear``, C++ in ``flexpage/backends/cpu/gguf_linear.cpp``) expands blocks in registers,
per output row, for up to 12 input rows; for more it expands 16 output rows at a time into a
float32 panel once per call and multiplies tiles of 6 input rows with it (a register-tiled
GEMM, where the expansion is paid once rather than once per few rows). On the 2-core AMD
EPYC Zen 3 (AVX2), one forward's projections and LM head (``python -m bench.gguf_linear``)
took 9-13 vs 27-35 ms through oneDNN's packed float32 at 1 row, 14 vs 35 at 4, 38-44 vs 45-51
at 12, 42 vs 52 at 16, 97-107 vs 115-122 at 48, 159-181 vs 195-203 at 96, 277 vs 328 at 128,
and within +-5% of oneDNN (either way, between runs) from 160 rows to 1,024. So a projection
with blocks keeps no float32 copy (:class:`~flexpage.model.packed_linear.PackedLinear`).

bf16 inputs: on CPUs with AVX512-BF16, up to 4 rows expand each output row's blocks in 16-wide
float32 registers, and more rows expand 32 output rows at a time into a bf16 panel (the model's
bf16 weights, rounded from the blocks exactly as they were) and multiply 12 input rows at a
time with vdpbf16ps; both prefetch the next row's or panel's blocks as they go. On the 2-core
AMD EPYC Zen 5, one forward's projections and LM head from memory took 0.41-0.56x the time of
oneDNN's packed bf16 at 1-4 rows, 0.68-0.86x at 8-128 and 0.99x at 1,024 (a third of the
bytes, and both threads given equal shares of the outputs). So where :func:`blocks_at_every_row` says so,
a bf16 projection keeps its blocks only, like float32. Elsewhere -- Intel CPUs with AMX, whose
oneDNN bf16 tiles outrun the panels on many rows -- a bf16 model keeps its packed bf16 weights
too and reads the blocks for up to :data:`MAX_BLOCK_ROWS` rows in float32 registers and for
5-:data:`MAX_TILE_ROWS` rows on the AMX tiles themselves (blocks expanded to bf16 into A tiles, ``x.T`` the B
tile: the same bits as oneDNN's packed bf16 from 2.4x fewer bytes), oneDNN's packed weight
beyond (:func:`block_or_packed_linear`).

The blocks expand to exactly the float32 weights the model was loaded with (``d * q [+ m]``
with ``d * q`` exact), which :func:`gguf_blocks` checks for every weight before using it:
results differ from the float32 path only in summation order.

The kernel is compiled on first use (~20 s, then cached by ``torch.utils.cpp_extension``) on
x86 CPUs with AVX2, FMA and F16C (:mod:`flexpage.backends.cpu.block_kernel`); elsewhere
:func:`available` is False and the float32 weights run as before -- said in the ``flexpage
serve`` banner, ``flexpage env`` and ``/metrics``, or refused with ``FLEXPAGE_KERNEL_FALLBACK=error``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator

import torch
from torch import Tensor

from flexpage.backends.cpu import block_kernel
from flexpage.backends.cpu.description import describe
from flexpage.model.gguf_file import gguf_tensors

__all__ = ["MAX_BLOCK_ROWS", "available", "block_linear", "blocks_at_every_row", "block_or_packed_linear", "embedding", "expand", "gguf_blocks",
           "repack"]

#: bytes of one GGUF block of 32 weights: fp16 scale d [, fp16 offset m], then the codes
GGUF_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
#: GGUF's Q6_K: 256 weights in 210 bytes (4-bit low codes, 2-bit high codes, 16 int8 scales sc,
#: fp16 d); weight = (d * sc[i // 16]) * (q - 32)
Q6_K_BYTES = 210
#: the format the kernel reads each GGUF kind as; Q6_K becomes ``Q8_16``: per 32 weights the two
#: 16-weight scales ``d * sc`` (exact in float32) and the 32 codes ``q - 32`` as signed bytes
KERNEL_KIND = {"Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q8_0": "Q8_0", "Q6_K": "Q8_16"}
#: bytes per 32 weights as the kernel reads them: the scales as float32 (Q4_0's ``m = -8 d`` is
#: computed, not stored), then the codes
BLOCK_BYTES = {"Q4_0": 20, "Q4_1": 24, "Q8_0": 36, "Q8_16": 40}
#: float32 scales per 32 weights in each kernel format
_SCALES = {"Q4_0": 1, "Q4_1": 2, "Q8_0": 1, "Q8_16": 2}
#: where a bf16 model keeps its packed weights too (AMX CPUs), its projections read their blocks
#: up to this many rows, oneDNN's packed bf16 beyond (:func:`block_or_packed_linear`): up to 4
#: rows the blocks' 16-wide float32 path took 0.41-0.56x packed bf16's time on the Zen 5.
MAX_BLOCK_ROWS = 4
#: bf16 rows (more than ``MAX_BLOCK_ROWS``) up to this many run on the AMX tiles where the CPU
#: has them (the kernel's ``amx::kRows``: four C tiles of 16 rows), oneDNN's packed bf16 beyond
MAX_TILE_ROWS = 64

#: GGUF tensor names (``blk.<i>.`` dropped) -> HF parameter names of a Llama-family model
_HF_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_HF_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}


@functools.cache
def available() -> bool:
    """True once the kernel is built and registered (x86 with AVX2/FMA/F16C and a C++ compiler).
    Where it cannot be, the fallback is recorded and warned about once, or raised as
    :class:`~flexpage.backends.cpu.fallback.KernelFallbackError` under
    ``FLEXPAGE_KERNEL_FALLBACK=error`` (:mod:`flexpage.backends.cpu.block_kernel`)."""
    if not block_kernel.build():
        return False
    torch.library.register_fake("flexpage::block_linear")(_block_linear_shape)
    torch.library.register_fake("flexpage::block_or_packed_linear")(_block_or_packed_linear_shape)
    return True


def blocks_at_every_row(dtype: torch.dtype) -> bool:
    """True where a projection of ``dtype`` computes every row count from its blocks, keeping no
    weight beside them: float32 wherever the kernel is built; bf16 where the CPU has AVX512-BF16
    (the kernel's bf16 panels) and no AMX (whose oneDNN tiles outrun them once rows are many)."""
    if not available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and describe().bf16_blocks_at_every_row(bool(torch.ops.flexpage.has_bf16_panels()))


def _block_linear_shape(x: Tensor, blocks: Tensor, bias: Tensor | None, valid_rows: Tensor | None = None) -> Tensor:
    return x.new_empty(x.shape[0], blocks.shape[0])


def _block_or_packed_linear_shape(x: Tensor, blocks: Tensor, packed: Tensor, bias: Tensor | None,
                                  max_block_rows: int, valid_rows: Tensor | None = None) -> Tensor:
    return x.new_empty(x.shape[0], blocks.shape[0])


def block_linear(x: Tensor, blocks: Tensor, bias: Tensor | None = None, valid_rows: Tensor | None = None) -> Tensor:
    """``x @ W.T + bias`` in ``x``'s dtype (float32 or bf16) for ``W`` given as the kernel's blocks
    (:func:`repack`), Q4_1 ``[out, in / 32 * 24]`` or Q8_0 ``[out, in / 32 * 36]``. ``valid_rows``
    (a one-value integer tensor: a compiled step's row count before its padding): the rows from
    it on are padding, their outputs zeros and not computed. Needs :func:`available`."""
    return torch.ops.flexpage.block_linear(x, blocks, bias, valid_rows)


def block_or_packed_linear(x: Tensor, blocks: Tensor, packed: Tensor, bias: Tensor | None = None,
                           valid_rows: Tensor | None = None) -> Tensor:
    """``x @ W.T + bias`` in ``x``'s dtype for ``W`` given twice: as the kernel's blocks, read for up
    to :data:`MAX_BLOCK_ROWS` rows (:func:`block_linear`, ``valid_rows`` as there; bf16 on AMX
    CPUs: up to 16, on the tiles), and packed for oneDNN (``packed``, ``x``'s dtype) for more,
    padding rows and all. One operator that picks per call, so one compiled graph serves
    batch-1 decode and prefill alike. Needs :func:`available`."""
    return torch.ops.flexpage.block_or_packed_linear(x, blocks, packed, bias, MAX_BLOCK_ROWS, valid_rows)


def embedding(token_ids: Tensor, blocks: Tensor, features: int) -> Tensor:
    """Rows ``token_ids`` of an embedding table of ``features`` columns kept as the kernel's
    blocks (:func:`repack`), expanded after the lookup: exactly the float32 rows of the table
    (``d * q [+ m]`` as :func:`expand` computes it). Plain tensor operations (compiles)."""
    rows = blocks[token_ids].view(token_ids.shape[0], features // 32, -1)
    kind = next((k for k, width in BLOCK_BYTES.items() if width == rows.shape[-1]), None)
    if kind is None:
        raise ValueError(f"embedding: blocks of {blocks.shape[1]} bytes per row for {features} features are "
                         f"{rows.shape[-1]} bytes per 32 weights, none of the kernel's formats ({BLOCK_BYTES})")
    scale_bytes = 4 * _SCALES[kind]
    scales = rows[..., :scale_bytes].contiguous().view(torch.float32)
    return _dequantise(kind, scales, rows[..., scale_bytes:]).reshape(-1, features)


def expand(kind: str, blocks: Tensor) -> Tensor:
    """The float32 weights ``[out, in]`` of GGUF ``blocks`` (uint8, ``[out, bytes per row]``) as
    GGUF dequantises them: Q4_0 ``d * (q - 8)``, Q4_1 ``d * q + m`` (low nibbles first), Q8_0
    ``d * q``, Q6_K ``(d * sc) * (q - 32)``."""
    scales, codes = _split(kind, blocks)
    return _dequantise(KERNEL_KIND[kind], scales, codes).reshape(blocks.shape[0], -1)


def _split(kind: str, blocks: Tensor) -> tuple[Tensor, Tensor]:
    """GGUF ``blocks`` in the kernel's format (:data:`KERNEL_KIND`): float32 scales
    ``[out, in / 32, 1 or 2]`` and code bytes ``[out, in / 32, 16 or 32]``."""
    if kind == "Q6_K":
        return _split_q6_k(blocks)
    b = blocks.view(blocks.shape[0], -1, GGUF_BLOCK_BYTES[kind])
    scale_bytes = 4 if kind == "Q4_1" else 2  # float16 d (and m)
    return b[..., :scale_bytes].contiguous().view(torch.float16).float(), b[..., scale_bytes:]


def _split_q6_k(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """Q6_K super-blocks (GGUF's order: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8
    scales, fp16 d) as ``Q8_16`` scales ``d * sc`` and signed codes ``q - 32``, 32 weights per block."""
    rows = blocks.shape[0]
    b = blocks.view(-1, Q6_K_BYTES)
    low = torch.stack((b[:, :128] & 0x0F, b[:, :128] >> 4), dim=1)  # [n, 2, 128]: low nibble, high nibble
    low = low.view(-1, 2, 2, 64).transpose(1, 2).reshape(-1, 8, 32)  # weights 0-127 then 128-255, in order
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    high = ((b[:, 128:192].view(-1, 2, 1, 32) >> shifts) & 0x03).reshape(-1, 8, 32)
    codes = ((low | (high << 4)).to(torch.int16) - 32).to(torch.int8).view(torch.uint8)
    d = b[:, 208:210].contiguous().view(torch.float16).float()  # [n, 1]
    scales = d * b[:, 192:208].contiguous().view(torch.int8).float()  # [n, 16]: exact (11 x 8 bits)
    return scales.view(rows, -1, 2), codes.view(rows, -1, 32)


def _dequantise(kind: str, scales: Tensor, codes: Tensor) -> Tensor:
    """Blocks ``[..., 32]`` of float32 weights from their kernel-format scales (float32) and code
    bytes: Q4_0 ``d * q - 8 d``, Q4_1 ``d * q + m`` (low nibbles first), Q8_0 ``d * q``, Q8_16
    ``d0 * q`` (first 16) and ``d1 * q`` (last 16)."""
    if kind in ("Q8_0", "Q8_16"):
        q = codes.contiguous().view(torch.int8).float()
        return scales.repeat_interleave(32 // scales.shape[-1], dim=-1) * q
    q = torch.cat((codes & 0x0F, codes >> 4), dim=-1).float()
    offset = -8 * scales if kind == "Q4_0" else scales[..., 1:]
    return scales[..., :1] * q + offset


def repack(kind: str, blocks: Tensor) -> Tensor:
    """GGUF ``blocks`` as the kernel reads them, ``[out, in / 32 * BLOCK_BYTES[KERNEL_KIND[kind]]]``:
    each block's fp16 scales widened to float32 (exactly), its codes unchanged; a Q6_K
    super-block becomes eight ``Q8_16`` blocks."""
    scales, codes = _split(kind, blocks)
    return torch.cat((scales.view(torch.uint8), codes), dim=-1).reshape(blocks.shape[0], -1)


def gguf_blocks(gguf_path: str | os.PathLike[str], model: torch.nn.Module) -> dict[str, Tensor]:
    """The kernel's blocks (:func:`repack`) of ``model``'s weights stored as Q4_0, Q4_1, Q8_0 or Q6_K in the
    GGUF ``model`` was converted from, by HF parameter name (``model.layers.0.self_attn.q_proj.weight``;
    a tied LM head under both of its names). Needs :func:`available`.

    Only blocks that expand to exactly the model's float32 weight, or round to exactly its
    bfloat16 weight, are returned (trying the row order llama.cpp permutes q and k into);
    anything else -- other quantisations, other architectures' names, a model modified after
    loading -- keeps its weight only. A bfloat16 model's blocks are the weights it was rounded
    from: computed from them, results are float32's.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    config = model.config.get_text_config()
    head_counts = {config.num_attention_heads, getattr(config, "num_key_value_heads", config.num_attention_heads)}
    found: dict[str, Tensor] = {}
    for tensor in gguf_tensors(gguf_path):
        name, kind = _hf_name(tensor.name), tensor.type_name
        if kind not in KERNEL_KIND or name not in params:
            continue
        weight = params[name]
        if weight.dtype not in (torch.float32, torch.bfloat16) or weight.is_meta:
            continue
        raw = torch.from_numpy(tensor.data.copy()).reshape(weight.shape[0], -1)
        candidates = (repack(kind, b) for b in _row_orders(raw, head_counts))
        blocks = next((b for b in candidates if torch.ops.flexpage.blocks_match(b, weight.detach())), None)
        if blocks is not None:
            found.update((alias, blocks) for alias, param in params.items() if param is weight)
    return found


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _HF_TOP_NAMES:
        return _HF_TOP_NAMES[gguf_name]
    parts = gguf_name.split(".")  # blk.<i>.<kind>.weight
    if len(parts) != 4 or parts[0] != "blk" or parts[3] != "weight" or parts[2] not in _HF_NAMES:
        return None
    return f"model.layers.{parts[1]}.{_HF_NAMES[parts[2]]}.weight"


def _row_orders(blocks: Tensor, head_counts: set[int]) -> Iterator[Tensor]:
    """``blocks`` as stored, then with rows un-permuted as llama.cpp's converter permutes q and
    k for each head count that divides them (what transformers' GGUF loader undoes)."""
    yield blocks
    rows = blocks.shape[0]
    for heads in sorted(head_counts):
        if rows % (2 * heads) == 0:
            yield blocks.view(heads, rows // heads // 2, 2, -1).transpose(1, 2).reshape(rows, -1).contiguous()
