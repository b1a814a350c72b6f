"""A saved program's Inductor graph called directly, without Dynamo's prologue and AOTAutograd's
wrappers (:class:`GraphCall`): for programs whose graph only reads its inputs (the HF
backend's attention, :mod:`flexpage.attention.contiguous`), the wrappers only rearranged the
inputs, and cost ~50-60 us per call inside a model's forward. :func:`graph_call` finds where
each of the graph's inputs comes from, and checks the direct call against the program's own
on the first call (used by :class:`~flexpage.backends.cpu.saved_programs.SavedProgram`).
"""

from __future__ import annotations

import itertools
import logging
import operator
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["GraphCall", "graph_call"]

log = logging.getLogger(__name__)


#: where a graph's input comes from: an argument (getter None) or a number read off one
_Source = tuple[int, Callable[[Tensor], int] | None]


class GraphCall:
    """A program's Inductor graph called with its inputs directly: arguments and the sizes,
    strides and storage offsets read off them, in the graph's order. It skips what
    :func:`~flexpage.backends.cpu.saved_programs._called_whole` runs around the graph -- ~10 us of Python per call in a loop, 50-60 us
    inside a model's forward, where the interpreter's caches are cold -- which only rearranges
    inputs for programs like these (:func:`_graph_call` says which)."""

    def __init__(self, graph: Callable[[list], Sequence[Tensor]], sources: tuple[_Source, ...]) -> None:
        self.graph = graph
        self.sources = sources

    def __call__(self, args: Sequence[object]) -> Tensor:
        return self.graph([args[i] if read is None else read(args[i]) for i, read in self.sources])[0]  # type: ignore[arg-type]


class _Probed(Exception):
    pass


def graph_call(program: Any, args: Sequence[object], dynamic: Sequence[tuple[Tensor, int]]) -> GraphCall | None:
    """``program``'s graph as a :class:`GraphCall`, or None where calling it directly could
    differ from calling the program: a graph that writes to its inputs, a training graph,
    a graph's input that is neither an argument nor a number read off one (a size marked
    dynamic, a stride, a storage offset), a graph torch wraps otherwise than this torch
    version does (the walk finds no Inductor graph), or a first call whose result differs
    in any bit from the program's."""
    graph = _inductor_graph(program)
    reason = _why_not_direct(graph, args)
    sources = None if reason else _graph_inputs(program, args, dynamic)
    if sources is None:
        log.debug("a program's graph is not called directly: %s",
                  reason or "an input of the graph is neither an argument nor read off one")
        return None
    call = GraphCall(graph.current_callable, sources)
    try:
        expected, result = program(*args), call(args)
    except Exception as error:  # noqa: BLE001 - any failure keeps the program's own call
        log.debug("calling a program's graph directly failed: %s", error)
        return None
    if not (isinstance(expected, Tensor) and isinstance(result, Tensor) and result.dtype == expected.dtype
            and result.shape == expected.shape and result.stride() == expected.stride()
            and _same_bits(result, expected)):
        log.debug("a program's graph called directly gave another result than the program")
        return None
    return call


def _same_bits(a: Tensor, b: Tensor) -> bool:
    """Bit-for-bit equality (NaN rows included, which ``torch.equal`` calls different)."""
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _why_not_direct(graph: Any | None, args: Sequence[object]) -> str:
    """Why a program's Inductor ``graph`` (None: not found) must not be called directly with
    ``args`` ("" if it may)."""
    if graph is None or graph.current_callable is None:
        return "no Inductor graph found under it"
    if graph.mutated_input_idxs:
        return "it writes to its inputs"
    tensors = [a for a in args if isinstance(a, Tensor)]
    if any(t.requires_grad for t in tensors):
        return "an argument requires grad"
    if len(tensors) != len({id(t) for t in tensors}):
        return "a tensor is passed twice"
    return ""


def _inductor_graph(program: Any) -> Any | None:
    """The Inductor graph under an ``aot_compile``'d program, or None: torch 2.13 wraps it in
    the bundled AOTAutograd callable, functions that hold the next callable (``fn``,
    ``compiled_fn``, ``_inner_compiled_fn``: the ``torch._dynamo.disable`` wrapper, AOTAutograd's
    forward, its runtime wrapper) and a serialisable wrapper (``.compiled_fn``). A forward
    that prepends parameters to the inputs is not followed."""
    from torch._inductor.output_code import CompiledFxGraph

    found = program._artifacts.compiled_fn
    for _ in range(8):
        if isinstance(found, CompiledFxGraph):
            return found
        code = getattr(found, "__code__", None)
        cells = dict(zip(code.co_freevars, (c.cell_contents for c in found.__closure__ or ()))) if code else {}
        if cells.get("params_buffers_flat"):
            return None
        found = next((cells[name] for name in ("_inner_compiled_fn", "compiled_fn", "fn") if name in cells),
                     None) or getattr(found, "compiled_fn", None)
    return None


def _graph_inputs(program: Any, args: Sequence[object],
                  dynamic: Sequence[tuple[Tensor, int]]) -> tuple[_Source, ...] | None:
    """Where each of the graph's inputs comes from, found by running the program's prologue on
    stand-ins (meta tensors whose dynamic sizes, strides and storage offsets are all distinct
    numbers) and recording what it hands the graph; None for an input that is none of these."""
    function = program.fn
    names = [n for n in function.__code__.co_names if n.startswith("__compiled_fn")]
    if len(names) != 1:
        return None
    marked: dict[int, set[int]] = {}
    for tensor, dim in dynamic:
        marked.setdefault(id(tensor), set()).add(dim)
    distinct = itertools.count(1_000_003, 2)
    origin: dict[int, _Source] = {}  # a stand-in's distinct number -> where it was read
    stand_ins: list[object] = []
    for i, value in enumerate(args):
        if isinstance(value, Tensor):
            size = list(value.shape)
            for dim in marked.get(id(value), ()):
                size[dim] = next(distinct)
                origin[size[dim]] = (i, operator.methodcaller("size", dim))
            stride = [next(distinct) for _ in size]
            origin.update({n: (i, operator.methodcaller("stride", dim)) for dim, n in enumerate(stride)})
            offset = next(distinct)
            origin[offset] = (i, operator.methodcaller("storage_offset"))
            value = torch.empty(0, dtype=value.dtype, device="meta").as_strided(size, stride, offset)
        stand_ins.append(value)
    recorded: list[tuple] = []

    def record(*inputs: object) -> None:
        recorded.append(inputs)
        raise _Probed

    prologue = types.FunctionType(function.__code__, {**function.__globals__, names[0]: record},
                                  function.__name__, function.__defaults__, function.__closure__)
    try:
        prologue(*stand_ins)
    except _Probed:
        pass
    except Exception as error:  # noqa: BLE001
        log.debug("the program's prologue did not run on stand-ins: %s", error)
        return None
    if len(recorded) != 1:
        return None
    positions = {id(value): i for i, value in enumerate(stand_ins) if isinstance(value, Tensor)}
    sources: list[_Source] = []
    for item in recorded[0]:
        if isinstance(item, Tensor) and id(item) in positions:
            sources.append((positions[id(item)], None))
        elif type(item) is int and item in origin:
            sources.append(origin[item])
        else:
            return None
    return tuple(sources)
