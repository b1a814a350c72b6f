"""Engines made, used and dropped in one process, and a process that exits while helpers run.

* ``LLM()`` returns ready: no helper thread (KV pool population, vector-ISA probe) still runs.
* Engines of different pool sizes, one after the other in one process, give the same greedy
  tokens; a dropped engine's KV pool is freed.
* A KV pool dropped while it populates stops its thread (between 8 MB chunks).
* The warm-up does not wait for the KV pool's pages (the wait would grow with the pool), and
  population takes turns with steps: no page is faulted in beside or between the steps of a
  stream of them, and a step waits for one chunk of population at most.
* A compile child dropped before it was joined is killed and reaped.
* A process that exits while a pool populates (through madvise, or through torch where the
  kernel lacks ``MADV_POPULATE_WRITE``) and a compile child runs exits with status 0, without
  ``terminate called without an active exception`` (a daemon thread inside a torch call as
  Python finalises: see :mod:`flexpage.background`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch

from flexpage import LLM, SamplingParams, background
from flexpage.attention import kv_pool
from flexpage.attention.virtual_arena import resident_bytes
from flexpage.model.compile_ahead import compile_in_child

pytestmark = pytest.mark.usefixtures("single_torch_thread")

PROMPTS = [{"prompt_token_ids": [5 + 3 * j for j in range(20)]}, {"prompt_token_ids": [900 + j for j in range(9)]}]


def test_engines_of_different_pool_sizes_are_made_used_and_dropped_in_one_process(tiny_model):
    """64 MiB and 256 MiB pools populate on a thread (mappings); 1 MiB is a plain tensor."""
    model = str(tiny_model("llama"))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = []
    for size in ("64MiB", "1MiB", "256MiB", "64MiB"):
        llm = LLM(model, kv_cache_memory=size, dtype="float32", compile=False)
        assert background.running() == []  # ready: nothing left running behind the caller
        pool = weakref.ref(llm.engine.runner.pool)
        tokens.append([out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)])
        del llm
        gc.collect()
        assert pool() is None, f"the {size} engine's KV pool outlived its engine"
    assert all(t == tokens[0] for t in tokens), tokens


def test_the_warm_up_returns_while_the_kv_pool_still_populates(monkeypatch, tiny_model):
    from flexpage.config import EngineConfig
    from flexpage.engine import LLMEngine

    may_start = threading.Event()
    fault_in = kv_pool.fault_in
    monkeypatch.setattr(kv_pool, "fault_in", lambda *args, **kwargs: may_start.wait(60) and fault_in(*args, **kwargs))
    engine = LLMEngine(EngineConfig(model=str(tiny_model("llama")), kv_cache_memory="64MiB", dtype="float32",
                                    compile=False))
    try:
        assert engine.warm_up() > 0
        assert engine.runner.pool.populating
    finally:
        may_start.set()
    engine.runner.pool.wait_until_resident()
    assert not engine.runner.pool.populating


def test_population_waits_while_steps_keep_coming():
    pool = kv_pool.allocate_pool((64 << 20,), torch.uint8, populate=False)  # 64 MB: a mapping, not resident
    turns = kv_pool.StepsFirst(idle_s=0.5)  # far longer than any gap below, on a busy machine too
    helper = threading.Thread(target=kv_pool.fault_in, args=(pool,), kwargs={"turn": turns.chunk})
    with turns.step():
        helper.start()
    for _ in range(50):  # 0.5 s of steps with the gaps of a serving loop between them
        with turns.step():
            time.sleep(0.01)
        time.sleep(0.001)
    assert resident_bytes(pool) == 0  # nothing faulted in beside or between the steps
    helper.join(60)  # the engine idle: the pool populates
    assert resident_bytes(pool) == pool.nbytes


def test_a_step_waits_for_one_chunk_of_population_at_most():
    pool = kv_pool.allocate_pool((64 << 20,), torch.uint8, populate=False)  # 8 chunks of 8 MB
    turns = kv_pool.StepsFirst()

    @contextlib.contextmanager
    def slow_chunk():  # 100 ms a chunk: the population takes 0.8 s
        with turns.chunk():
            time.sleep(0.1)
            yield

    helper = threading.Thread(target=kv_pool.fault_in, args=(pool,), kwargs={"turn": slow_chunk})
    helper.start()
    while resident_bytes(pool) == 0:
        time.sleep(0.001)
    for _ in range(3):  # steps back to back (with the gaps of a serving loop) get in between chunks
        with turns.step():
            assert resident_bytes(pool) < pool.nbytes
            time.sleep(0.02)
        time.sleep(0.001)
    helper.join(60)
    assert resident_bytes(pool) == pool.nbytes


def test_a_pool_dropped_while_it_populates_stops_its_thread(monkeypatch):
    results = []
    fault_in = kv_pool.fault_in
    monkeypatch.setattr(kv_pool, "fault_in", lambda *args, **kwargs: results.append(fault_in(*args, **kwargs)))
    pool = kv_pool.KVPool(num_layers=2, num_blocks=1 << 15, block_size=16, num_kv_heads=4, head_dim=64,
                          dtype=torch.bfloat16)  # 1 GiB: seconds to populate
    thread = pool._populating
    del pool
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert results == [False]  # stopped before the end, not finished
    assert "flexpage-kv-populate" not in background.running()


def test_fault_in_stops_at_once_when_asked():
    pool = kv_pool.allocate_pool((4 << 20,), torch.uint8, populate=False)
    stop = threading.Event()
    stop.set()
    assert kv_pool.fault_in(pool, stop=stop) is False
    assert kv_pool.fault_in(pool) is True


def test_a_compile_child_dropped_unjoined_is_killed_and_reaped():
    child = compile_in_child(lambda: time.sleep(60))
    pid = child.pid
    del child
    gc.collect()
    with pytest.raises(ChildProcessError):  # reaped: no such child any more
        os.waitpid(pid, 0)


_EXIT_WHILE_BUSY = textwrap.dedent("""
    import sys, time
    import torch
    from flexpage.attention import kv_pool
    from flexpage.model.compile_ahead import compile_in_child

    if sys.argv[1] == "touch":  # as on a kernel before 5.14: EINVAL, the thread touches pages through torch
        kv_pool._MADV_POPULATE_WRITE = -1
    child = compile_in_child(lambda: time.sleep(60))
    pool = kv_pool.KVPool(num_layers=2, num_blocks=1 << 13, block_size=16, num_kv_heads=4, head_dim=64,
                          dtype=torch.bfloat16)  # 256 MiB
    time.sleep(0.1)
    print(child.pid, pool._populating.is_alive(), flush=True)
""")


@pytest.mark.parametrize("populate", ["madvise", "touch"])
def test_a_process_exits_cleanly_while_its_pool_populates_and_a_compile_child_runs(populate, tmp_path):
    """Before flexpage.background (population on a bare daemon thread, the ``touch`` path one
    torch call over the whole pool) the ``touch`` case died with status 134: 'terminate called
    without an active exception'."""
    script = tmp_path / "exit_while_busy.py"
    script.write_text(_EXIT_WHILE_BUSY)
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(script), populate], capture_output=True, text=True, timeout=300,
                          env=env)
    assert "terminate called" not in done.stderr, done.stderr
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:  # killed and reaped by its parent as it exited
        time.sleep(0.05)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
