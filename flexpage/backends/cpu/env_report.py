"""``flexpage env``: what a bug report needs, in one paste (as ``vllm collect-env`` and
``transformers env``): versions, the CPU as flexpage sees it, the paths this process takes
and why, the compile caches, and the GGUF block kernel's build state.

:func:`collect` gathers it as plain data (``--json``), :func:`render` as text. Nothing here
changes the machine except ``build_kernels=True``, which builds the block kernel now (as a
GGUF model's first load would) to report whether it builds.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import pathlib
import platform
import sys

import torch

from flexpage.backends.cpu import block_kernel
from flexpage.backends.cpu.description import describe

__all__ = ["ENV_VARIABLES", "collect", "render"]

#: environment variables that change a path flexpage or torch takes (shown where set)
ENV_VARIABLES = ("FLEXPAGE_KERNEL_FALLBACK", "FLEXPAGE_TORCH_PATCHES", "FLEXPAGE_BF16_DOT", "FLEXPAGE_COMPILE",
                 "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS", "TORCHINDUCTOR_CACHE_DIR",
                 "TORCH_EXTENSIONS_DIR")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _folder_size(folder: pathlib.Path) -> tuple[int, int]:
    """(files, bytes) under ``folder`` (0, 0 where it does not exist)."""
    files = size = 0
    for root, _, names in os.walk(folder):
        for name in names:
            with contextlib.suppress(OSError):
                size += os.stat(os.path.join(root, name)).st_size
                files += 1
    return files, size


def _mib(size: int) -> str:
    return f"{size / 2**20:,.1f} MiB"


def _projection_paths() -> dict[str, str]:
    """Which path a projection of each dtype takes here (the rule :class:`PackedLinear` follows)."""
    description = describe()
    paths = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        if description.can_prepack(dtype):
            paths[name] = f"oneDNN packed, rows padded to buckets of {description.row_step(dtype)}"
        else:
            paths[name] = "F.linear (oneDNN has no packed kernel for it here)"
    return paths


def _attention_paths() -> dict[str, str]:
    """The compute dtype of prefill rows for each model dtype, and the kernels' options."""
    from flexpage.backends.cpu import torch_patches
    from flexpage.backends.cpu.kernel_options import attention_kernel_options

    description = describe()
    status = torch_patches.install()  # records itself (and raises under FLEXPAGE_KERNEL_FALLBACK=error)
    options = attention_kernel_options()  # records the attention kernels' path
    paths = {"kernel options": ", ".join(f"{key}={value}" for key, value in options.items())}
    for dtype in (torch.bfloat16, torch.float16):
        name = str(dtype).removeprefix("torch.")
        computed = str(description.attention_dtype(dtype)).removeprefix("torch.")
        packs = ("packs K/V for AMX" if description.packs_for_amx(dtype)
                 else "AVX512-BF16 dot products" if dtype == torch.bfloat16 and description.dot_bf16()
                 else "vector micro-gemms")
        paths[f"{name} prefill rows"] = f"attend in {computed} ({packs})"
    if not status.active:
        paths["stock kernels because"] = status.reason
    return paths


def _block_kernel_state(build_kernels: bool) -> dict[str, str]:
    description = describe()
    state: dict[str, str] = {}
    if not description.block_kernel_cpu:
        state["state"] = "cannot run on this CPU (needs x86 with AVX2, FMA and F16C)"
        return state
    if build_kernels:
        from flexpage.model import gguf_linear

        built = gguf_linear.available()  # records the path (raises under FLEXPAGE_KERNEL_FALLBACK=error)
        state["state"] = "built and loaded" if built else "FAILED to build (see the paths below)"
    else:
        state["state"] = "not built in this process (--build-kernels builds it now)"
    cached = block_kernel.cached_build()
    state["cached build"] = str(cached) if cached is not None else "none"
    state["source"] = str(block_kernel.SOURCE)
    return state


def _caches() -> dict[str, str]:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    from flexpage.backends.cpu.saved_programs import program_dir

    caches = {}
    inductor = pathlib.Path(cache_dir())
    files, size = _folder_size(inductor)
    caches["inductor"] = f"{inductor} ({files} files, {_mib(size)})"
    programs = program_dir()
    files, size = _folder_size(programs)
    caches["saved programs"] = f"{programs} ({files} files, {_mib(size)})"
    with contextlib.suppress(Exception):
        extensions = block_kernel.extensions_dir()
        files, size = _folder_size(extensions)
        caches["torch extensions"] = f"{extensions} ({files} files, {_mib(size)})"
    return caches


def collect(*, build_kernels: bool = False) -> dict[str, dict[str, object]]:
    """Everything ``flexpage env`` reports, by section (``paths taken``: a list of lines, the
    paths this process recorded while collecting; failures say ``FAILED``)."""
    import flexpage

    description = describe()
    facts = description.facts()
    report: dict[str, dict[str, object]] = {
        "versions": {
            "flexpage": f"{getattr(flexpage, '__version__', '?')} ({pathlib.Path(flexpage.__file__).parent})",
            "python": f"{platform.python_version()} ({sys.executable})",
            "torch": torch.__version__,
            "transformers": _version("transformers"),
            "numpy": _version("numpy"),
            "platform": platform.platform(),
        },
        "cpu": {
            "model": f"{description.model_name} ({description.vendor or 'unknown vendor'}, {description.machine})",
            "cores": f"{os.cpu_count()} logical, torch uses {torch.get_num_threads()} threads",
            "flags that matter": " ".join(facts["flags"]) or "none",  # type: ignore[arg-type]
            "ATen vector code": description.aten_capability,
            "Inductor vector ISA": facts["vec_isa"],
            "oneDNN": f"{'yes' if description.onednn else 'no'}, bf16 {'yes' if description.onednn_bf16 else 'no'}",
            "AMX": (f"tiles yes, bf16 {'yes' if description.amx_bf16 else 'no'}, fp16 "
                    f"{'yes' if description.amx_fp16 else 'no'}") if description.amx_tile else "no",
            "AVX512-BF16 dot products": "yes" if description.avx512_bf16 else "no",
        },
        "dtype": {"default (auto)": facts["default_dtype"], "because": facts["dtype_reason"]},
        "projections": _projection_paths(),
        "attention": _attention_paths(),
        "gguf block kernel": _block_kernel_state(build_kernels),
        "compile caches": _caches(),
        "environment": {name: os.environ[name] for name in ENV_VARIABLES if name in os.environ} or {"(none set)": ""},
    }
    report["paths taken"] = description.paths.lines()  # type: ignore[assignment]
    return report


def render(report: dict[str, dict[str, object]]) -> str:
    """``report`` as text: a heading per section, ``key: value`` lines under it."""
    lines = []
    for section, entries in report.items():
        lines.append(f"{section}:")
        if isinstance(entries, dict):
            lines.extend(f"  {key}: {value}" if value != "" else f"  {key}" for key, value in entries.items())
        else:
            lines.extend(f"  - {entry}" for entry in entries)
    return "\n".join(lines)
