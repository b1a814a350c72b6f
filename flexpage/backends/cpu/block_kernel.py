"""Building the GGUF block kernel (``gguf_linear.cpp``, :mod:`flexpage.model.gguf_linear`), and
what a failed build does.

The kernel is compiled on first use (~20 s, then cached by ``torch.utils.cpp_extension`` under
``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) on x86 CPUs with AVX2, FMA and
F16C. Where it cannot be had, a GGUF model's projections run from float32 weights (about 5x
the memory of its blocks). That fallback is recorded in the CPU description's paths (the
``flexpage serve`` banner, ``flexpage env``, ``/metrics``) and warned about; with
``FLEXPAGE_KERNEL_FALLBACK=error`` (``--kernel-fallback error``) it raises
:class:`~flexpage.backends.cpu.fallback.KernelFallbackError` instead.
"""

from __future__ import annotations

import functools
import logging
import os
import pathlib
import shutil

from flexpage.backends.cpu.description import BLOCK_KERNEL_FLAGS, describe
from flexpage.backends.cpu.fallback import fall_back

__all__ = ["PATH_NAME", "SOURCE", "build", "cached_build", "extensions_dir"]

log = logging.getLogger(__name__)

SOURCE = pathlib.Path(__file__).with_name("gguf_linear.cpp")
EXTENSION_NAME = "flexpage_gguf_linear"
#: the name of the block kernel's entry in the CPU description's paths
PATH_NAME = "gguf block kernel"


def build() -> bool:
    """Build and register the block kernel (once per process); False where it cannot be had,
    after :func:`fall_back` (which raises under ``FLEXPAGE_KERNEL_FALLBACK=error``)."""
    error = _build_once()
    if error is None:
        return True
    describe().paths.forget(PATH_NAME)
    fall_back(PATH_NAME, "the GGUF block kernel is not available", "float32 weights (about 5x the memory)", error)
    return False


@functools.cache
def _build_once() -> str | None:
    """None once the kernel is built and registered; else why not (kept: one build per process)."""
    description = describe()
    if not description.block_kernel_cpu:
        missing = sorted(set(BLOCK_KERNEL_FLAGS) - description.flags)
        return f"the CPU lacks {', '.join(missing)} ({description.machine})"
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    try:  # built under $TORCH_EXTENSIONS_DIR (~/.cache/torch_extensions), rebuilt when the source changes
        _load(cpp_extension)
    except (OSError, RuntimeError, ImportError) as error:  # no compiler, or the build failed
        log.warning("the GGUF block kernel did not build: %s", error)  # the compiler's whole output
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return f"the build failed: {first_line[:200]}"
    description.paths.record(PATH_NAME, "built", f"{SOURCE.name}, cached under {extensions_dir()}")
    return None


def _load(cpp_extension) -> None:  # noqa: ANN001
    cpp_extension.load(name=EXTENSION_NAME, sources=[str(SOURCE)],
                       # OpenMP: at::parallel_for is inline code; libgomp.so.1 is the one torch loaded
                       extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"], extra_ldflags=["-fopenmp"],
                       is_python_module=False,
                       verbose=os.environ.get("FLEXPAGE_VERBOSE_BUILD") == "1")


def extensions_dir() -> pathlib.Path:
    """Where ``torch.utils.cpp_extension`` keeps its builds ($TORCH_EXTENSIONS_DIR or its default)."""
    from torch.utils.cpp_extension import _get_build_directory

    return pathlib.Path(_get_build_directory(EXTENSION_NAME, verbose=False)).parent


def cached_build() -> pathlib.Path | None:
    """The built library of a previous build, if one is on disk (built or not in this process)."""
    try:
        folder = extensions_dir() / EXTENSION_NAME
    except Exception:  # noqa: BLE001 - a report, never a failure
        return None
    return next(iter(sorted(folder.glob("*.so"))), None) if folder.is_dir() else None


def _put_ninja_on_path() -> None:
    """The build runs ``ninja``: the one installed with flexpage (the ``ninja`` package) where the
    environment's scripts are not on ``PATH`` (a virtual environment used without activating it)."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")

