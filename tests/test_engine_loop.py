"""``EngineLoop.build``: the engine is created in the thread that steps it.

Torch keeps per-thread state; a model loaded in one thread and stepped in another ran
small-batch decode steps 20-50% slower (docs/serve-benchmark.md). These tests use a stub
engine: they check where things run, not what the engine computes.
"""

from __future__ import annotations

import threading

import pytest

from flexpage.server.engine_loop import EngineLoop


class StubEngine:
    """The part of LLMEngine the loop calls while idle; records the threads that call it."""

    def __init__(self) -> None:
        self.built_in = threading.get_ident()
        self.stepped_in: set[int] = set()
        self.stats_calls = threading.Event()

    def has_unfinished_requests(self) -> bool:
        self.stepped_in.add(threading.get_ident())
        return False

    def stats(self) -> dict[str, float]:
        self.stats_calls.set()
        return {}

    def check_health(self) -> None:
        pass


def test_the_engine_is_built_and_run_in_one_thread_that_is_not_the_callers():
    seen_init: list[int] = []
    loop = EngineLoop.build(StubEngine, thread_init=lambda: seen_init.append(threading.get_ident()))
    engine = loop.engine
    assert engine.built_in != threading.get_ident()
    assert seen_init == [engine.built_in]  # thread_init ran first, in the same thread
    assert not engine.stepped_in  # nothing runs before start()
    loop.start()
    engine.stats_calls.clear()
    assert engine.stats_calls.wait(5)
    loop.stop(timeout=5)
    assert not loop.alive
    assert engine.stepped_in == {engine.built_in}


def test_a_failing_factory_raises_in_the_caller():
    def broken() -> StubEngine:
        raise ValueError("model: got 'nowhere', expected a folder")

    with pytest.raises(ValueError, match="model: got 'nowhere'"):
        EngineLoop.build(broken)


def test_stop_ends_a_built_loop_that_was_never_started():
    loop = EngineLoop.build(StubEngine)
    loop.stop(timeout=5)
    assert not loop.alive
