"""Which dtype a model runs in: user-facing names, and the default for this machine."""

from __future__ import annotations

import torch

from flexpage.backends.cpu.description import describe

__all__ = ["default_dtype", "parse_dtype"]

_DTYPE_ALIASES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def default_dtype() -> torch.dtype:
    """Pick the fastest dtype that keeps quality on this machine.

    bfloat16 halves memory traffic, but on CPUs without native bf16 support
    (AMX or AVX512-BF16) PyTorch emulates it and is *slower* than float32, so
    float32 is the safe default there. GPUs always get bfloat16. The rule, and why it picked
    what it did, live in the CPU description
    (:attr:`~flexpage.backends.cpu.description.CPUDescription.default_dtype`).
    """
    return describe().default_dtype


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
