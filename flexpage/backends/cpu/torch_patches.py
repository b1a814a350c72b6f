"""The four changes flexpage makes inside PyTorch's Inductor, installed explicitly and safely.

* :mod:`~flexpage.backends.cpu.inductor_fix`: a size-symbol name clash in the CPU FlexAttention
  template, which makes paged mask mods fail to compile;
* :mod:`~flexpage.backends.cpu.template_tuning`: the tuned CPU template for paged attention
  (opt-in per kernel through its kernel option);
* :mod:`~flexpage.backends.cpu.packed_linear_lowering`: graphs may call oneDNN's packed linear
  on weights that are inputs (the compiled step: one graph for every layer);
* :mod:`~flexpage.backends.cpu.canonical_kernel_names`: C++ kernels that differ only in the
  names of their size arguments are compiled once.

All rewrite private PyTorch code, so :func:`install` applies them only on the torch
versions they were written and tested against (:data:`TESTED_TORCH`, which pyproject's
torch range matches), only when every private symbol and template text they touch is
present, and not when ``FLEXPAGE_TORCH_PATCHES=0``. Otherwise flexpage runs PyTorch's stock
kernels after one warning that says why (and recorded in the CPU description's paths; under
``FLEXPAGE_KERNEL_FALLBACK=error`` it raises instead, unless the switch asked for stock
kernels): correct, but slower for paged attention; a long
paged mask may hit the name clash; and on an AMX CPU whose kernels are compiled for AVX2
(``ATEN_CPU_CAPABILITY=avx2``) the stock bf16 prefill kernel fails (it packs for AMX). The
compiled attention paths call it before their first compile (``FlexRunner``,
``contiguous_attention``); ``import flexpage`` changes nothing.

Apart from these, :mod:`~flexpage.backends.cpu.vec_isa_cache` keeps Inductor's vector-ISA
probe on disk (whatever the switch: it returns what the probe returns, and changes no code).
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass

import torch

from flexpage.backends.cpu import canonical_kernel_names, inductor_fix, packed_linear_lowering, template_tuning
from flexpage.backends.cpu.description import describe
from flexpage.backends.cpu.fallback import fall_back

#: torch versions (major.minor) the patches were written and tested against
TESTED_TORCH = ("2.13",)
#: set to 0 to run PyTorch's stock kernels
ENV_SWITCH = "FLEXPAGE_TORCH_PATCHES"
#: the patches' entry in the CPU description's paths
PATH_NAME = "torch patches"


@dataclass(frozen=True)
class PatchStatus:
    """What :func:`install` did: ``active`` when every patch is in; else ``reason``."""

    active: bool
    reason: str = ""


@functools.cache  # once per process: the patches are process-wide and idempotent
def install() -> PatchStatus:
    reason = _reason_not_to_patch()
    if not reason:
        try:
            inductor_fix.apply()
            packed_linear_lowering.apply()
            canonical_kernel_names.apply()
            if not template_tuning.apply():
                reason = "PyTorch's CPU FlexAttention template text is not the one the tuning edits"
        except (ImportError, AttributeError) as error:
            reason = f"a private PyTorch symbol the patches touch is missing ({error})"
    paths = describe().paths
    if reason == f"{ENV_SWITCH}=0":  # asked for: no fallback
        paths.record(PATH_NAME, "stock PyTorch kernels", reason)
    elif reason:  # FLEXPAGE_KERNEL_FALLBACK=error raises here
        fall_back(PATH_NAME, "flexpage's Inductor patches are not installed", "stock PyTorch kernels", reason,
                  warn=False)  # warned below
    if reason:
        warnings.warn(f"flexpage: {reason}; running PyTorch's stock CPU FlexAttention kernels (correct, slower "
                      "for paged attention)", RuntimeWarning, stacklevel=3)
        return PatchStatus(False, reason)
    paths.record(PATH_NAME, "installed", f"torch {torch.__version__}: tuned CPU template, Inductor fixes")
    return PatchStatus(True)


def tuning_active() -> bool:
    """Whether compiled kernels may ask for the tuned template (its option is then part of their cache key)."""
    return template_tuning.installed()


def _reason_not_to_patch() -> str:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return f"{ENV_SWITCH}=0"
    version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    if version not in TESTED_TORCH:
        return f"torch {torch.__version__} is not a version the patches were tested with ({', '.join(TESTED_TORCH)})"
    return ""
