"""Projections that read a GGUF's quantised blocks (Q4_1, Q8_0) instead of float32 weights.

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
5-16 rows on the AMX tiles themselves (blocks expanded to bf16 into A tiles, ``x.T`` the B
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
GGUF_BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}
#: bytes of one block as the kernel reads it: the scales as float32, then the same codes
BLOCK_BYTES = {"Q4_1": 24, "Q8_0": 36}
#: where a bf16 model keeps its packed weights too (AMX CPUs), its projections read their blocks
#: up to this many rows, oneDNN's packed bf16 beyond (:func:`block_or_packed_linear`): up to 4
#: rows the blocks' 16-wide float32 path took 0.41-0.56x packed bf16's time on the Zen 5.
MAX_BLOCK_ROWS = 4

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


def _block_linear_shape(x: Tensor, blocks: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty(x.shape[0], blocks.shape[0])


def _block_or_packed_linear_shape(x: Tensor, blocks: Tensor, packed: Tensor, bias: Tensor | None,
                                  max_block_rows: int) -> Tensor:
    return x.new_empty(x.shape[0], blocks.shape[0])


def block_linear(x: Tensor, blocks: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ W.T + bias`` in ``x``'s dtype (float32 or bf16) for ``W`` given as the kernel's blocks
    (:func:`repack`), Q4_1 ``[out, in / 32 * 24]`` or Q8_0 ``[out, in / 32 * 36]``. Needs
    :func:`available`."""
    return torch.ops.flexpage.block_linear(x, blocks, bias)


def block_or_packed_linear(x: Tensor, blocks: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ W.T + bias`` in ``x``'s dtype for ``W`` given twice: as the kernel's blocks, read for up
    to :data:`MAX_BLOCK_ROWS` rows (:func:`block_linear`; bf16 on AMX CPUs: up to 16, on the
    tiles), and packed for oneDNN (``packed``, ``x``'s dtype) for more. One operator that picks per call, so one compiled
    graph serves batch-1 decode and prefill alike. Needs :func:`available`."""
    return torch.ops.flexpage.block_or_packed_linear(x, blocks, packed, bias, MAX_BLOCK_ROWS)


def embedding(token_ids: Tensor, blocks: Tensor, features: int) -> Tensor:
    """Rows ``token_ids`` of an embedding table of ``features`` columns kept as the kernel's
    blocks (:func:`repack`), expanded after the lookup: exactly the float32 rows of the table
    (``d * q [+ m]`` as :func:`expand` computes it). Plain tensor operations (compiles)."""
    rows = blocks[token_ids].view(token_ids.shape[0], features // 32, -1)
    kind = next((k for k, width in BLOCK_BYTES.items() if width == rows.shape[-1]), None)
    if kind is None:
        raise ValueError(f"embedding: blocks of {blocks.shape[1]} bytes per row for {features} features are "
                         f"{rows.shape[-1]} bytes per 32 weights, neither Q4_1 ({BLOCK_BYTES['Q4_1']}) "
                         f"nor Q8_0 ({BLOCK_BYTES['Q8_0']})")
    scale_bytes = 8 if kind == "Q4_1" else 4  # float32 d (and m)
    scales = rows[..., :scale_bytes].contiguous().view(torch.float32)
    return _dequantise(kind, scales, rows[..., scale_bytes:]).reshape(-1, features)


def expand(kind: str, blocks: Tensor) -> Tensor:
    """The float32 weights ``[out, in]`` of GGUF ``blocks`` ``[out, in / 32 * GGUF_BLOCK_BYTES[kind]]``
    (uint8) as GGUF dequantises them: Q4_1 ``d * q + m`` (low nibbles first), Q8_0 ``d * q``."""
    rows = blocks.shape[0]
    b = blocks.view(rows, -1, GGUF_BLOCK_BYTES[kind])
    scale_bytes = 4 if kind == "Q4_1" else 2  # float16 d (and m)
    scales = b[..., :scale_bytes].contiguous().view(torch.float16).float()
    return _dequantise(kind, scales, b[..., scale_bytes:]).reshape(rows, -1)


def _dequantise(kind: str, scales: Tensor, codes: Tensor) -> Tensor:
    """Blocks ``[..., 32]`` of float32 weights from their scales ``[..., 1 or 2]`` (float32 d,
    and m for Q4_1) and code bytes: Q4_1 ``d * q + m`` (low nibbles first), Q8_0 ``d * q``."""
    if kind == "Q8_0":
        return scales * codes.contiguous().view(torch.int8).float()
    q = torch.cat((codes & 0x0F, codes >> 4), dim=-1).float()
    return scales[..., :1] * q + scales[..., 1:]


def repack(kind: str, blocks: Tensor) -> Tensor:
    """GGUF ``blocks`` as the kernel reads them, ``[out, in / 32 * BLOCK_BYTES[kind]]``: each
    block's fp16 scales widened to float32 (exactly), its codes unchanged."""
    rows = blocks.shape[0]
    b = blocks.view(rows, -1, GGUF_BLOCK_BYTES[kind])
    halves = 2 if kind == "Q4_1" else 1
    scales = b[..., : 2 * halves].contiguous().view(torch.float16).float().view(torch.uint8)
    return torch.cat((scales, b[..., 2 * halves:]), dim=-1).reshape(rows, -1)


def gguf_blocks(gguf_path: str | os.PathLike[str], model: torch.nn.Module) -> dict[str, Tensor]:
    """The kernel's blocks (:func:`repack`) of ``model``'s weights stored as Q4_1 or Q8_0 in the
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
        if kind not in GGUF_BLOCK_BYTES or name not in params:
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
