"""What flexpage does when one of its kernels cannot be built or used: fall back to a slower
path and say so (``warn``, the default), or refuse (``error``).

``FLEXPAGE_KERNEL_FALLBACK={warn,error}`` (``flexpage serve --kernel-fallback``) chooses. An
environment variable, like the ``VLLM_*`` and ``TORCH_*`` switches, so that every process of
a run reads the same choice: the tensor-parallel ranks and the compile-ahead child inherit it.
Either way the fallback is recorded as a failed path in the CPU description
(:class:`~flexpage.backends.cpu.description.PathRecord`), which the ``flexpage serve`` banner,
``flexpage env`` and ``/metrics`` show.
"""

from __future__ import annotations

import logging
import os
import warnings

from flexpage.backends.cpu.description import describe

__all__ = ["FALLBACK_ENV", "FALLBACK_POLICIES", "KernelFallbackError", "fall_back", "fallback_policy"]

log = logging.getLogger(__name__)

#: what a kernel that cannot be built or used does: "warn" (fall back, say so) or "error" (raise)
FALLBACK_ENV = "FLEXPAGE_KERNEL_FALLBACK"
FALLBACK_POLICIES = ("warn", "error")


class KernelFallbackError(RuntimeError):
    """A flexpage kernel could not be built or used, and ``FLEXPAGE_KERNEL_FALLBACK=error`` asked
    for a hard failure instead of the slower fallback."""


def fallback_policy() -> str:
    """``FLEXPAGE_KERNEL_FALLBACK`` (read on every call: the CLI sets it before the engine starts)."""
    policy = os.environ.get(FALLBACK_ENV, "warn").strip().lower() or "warn"
    if policy not in FALLBACK_POLICIES:
        raise ValueError(f"{FALLBACK_ENV}: got {policy!r}, expected one of {', '.join(FALLBACK_POLICIES)}")
    return policy


def fall_back(name: str, what: str, instead: str, reason: str, *, warn: bool = True) -> None:
    """``what`` (a path named ``name``) cannot be had: record it as failed in the CPU description,
    then (``warn``) warn that ``instead`` runs -- or raise :class:`KernelFallbackError` under
    ``FLEXPAGE_KERNEL_FALLBACK=error``."""
    describe().paths.record(name, instead, f"{what}: {reason}", ok=False)
    message = f"flexpage: {what}: {reason}; {instead} instead"
    if fallback_policy() == "error":
        raise KernelFallbackError(f"{message} -- refused ({FALLBACK_ENV}=error; set it to 'warn' to fall back)")
    if warn:
        log.warning("%s (%s=error makes this a hard failure)", message, FALLBACK_ENV)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
