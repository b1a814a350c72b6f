"""Compiled programs kept on disk, so that a later process loads them instead of tracing again
(the engine's compiled steps, :mod:`flexpage.model.compiled_step`; the HF backend's attention,
:mod:`flexpage.attention.contiguous`).

Why: Inductor's caches make a second start skip code generation, but not Dynamo: every start
re-traced the 30 layers of each step variant to find the graph it had already compiled, ~3.5 s
per variant on 2 cores (10 of a warm start's 22 s). torch's ahead-of-time compile
(``aot_compile``) saves the traced program, its guards and Inductor's output in one file
that loads in ~0.1-0.5 s.

A program's files are named by a fingerprint of what the graph bakes in but does not guard:
the torch and Python versions, flexpage's own source, and the caller's constants (head counts,
the recipe's functions and the values they close over, kernel options with the CPU's vector
ISA, the attention groups). Guards check the rest -- tensor dtypes, shapes, strides, the
grad mode -- when a call's tensors differ from the last accepted call's; a call no saved
program accepts compiles one more and saves it. The programs are called directly, not
through Dynamo's frame evaluation, and a program whose graph only reads its inputs (the HF
backend's attention) calls that graph itself, without Dynamo's prologue and AOTAutograd's
wrappers (:class:`~flexpage.backends.cpu.graph_call.GraphCall`): inside a model's forward a decode attention call went from
~190 to ~100-150 us on 2 cores, its kernel ~30 us.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import inspect
import logging
import pathlib
import platform
import types
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch._dynamo.types import GuardFilterEntry

from flexpage.attention.flex import call_compiled
from flexpage.backends.cpu.graph_call import GraphCall, graph_call

__all__ = ["Program", "SavedProgram", "compiled_program", "fingerprint", "program_dir", "program_key", "prune",
           "saveable_guards", "traced_in_each_process"]

log = logging.getLogger(__name__)

#: the folder (under Inductor's cache directory) that holds the saved programs
PROGRAM_FOLDER = "flexpage-steps"
#: bytes of saved programs a save leaves at most, the least recently used going first: every
#: edit or upgrade of flexpage (or torch) keys new programs and leaves the old ones unread
PROGRAM_FOLDER_BYTES = 1 << 30


def program_dir() -> pathlib.Path:
    """Where saved programs live: beside Inductor's own caches (``$TORCHINDUCTOR_CACHE_DIR``,
    which flexpage points at ``~/.cache/flexpage/inductor``), so clearing one clears both."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return pathlib.Path(cache_dir()) / PROGRAM_FOLDER


@functools.cache
def _source_digest() -> str:
    """A hash of flexpage's source files: a saved program is the code that traced it."""
    root = pathlib.Path(__file__).resolve().parents[2]  # flexpage/ (this file: flexpage/backends/cpu/)
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cpp", ".h") and p.is_file()):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.cache
def _file_digest(filename: str) -> str:
    path = pathlib.Path(filename)
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else filename


def fingerprint(value: object) -> str:
    """A stable text naming ``value`` by content: numbers, strings, dtypes, tuples, dicts,
    dataclasses, tensors (by their bytes) and functions (by their code, defaults, the values
    they close over and their source file). Raises TypeError for anything else: a value this
    cannot name must not share a saved program with another."""
    parts: list[str] = []
    _fingerprint_into(value, parts)
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()


def _fingerprint_into(value: object, parts: list[str]) -> None:
    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.dtype, torch.device, enum.Enum)):
        parts.append(f"{type(value).__name__}:{value!r}")
    elif isinstance(value, (tuple, list)):
        parts.append(f"{type(value).__name__}[{len(value)}")
        for item in value:
            _fingerprint_into(item, parts)
    elif isinstance(value, dict):
        parts.append(f"dict[{len(value)}")
        for key in sorted(value, key=repr):
            _fingerprint_into(key, parts)
            _fingerprint_into(value[key], parts)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        parts.append(type(value).__qualname__)
        for field in dataclasses.fields(value):
            _fingerprint_into(getattr(value, field.name), parts)
    elif isinstance(value, Tensor):
        data = value.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
        parts.append(f"tensor:{value.dtype}:{tuple(value.shape)}:{hashlib.sha256(data).hexdigest()}")
    elif isinstance(value, types.FunctionType):
        # the file too: the helpers a function calls (e.g. in a recipe's file) are globals, not constants
        parts.append(f"function:{value.__module__}.{value.__qualname__}:{_file_digest(value.__code__.co_filename)}")
        _fingerprint_into(value.__code__, parts)
        _fingerprint_into(value.__defaults__, parts)
        _fingerprint_into(tuple(cell.cell_contents for cell in value.__closure__ or ()), parts)
    elif isinstance(value, types.CodeType):
        parts.append(f"code:{value.co_code.hex()}:{value.co_names}")
        _fingerprint_into(value.co_consts, parts)
    else:
        raise TypeError(f"cannot fingerprint a {type(value).__qualname__}")


