"""One thread owns the engine; HTTP handlers talk to it through queues.

The engine is not thread-safe and ``step()`` blocks for tens of milliseconds of compute,
so it lives in a dedicated thread (``flexpage-engine``). That thread is the only code
that ever touches the :class:`~flexpage.engine.LLMEngine`:

* handlers (on the asyncio loop) call :meth:`EngineLoop.add` / :meth:`EngineLoop.abort`,
  which only put a command on a thread-safe queue;
* between two steps the thread drains the command queue (``add_request`` / ``abort``),
  runs one ``step()`` over every live request of every connection, and pushes each
  request's progress to its own unbounded ``asyncio.Queue``: one
  ``loop.call_soon_threadsafe`` per step delivers all of that step's items, so the event
  loop wakes (and takes the GIL) once per step, not once per token. It never waits for a
  client, so a slow reader only grows its own queue;
* progress is handed over as immutable snapshots (:class:`Delta`): the engine keeps
  mutating its ``CompletionOutput`` objects after ``step()`` returns, so they must not be
  read from another thread.

The thread also refreshes :attr:`EngineLoop.stats` (a fresh dict from ``engine.stats()``)
for ``/metrics`` and observes the latency histograms.

:meth:`EngineLoop.build` loads the engine *in* that thread: torch keeps per-thread state
(OpenMP teams, math-library buffers), and a model loaded in one thread and stepped in
another ran small-batch decode steps 20-50% slower on this CPU (docs/serve-benchmark.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Union

from flexpage.frame_stack import reserved_frame_stack
from flexpage.model.tensor_parallel import RankFailure
from flexpage.outputs import Logprob, RequestOutput, SpeculationCounts

__all__ = ["Accepted", "Delta", "EngineLoop", "Failed", "SampleDelta", "Sink"]

log = logging.getLogger("flexpage.server")

#: the message of every request ended by a shutdown
SHUTTING_DOWN = "the server is shutting down"


@dataclass(frozen=True)
class SampleDelta:
    """New progress of one sample (choice) of a request."""

    index: int
    text: str  # the whole text so far (str is immutable, so sharing it is safe)
    token_ids: tuple[int, ...]  # tokens added since the previous delta
    logprobs: tuple[dict[int, Logprob], ...] | None  # entries for those tokens
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass(frozen=True)
class Delta:
    tag: Any
    samples: tuple[SampleDelta, ...]
    finished: bool
    num_prompt_tokens: int
    num_cached_tokens: int
    #: speculative decoding's counts for the request so far (None: the engine does not speculate)
    speculation: SpeculationCounts | None = None
    #: in the final delta of a request with ``prompt_logprobs``: one entry per prompt token
    prompt_logprobs: tuple[dict[int, Logprob] | None, ...] | None = None


@dataclass(frozen=True)
class Accepted:
    tag: Any


@dataclass(frozen=True)
class Failed:
    """``add_request`` refused the request (``client_error``) or the engine failed / shut down."""

    tag: Any
    message: str
    client_error: bool = False
    param: str | None = None
    shutdown: bool = False  # aborted because the server is shutting down (the client may retry elsewhere)


@dataclass
class Sink:
    """Where one request's progress goes: an asyncio queue on a given loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    def put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


def _deliver(items: list[tuple[Sink, Any]]) -> None:
    for sink, item in items:
        sink.queue.put_nowait(item)


@dataclass
class _Live:
    sink: Sink
    tag: Any
    arrival: float
    num_prompt_tokens: int = 0
    sent_tokens: dict[int, int] = field(default_factory=dict)
    sent_finished: set[int] = field(default_factory=set)
    first_token_time: float | None = None
    last_token_time: float | None = None


# -- commands: what the server's threads ask of the engine thread ---------------------------
@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt: Any
    params: Any
    sink: Sink
    tag: Any
    arrival: float
    options: dict[str, Any] = field(default_factory=dict)  # more add_request keywords (conversation_id, ...)


@dataclass(frozen=True)
class Call:
    """Run ``fn(engine)`` between steps; its result (or exception) goes to ``future``."""

    fn: Callable[[Any], Any]
    future: concurrent.futures.Future


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class AbortAll:
    """Abort every live request (the server is shutting down)."""


@dataclass(frozen=True)
class Stop:
    pass


Command = Union[AddRequest, Abort, AbortAll, Call, Stop]


