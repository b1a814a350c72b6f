"""The compiled step (:mod:`flexpage.model.compiled_step`): every layer of a step in one
compiled graph.

* Through the engine it gives HF ``generate``'s greedy tokens (float32; Llama, Qwen2's q/k/v
  biases, Qwen3's q/k norms), in prefill, decode and mixed steps alike.
* Each kind of step gives the logits of the layer-by-layer path, to rounding (float32, and
  bfloat16 with oneDNN-packed weights), and writes the same K/V into the pool. A prefill-only
  step runs the mixed steps' graph.
* Its graphs are keyed by the weights' and pools' shapes (which they do not guard): a model
  that differs only there gets graphs of its own. Being unguarded, oneDNN-packed weights
  (bf16) do not keep the graphs from being saved: the next engine loads them.
* It is off where it does not apply: deterministic mode, eager attention, ``compile_step=False``.
"""

from __future__ import annotations

import pytest
import torch

from engine_models import greedy_in_two_processes, hf_greedy, load_reference, random_prompts
from flexpage import SamplingParams
from flexpage.model.runner import ModelRunner, StepInputs

pytestmark = pytest.mark.usefixtures("single_torch_thread", "kv_blocks_returned")

PROMPTS = random_prompts((5, 17, 33, 60), seed=21)
NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_compiled_steps_give_hf_greedy_tokens(kind, tiny_model, llm_factory):
    llm = llm_factory(tiny_model(kind), compile=True, num_blocks=128)
    step = llm.engine.runner.compiled_step
    assert step is not None
    before = step.steps_run
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    reference = load_reference(tiny_model(kind))
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(reference, p, NEW_TOKENS) for p in PROMPTS]
    assert step.steps_run - before >= NEW_TOKENS  # a prefill step, then decode steps
    alone = llm.generate([{"prompt_token_ids": PROMPTS[1]}], GREEDY)  # one row: its own graph (a size of 1)
    assert alone[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids


def test_models_alike_but_for_their_weight_shapes_get_graphs_of_their_own(tiny_model, llm_factory):
    """The graph does not guard the weights (a check per step on ~600 tensors): their shapes
    key it instead, so a model that differs only there never runs another's graph."""
    narrow = tiny_model("llama", intermediate_size=96)
    steps = [llm_factory(model, compile=True, num_blocks=128).engine.runner.compiled_step
             for model in (tiny_model("llama"), narrow)]
    assert steps[0].shape == steps[1].shape and steps[0].layout != steps[1].layout
    for model in (tiny_model("llama"), narrow):
        outputs = llm_factory(model, compile=True, num_blocks=128).generate(
            [{"prompt_token_ids": p} for p in PROMPTS[:2]], GREEDY)
        reference = load_reference(model)
        assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(reference, p, NEW_TOKENS) for p in PROMPTS[:2]]


def test_a_prompt_joining_decoding_requests_gives_hf_greedy_tokens(tiny_model, llm_factory):
    """Steps that mix decode rows (the pool in place) and a prefill (gathered keys) are one graph too."""
    llm = llm_factory(tiny_model("llama"), compile=True, num_blocks=128)
    engine = llm.engine
    step = engine.runner.compiled_step
    for i, prompt in enumerate(PROMPTS[:2]):
        engine.add_request({"prompt_token_ids": prompt}, GREEDY, f"early-{i}")
    outputs = {}
    for _ in range(2):  # a prefill step, a decode step
        for out in engine.step():
            outputs[out.request_id] = out
    before = step.steps_run
    engine.add_request({"prompt_token_ids": PROMPTS[3]}, GREEDY, "late")
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    assert step.steps_run - before >= NEW_TOKENS  # every step, the mixed one included
    reference = load_reference(tiny_model("llama"))
    for request_id, prompt in (("early-0", PROMPTS[0]), ("early-1", PROMPTS[1]), ("late", PROMPTS[3])):
        assert outputs[request_id].outputs[0].token_ids == hf_greedy(reference, prompt, NEW_TOKENS), request_id


def _both_ways(runner: ModelRunner, inputs: StepInputs) -> tuple[torch.Tensor, ...]:
    """Run ``inputs`` through the compiled step and, from the same pool, layer by layer:
    (compiled logits, compiled pool, layered logits, layered pool)."""
    before = runner.pool.storage.clone()
    steps = runner.compiled_step.steps_run
    compiled = runner.execute(inputs)
    assert runner.compiled_step.steps_run == steps + 1
    compiled_pool = runner.pool.storage.clone()
    runner.pool.storage.copy_(before)
    step, runner.compiled_step = runner.compiled_step, None
    try:
        layered = runner.execute(inputs)
    finally:
        runner.compiled_step = step
    return compiled, compiled_pool, layered, runner.pool.storage.clone()