#: a compiled program: called with its arguments and the (tensor, dim) sizes that vary between calls
Program = Callable[[Sequence[object], Sequence[tuple[Tensor, int]]], Tensor]


def compiled_program(function: Callable[..., Tensor], *constants: object, saved: bool = True,
                     unguarded: Sequence[str] = ()) -> Program:
    """``function`` compiled whole: a :class:`SavedProgram` keyed by ``constants`` (what
    ``function`` closes over), or, where ``saved`` is false or a constant cannot be named by
    its content, :func:`traced_in_each_process`."""
    if saved:
        try:
            return SavedProgram(function, program_key(*constants), unguarded=unguarded)
        except TypeError:
            pass
    return traced_in_each_process(function)


#: Inductor options of every program: no size, stride or alignment asserts in its Python wrapper.
#: The guards (or :class:`_CallShape`) check a call's inputs; the asserts re-checked
#: them and every buffer the graph hands its layer regions: ~40 checks per layer, 50 more per step
_INDUCTOR_OPTIONS = {"size_asserts": False, "alignment_asserts": False}


def traced_in_each_process(function: Callable[..., Tensor]) -> Program:
    """``function`` compiled whole as a :data:`Program` that keeps nothing on disk: Dynamo
    traces it anew in every process, with its full guards (Inductor's caches still spare it
    the code generation)."""
    compiled = torch.compile(function, dynamic=False, fullgraph=True, options=_INDUCTOR_OPTIONS)

    def run(args: Sequence[object], dynamic: Sequence[tuple[Tensor, int]]) -> Tensor:
        for tensor, dim in dynamic:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
        return call_compiled(compiled, *args)

    return run