class EngineLoop:
    """Runs ``engine`` in its own thread; see the module docstring."""

    def __init__(self, engine: Any, metrics: Any = None, *, stats_interval: float = 0.1,
                 thread_init: Any = None, on_fatal: Callable[[BaseException], None] | None = None) -> None:
        """``on_fatal``: called (on the engine thread) when the engine cannot go on -- a
        tensor-parallel rank died or hung; what was in flight has failed and the thread ends."""
        self.engine = engine
        self.on_fatal = on_fatal
        self.fatal: BaseException | None = None
        self.thread_init = thread_init  # run first in the engine thread (per-thread torch settings)
        self.metrics = metrics
        self.stats: dict[str, float] = engine.stats()  # the thread is not running yet
        self.stats_interval = stats_interval
        self.fatal_errors = 0
        self.steps = 0
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._outbox: list[tuple[Sink, Any]] = []
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flexpage-engine", daemon=True)

    @classmethod
    def build(cls, factory: Callable[[], Any], *, thread_init: Any = None, poll_s: float = 0.2,
              **kwargs: Any) -> EngineLoop:
        """Create the engine with ``factory()`` in the thread that will step it; return once it exists.

        The thread then waits for :meth:`start` (or :meth:`stop`). An exception from
        ``thread_init`` or ``factory`` is raised here, in the caller's thread.
        """
        built = threading.Event()
        result: dict[str, Any] = {}

        def build_then_serve() -> None:
            try:
                if thread_init is not None:
                    thread_init()
                loop = cls(factory(), **kwargs)
            except BaseException as error:  # handed to the caller below
                result["error"] = error
                built.set()
                return
            loop._thread = threading.current_thread()
            result["loop"] = loop
            built.set()
            loop._started.wait()
            loop._run()

        threading.Thread(target=build_then_serve, name="flexpage-engine", daemon=True).start()
        while not built.wait(poll_s):  # short waits, so Ctrl-C still reaches the calling thread
            pass
        if "error" in result:
            raise result["error"]
        return result["loop"]

    # -- called from other threads --------------------------------------------------------
    def start(self) -> None:
        self._started.set()
        if self._thread.ident is None:  # built by the constructor, not by build()
            self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def add(self, request_id: str, prompt: Any, params: Any, sink: Sink, *, tag: Any = None,
            arrival: float | None = None, options: dict[str, Any] | None = None) -> None:
        """Queue a request; ``sink`` gets :class:`Accepted` or :class:`Failed`, then :class:`Delta` items.
        ``options``: further ``add_request`` keywords."""
        self._commands.put(AddRequest(request_id, prompt, params, sink, tag,
                                      time.monotonic() if arrival is None else arrival, options or {}))

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the engine thread between steps (the engine is not thread-safe)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(Call(fn, future))
        return future

    def abort(self, request_id: str) -> None:
        """Abort a request (idempotent; unknown or finished ids are ignored)."""
        self._commands.put(Abort(request_id))

    def abort_all(self) -> None:
        """Shutting down: abort every live request; each gets a :class:`Failed` item."""
        self._commands.put(AbortAll())

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is left, end the thread and wait for it (bounded)."""
        self._commands.put(Stop())
        self._started.set()  # a built thread that was never started still has to see "stop"
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the engine thread ----------------------------------------------------------------
    @reserved_frame_stack
    def _run(self) -> None:
        if self.thread_init is not None:
            self.thread_init()
        last_stats = 0.0
        while True:
            busy = self.engine.has_unfinished_requests()
            handled = False
            try:
                command = self._commands.get(block=not busy, timeout=None if busy else 0.5)
            except queue.Empty:
                command = None
            while command is not None:
                handled = True
                if isinstance(command, Stop):
                    self._abort_all(SHUTTING_DOWN, shutdown=True)
                    self._flush()
                    self._refresh_stats()
                    return
                self._handle(command)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            self._flush()
            try:
                if not self.engine.has_unfinished_requests():
                    self.engine.check_health()
            except RankFailure as error:
                self._end(error)
                return
            if self.engine.has_unfinished_requests():
                try:
                    outputs = self.engine.step()
                except RankFailure as error:  # the engine cannot go on
                    self._end(error)
                    return
                except Exception as error:  # a bug in the engine: fail what is in flight, keep serving
                    self.fatal_errors += 1
                    log.error("engine step failed:\n%s", traceback.format_exc())
                    self._abort_all(f"internal engine error: {type(error).__name__}: {error}")
                    outputs = []
                self.steps += 1
                for out in outputs:
                    if out.error is not None:  # aborted alone: its own computation failed
                        self._fail_one(out.request_id, out.error)
                    else:
                        self._dispatch(out)
                self._flush()
            now = time.monotonic()
            if handled or now - last_stats >= self.stats_interval or not self.engine.has_unfinished_requests():
                self._refresh_stats()
                last_stats = now

    def _end(self, error: BaseException) -> None:
        """Fail everything in flight with ``error``'s message and tell ``on_fatal``."""
        log.error("engine cannot go on: %s", error)
        self.fatal = error
        self._abort_all(f"engine failed: {error}", shutdown=True)
        self._flush()
        if self.on_fatal is not None:
            self.on_fatal(error)

    def _post(self, sink: Sink, item: Any) -> None:
        self._outbox.append((sink, item))

    def _flush(self) -> None:
        """Hand everything produced since the last flush to the event loop(s): one wake-up per loop,
        not one per token, so the asyncio thread contends for the GIL once per step."""
        if not self._outbox:
            return
        by_loop: dict[Any, list[tuple[Sink, Any]]] = {}
        for sink, item in self._outbox:
            by_loop.setdefault(sink.loop, []).append((sink, item))
        self._outbox = []
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that loop is closed: nobody is listening any more
                pass

    def _refresh_stats(self) -> None:
        try:
            self.stats = self.engine.stats()
        except Exception:  # pragma: no cover - stats must never take the loop down
            log.exception("engine.stats() failed")

    def _handle(self, command: Command) -> None:
        if isinstance(command, AddRequest):
            self._add(command)
        elif isinstance(command, Abort):
            live = self._live.pop(command.request_id, None)
            if live is not None and self._abort_engine(command.request_id) and self.metrics is not None:
                self.metrics.observe_finish("abort")
        elif isinstance(command, AbortAll):
            self._abort_all(SHUTTING_DOWN, shutdown=True)
        elif isinstance(command, Call):
            try:
                command.future.set_result(command.fn(self.engine))
            except Exception as error:  # noqa: BLE001 - the caller's to report
                command.future.set_exception(error)

    def _add(self, command: AddRequest) -> None:
        sink, tag = command.sink, command.tag
        try:
            self.engine.add_request(command.prompt, command.params, command.request_id, **command.options)
        except ValueError as error:  # the request's fault: InvalidParameter names the field
            self._post(sink, Failed(tag, str(error), client_error=True, param=getattr(error, "param", None)))
            return
        except Exception as error:  # noqa: BLE001 - reported to the client as a 500
            log.error("add_request failed:\n%s", traceback.format_exc())
            self._post(sink, Failed(tag, f"internal error: {type(error).__name__}: {error}"))
            return
        request = self.engine.requests.get(command.request_id)
        self._live[command.request_id] = _Live(sink, tag, command.arrival,
                                               num_prompt_tokens=len(request.prompt_token_ids) if request else 0)
        self._post(sink, Accepted(tag))

    def _abort_engine(self, request_id: str) -> bool:
        try:
            return self.engine.abort(request_id)
        except Exception:  # noqa: BLE001
            log.error("abort(%s) failed:\n%s", request_id, traceback.format_exc())
            return False

    def _fail_one(self, request_id: str, message: str) -> None:
        """A request the engine aborted because its own computation failed: a 500 for its client."""
        live = self._live.pop(request_id, None)
        if live is None:
            return
        if self.metrics is not None:
            self.metrics.observe_finish("abort")
        self._post(live.sink, Failed(live.tag, message))

    def _abort_all(self, message: str, shutdown: bool = False) -> None:
        for request_id, live in list(self._live.items()):
            if self._abort_engine(request_id) and self.metrics is not None:
                self.metrics.observe_finish("abort")
            self._post(live.sink, Failed(live.tag, message, shutdown=shutdown))
        self._live.clear()

    def _dispatch(self, out: RequestOutput) -> None:
        live = self._live.get(out.request_id)
        if live is None:
            return
        now = time.monotonic()
        samples = []
        grew = False
        for sample in out.outputs:
            sent = live.sent_tokens.get(sample.index, 0)
            count = len(sample.token_ids)
            finished = sample.finish_reason is not None
            if count == sent and (not finished or sample.index in live.sent_finished):
                continue
            grew = grew or count > sent
            new_logprobs = None
            if sample.logprobs is not None:
                new_logprobs = tuple(dict(entry) for entry in sample.logprobs[sent:count])
            samples.append(SampleDelta(sample.index, sample.text, tuple(sample.token_ids[sent:count]), new_logprobs,
                                       sample.finish_reason, sample.stop_reason))
            live.sent_tokens[sample.index] = count
            if finished:
                live.sent_finished.add(sample.index)
        if self.metrics is not None and grew:
            if live.first_token_time is None:
                self.metrics.ttft.observe(now - live.arrival)
            else:
                self.metrics.itl.observe(now - live.last_token_time)
        if grew:
            live.first_token_time = live.first_token_time or now
            live.last_token_time = now
        if samples or out.finished:
            prompt_logprobs = tuple(out.prompt_logprobs) if out.finished and out.prompt_logprobs is not None else None
            self._post(live.sink, Delta(live.tag, tuple(samples), out.finished, len(out.prompt_token_ids),
                                        out.num_cached_tokens, out.metrics.speculation if out.metrics else None,
                                        prompt_logprobs))
        if out.finished:
            del self._live[out.request_id]
            if self.metrics is not None:
                self.metrics.observe_finish(out.outputs[0].finish_reason if out.outputs else None)
                self.metrics.e2e.observe(now - live.arrival)
