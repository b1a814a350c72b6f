"""Weight-only int8 (``quantization="int8"``): every projection and the LM head quantised per
output channel, computed by the GGUF block kernel.

Why: decode streams every weight once per step, so its time follows the weights' bytes. int8
with one float32 scale per output row, stored in the block kernel's Q8_0 layout
(:mod:`~flexpage.model.gguf_linear`: a scale and 32 int8 codes per 36 bytes, the row's scale
repeated in each of its blocks), is 1.125 bytes a weight against bf16's 2, and the kernel
expands it in registers (float32) or into bf16 panels (AVX512-BF16) with the activations
in the model's dtype -- no int8 arithmetic, so float32 and bf16 activations alike.

Symmetric per-channel rounding: ``scale = max|w_row| / 127``, ``q = round(w / scale)``. The
model's own weights are replaced by what the codes expand to (``scale * q``, rounded to its
dtype), so every path -- the block kernel, a packed copy on AMX CPUs, HF's modules, a tied
embedding -- computes with the same quantised weights.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flexpage.model.gguf_linear import BLOCK_BYTES

__all__ = ["int8_blocks", "quantize_int8"]

#: weights per block of the kernel's Q8_0 layout
_BLOCK = 32
#: rows quantised at a time hold at most this many weights (bounds the float32 temporaries)
_CHUNK_WEIGHTS = 1 << 22


@torch.no_grad()
def quantize_int8(weight: Tensor, *, in_place: bool = False) -> tuple[Tensor, Tensor]:
    """``weight`` ``[out, in]`` (``in`` a multiple of 32) as the kernel's Q8_0 blocks with one
    scale per output row, and the weight they expand to in ``weight``'s dtype (``in_place``:
    written over ``weight``, which is returned). Rows go a chunk at a time, so the float32
    temporaries stay ~16 MB whatever the weight's size (an LM head of 128k rows is 1 GB in float32)."""
    rows, features = weight.shape
    if features % _BLOCK:
        raise ValueError(f"weight: {features} input features, expected a multiple of {_BLOCK}")
    blocks_per_row = features // _BLOCK
    blocks = torch.empty(rows, blocks_per_row, BLOCK_BYTES["Q8_0"], dtype=torch.uint8)
    quantised = weight if in_place else torch.empty_like(weight)
    step = max(1, _CHUNK_WEIGHTS // features)
    for start in range(0, rows, step):
        w = weight[start:start + step].detach().float()
        scale = w.abs().amax(dim=1, keepdim=True) / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
        codes = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
        chunk = blocks[start:start + step]
        chunk[..., :4] = scale.expand(-1, blocks_per_row).contiguous().view(torch.uint8).view(-1, blocks_per_row, 4)
        chunk[..., 4:] = codes.view(torch.uint8).view(-1, blocks_per_row, _BLOCK)
        quantised[start:start + step] = scale * codes.float()
    return blocks.view(rows, -1), quantised


@torch.no_grad()
def int8_blocks(model: torch.nn.Module) -> dict[str, Tensor]:
    """Quantise every ``nn.Linear`` weight of ``model`` whose input features are a multiple of 32
    (its projections and LM head), in place, and return their blocks by HF parameter name (a tied
    weight under each of its names), as :func:`~flexpage.model.gguf_linear.gguf_blocks` does."""
    params = dict(model.named_parameters(remove_duplicate=False))
    found: dict[str, Tensor] = {}
    done: set[int] = set()
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (not isinstance(module, torch.nn.Linear) or weight is None or weight.is_meta
                or weight.shape[1] % _BLOCK or id(weight) in done):
            continue
        blocks, _ = quantize_int8(weight, in_place=True)
        done.add(id(weight))
        found.update((name, blocks) for name, param in params.items() if param is weight)
    return found
