"""Tensor parallelism, specified against one process and HF transformers.

* Sharding: every rank's slices of a model reassemble to the original weights; a rank
  count that does not divide the head counts is refused before any rank starts, naming them.
* The wire: a step and the block moves travel as int64 tensors and come back unchanged.
* Recipes: a rank's heads see the model's head numbers (ALiBi's slopes follow their heads).
* Ranks spawned here (gloo): greedy tokens equal HF's / one process's for a tiny Llama with
  4 KV heads (compiled step, prefix-cache hits), under swap preemption with ALiBi, and for
  SmolLM2 on 3 ranks.
* Failure: a rank killed mid-request ends the server with an error, non-zero, within 30 s,
  leaving no process behind; a killed rank 0 takes its spawned ranks with it.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from engine_models import hf_greedy, load_reference, random_prompts
from flexpage import LLM, SamplingParams
from flexpage.attention.recipe import offset_heads
from flexpage.config import EngineConfig
from flexpage.model.runner import StepInputs
from flexpage.model.tensor_parallel import padded_vocab
from flexpage.parallel.launch import WorkerSpec, start_group
from flexpage.model.sharding import check_shardable, shard_llama
from flexpage.core.kv_ops import BlockOp, BlockOpKind
from flexpage.core.scheduler_output import ScoreRequest
from flexpage.parallel.wire import (
    Command, pack_block_ops, pack_scores, pack_step, unpack_block_ops, unpack_scores, unpack_step,
)
from flexpage.recipes import alibi
from server_fixtures import ServerProcess, free_port

# ---- sharding -------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "overrides"), [("llama", {"num_key_value_heads": 4}),
                                                 ("qwen2", {"tie_word_embeddings": True})])
def test_rank_shards_reassemble_to_the_original_weights(kind, overrides, tiny_model):
    """Column-parallel slices stack by rows, row-parallel ones by columns, the vocabulary by rows
    (padding dropped); a row-parallel bias is kept once (rank 0)."""
    model = load_reference(tiny_model(kind, **overrides))
    size = 2
    shards = []
    for rank in range(size):
        shard = copy.deepcopy(model)
        shard_llama(shard, rank, size)
        shards.append(dict(shard.named_parameters()))
    for name, original in model.named_parameters():
        parts = [shard[name] for shard in shards]
        row_parallel = name.endswith(("o_proj.weight", "down_proj.weight"))
        if "norm" in name:
            assert all(torch.equal(p, original) for p in parts), name  # replicated
            continue
        whole = torch.cat(parts, dim=1 if row_parallel else 0)
        assert torch.equal(whole[: original.shape[0]], original), name
    if model.config.tie_word_embeddings:
        assert all(s.get("lm_head.weight") is None or s["lm_head.weight"] is s["model.embed_tokens.weight"]
                   for s in shards)


def test_the_vocabulary_is_padded_to_whole_rank_slices():
    assert padded_vocab(49152, 3) == 49152
    assert padded_vocab(10, 3) == 12
    assert padded_vocab(10, 1) == 10


def test_smollm2_splits_over_3_ranks_and_is_refused_on_2_naming_its_heads(default_model_path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(default_model_path, local_files_only=True)
    check_shardable(config, 3)
    with pytest.raises(ValueError, match="9 attention heads and 3 key/value heads"):
        check_shardable(config, 2)
    with pytest.raises(ValueError, match="9 attention heads and 3 key/value heads"):
        LLM(None, dtype="float32", compile=False, num_blocks=64, tensor_parallel_size=2)


@pytest.mark.parametrize(("config", "message"), [
    (dict(tensor_parallel_size=0), "tensor_parallel_size: got 0"),
    (dict(tensor_parallel_timeout=0), "tensor_parallel_timeout: got 0"),
    (dict(tensor_parallel_size=2, deterministic=True), "tensor_parallel_size > 1 cannot be combined with deterministic"),
    (dict(tensor_parallel_size=2, host_kv_bytes="1MiB"), "host_kv_bytes > 0 cannot be combined with tensor_parallel_size > 1"),
])
def test_settings_tensor_parallelism_cannot_serve_are_named(config, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**config)


def test_a_recipe_that_cannot_travel_to_the_other_ranks_is_refused_before_they_start(tiny_model):
    with pytest.raises(ValueError, match="give the recipe by name"):
        LLM(str(tiny_model("llama", num_key_value_heads=4)), dtype="float32", compile=False, num_blocks=64,
            tensor_parallel_size=2, recipe=alibi(4))


def test_a_torchrun_world_of_another_size_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="got 2, but torchrun started WORLD_SIZE=3"):
        start_group(2, WorkerSpec("unused", torch.float32, None))


# ---- the wire and the recipes -----------------------------------------------------------


def test_a_step_travels_as_int64_tensors_and_comes_back_unchanged():
    step = StepInputs(token_ids=[5, 6, 7, 9], block_tables=[[1, 2], [3]], seq_lens=[10, 1], query_lens=[3, 1],
                      sample_rows=[2, 3], group_block_tables=[[[1, 2], [3]], [[0, 4], [5]]], evicted_pages=True)
    header, payload = pack_step(step)
    assert header.dtype == payload.dtype == torch.int64
    assert unpack_step(header, payload) == step
    plain = StepInputs([1], [[4]], [1], [1], [0])
    assert unpack_step(*pack_step(plain)) == plain


def test_score_requests_travel_with_their_pages_and_positions():
    requests = [ScoreRequest(7, [2, 3], [[11, 12], [21, 22]], [16, 24]), ScoreRequest(8, [5], [[30]], [40])]
    header, payload = pack_scores(requests)
    assert Command(int(header[0])) == Command.SCORE
    assert [(r.pages, r.first_positions) for r in unpack_scores(payload)] == [(r.pages, r.first_positions)
                                                                             for r in requests]


def test_block_ops_travel_in_their_order():
    ops = [BlockOp(BlockOpKind.SWAP_OUT, 1, 2), BlockOp(BlockOpKind.COPY, 3, 4), BlockOp(BlockOpKind.RELEASE, 8, 16)]
    header, payload = pack_block_ops(ops)
    assert Command(int(header[0])) == Command.BLOCK_OPS
    assert unpack_block_ops(payload) == ops


def test_a_rank_s_heads_see_the_model_s_head_numbers():
    """ALiBi on a rank holding heads 4..7 of 8 gives those heads' slopes."""
    full, shard = alibi(8), offset_heads(alibi(8), 4)
    score, b = torch.zeros(()), torch.tensor(0)
    q, kv = torch.tensor(10), torch.tensor(3)
    for h in range(4):
        assert shard.score_mod(score, b, torch.tensor(h), q, kv) == full.score_mod(score, b, torch.tensor(h + 4), q, kv)
    assert offset_heads(full, 0) is full
    assert shard.block_rule is full.block_rule and shard.window == full.window


