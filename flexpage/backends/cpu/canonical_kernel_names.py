"""Compile each distinct C++ kernel once, whatever its graph named its size arguments.

Inductor passes a template kernel the graph's size symbols as arguments (``ks16``, ``ks2``,
...), named and ordered by the graph, and its C++ compile cache keys a kernel by its source
text. The compiled step's prefill and mixed graphs hold the same paged prefill attention
kernel (as its decode and mixed graphs the same decode kernel), but the two graphs passed it
its sizes in another order under other names, so each compiled its own copy (~10-12 s of
``g++ -O3`` on 2 cores of an AMD EPYC Zen 5).

:func:`apply` rewrites a kernel's source before Inductor looks it up or compiles it: its size
arguments are renamed ``ks0``, ``ks1``, ... in the order the kernel body first uses them,
and sit in the signature in that order; the kernel it returns puts the caller's arguments in
that order. Kernels that compute the same thing then have one source, one cache key and one
shared object, in this process and the next. Renaming and reordering a kernel's own
parameters changes nothing it computes. Inductor's pointwise kernels are already named and
ordered that way: they keep their source, their cache keys and their direct call.
Installed by :func:`flexpage.backends.cpu.torch_patches.install`.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from typing import Any, NamedTuple

_SIZE_ARGUMENT = re.compile(r"\bks\d+\b")
_SIGNATURE = re.compile(r'extern "C"\s*void\s+kernel\(([^)]*)\)')


class CanonicalKernel(NamedTuple):
    """A kernel's source with canonical size arguments, and for each of its parameters the
    position of the caller's argument that goes there."""

    source: str
    order: tuple[int, ...]

    @property
    def reordered(self) -> bool:
        return self.order != tuple(range(len(self.order)))


def canonical_kernel(source: str) -> CanonicalKernel:
    """``source`` with its size arguments named and ordered by first use in the kernel body; a
    source without one ``kernel`` signature whose size arguments share one type is returned as is."""
    signatures = list(_SIGNATURE.finditer(source))
    if len(signatures) != 1:
        return CanonicalKernel(source, ())
    signature = signatures[0]
    params = [param.strip() for param in signature.group(1).split(",")]
    names = [param.split()[-1].lstrip("*&") for param in params]
    sized = [i for i, name in enumerate(names) if _SIZE_ARGUMENT.fullmatch(name)]
    if len({params[i].rsplit(maxsplit=1)[0] for i in sized}) > 1:
        return CanonicalKernel(source, tuple(range(len(params))))
    first_use = list(dict.fromkeys(_SIZE_ARGUMENT.findall(source[signature.end():])))
    by_use = [name for name in first_use if name in {names[i] for i in sized}]
    by_use += [names[i] for i in sized if names[i] not in by_use]  # never used in the body
    renamed = {old: f"ks{k}" for k, old in enumerate(by_use)}
    order = list(range(len(params)))
    position = {names[i]: i for i in sized}
    new_params = list(params)
    for slot, old in zip(sized, by_use):
        order[slot] = position[old]
        new_params[slot] = f"{params[slot].rsplit(maxsplit=1)[0]} {renamed[old]}"
    if all(old == new for old, new in renamed.items()) and order == list(range(len(params))):
        return CanonicalKernel(source, tuple(order))
    rest = _SIZE_ARGUMENT.sub(lambda match: renamed.get(match.group(0), match.group(0)), source[signature.end(1):])
    return CanonicalKernel(source[: signature.start(1)] + ", ".join(new_params) + rest, tuple(order))


def _reordered(kernel: Callable[..., Any], order: tuple[int, ...]) -> Callable[..., Any]:
    arguments = operator.itemgetter(*order)  # in C: this runs in every kernel call

    def call(*args: Any) -> Any:
        return kernel(*arguments(args))

    return call


def apply() -> None:
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.codecache import LambdaFuture

    original = AsyncCompile.cpp_pybinding
    if getattr(original, "_flexpage_canonical", False):
        return

    def cpp_pybinding(self: AsyncCompile, argtypes: list[str], source_code: str) -> Any:
        canonical = canonical_kernel(source_code)
        kernel = original(self, argtypes, canonical.source)
        if not canonical.reordered:
            return kernel
        if isinstance(kernel, LambdaFuture):  # compiling in worker processes
            return LambdaFuture(lambda: _reordered(kernel.result(), canonical.order))
        return _reordered(kernel, canonical.order)

    cpp_pybinding._flexpage_canonical = True  # type: ignore[attr-defined]
    AsyncCompile.cpp_pybinding = cpp_pybinding  # type: ignore[method-assign]
