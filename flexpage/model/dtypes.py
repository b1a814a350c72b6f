"""Which dtype a model runs in: user-facing names, and the default for this machine."""

from __future__ import annotations

import torch

__all__ = ["cpu_flags", "default_dtype", "parse_dtype"]

_DTYPE_ALIASES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
_BF16_CPU_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


def default_dtype() -> torch.dtype:
    """Pick the fastest dtype that keeps quality on this machine.

    bfloat16 halves memory traffic, but on CPUs without native bf16 support
    (AMX or AVX512-BF16) PyTorch emulates it and is *slower* than float32, so
    float32 is the safe default there. GPUs always get bfloat16.
    """
    if torch.cuda.is_available():
        return torch.bfloat16
    return torch.bfloat16 if _cpu_has_native_bf16() else torch.float32


def _cpu_has_native_bf16() -> bool:
    """True when every kernel a step runs has native bf16 on this CPU.

    Three things must hold: ATen's (and Inductor's) vector code is AVX-512 (under AVX2 it
    converts bf16 element by element; ``ATEN_CPU_CAPABILITY=avx2`` simulates such a CPU),
    oneDNN runs bf16 matmuls (it needs at least AVX-512; ``ONEDNN_MAX_CPU_ISA`` lowers it),
    and the CPU has bf16 instructions (``avx512_bf16`` or ``amx_bf16``: without them oneDNN
    emulates bf16 too).
    """
    if not str(torch.backends.cpu.get_cpu_capability()).upper().startswith("AVX512"):
        return False
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return False
    return bool(_BF16_CPU_FLAGS & cpu_flags())


def cpu_flags() -> set[str]:
    """CPU feature flags from /proc/cpuinfo; empty where it is unavailable."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """Turn a user-facing dtype name (CLI flag, config value) into a torch dtype.

    Accepts "auto" (see :func:`default_dtype`), float32/fp32, bfloat16/bf16,
    float16/fp16 (case-insensitive, optional ``torch.`` prefix) or one of those
    torch dtypes. Anything else is rejected up front rather than failing deep
    inside model loading.
    """
    if isinstance(name, torch.dtype):
        if name in _DTYPE_ALIASES.values():
            return name
        raise ValueError(
            f"dtype={name!r} is not supported; expected torch.float32, torch.bfloat16 or torch.float16"
        )
    if not isinstance(name, str):
        raise ValueError(f"dtype={name!r} must be a string or torch.dtype")
    key = name.strip().lower().removeprefix("torch.")
    if key == "auto":
        return default_dtype()
    if key in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[key]
    choices = ", ".join(["auto", *_DTYPE_ALIASES])
    raise ValueError(f"dtype={name!r} is not a known dtype; expected one of: {choices}")