class SavedProgram:
    """A :data:`Program` of ``function``, compiled whole (static shapes but for the sizes each
    call names), whose compiled programs persist on disk.

    A call that no program in memory accepts (by its guards) reads the ones saved under
    ``key`` until one does, and else compiles another with the varying sizes marked dynamic,
    and saves it. Where torch cannot compile ahead of time (a guard it cannot serialise), the
    function is traced in each process instead, as :func:`traced_in_each_process` does.
    """

    def __init__(self, function: Callable[..., Tensor], key: str, directory: pathlib.Path | None = None, *,
                 unguarded: Sequence[str] = ()) -> None:
        """``unguarded``: arguments of ``function`` whose values the programs do not check on
        each call (:func:`saveable_guards`); ``key`` must name what the programs assume of them."""
        self.function = function
        self.compiled = torch.compile(function, dynamic=False, fullgraph=True, options={
            **_INDUCTOR_OPTIONS, "guard_filter_fn": functools.partial(saveable_guards, tuple(unguarded))})
        self.key = key
        self.directory = directory or program_dir()
        self.programs: list[Any] = []  # torch._dynamo.aot_compile.AOTCompiledFunction
        self.loaded = 0  # programs read from disk (tests read these)
        self.compiled_here = 0  # programs this process compiled
        self._unread: list[pathlib.Path] | None = None  # saved files not read yet, next first; None: not listed
        self._unsaveable: Program | None = None
        names = list(inspect.signature(function).parameters)
        self._unguarded_positions = frozenset(i for i, name in enumerate(names) if name in unguarded)
        #: how each program (by id) runs a call its guards accepted (:func:`~flexpage.backends.cpu.graph_call.graph_call` where it can)
        self._runners: dict[int, Callable[[Sequence[object]], Tensor]] = {}
        #: the last call a program's guards accepted
        self._last: _Accepted | None = None

    def __call__(self, args: Sequence[object], dynamic: Sequence[tuple[Tensor, int]]) -> Tensor:
        if self._unsaveable is not None:
            return self._unsaveable(args, dynamic)
        last = self._last
        if last is not None and last.global_state.check() and last.call.matches(args):
            return last.run(args)
        program = next((p for p in self.programs if p.guard_check(*args)), None) or self._load_accepting(args)
        if program is None:
            program = self._compile(args, dynamic)
            if program is None:
                return self._unsaveable(args, dynamic)  # type: ignore[misc]
            self.programs.append(program)
        runner = self._runners.get(id(program))
        if runner is None:
            runner = self._runners[id(program)] = graph_call(program, args, dynamic) or _called_whole(program)
        self._last = _Accepted(_CallShape(args, self._unguarded_positions),
                               torch._C._dynamo.guards.GlobalStateGuard(), runner)
        return self._last.run(args)

    @property
    def calls_graphs_directly(self) -> bool:
        """Whether every program that ran a call here runs its Inductor graph directly
        (:class:`~flexpage.backends.cpu.graph_call.GraphCall`; tests read this: a torch upgrade that wraps graphs otherwise
        loses the fast path silently)."""
        return bool(self._runners) and all(isinstance(r, GraphCall) for r in self._runners.values())

    def is_saved(self) -> bool:
        """Whether any program is saved under the key (one that accepts a given call or not)."""
        return any(self._saved_files())

    def compile_and_save(self, args: Sequence[object], dynamic: Sequence[tuple[Tensor, int]]) -> None:
        """Compile a program for calls like ``args`` and save it, without calling it: the
        calls' tensors need only their shapes and dtypes (:mod:`flexpage.model.compile_ahead`
        runs this in a child process whose KV pool is not mapped)."""
        self._compile(args, dynamic)

    def _saved_files(self) -> Iterator[pathlib.Path]:
        return self.directory.glob(f"{self.key}-*.bin")

    def _compile(self, args: Sequence[object], dynamic: Sequence[tuple[Tensor, int]]) -> Any | None:
        """A new program for ``args`` (the sizes ``dynamic`` names traced as variables), saved;
        None (and the function traced in each process from now on) where it cannot be saved."""
        for tensor, dim in dynamic:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
        try:
            program = self.compiled.aot_compile((tuple(args), {}))
        except Exception as error:  # a guard torch cannot serialise (compiled_step keeps known ones away)
            log.warning("the compiled program cannot be saved (%s: %s); it is traced in each process",
                        type(error).__name__, error)
            self._unsaveable = traced_in_each_process(self.function)
            return None
        program.disable_guard_check()  # checked by the caller; its tensors carry the marks it was traced with
        self.compiled_here += 1
        self._save(program)
        return program

    def _load_accepting(self, args: Sequence[object]) -> Any | None:
        """Read saved programs, most recently used first, until one accepts ``args`` (None if
        none does). One at a time: a key gathers programs for other pool sizes and dtypes (the
        tests' engines, other settings), and each costs ~0.4 s to read (its guards are rebuilt).
        Runs inside a call, so the guards are rebuilt under the grad mode the calls run in (a
        guard compares dispatch keys)."""
        if self._unread is None:
            self._unread = sorted(self._saved_files(), key=_last_used, reverse=True)
        while self._unread:
            path = self._unread.pop(0)
            program = self._read(path)
            if program is None:
                continue
            self.programs.append(program)
            self.loaded += 1
            if program.guard_check(*args):
                with contextlib.suppress(OSError):  # a read-only cache: the order is only a hint
                    path.touch()  # the next process tries it first
                return program
        return None

    def _read(self, path: pathlib.Path) -> Any | None:
        """The program saved in ``path``, or None (with a warning) if it cannot be read."""
        from torch._dynamo import convert_frame
        from torch._dynamo.utils import get_metrics_context
        from torch._guards import CompileContext, TracingContext, compile_context, tracing

        try:
            # loading a guard on an imported module installs it into a tracing context
            with (compile_context(CompileContext(convert_frame.get_compile_id({}))), get_metrics_context(),
                  tracing(TracingContext(None)), path.open("rb") as file):
                program = torch.compiler.load_compiled_function(file)
        except Exception as error:  # torn, or from another torch: compile afresh, never fail a step
            log.warning("ignoring the saved step program %s: %s", path, error)
            return None
        program.disable_guard_check()
        return program

    def _save(self, program: Any) -> None:
        """Write ``program`` under the key (atomically: a reader sees a whole file or none), then
        bound the folder (:func:`prune`)."""
        path = self.directory / f"{self.key}-{uuid.uuid4().hex[:12]}.bin"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            program.save_compiled_function(str(path))
        except Exception as error:  # a full disk or an unpicklable constant costs the next start a compile
            log.warning("could not save the compiled step program: %s", error)
            return
        prune(self.directory, PROGRAM_FOLDER_BYTES, keep=path)


