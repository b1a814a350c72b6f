"""The CPU kernel options of flexpage's compiled attention, read off the CPU description.

Every compiled flexpage kernel names the vector ISA Inductor compiles for
(:data:`VEC_ISA_OPTION`): Inductor's FX graph cache does not key compiled graphs by ISA, so a
kernel compiled under ``ATEN_CPU_CAPABILITY=avx2`` (or on another CPU sharing the cache
directory) was loaded by an AVX-512 process and corrupted its heap. As a kernel option the
ISA is part of the graph, hence of the cache key. Where the patches are in, kernels also ask
for the tuned template (:mod:`~flexpage.backends.cpu.template_tuning`), in its deterministic
form or with AVX512-BF16 dot products.
"""

from __future__ import annotations

import torch

from flexpage.backends.cpu import template_tuning, torch_patches
from flexpage.backends.cpu.description import describe

__all__ = ["VEC_ISA_OPTION", "attention_kernel_options", "isa_options"]

#: names the CPU vector ISA a kernel is compiled for
VEC_ISA_OPTION = "FLEXPAGE_CPU_VEC_ISA"
#: the attention kernels' entry in the CPU description's paths
PATH_NAME = "attention kernels"


def isa_options() -> dict:
    """The kernel option naming the vector ISA Inductor compiles for in this process."""
    return {VEC_ISA_OPTION: describe().inductor_isa()}


def attention_kernel_options(kernel_options: dict | None = None, deterministic: bool = False) -> dict:
    """The options of flexpage's paged attention kernels on the CPU: the caller's
    ``kernel_options``, the ISA, and the tuned template (deterministic, or with the bf16 dot
    products where the CPU has them; the caller's choices win but for ``deterministic``)."""
    options = {**(kernel_options or {}), **isa_options()}
    if torch_patches.tuning_active():  # stock kernels keep a key of their own
        options.setdefault(template_tuning.TUNED_OPTION, template_tuning.TUNING_VERSION)
        if deterministic:
            options[template_tuning.DETERMINISTIC_OPTION] = True
        else:
            options.setdefault(template_tuning.DOT_BF16_OPTION, template_tuning.dot_bf16_option())
        _record(options, deterministic)
    elif deterministic:  # the stock template picks its arithmetic by call shape
        raise ValueError("deterministic: attention needs flexpage's tuned CPU template, which is not installed "
                         f"(compile=False or FLEXPAGE_COMPILE=0, {torch_patches.ENV_SWITCH}=0, or torch "
                         f"{torch.__version__}'s template text changed); run compiled, or without deterministic")
    else:
        describe().paths.record(PATH_NAME, f"stock PyTorch template ({options[VEC_ISA_OPTION]})",
                                "flexpage's Inductor patches are not installed")
    return options


def _record(options: dict, deterministic: bool) -> None:
    description = describe()
    isa = options[VEC_ISA_OPTION]
    if deterministic:
        choice, reason = f"tuned template, deterministic ({isa})", "one arithmetic for every call shape"
    else:
        dot = bool(options[template_tuning.DOT_BF16_OPTION])
        choice = f"tuned template ({isa}{', bf16 on AVX512-BF16 dot products' if dot else ''})"
        amx = description.packs_for_amx(torch.bfloat16)
        reason = ("bf16 prefill packs K/V for AMX" if amx else "no AMX packing") + (
            "" if dot else "; bf16 micro-gemms stock" + ("" if description.dot_bf16_switch
                                                          else f" ({template_tuning.DOT_BF16_ENV_SWITCH}=0)"))
    description.paths.record(PATH_NAME, choice, reason)