# ---- ranks spawned here ------------------------------------------------------------------

PROMPTS = random_prompts((5, 17, 40), seed=1)
NEW_TOKENS = 12


def _greedy(llm, prompts, tokens=NEW_TOKENS, **params):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=tokens, **params))
    return [o.outputs[0].token_ids for o in outputs]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _close(llm: LLM) -> None:
    """Close the engine: every spawned rank leaves on rank 0's STOP (exit code 0)."""
    workers = llm.engine.executor.group.workers
    llm.engine.close()
    assert [w.returncode for w in workers] == [0] * len(workers)


@pytest.mark.usefixtures("compile_budget")
def test_two_ranks_give_hf_greedy_tokens_through_the_compiled_step_with_prefix_hits(tiny_model):
    folder = tiny_model("llama", num_key_value_heads=4)
    reference = load_reference(folder)
    shared = random_prompts((24,), seed=5)[0]
    prompts = [*PROMPTS, shared + [11, 12], shared + [13]]
    expected = [hf_greedy(reference, p, NEW_TOKENS) for p in prompts]
    llm = LLM(str(folder), dtype="float32", compile=True, num_blocks=64, tensor_parallel_size=2)
    try:
        engine = llm.engine
        assert engine.runner.pool.num_kv_heads == 2  # each rank holds half the KV heads
        assert _greedy(llm, prompts[:4]) + _greedy(llm, prompts[4:]) == expected
        assert engine.runner.compiled_step is not None and engine.runner.compiled_step.steps_run > 0
        assert engine.stats()["prefix_cache_hits"] > 0
        assert engine.block_manager.stats().used == 0
    finally:
        _close(llm)