def test_the_next_engine_loads_the_steps_of_a_bf16_model_with_onednn_packed_weights(tiny_model, monkeypatch, tmp_path):
    """The default on CPUs with bf16: the weights packed for oneDNN are opaque tensors whose
    guards torch cannot save, and which the saved programs do not guard (their layout is in the
    key). The second engine compiles nothing, reads the first one's programs and gives the same
    greedy tokens."""
    from flexpage import LLM

    def make_llm() -> LLM:
        llm = LLM(str(tiny_model("llama")), dtype="bfloat16", compile=True, num_blocks=128)
        assert llm.engine.runner.compact.layers[0].qkv.weight.is_mkldnn == torch.ops.mkldnn._is_mkldnn_bf16_supported()
        return llm

    tokens, saved = greedy_in_two_processes(make_llm, PROMPTS, GREEDY, tmp_path, monkeypatch)
    assert saved[0] and saved[1] == saved[0]  # the first engine saved programs, the second added none
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_decode_and_mixed_steps_give_the_layer_by_layer_logits_and_kv(dtype, tiny_model):
    """bf16 runs the projections on oneDNN-packed weights (where the CPU has bf16): the compiled
    graph rounds fused elementwise ops once, eager code after every op, hence the tolerance."""
    model = load_reference(tiny_model("qwen3")).to(dtype)
    runner = ModelRunner(model, num_blocks=16, block_size=8, compile=True, blocks_per_attention_block=2)
    tables = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    prompts = random_prompts([9, 20, 30], seed=5)
    prefill = StepInputs(token_ids=prompts[0] + prompts[1], block_tables=tables[:2], seq_lens=[9, 20],
                         query_lens=[9, 20], sample_rows=[8, 28])
    decode = StepInputs(token_ids=[11, 12], block_tables=tables[:2], seq_lens=[10, 21], query_lens=[1, 1],
                        sample_rows=[0, 1])
    mixed = StepInputs(token_ids=[13, 14, *prompts[2]], block_tables=tables, seq_lens=[11, 22, 30],
                       query_lens=[1, 1, 30], sample_rows=[0, 1, 31])
    tolerance = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    for inputs in (prefill, decode, mixed):
        compiled, compiled_pool, layered, layered_pool = _both_ways(runner, inputs)
        torch.testing.assert_close(compiled, layered, **tolerance)
        torch.testing.assert_close(compiled_pool, layered_pool, **tolerance)
        runner.pool.storage.copy_(compiled_pool)  # the next step continues from the compiled step's KV
    assert torch.count_nonzero(runner.pool.storage) > 0



def test_a_prefill_only_step_runs_the_program_of_mixed_steps(tiny_model, monkeypatch):
    """One graph fewer to compile (~10 s of a cold start on 2 cores): beside an idle decode
    group that lists no key block, a prefill-only step runs the mixed steps' program, and still
    gives the layer-by-layer logits and K/V."""
    import flexpage.model.compiled_step as compiled_step

    programs_asked = []
    program = compiled_step._program
    monkeypatch.setattr(compiled_step, "_program", lambda shape, groups, layout: (
        programs_asked.append(groups), program(shape, groups, layout))[1])
    runner = ModelRunner(load_reference(tiny_model("qwen3")), num_blocks=16, block_size=8, compile=True,
                         blocks_per_attention_block=2)
    prompts = random_prompts([9, 20, 30], seed=5)
    prefill = StepInputs(token_ids=prompts[0] + prompts[1], block_tables=[[1, 2, 3, 4], [5, 6, 7, 8]],
                         seq_lens=[9, 20], query_lens=[9, 20], sample_rows=[8, 28])
    mixed = StepInputs(token_ids=[13, 14, *prompts[2]], block_tables=[[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]],
                       seq_lens=[10, 21, 30], query_lens=[1, 1, 30], sample_rows=[0, 1, 31])
    for inputs in (prefill, mixed):
        compiled, compiled_pool, layered, layered_pool = _both_ways(runner, inputs)
        torch.testing.assert_close(compiled, layered, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(compiled_pool, layered_pool, rtol=1e-4, atol=1e-4)
        runner.pool.storage.copy_(compiled_pool)
    assert programs_asked[0] == programs_asked[1]
    assert [kind for kind, _, _ in programs_asked[0]] == ["decode", "prefill"]

def test_the_compiled_step_is_off_where_it_does_not_apply(tiny_model):
    model = load_reference(tiny_model("llama"))
    for options in (dict(compile=False), dict(compile=True, compile_step=False)):
        runner = ModelRunner(model, num_blocks=16, block_size=8, **options)
        assert runner.compiled_step is None, options


def test_compiled_graphs_are_kept_under_the_flexpage_cache_unless_the_user_chose_a_place(tmp_path):
    """Inductor's default cache is a temp directory a reboot clears; a second start should load
    the compiled step, not compile it again."""
    import os
    import subprocess
    import sys

    code = "import os, flexpage; print(os.environ['TORCHINDUCTOR_CACHE_DIR'])"
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["HOME"] = str(tmp_path)
    run = [sys.executable, "-c", code]
    chosen = subprocess.run(run, env=env, capture_output=True, text=True, check=True).stdout.split()[-1]
    assert chosen == str(tmp_path / ".cache" / "flexpage" / "inductor")
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "mine")
    assert subprocess.run(run, env=env, capture_output=True, text=True, check=True).stdout.split()[-1] == str(
        tmp_path / "mine")
