"""Engines made, used and dropped in one process, and a process that exits while helpers run.

* ``LLM()`` returns ready: no helper thread (KV pool population, vector-ISA probe) still runs.
* Engines of different pool sizes, one after the other in one process, give the same greedy
  tokens; a dropped engine's KV pool is freed.
* A KV pool dropped while it populates stops its thread (between 32 MB chunks).
* A compile child dropped before it was joined is killed and reaped.
* A process that exits while a pool populates (through madvise, or through torch where the
  kernel lacks ``MADV_POPULATE_WRITE``) and a compile child runs exits with status 0, without
  ``terminate called without an active exception`` (a daemon thread inside a torch call as
  Python finalises: see :mod:`flexpage.background`).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import time
import weakref
from pathlib import Path

import pytest
import torch

from flexpage import LLM, SamplingParams, background
from flexpage.attention import kv_pool
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
    import threading

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