def prune(directory: pathlib.Path, max_bytes: int, keep: pathlib.Path | None = None) -> None:
    """Delete the least recently used programs in ``directory`` (never ``keep``) until the rest
    take at most ``max_bytes``. Another process may be reading or deleting them too: a file
    that vanishes is skipped, and a reader that loses one compiles afresh."""
    files = []
    for path in directory.glob("*.bin"):
        with contextlib.suppress(OSError):
            stat = path.stat()
            files.append((stat.st_mtime, stat.st_size, path))
    total = sum(size for _, size, _ in files)
    for _, size, path in sorted(files, key=lambda item: item[0]):
        if total <= max_bytes:
            break
        if path != keep:
            with contextlib.suppress(OSError):
                path.unlink()
            total -= size


@dataclasses.dataclass(frozen=True)
class _Accepted:
    """The last call a program's guards accepted: a call like it under the same global state
    (grad mode, ...) runs the same program without checking its guards again (~150-250 us for
    ten tensors; HF's 30 attention calls of a forward differ only in their K/V tensors)."""

    call: _CallShape
    global_state: Any  # torch._C._dynamo.guards.GlobalStateGuard
    run: Callable[[Sequence[object]], Tensor]


class _CallShape:
    """What a program's guards read of a call's arguments, less the unguarded ones: the tensors'
    type, dispatch keys, dtype, device, sizes and strides (checked in C++, ~1 us for ten), other
    values themselves (tensors nested in them described in Python), and which tensors share memory."""

    def __init__(self, args: Sequence[object], unguarded: frozenset[int]) -> None:
        self._count = len(args)
        self._tensor_positions = tuple(i for i, value in enumerate(args)
                                       if i not in unguarded and isinstance(value, Tensor))
        tensors = [args[i] for i in self._tensor_positions]
        self._tensors = torch._C._dynamo.guards.TensorGuards(  # under the dispatch state of now, as accepted
            *tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
            dynamic_dims_strides=[list(t.stride()) for t in tensors])
        self._other_positions = tuple(i for i, value in enumerate(args)
                                      if i not in unguarded and not isinstance(value, Tensor))
        self._others, self._sharing = self._rest(args, tensors)

    def matches(self, args: Sequence[object]) -> bool:
        if len(args) != self._count:
            return False
        tensors = [args[i] for i in self._tensor_positions]
        return self._tensors.check(*tensors) and self._rest(args, tensors) == (self._others, self._sharing)

    def _rest(self, args: Sequence[object], tensors: list[Tensor]) -> tuple[tuple, tuple[int, ...]]:
        """The other values' descriptions and the sharing pattern of every tensor's memory."""
        tensors = list(tensors)
        others = tuple(_described(args[i], tensors) for i in self._other_positions)
        storages = [t.untyped_storage().data_ptr() for t in tensors]
        if len(set(storages)) == len(storages):
            return others, ()  # none shared (the usual case: no pattern to build)
        return others, tuple(storages.index(ptr) for ptr in storages)


def _described(value: object, tensors: list[Tensor]) -> object:
    """``value`` as a program's guards read it (a tensor by its metadata, added to ``tensors``)."""
    if isinstance(value, Tensor):
        tensors.append(value)
        return (type(value), value.shape, value.stride(), value.dtype, value.device, value.requires_grad,
                value.is_inference())
    if isinstance(value, (tuple, list)):
        return (type(value), *(_described(item, tensors) for item in value))
    return (type(value), value)


def _called_whole(program: Any) -> Callable[[Sequence[object]], Tensor]:
    """Run ``program`` as torch does: Dynamo's prologue (the graph's inputs from the arguments),
    AOTAutograd's runtime wrappers, the graph."""
    return lambda args: program(*args)


def saveable_guards(unguarded: tuple[str, ...], guards: Sequence[GuardFilterEntry]) -> list[bool]:
    """Which of Dynamo's ``guards`` a saved program keeps: those it can save (what
    ``aot_compile`` keeps by default: none on globals, none of the types torch cannot
    serialise, such as closures -- :func:`program_key` names those), less every guard on the
    arguments named in ``unguarded`` and what they hold."""
    from torch._dynamo.guards import CheckFunctionManager

    unsaveable = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
    return [not (g.is_global or g.guard_type in unsaveable or g.name.split("[", 1)[0] in unguarded) for g in guards]


def _last_used(path: pathlib.Path) -> float:
    """When ``path``'s program last served a call (its modification time; a vanished file: never)."""
    try:
        return path.stat().st_mtime
    except OSError:
        return float("-inf")


def program_key(*constants: object) -> str:
    """The file-name key of a program: the versions, flexpage's source and ``constants``."""
    return fingerprint((torch.__version__, platform.python_version(), platform.machine(), _source_digest(),
                        constants))[:32]
