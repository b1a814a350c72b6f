"""Helper threads: started through here, waited for by ``LLM()``, stopped before the interpreter exits.

flexpage starts a few threads so that slow chores overlap loading the model: the KV pool's
population (:class:`flexpage.attention.kv_pool.KVPool`), Inductor's vector-ISA probe
(:func:`flexpage.backends.cpu.vec_isa_cache.probe_in_background`) and its precompiled kernel
header (:func:`flexpage.backends.cpu.kernel_header.build_in_background`). Two rules keep them
from running behind a user's back:

* :func:`wait` joins every running helper: ``LLM()`` calls it, so an engine that says it is
  ready has nothing left running (a timed step right after it pays for no page faults).
* At exit (``atexit``: before Python finalises, while threads still run normally) every
  helper is asked to stop (``stop`` event: the pool stops between chunks) and joined. Why:
  a daemon thread that takes the GIL back while Python finalises is ended with
  ``pthread_exit``; if that thread is inside a torch call (pybind11's ``gil_scoped_release``
  re-takes the GIL in a ``noexcept`` destructor), the unwinding calls ``std::terminate``:
  ``terminate called without an active exception`` and exit status 134.

The threads stay daemons, so a helper that does not stop in time (a hung compiler in the
probe) cannot hold the process up for more than :data:`EXIT_JOIN_TIMEOUT_S`.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["EXIT_JOIN_TIMEOUT_S", "running", "start", "stop_all", "wait"]

#: the longest the exit hook waits for one helper that was asked to stop
EXIT_JOIN_TIMEOUT_S = 30.0

_helpers: dict[threading.Thread, threading.Event | None] = {}  # running helpers, and how to stop each
_lock = threading.Lock()


def start(target: Callable[..., Any], *args: Any, name: str,
          stop: threading.Event | None = None) -> threading.Thread:
    """Run ``target(*args)`` on a daemon helper thread called ``name``; ``stop`` is the event
    the target checks to end early (None: it cannot be stopped, only waited for)."""
    def run() -> None:
        try:
            target(*args)
        finally:
            with _lock:
                _helpers.pop(thread, None)

    thread = threading.Thread(target=run, name=name, daemon=True)
    with _lock:
        _helpers[thread] = stop
    thread.start()
    return thread


def running() -> list[str]:
    """The names of the helper threads still running."""
    with _lock:
        return [thread.name for thread in _helpers if thread.is_alive()]


def wait(timeout: float | None = None) -> list[str]:
    """Join every running helper (each for up to ``timeout`` seconds; None: until it ends);
    returns the names of those still running."""
    with _lock:
        threads = list(_helpers)
    for thread in threads:
        thread.join(timeout)
    return running()


def stop_all(timeout: float = EXIT_JOIN_TIMEOUT_S) -> list[str]:
    """Ask every helper that can stop to stop, then join them all (up to ``timeout`` seconds
    each); returns the names of those still running."""
    with _lock:
        events = [event for event in _helpers.values() if event is not None]
    for event in events:
        event.set()
    return wait(timeout)


atexit.register(stop_all)
if hasattr(os, "register_at_fork"):  # a forked child has none of its parent's threads
    os.register_at_fork(after_in_child=_helpers.clear)
