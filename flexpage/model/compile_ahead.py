"""Compile a step program in a forked child process while this process compiles another.

Why: a first start compiles two step graphs, one after the other (the engine's ``warm_up``):
each is seconds of Dynamo, AOTAutograd and Inductor in Python on one core (~10 and ~7 s on
the 2-core Zen 5), and only the first's C++ kernels keep both cores busy. Threads cannot
overlap the two (the GIL, and Dynamo compiles under one lock), and a helper process started
afresh spends ~5 s importing and loading the model first. A child forked once the model is
loaded shares its weights, copy-on-write, and starts at once: it compiles the decode steps'
program and saves it (:mod:`flexpage.backends.cpu.saved_programs`), where the parent's first
decode step reads it.

What keeps the fork safe in a process that has threads and thread pools:

* The child runs no kernel: the program is compiled ahead of time, never called, so the child
  never enters OpenMP (whose GNU runtime does not survive a fork) or touches the KV pool,
  which is not even mapped in it (``MADV_DONTFORK``, :func:`flexpage.attention.kv_pool.allocate_pool`:
  the parent's KV writes then pay no copy-on-write).
* It compiles its C++ kernels itself, one at a time: Inductor's worker pool is the parent's.
* The vector-ISA probe (whose thread holds a lock while it runs) has answered before the fork,
  and Inductor's precompiled kernel header is built (:mod:`flexpage.backends.cpu.kernel_header`).
* It leaves with ``os._exit``: no exit handlers, no flushing of buffers it shares with the
  parent, and it dies with the parent (``PR_SET_PDEATHSIG``, and it checks that the parent
  is still there once that is set). A child that fails or hangs costs the parent only the
  compile it would have done itself.
* The parent never leaves one behind: a :class:`ForkedCompile` dropped before it was joined,
  and any still running as the parent exits, is killed and reaped (no zombie, no orphan
  writing to the compile cache).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import time
import warnings
import weakref
from collections.abc import Callable

from flexpage.backends.cpu import kernel_header
from flexpage.backends.cpu.vec_isa_cache import cpu_vec_isa

__all__ = ["ForkedCompile", "compile_in_child"]

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # prctl option: the signal a process gets when its parent dies


class ForkedCompile:
    """A child process running a compile (:func:`compile_in_child`)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.succeeded: bool | None = None  # None until joined
        # dropped unjoined, or still running at exit (weakref.finalize runs then too): kill and reap it
        self._end = weakref.finalize(self, _kill_and_reap, pid, os.getpid())

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the child (then kill it); True if it compiled."""
        if self.succeeded is not None:
            return self.succeeded
        deadline = time.monotonic() + timeout
        while True:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self._end.detach()
                self.succeeded = os.waitstatus_to_exitcode(status) == 0
                return self.succeeded
            if time.monotonic() > deadline:
                log.warning("the compile child %d took over %.0f s; compiling here instead", self.pid, timeout)
                self._end()
                self.succeeded = False
                return False
            time.sleep(0.02)


def compile_in_child(compile: Callable[[], None]) -> ForkedCompile | None:
    """Run ``compile`` (which must compile and save, not run kernels) in a forked child; None
    where this platform cannot fork."""
    if not hasattr(os, "fork"):
        return None
    parent = os.getpid()
    cpu_vec_isa()  # waits for the probe thread, if one is running (its lock would stay held in the child)
    kernel_header.wait()  # and for the kernel header's builder (the same: no thread of it is in the child)
    sys.stdout.flush()
    sys.stderr.flush()
    with warnings.catch_warnings():  # Python 3.12+ warns of forking with threads: the child keeps away from them
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid:
        return ForkedCompile(pid)
    status = 1
    try:
        _die_with_parent(parent)
        from torch._inductor import config

        config.compile_threads = 1  # synchronous C++ builds in this process, not through the parent's pool
        compile()
        status = 0
    except BaseException as error:  # noqa: BLE001 -- whatever it is, the parent compiles instead
        with contextlib.suppress(Exception):
            log.warning("the compile child failed (%s: %s); the parent compiles instead", type(error).__name__, error)
    finally:
        os._exit(status)


def _die_with_parent(parent: int) -> None:
    """Ask Linux to kill this process when its parent exits (elsewhere, a no-op); leave at once
    where the parent (pid ``parent``) has exited already, before the request was made."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def _kill_and_reap(pid: int, parent: int) -> None:
    """End a compile child that is still running, and collect its exit status (only in its
    parent ``parent``: not in a process forked from it since)."""
    if os.getpid() != parent:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
