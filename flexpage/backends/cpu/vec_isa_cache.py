"""Inductor's vector-ISA probe, kept on disk for the next process.

Inductor decides which vector ISAs this CPU and compiler support by compiling and running a
test program per candidate ISA (``torch._inductor.cpu_vec_isa.valid_vec_isa_list``), once per
process: ~1 s of every start (asked first by flexpage's kernel options or by the first saved
program read, which asks ``pick_vec_isa`` for its code's ISA). The answer depends only on the
CPU's features, the compiler and the torch version, so it is kept on disk under those (in
Inductor's cache directory), and Inductor's function is replaced by one that reads it: the
same ISA objects, in the same order, as the probe returns. ``pick_vec_isa`` still applies
``ATEN_CPU_CAPABILITY`` and ``simdlen`` to that list on every call.

Where neither is set, ``pick_vec_isa`` takes the list's first entry, so the probe tries the
candidates best first and stops at the first that builds: on an AMD EPYC with AVX-512 the full
probe built six test programs (6.2 s of a cold start), the first valid ISA needs three.

The probe also finds, as a side effect on Inductor's AVX-512 ISA objects, whether AVX512-BF16
builds, which adds ``-mavx512bf16`` to every kernel's compile command and so to its cache key.
That fact is kept on disk beside the names and set again on the objects: without it, a process
reading the names compiled every kernel once more under a key without the flag (the first warm
start after a cold one: 16 kernels, 17 s instead of 6.3 on an AMX Xeon), as code without
AVX512-BF16 instructions.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import sys
import threading
from pathlib import Path

import torch

__all__ = ["apply", "cpu_vec_isa", "probe_in_background"]

_probing = threading.Lock()  # one probe at a time: a second caller waits for the first's answer
#: the kept answer's layout (a new one is probed afresh, not misread)
_FORMAT = 2
#: where Inductor's AVX-512 ISA objects note that AVX512-BF16 built (``VecAVX512.__bool__``);
#: ``build_arch_flags`` then adds ``-mavx512bf16``
_BF16_FLAG = "_is_avx512_bf16_supported"


def cpu_vec_isa() -> str:
    """Inductor's choice of vector ISA for this process (``str(pick_vec_isa())``: ``"avx2"``,
    ``"avx512"``, ``"avx512 avx512_vnni amx_tile"``, ...), from the probe kept on disk."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    apply()
    return str(pick_vec_isa())


def probe_in_background() -> None:
    """Start answering :func:`cpu_vec_isa` on a thread, so that a first start's probe (test
    programs built by g++, ~2 s) overlaps loading the model instead of following it."""
    apply()  # here: Inductor's function is replaced once, by this thread
    from flexpage import background  # LLM() waits for it, exit joins it

    background.start(cpu_vec_isa, name="flexpage-vec-isa-probe")


@functools.cache  # once per process
def apply() -> bool:
    """Make Inductor read its ISA probe from disk (writing it there after probing, the first
    time). False where Inductor's function is not the one this replaces (nothing changed)."""
    from torch._inductor import cpu_vec_isa as inductor

    probe = getattr(inductor, "valid_vec_isa_list", None)
    if probe is None or not hasattr(inductor, "supported_vec_isa_list"):
        return False

    def valid_vec_isa_list() -> list:
        return _valid_isas(_only_the_best_is_read())

    @functools.cache
    def _valid_isas(best_only: bool) -> list:
        with _probing:
            names, bf16 = _kept_probe(functools.partial(_best_valid_isa, inductor, probe) if best_only else probe,
                                      best_only)
        isas = [isa for isa in inductor.supported_vec_isa_list if str(isa) in names]
        for isa in isas:
            if str(isa) in bf16 and hasattr(isa, _BF16_FLAG):
                setattr(isa, _BF16_FLAG, True)  # what the probe's build check set in its process
        return isas

    valid_vec_isa_list.probe = probe  # Inductor's own (tests compare)
    valid_vec_isa_list.cache_clear = _valid_isas.cache_clear  # as Inductor's functools.cache has
    inductor.valid_vec_isa_list = valid_vec_isa_list
    return True


def _only_the_best_is_read() -> bool:
    """Whether ``pick_vec_isa`` reads only the first valid ISA: neither ``ATEN_CPU_CAPABILITY``
    nor Inductor's ``cpp.simdlen`` asks for another one."""
    from torch._inductor import config

    return not os.getenv("ATEN_CPU_CAPABILITY") and config.cpp.simdlen is None


def _best_valid_isa(inductor, probe) -> list:  # noqa: ANN001
    """Inductor's ``probe`` cut short: the candidates this CPU's flags allow, best first
    (Inductor's order), tried until one builds; that one alone (or none)."""
    if platform.machine() not in ("x86_64", "AMD64") or sys.platform not in ("linux", "win32"):
        return probe()[:1]  # Inductor's probe builds nothing there
    flags = inductor.x86_isa_checker()
    for isa in inductor.supported_vec_isa_list:
        if all(flag in flags for flag in str(isa).split()) and isa:
            return [isa]
    return []


def _kept_probe(probe, best_only: bool = False) -> tuple[list[str], list[str]]:  # noqa: ANN001
    """The names of the ISAs ``probe()`` finds valid and of those among them that build
    AVX512-BF16, from disk when this machine probed before (``best_only``: a probe that stops
    at the first valid ISA, kept apart)."""
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import x86_isa_checker
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    facts = repr((_FORMAT, torch.__version__, platform.machine(), x86_isa_checker(), config.cpp.cxx, best_only))
    path = Path(cache_dir()) / "flexpage-vec-isa" / hashlib.sha256(facts.encode()).hexdigest()[:32]
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        kept = json.loads(path.read_text())
        names, bf16 = kept["isas"], kept["avx512_bf16"]
        if all(isinstance(name, str) for name in (*names, *bf16)):
            return names, bf16
    isas = probe()
    names = [str(isa) for isa in isas]
    bf16 = [str(isa) for isa in isas if getattr(isa, _BF16_FLAG, False)]
    with contextlib.suppress(OSError):  # a read-only cache: probe again next time
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}")
        partial.write_text(json.dumps({"isas": names, "avx512_bf16": bf16}))
        partial.replace(path)
    return names, bf16
