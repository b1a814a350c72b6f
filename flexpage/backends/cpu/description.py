"""One description of this CPU, built once per process, that every ISA decision reads.

:func:`describe` reads the machine once (``/proc/cpuinfo``, what ATen, oneDNN and
``torch.cpu`` report) into a frozen :class:`CPUDescription`. Its methods are the rules that
used to be spread over six files: the default dtype, the packed projections' row step, whether
oneDNN packs a weight, the GGUF block kernel's bf16 panels, whether attention kernels pack K/V
for AMX or run AVX512-BF16 dot products, and the dtype prefill rows attend in. Inductor's
vector ISA (which code its kernels are compiled for) is asked for only when a rule needs it:
its probe builds test programs (~1-2 s on a first start), so an engine starts it on a thread
while the model loads (:func:`~flexpage.backends.cpu.vec_isa_cache.probe_in_background`).

The description also carries a :class:`PathRecord`: which projection and attention paths this
process took, and which failed and why (a kernel that did not build). ``flexpage serve``
prints it in its banner, ``flexpage env`` in its report, ``/metrics`` as
``flexpage_cpu_path_info``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import threading
from dataclasses import dataclass, field

import torch

__all__ = ["CPUDescription", "PathChoice", "PathRecord", "cpu_flags", "describe", "read_machine"]

#: cpuinfo flags that decide a path somewhere in flexpage (shown by ``flexpage env``)
FLAGS_THAT_MATTER = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                     "amx_tile", "amx_bf16", "amx_int8", "amx_fp16")
#: the GGUF block kernel's instructions (:mod:`~flexpage.backends.cpu.block_kernel`)
BLOCK_KERNEL_FLAGS = ("avx2", "fma", "f16c")
#: "0": bf16 attention kernels keep the stock micro-gemms, not AVX512-BF16 dot products (comparisons)
DOT_BF16_ENV_SWITCH = "FLEXPAGE_BF16_DOT"
_BF16_CPU_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})
_REDUCED = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class PathChoice:
    """One path this process took for ``name`` (``choice``), or a failure (``ok`` False) and
    what runs instead; ``reason`` says why."""

    name: str
    choice: str
    reason: str = ""
    ok: bool = True


class PathRecord:
    """The paths this process took, by name, in the order first recorded; a name may hold
    several choices (the LM head's projection path can differ from the layers'). Thread-safe:
    a kernel builds on whichever thread first needs it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._paths: dict[tuple[str, str], PathChoice] = {}

    def record(self, name: str, choice: str, reason: str = "", *, ok: bool = True) -> PathChoice:
        """Record (or update the reason of) ``choice`` for ``name``; returns it."""
        path = PathChoice(name, choice, reason, ok)
        with self._lock:
            self._paths[(name, choice)] = path
        return path

    def forget(self, name: str) -> None:
        """Drop every choice recorded for ``name`` (a path decided again, e.g. after a retry)."""
        with self._lock:
            for key in [key for key in self._paths if key[0] == name]:
                del self._paths[key]

    def paths(self) -> tuple[PathChoice, ...]:
        with self._lock:
            return tuple(self._paths.values())

    def failures(self) -> tuple[PathChoice, ...]:
        return tuple(path for path in self.paths() if not path.ok)

    def lines(self) -> list[str]:
        """One line per path: ``name: choice (reason)``, failures marked."""
        return [f"{p.name}: {'FAILED, ' if not p.ok else ''}{p.choice}" + (f" ({p.reason})" if p.reason else "")
                for p in self.paths()]


