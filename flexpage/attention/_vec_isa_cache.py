"""Inductor's vector-ISA probe, kept on disk for the next process.

Inductor decides which vector ISAs this CPU and compiler support by compiling and running a
test program per candidate ISA (``torch._inductor.cpu_vec_isa.valid_vec_isa_list``), once per
process: ~1 s of every start (asked first by flexpage's kernel options or by the first saved
program read, which asks ``pick_vec_isa`` for its code's ISA). The answer depends only on the
CPU's features, the compiler and the torch version, so it is kept on disk under those (in
Inductor's cache directory), and Inductor's function is replaced by one that reads it: the
same ISA objects, in the same order, as the probe returns. ``pick_vec_isa`` still applies
``ATEN_CPU_CAPABILITY`` and ``simdlen`` to that list on every call.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
from pathlib import Path

import torch

__all__ = ["apply", "cpu_vec_isa"]


def cpu_vec_isa() -> str:
    """Inductor's choice of vector ISA for this process (``str(pick_vec_isa())``: ``"avx2"``,
    ``"avx512"``, ``"avx512 avx512_vnni amx_tile"``, ...), from the probe kept on disk."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    apply()
    return str(pick_vec_isa())


@functools.cache  # once per process
def apply() -> bool:
    """Make Inductor read its ISA probe from disk (writing it there after probing, the first
    time). False where Inductor's function is not the one this replaces (nothing changed)."""
    from torch._inductor import cpu_vec_isa as inductor

    probe = getattr(inductor, "valid_vec_isa_list", None)
    if probe is None or not hasattr(inductor, "supported_vec_isa_list"):
        return False

    @functools.cache
    def valid_vec_isa_list() -> list:
        names = _kept_probe(probe)
        return [isa for isa in inductor.supported_vec_isa_list if str(isa) in names]

    valid_vec_isa_list.probe = probe  # Inductor's own (tests compare)
    inductor.valid_vec_isa_list = valid_vec_isa_list
    return True


def _kept_probe(probe) -> list[str]:  # noqa: ANN001
    """The names of the ISAs ``probe()`` finds valid, from disk when this machine probed before."""
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import x86_isa_checker
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    facts = repr((torch.__version__, platform.machine(), x86_isa_checker(), config.cpp.cxx))
    path = Path(cache_dir()) / "flexpage-vec-isa" / hashlib.sha256(facts.encode()).hexdigest()[:32]
    with contextlib.suppress(OSError, ValueError):
        names = json.loads(path.read_text())
        if isinstance(names, list) and all(isinstance(name, str) for name in names):
            return names
    names = [str(isa) for isa in probe()]
    with contextlib.suppress(OSError):  # a read-only cache: probe again next time
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}")
        partial.write_text(json.dumps(names))
        partial.replace(path)
    return names
