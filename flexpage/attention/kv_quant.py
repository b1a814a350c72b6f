"""The 8-bit KV cache's arithmetic: static per-channel scales, folded out of the attention kernel.

Keys and values are stored as int8 with one float32 scale per layer, KV head and channel
(``x ~= scale * int8``). A per-channel key scale folds into the query,
``q . (s * k) = (q * s) . k``, and a per-channel value scale multiplies the output,
``sum_t p_t (s * v_t) = s * sum_t p_t v_t``; so the paged kernels read 8-bit blocks as they
are, with no scale inside the score or the sum, and every recipe's ``score_mod``/``mask_mod``
runs unchanged. Per-token or per-block scales would need the scale inside the score and the
sum. A fake-quantisation study on the default model (``bench/kv_quant_accuracy.py``) measured
this layout at +0.17% negative log-likelihood over the bf16 cache (per-token scales +0.005%,
keys per token with values per channel +0.072%, KIVI's per-channel keys with per-token values
+0.083%); through the engine, query grid included, it is +0.11% (docs/kv-cache-dtype.md).

The scales are static: :func:`calibration_scales` derives them from the absolute maxima of
each channel's keys and values over a calibration text the model itself encodes at start-up
(:mod:`flexpage.model.kv_calibration`), so no offline data is needed, and a block's bytes mean
the same in every block: prefix caching, copy-on-write, swapping, the host and disk tiers copy
blocks as bytes. Values beyond a channel's calibrated range saturate at +-127 steps.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["KV_CACHE_DTYPES", "QMAX", "calibration_scales", "dequantize", "quantize", "scale_output",
           "scale_queries", "storage_dtype"]

#: ``kv_cache_dtype`` values: ``"auto"`` stores K/V in the model's dtype
KV_CACHE_DTYPES = ("auto", "int8")
#: the largest int8 step used (symmetric: -127..127)
QMAX = 127
#: calibrated maxima are widened by this much: text unlike the calibration text saturates less
HEADROOM = 1.25
#: the smallest scale (a channel whose calibrated values were all zero)
MIN_SCALE = 1e-6


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's dtype for ``kv_cache_dtype`` (see :data:`KV_CACHE_DTYPES`)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: got {kv_cache_dtype!r}, expected one of {KV_CACHE_DTYPES}")
    return torch.int8 if kv_cache_dtype == "int8" else model_dtype


def quantize(x: Tensor, scale: Tensor) -> Tensor:
    """``x [..., H_kv, D]`` as int8 steps of ``scale [H_kv, D]``, rounded to nearest, saturating."""
    return (x.float() / scale).round().clamp(-QMAX, QMAX).to(torch.int8)


def dequantize(x: Tensor, scale: Tensor) -> Tensor:
    """float32 ``x * scale`` (``x`` int8 ``[..., H_kv, D]``)."""
    return x.float() * scale


def scale_queries(q: Tensor, key_scale: Tensor) -> Tensor:
    """``q [T, H, D]`` times the key scale of each query head's KV head (``key_scale [H_kv, D]``),
    rounded to an int8 grid per row (``code * max|row| / 127``), in ``q``'s dtype: the query
    that, against int8 keys, gives the scores of the real keys.

    Why the grid: on CPUs with AVX512-VNNI the attention kernel multiplies the row's int8 codes
    with the keys' in integer dot products (``int8_kv.h``), as llama.cpp's quantised caches do,
    four times the products per instruction of float32. Rounding here, for every kernel, keeps
    the result the same on every CPU (up to float32 summation order). The rounding adds an
    error like the keys' own (half a step of the row's largest element)."""
    heads, kv_heads = q.shape[-2], key_scale.shape[0]
    compute = torch.promote_types(q.dtype, torch.float32)
    scaled = q.to(compute) * key_scale.repeat_interleave(heads // kv_heads, 0)
    step = (scaled.abs().amax(-1, keepdim=True) / QMAX).clamp_min(torch.finfo(compute).tiny)
    return ((scaled / step).round() * step).to(q.dtype)


def scale_output(out: Tensor, value_scale: Tensor) -> Tensor:
    """Attention output ``[T, H, D]`` over int8 values times each head's value scale."""
    heads, kv_heads = out.shape[-2], value_scale.shape[0]
    compute = torch.promote_types(out.dtype, torch.float32)
    return (out.to(compute) * value_scale.repeat_interleave(heads // kv_heads, 0)).to(out.dtype)


def calibration_scales(abs_max: Tensor, rope_pairs: bool = True) -> Tensor:
    """Scales ``[..., H_kv, D]`` from each channel's calibrated ``abs_max`` (same shape): the
    range widened by :data:`HEADROOM` over :data:`QMAX` steps. ``rope_pairs``: channels ``i`` and
    ``i + D/2`` share the larger range (RoPE rotates each such pair by the token's position, so
    either channel of a pair can take the other's values). A channel never seen nonzero gets
    :data:`MIN_SCALE`, so every scale is positive."""
    abs_max = abs_max.float()
    if rope_pairs:
        half = abs_max.shape[-1] // 2
        paired = torch.maximum(abs_max[..., :half], abs_max[..., half: 2 * half])
        abs_max = torch.cat((paired, paired, abs_max[..., 2 * half:]), -1)
    return (abs_max * HEADROOM / QMAX).clamp_min(MIN_SCALE).contiguous()