@dataclass(frozen=True)
class CPUDescription:
    """This CPU as flexpage's kernels see it (facts read once, see :func:`read_machine`), and
    the rules that pick a path from them."""

    machine: str  # platform.machine(): x86_64, aarch64, ...
    vendor: str  # cpuinfo vendor_id: GenuineIntel, AuthenticAMD ("" where unknown)
    model_name: str  # cpuinfo model name
    flags: frozenset[str] = field(repr=False)  # every cpuinfo flag
    aten_capability: str  # ATen's vector code: AVX512, AVX2, DEFAULT (ATEN_CPU_CAPABILITY lowers it)
    onednn: bool  # oneDNN is built into torch
    onednn_bf16: bool  # oneDNN runs bf16 matmuls (needs AVX-512; ONEDNN_MAX_CPU_ISA lowers it)
    avx512_bf16: bool  # torch.cpu: AVX512-BF16 dot products (vdpbf16ps)
    amx_tile: bool  # torch.cpu: AMX tiles usable
    amx_fp16: bool  # torch.cpu: AMX-FP16
    cuda: bool = False  # a CUDA device is visible (the default dtype is then bf16)
    dot_bf16_switch: bool = True  # FLEXPAGE_BF16_DOT is not "0"
    #: Inductor's vector ISA (``"avx2"``, ``"avx512"``, ``"avx512 avx512_vnni amx_tile"``); None:
    #: asked of Inductor's probe when a rule first needs it (:meth:`inductor_isa`)
    vec_isa: str | None = None
    paths: PathRecord = field(default_factory=PathRecord, compare=False, repr=False)

    # -- facts derived from the flags --------------------------------------------------------
    @property
    def amx_bf16(self) -> bool:
        return "amx_bf16" in self.flags

    @property
    def block_kernel_cpu(self) -> bool:
        """The CPU has the GGUF block kernel's instructions (x86 with AVX2, FMA and F16C)."""
        return set(BLOCK_KERNEL_FLAGS) <= self.flags

    # -- dtype ---------------------------------------------------------------------------------
    @property
    def native_bf16(self) -> bool:
        """True when every kernel a step runs has native bf16 on this CPU.

        Three things must hold: ATen's (and Inductor's) vector code is AVX-512 (under AVX2 it
        converts bf16 element by element; ``ATEN_CPU_CAPABILITY=avx2`` simulates such a CPU),
        oneDNN runs bf16 matmuls (it needs at least AVX-512; ``ONEDNN_MAX_CPU_ISA`` lowers it),
        and the CPU has bf16 instructions (``avx512_bf16`` or ``amx_bf16``: without them oneDNN
        emulates bf16 too)."""
        return (self.aten_capability.upper().startswith("AVX512") and self.onednn and self.onednn_bf16
                and bool(_BF16_CPU_FLAGS & self.flags))

    @property
    def default_dtype(self) -> torch.dtype:
        """bfloat16 where every kernel runs it natively (or on a GPU), else float32: emulated
        bf16 is *slower* than float32."""
        return torch.bfloat16 if self.cuda or self.native_bf16 else torch.float32

    @property
    def dtype_reason(self) -> str:
        """Why :attr:`default_dtype` is what it is, in words."""
        if self.cuda:
            return "a CUDA device is visible"
        if self.native_bf16:
            which = "AMX-BF16" if self.amx_bf16 else "AVX512-BF16"
            return f"AVX-512 vector code, oneDNN bf16 and {which} instructions"
        if not self.aten_capability.upper().startswith("AVX512"):
            return f"ATen's vector code is {self.aten_capability}, not AVX-512: bf16 would be emulated"
        if not (self.onednn and self.onednn_bf16):
            return "oneDNN has no bf16 kernels here (ONEDNN_MAX_CPU_ISA, or the CPU): bf16 would be emulated"
        return "no avx512_bf16 or amx_bf16 instructions: bf16 would be emulated"

    # -- projections -----------------------------------------------------------------------------
    def row_step(self, dtype: torch.dtype) -> int:
        """Packed inputs of ``dtype`` are padded to a multiple of this many rows at least: bf16 16
        where AMX tiles hold 16 rows (fewer cost as much), 8 where the vector kernels' cost grows
        with the rows; float32 2 (its cost grows from 2 rows; and the compiled step needs 2)."""
        if dtype == torch.float32:
            return 2
        return 16 if self.amx_tile else 8

    def can_prepack(self, dtype: torch.dtype) -> bool:
        """oneDNN packs CPU weights of ``dtype``: float32 wherever it is built in, bf16 where it
        has bf16 kernels."""
        if not self.onednn:
            return False
        return dtype == torch.float32 or (dtype == torch.bfloat16 and self.onednn_bf16)

    def bf16_blocks_at_every_row(self, has_bf16_panels: bool) -> bool:
        """A bf16 projection computes every row count from its GGUF blocks: the kernel has its
        AVX512-BF16 panels (``has_bf16_panels``) and the CPU no AMX, whose oneDNN tiles outrun
        them once rows are many."""
        return has_bf16_panels and not self.amx_bf16

    # -- attention kernels -------------------------------------------------------------------------
    def inductor_isa(self) -> str:
        """Inductor's vector ISA for this process (its probe, kept on disk; asked once needed)."""
        if self.vec_isa is not None:
            return self.vec_isa
        from flexpage.backends.cpu.vec_isa_cache import cpu_vec_isa

        return cpu_vec_isa()

    def compiles_avx512(self) -> bool:
        """Inductor compiles AVX-512 code (VecAVX512 and its subclasses: VNNI, AMX)."""
        return "avx512" in self.inductor_isa().split()

    def packs_for_amx(self, dtype: torch.dtype) -> bool:
        """Whether attention kernels for ``dtype`` run their products on the AMX brgemm over
        packed K/V (bf16, or fp16 with AMX-FP16, in the AMX code Inductor compiles here).
        Everywhere else a reduced-precision kernel runs the vector micro-gemm, which widens every
        load to float32."""
        if dtype not in _REDUCED or "amx_tile" not in self.inductor_isa().split():
            return False
        return dtype == torch.bfloat16 or self.amx_fp16

    def dot_bf16(self) -> bool:
        """bf16 attention micro-gemms run on AVX512-BF16 dot products: Inductor compiles AVX-512
        code for a CPU with AVX512-BF16 (and ``FLEXPAGE_BF16_DOT`` is not ``"0"``)."""
        return self.dot_bf16_switch and self.compiles_avx512() and self.avx512_bf16

    def attention_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype rows over a gathered copy of their keys attend in on this CPU (see
        :func:`flexpage.attention.flex.gathered_attention_dtype`): ``dtype``, except bf16/fp16
        where the kernels can neither pack for AMX nor (bf16) run AVX512-BF16 dot products:
        float32, which the tuned template runs faster than the stock reduced-precision path."""
        if dtype not in _REDUCED or self.packs_for_amx(dtype) or (dtype == torch.bfloat16 and self.dot_bf16()):
            return dtype
        return torch.float32

    # -- reports -------------------------------------------------------------------------------
    def summary(self) -> str:
        """One line: the CPU, Inductor's vector ISA, AMX and bf16 dot products (``flexpage serve``'s
        banner; asks for the ISA)."""
        isa = self.inductor_isa()
        amx = "AMX" + ("-BF16" if self.amx_bf16 else "") if self.amx_tile else "no AMX"
        dot = "AVX512-BF16" if self.avx512_bf16 else "no AVX512-BF16"
        return f"{self.model_name or self.machine}; {isa}, {amx}, {dot}"

    def facts(self) -> dict[str, object]:
        """The description as plain data (``flexpage env --json``; asks for the ISA)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("flags", "paths")}
        data["vec_isa"] = self.inductor_isa()
        data["flags"] = sorted(flag for flag in FLAGS_THAT_MATTER if flag in self.flags)
        data["default_dtype"] = str(self.default_dtype).removeprefix("torch.")
        data["dtype_reason"] = self.dtype_reason
        return data


