"""Inductor's precompiled header for C++ kernels, built while the model loads.

Inductor compiles every CPU kernel against a precompiled ``cpp_prefix.h`` (155 MB;
``config.cpp_cache_precompile_headers``), built by a process's first kernel compile where the
system's temporary directory lacks it (Inductor keeps it there, outside the compile cache). On
a first start that compile comes after both step programs are traced, and every kernel waits
for the header: 6-9 s of g++ on the 2-core AMD EPYC Zen 4, nothing else compiling meanwhile.
:func:`build_in_background` compiles a tiny kernel through the same path as Inductor's kernels
(the same command line, so the same header) on a helper thread once the vector ISA is known,
while the model loads on the other core. A compile cache it has built for once is left alone:
its kernels are compiled, a warm start loads them without the header, and after a reboot
cleared the temporary directory the header would be built for nothing.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from pathlib import Path

from flexpage.backends.cpu.vec_isa_cache import cpu_vec_isa

__all__ = ["build", "build_in_background", "wait"]

log = logging.getLogger(__name__)

#: held from :func:`build_in_background` until its thread is done (released by that thread)
_building = threading.Lock()

#: a kernel as Inductor writes them: its prefix header, vector code (which decides the ISA flags
#: of the command line) and nothing else
_TINY_KERNEL = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
extern "C" void kernel(float* out) {
    at::vec::Vectorized<float>(0.0f).store(out);
}
"""


def _marker() -> Path:
    """The file that says this compile cache had the header built for it."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "flexpage-kernel-header" / "built"


def build() -> None:
    """Compile and load the tiny kernel as Inductor's generated code would (building the
    precompiled header first where Inductor precompiles headers and it is not on disk yet),
    and mark the compile cache as done."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    cpu_vec_isa()  # the ISA the command line names: probed (or read from disk) first
    CppPythonBindingsCodeCache.load_pybinding(["float*"], _TINY_KERNEL)
    with contextlib.suppress(OSError):  # a read-only cache: built again next time
        marker = _marker()
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()


def build_in_background() -> None:
    """Start :func:`build` on a helper thread (``LLM()`` waits for it; a forked compile waits
    for it with :func:`wait`) unless Inductor precompiles no headers or this compile cache was
    built for before. A second call while one runs does nothing."""
    from torch._inductor import config

    from flexpage import background

    if not config.cpp_cache_precompile_headers or _marker().exists() or not _building.acquire(blocking=False):
        return

    def run() -> None:
        try:
            build()
        except Exception as error:  # noqa: BLE001 -- only time is lost: Inductor builds it (or fails) itself
            log.warning("building Inductor's kernel header ahead failed (%s: %s)", type(error).__name__, error)
        finally:
            _building.release()

    try:
        background.start(run, name="flexpage-kernel-header")
    except BaseException:
        _building.release()
        raise


def wait() -> None:
    """Return once no :func:`build_in_background` thread is running."""
    with _building:
        pass
