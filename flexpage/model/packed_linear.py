"""Linear layers whose weights are reordered once into oneDNN's blocked layout.

Why: eager ``F.linear`` on a bf16 CPU tensor hands oneDNN a plain row-major weight, which
it reorders into its blocked (AVX512-BF16 / AMX) layout on every call. At decode-sized
inputs that reorder costs as much as the matmul: on this project's 2-core AVX512-BF16
machine, a 576x3072 projection takes 158 us plain vs 47 us pre-packed for one row and
~0.8-0.9x at 64 rows, with
the same results (the same oneDNN kernel, minus the reorder: bit-identical on the AMX and
AVX512-BF16 CPUs tried, though oneDNN may pick another kernel elsewhere). Inductor's
``freezing`` pass does the same for compiled models; this applies it to eager layers.

Only bf16 weights on CPUs where oneDNN runs bf16 are packed: float32 gains nothing here
(MKL's packed path measured 0.99-1.05x of ``F.linear``), other dtypes and devices keep
``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["PackedLinear", "can_prepack"]

#: the row count oneDNN tunes the packed layout for (a decode batch); any count works
_BATCH_HINT = 64


def can_prepack(weight: Tensor) -> bool:
    """True when ``weight`` would run faster packed for oneDNN (bf16, CPU, oneDNN bf16 support)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class PackedLinear:
    """``y = x @ weight.T + bias``, with the weight pre-packed where :func:`can_prepack` says so."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None, *, prepack: bool = True) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.packed = prepack and can_prepack(weight)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT) if self.packed else weight

    def __call__(self, x: Tensor) -> Tensor:
        """``x``: ``[rows, in_features]`` -> ``[rows, out_features]``."""
        if not self.packed:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")