def cpu_flags() -> set[str]:
    """CPU feature flags from /proc/cpuinfo; empty where it is unavailable."""
    return set(_cpuinfo().get("flags", "").split())


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if not line.strip():
                    break  # the first processor's block ends
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def read_machine() -> CPUDescription:
    """A new description of this machine (:func:`describe` keeps the first one)."""
    info = _cpuinfo()
    onednn = torch.backends.mkldnn.is_available()
    return CPUDescription(
        machine=platform.machine(),
        vendor=info.get("vendor_id", ""),
        model_name=info.get("model name", "") or platform.processor(),
        flags=frozenset(cpu_flags()),
        aten_capability=str(torch.backends.cpu.get_cpu_capability()),
        onednn=onednn,
        onednn_bf16=onednn and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        avx512_bf16=bool(torch.cpu._is_avx512_bf16_supported()),
        amx_tile=bool(torch.cpu._is_amx_tile_supported()),
        amx_fp16=bool(torch.cpu._is_amx_fp16_supported()),
        cuda=torch.cuda.is_available(),
        dot_bf16_switch=os.environ.get(DOT_BF16_ENV_SWITCH, "1") != "0",
    )


@functools.cache
def describe() -> CPUDescription:
    """This process's CPU description, read once; its default dtype recorded as a path."""
    description = read_machine()
    description.paths.record("dtype (auto)", str(description.default_dtype).removeprefix("torch."),
                             description.dtype_reason)
    return description
