"""Compiling a step program in a forked child (:mod:`flexpage.model.compile_ahead`).

* The child runs the function and reports whether it succeeded; one that fails or hangs
  (killed at the timeout) only reports failure.
* The KV pool's memory is not mapped in the child.
* A first warm-up compiles the decode steps' program in a child while it compiles the prefill
  steps' one, then loads the child's program instead of compiling it; the engine gives HF's
  greedy tokens through it. Where the program is saved already, nothing is forked.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from engine_models import hf_greedy, load_reference, random_prompts
from flexpage import SamplingParams
from flexpage.attention.kv_pool import allocate_pool
from flexpage.model.compile_ahead import compile_in_child

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def test_a_child_reports_whether_its_function_succeeded(tmp_path):
    marker = tmp_path / "ran"
    child = compile_in_child(lambda: marker.write_text(str(os.getpid())))
    assert child is not None and child.join(timeout=30)
    assert int(marker.read_text()) == child.pid != os.getpid()

    def fails() -> None:
        raise RuntimeError("no compiler")

    assert compile_in_child(fails).join(timeout=30) is False


def test_a_child_that_hangs_is_killed_at_the_timeout():
    child = compile_in_child(lambda: time.sleep(60))
    began = time.monotonic()
    assert child.join(timeout=0.5) is False
    assert time.monotonic() - began < 10
    with pytest.raises(ChildProcessError):  # reaped: no such child any more
        os.waitpid(child.pid, 0)


def test_the_kv_pool_is_not_mapped_in_a_child():
    """The parent's KV writes then pay no copy-on-write while a child lives."""
    pool = allocate_pool((4 << 20,), torch.uint8, populate=False)  # 4 MB: a mapping
    address = pool.data_ptr()

    def pool_unmapped() -> None:
        with open("/proc/self/maps") as maps:
            for line in maps:
                start, end = (int(bound, 16) for bound in line.split()[0].split("-"))
                if start <= address < end:
                    raise AssertionError(f"the pool is mapped in the child: {line}")

    with pytest.raises(AssertionError):  # the check finds it in this process
        pool_unmapped()
    assert compile_in_child(pool_unmapped).join(timeout=30)


def test_a_first_warm_up_loads_the_decode_program_a_child_compiled(tiny_model, monkeypatch, tmp_path):
    from flexpage import LLM
    from flexpage import warmup
    from flexpage.backends.cpu import saved_programs
    from flexpage.model import compiled_step

    programs = {}
    program = compiled_step._program
    program.cache_clear()  # as a new process with an empty cache
    monkeypatch.setattr(compiled_step, "_program", lambda shape, groups, layout: programs.setdefault(
        tuple(kind for kind, _, _ in groups), program(shape, groups, layout)))
    children = []
    monkeypatch.setattr(warmup, "compile_in_child", lambda compile: children.append(compile_in_child(compile))
                        or children[-1])
    monkeypatch.setattr(saved_programs, "program_dir", lambda: tmp_path)
    try:
        llm = LLM(str(tiny_model("llama")), dtype="float32", compile=True, num_blocks=128)
        llm.engine.warm_up()
        assert len(children) == 1 and children[0].succeeded
        decode, mixed = programs[("decode",)], programs[("decode", "prefill")]
        assert (decode.compiled_here, decode.loaded) == (0, 1)  # the child's, read from disk
        assert (mixed.compiled_here, mixed.loaded) == (1, 0)
        prompts = random_prompts((5, 17, 33), seed=8)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=6))
        reference = load_reference(tiny_model("llama"))
        assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(reference, p, 6) for p in prompts]

        llm.engine.warm_up()  # saved now: nothing to compile ahead
        assert len(children) == 1
    finally:
        program.cache_clear()  # later tests must not save into tmp_path