def test_two_ranks_match_one_process_under_swap_preemption_with_alibi(tiny_model, llm_factory, tmp_path):
    """Each rank swaps its share of the blocks; ALiBi's slopes follow their heads."""
    recipe = tmp_path / "alibi4.py"
    recipe.write_text("from flexpage.recipes import alibi\nRECIPE = alibi(4)\n")
    folder = tiny_model("llama", num_key_value_heads=4)
    prompts = random_prompts((5, 17, 33, 60, 9, 24), seed=7)
    config = dict(num_blocks=13, block_size=16, preemption_mode="swap", swap_space="1MiB",
                  max_num_batched_tokens=16, recipe=str(recipe))
    expected = _greedy(llm_factory(folder, **config), prompts, 16, ignore_eos=True)
    llm = LLM(str(folder), dtype="float32", compile=False, tensor_parallel_size=2, **config)
    try:
        assert _greedy(llm, prompts, 16, ignore_eos=True) == expected
        assert llm.engine.stats()["preemptions"] > 0
    finally:
        _close(llm)


def test_two_ranks_evict_the_blocks_one_process_evicts_under_a_kv_budget(tiny_model, llm_factory):
    """Each rank scores its own KV heads and the ranks average: the same blocks go, so the
    same tokens come out as in one process."""
    folder = tiny_model("llama", num_key_value_heads=4)
    prompts = random_prompts((70, 45, 90), seed=11)
    config = dict(block_size=8, kv_budget_tokens=32, num_blocks=96)
    one = llm_factory(folder, **config)
    expected = _greedy(one, prompts, 12, ignore_eos=True)
    llm = LLM(str(folder), dtype="float32", compile=False, tensor_parallel_size=2, **config)
    try:
        assert _greedy(llm, prompts, 12, ignore_eos=True) == expected
        evicted = llm.engine.stats()["kv_evicted_blocks"]
        assert evicted > 0 and evicted == one.engine.stats()["kv_evicted_blocks"]
    finally:
        _close(llm)


def test_smollm2_on_three_ranks_gives_one_process_greedy_tokens(llm_factory):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    expected = llm_factory(None).chat(messages, params)[0].outputs[0].token_ids
    llm = LLM(None, dtype="float32", compile=False, num_blocks=64, tensor_parallel_size=3)
    try:
        assert llm.chat(messages, params)[0].outputs[0].token_ids == expected
    finally:
        _close(llm)


# ---- failure ----------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().split(")")[-1].split()[1]) == pid:
                        found.append(int(entry))
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
    return found


@pytest.mark.parametrize(("fault", "message"), [(signal.SIGKILL, "tensor parallel rank 1"),
                                                 (signal.SIGSTOP, "timed out")])
def test_a_rank_that_dies_or_hangs_mid_request_ends_the_server_with_an_error(fault, message, tiny_model):
    """Killed: its peers see the connection drop at once. Hung (stopped): the collective's
    timeout (5 s here) ends the wait. Either way the request fails, the server exits non-zero
    within 30 s, and no rank is left running."""
    server = ServerProcess("--model", str(tiny_model("llama", num_key_value_heads=4)), "--dtype", "float32",
                           "--eager", "--no-warmup", "--num-blocks", "64", "--tensor-parallel-size", "2",
                           "--tensor-parallel-timeout", "5")
    server.start().wait_ready(timeout=240)
    workers = _children(server.proc.pid)
    try:
        assert len(workers) == 1
        assert "2 ranks (spawned on this host" in server.output()  # the banner
        client = server.openai(timeout=60)
        model = client.models.list().data[0].id
        received, error = [], []

        def stream() -> None:
            try:
                for chunk in client.completions.create(model=model, prompt=[5, 6, 7], max_tokens=1500, stream=True,
                                                       extra_body={"ignore_eos": True}):
                    received.append(chunk.choices[0].finish_reason)
            except Exception as failure:  # noqa: BLE001 - what the client sees is the point
                error.append(failure)

        reader = threading.Thread(target=stream)
        reader.start()
        deadline = time.monotonic() + 60
        while len(received) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(received) >= 5, (error, server.output()[-3000:])
        os.kill(workers[0], fault)
        faulted = time.monotonic()
        code = server.proc.wait(30)
        assert time.monotonic() - faulted < 30
        reader.join(30)
        assert code != 0
        assert error or received[-1] not in (None, "length"), "the in-flight request did not fail"
        assert message in server.output().lower()
        assert not any(_alive(pid) for pid in workers)
    finally:
        for pid in workers:  # a stopped rank cannot even notice its parent is gone
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        server.stop()


