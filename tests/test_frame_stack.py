"""Step loops run below a reserved frame (``flexpage.frame_stack``), so that CPython does not map
and unmap a chunk of its frame stack every step. What a test can see from Python: the loop
runs below a frame of ``RESERVED_SLOTS`` local slots, and the wrapped function behaves as
before. (That no chunk is then mapped per step is CPython's allocation rule, described in
the module; the speed it buys is measured in bench/, not here.)"""

from __future__ import annotations

import sys
import threading

import pytest

from flexpage.frame_stack import RESERVED_SLOTS, reserved_frame_stack
from flexpage.llm import LLM
from flexpage.server.engine_loop import EngineLoop


def below_a_reserved_frame() -> bool:
    """Whether a frame of the calling thread's stack holds the reserved slots."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_nlocals >= RESERVED_SLOTS:
            return True
        frame = frame.f_back
    return False


def test_a_reserved_loop_runs_below_the_reserved_frame_and_returns_what_it_returns():
    @reserved_frame_stack
    def loop(a: int, *, b: int) -> tuple[int, bool]:
        return a + b, below_a_reserved_frame()

    assert loop(2, b=3) == (5, True)
    assert not below_a_reserved_frame()
    assert loop.__name__ == "loop"


def test_a_reserved_loop_raises_what_it_raises():
    @reserved_frame_stack
    def loop() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        loop()


class StepRecorder:
    """The part of LLMEngine that ``LLM.generate`` and the server's loop call; records whether
    each step ran below the reserved frame."""

    def __init__(self, steps: int = 2) -> None:
        self.steps_left = steps
        self.reserved: list[bool] = []
        self.stepped = threading.Event()

    def prepare_prompt(self, prompt: object) -> object:
        return prompt

    def add_request(self, prompt: object, params: object, conversation_id: object = None) -> str:
        return "r0"

    def has_unfinished_requests(self) -> bool:
        return self.steps_left > 0

    def step(self) -> list:
        self.steps_left -= 1
        self.reserved.append(below_a_reserved_frame())
        if self.steps_left == 0:
            self.stepped.set()
        return []

    def check_health(self) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {}


def test_llm_generate_steps_below_the_reserved_frame():
    llm = LLM.__new__(LLM)  # the loop alone: no model
    llm.engine = StepRecorder()
    with pytest.raises(KeyError):  # the recorder never finishes its request
        llm.generate([[1, 2, 3]])
    assert llm.engine.reserved == [True, True]


def test_the_server_engine_thread_steps_below_the_reserved_frame():
    engine = StepRecorder()
    loop = EngineLoop(engine)
    loop.start()
    try:
        assert engine.stepped.wait(10)
    finally:
        loop.stop()
    assert engine.reserved == [True, True]
