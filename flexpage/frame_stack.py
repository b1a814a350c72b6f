"""Step loops that do not map and unmap Python's frame stack every step.

CPython (3.11 and later) keeps each thread's frames in chunks of its own stack, 16 KB each,
mapped with ``mmap`` when a call needs room past the current chunk and unmapped when that call
returns. A decode step's calls reach ~19 KB below the loop that drives it (the engine, the
compiled step's wrappers, its layers), so wherever the loop's own frame sits, some call of
every step crosses into a new chunk and maps it, and unmaps it on return: 2-3 times a step.
Unmapping memory of a process whose other threads run (the OpenMP worker of every parallel
kernel) interrupts them to flush their TLBs, and in a VM each interrupt exits to the
hypervisor: 8% of a SmolLM2 batch-1 decode step's main thread went to those flushes
(``perf``, 2-core Intel Xeon VM), and its decode steps ran 1.1-1.25x faster without them
(bench/results/against_commit-frame-stack.json).

:func:`reserved_frame_stack` runs a loop below one frame of :data:`RESERVED_SLOTS` empty
local slots (~128 KB). CPython gives that frame a chunk of its own of 256 KB, and every frame
of the loop below it fits in the rest, so the loop maps nothing while it runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

#: local slots of the reserving frame: 8 bytes each, ~128 KB, so that CPython allocates it a
#: 256 KB chunk (it doubles 16 KB until the frame and 1,000 slots of headroom fit), leaving
#: ~128 KB for the frames below it -- over 6x what a step's calls use
RESERVED_SLOTS = 16_000

F = TypeVar("F", bound=Callable[..., Any])


@functools.cache
def _below_reserved_frame() -> Callable[..., Any]:
    """A function whose frame holds :data:`RESERVED_SLOTS` locals that are never assigned (they
    only need to exist), compiled once on first use (~20 ms)."""
    names = " = ".join(f"_{i}" for i in range(RESERVED_SLOTS))
    source = ("def below_reserved_frame(fn, args, kwargs):\n"
              f"    if False:\n        {names} = None\n"
              "    return fn(*args, **kwargs)\n")
    namespace: dict[str, Any] = {}
    exec(compile(source, "<flexpage.frame_stack>", "exec"), namespace)
    return namespace["below_reserved_frame"]


def reserved_frame_stack(fn: F) -> F:
    """``fn`` (a loop that calls :meth:`~flexpage.engine.LLMEngine.step` many times) run below a
    reserved frame: same arguments, result and exceptions. Put it on the loop, not on a single
    step: the reserve itself is mapped and unmapped once per call."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        return _below_reserved_frame()(fn, args, kwargs)

    return run  # type: ignore[return-value]