def test_a_rank_that_hangs_between_requests_fails_the_next_one_within_the_timeout(tiny_model):
    """A rank stopped while it waits for rank 0's next command cannot take that command: sending
    it is bounded by the tensor-parallel timeout too (gloo's send waits for the receiver), so the
    next request fails with a RankFailure instead of waiting forever."""
    folder = tiny_model("llama", num_key_value_heads=4)
    script = textwrap.dedent(f"""
        import os, signal, time
        from flexpage import LLM, SamplingParams
        from flexpage.model.tensor_parallel import RankFailure
        llm = LLM({str(folder)!r}, dtype="float32", compile=False, num_blocks=64, tensor_parallel_size=2,
                  tensor_parallel_timeout=3)
        prompt = [{{"prompt_token_ids": [5, 6, 7]}}]
        llm.generate(prompt, SamplingParams(max_tokens=2))
        [worker] = llm.engine.executor.group.workers
        os.kill(worker.pid, signal.SIGSTOP)
        start = time.monotonic()
        try:
            llm.generate(prompt, SamplingParams(max_tokens=2))
        except RankFailure as error:
            print("failed after", time.monotonic() - start, "s:", error, flush=True)
        finally:
            os.kill(worker.pid, signal.SIGKILL)
    """)
    try:
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired as hung:
        raise AssertionError(f"the request waited for the stopped rank past 90 s: {hung.stdout}") from None
    failed = [line for line in run.stdout.splitlines() if line.startswith("failed after")]
    assert failed, (run.stdout, run.stderr[-3000:])
    assert float(failed[0].split()[2]) < 20, failed[0]


def test_a_killed_rank_0_takes_its_spawned_ranks_with_it(tiny_model):
    folder = tiny_model("llama", num_key_value_heads=4)
    script = textwrap.dedent(f"""
        import time
        from flexpage import LLM
        llm = LLM({str(folder)!r}, dtype="float32", compile=False, num_blocks=64, tensor_parallel_size=2)
        print(*[w.pid for w in llm.engine.executor.group.workers], flush=True)
        time.sleep(600)
    """)
    leader = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        workers = [int(pid) for pid in leader.stdout.readline().split()]
        assert workers and all(_alive(pid) for pid in workers)
        leader.send_signal(signal.SIGKILL)
        leader.wait(10)
        deadline = time.monotonic() + 15
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in workers)
    finally:
        leader.kill()


def test_a_rank_that_dies_while_the_server_idles_stops_it(tiny_model):
    server = ServerProcess("--model", str(tiny_model("llama", num_key_value_heads=4)), "--dtype", "float32",
                           "--eager", "--no-warmup", "--num-blocks", "64", "--tensor-parallel-size", "2")
    server.start().wait_ready(timeout=240)
    try:
        (worker,) = _children(server.proc.pid)
        os.kill(worker, signal.SIGKILL)
        assert server.proc.wait(30) == 1
        assert "tensor parallel rank 1" in server.output()
    finally:
        server.stop()


def test_ranks_started_by_torchrun_serve_one_process_s_greedy_text(tiny_model, llm_factory):
    """The multi-host path on one host: torchrun starts both ranks of ``-m flexpage.worker serve``,
    rank 0 serves HTTP with the world size as its tensor-parallel size."""
    folder = tiny_model("llama", num_key_value_heads=4)
    prompt = random_prompts((9,), seed=11)[0]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = llm_factory(folder).generate({"prompt_token_ids": prompt}, params)[0].outputs[0].text
    server = ServerProcess()
    server.args = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                   "--master-port", str(free_port()), "-m", "flexpage.worker", "serve", "--model", str(folder),
                   "--dtype", "float32", "--eager", "--no-warmup", "--num-blocks", "64", "--port", str(server.port)]
    server.start().wait_ready(timeout=240)
    try:
        assert "2 ranks (started by torchrun" in server.output()
        client = server.openai(timeout=60)
        out = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=8,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert out.choices[0].text == expected
    finally:
        server.stop()  # Ctrl-C: torchrun passes it on to both ranks, and itself exits 1 (its SignalException)
    output = server.output()
    assert "flexpage serve stopped" in output  # rank 0 drained and stopped rank 1
    assert "[rank1]" not in output, output[-3000:]  # rank 1 left without a traceback
