"""The compiled decode step (:mod:`flexpage.model.compiled_step`): every layer of a decode step
in one compiled graph.

* Through the engine it gives HF ``generate``'s greedy tokens (float32; Llama, Qwen2's q/k/v
  biases, Qwen3's q/k norms), and decode-only steps are what take it.
* One decode step gives the logits of the layer-by-layer path, to rounding (float32, and
  bfloat16 with oneDNN-packed weights), and writes the same K/V into the pool.
* It is off where it does not apply: deterministic mode, eager attention, ``compile_step=False``.
"""

from __future__ import annotations

import pytest
import torch

from engine_models import hf_greedy, load_reference, random_prompts
from flexpage import SamplingParams
from flexpage.model.runner import ModelRunner, StepInputs

pytestmark = pytest.mark.usefixtures("single_torch_thread", "kv_blocks_returned")

PROMPTS = random_prompts((5, 17, 33, 60), seed=21)
NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_compiled_decode_steps_give_hf_greedy_tokens(kind, tiny_model, llm_factory):
    llm = llm_factory(tiny_model(kind), compile=True, num_blocks=128)
    step = llm.engine.runner.compiled_step
    assert step is not None
    before = step.steps_run
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    reference = load_reference(tiny_model(kind))
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(reference, p, NEW_TOKENS) for p in PROMPTS]
    # the first step prefills all four prompts; every later step decodes only
    assert step.steps_run - before >= NEW_TOKENS - 1
    alone = llm.generate([{"prompt_token_ids": PROMPTS[1]}], GREEDY)  # batch 1: its own graph (a size of 1)
    assert alone[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids


def test_prefill_steps_run_layer_by_layer(tiny_model, llm_factory):
    llm = llm_factory(tiny_model("llama"), compile=True, num_blocks=128)
    step = llm.engine.runner.compiled_step
    before = step.steps_run
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0.0, max_tokens=1))
    assert step.steps_run == before


def _decode_logits_both_ways(runner: ModelRunner) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prefill three sequences layer by layer, then run one decode step of all three through the
    compiled step and, from the same pool, layer by layer: (logits, pool) of each."""
    tables = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    lengths = [9, 20, 30]
    prompts = random_prompts(lengths, seed=5)
    prefill = StepInputs(token_ids=[t for p in prompts for t in p], block_tables=tables, seq_lens=lengths,
                         query_lens=lengths, sample_rows=[8, 28, 58])
    runner.execute(prefill)
    decode = StepInputs(token_ids=[11, 12, 13], block_tables=tables, seq_lens=[n + 1 for n in lengths],
                        query_lens=[1, 1, 1], sample_rows=[0, 1, 2])
    before = runner.pool.storage.clone()
    steps = runner.compiled_step.steps_run
    compiled = runner.execute(decode)
    assert runner.compiled_step.steps_run == steps + 1
    compiled_pool = runner.pool.storage.clone()
    runner.pool.storage.copy_(before)
    step, runner.compiled_step = runner.compiled_step, None
    try:
        layered = runner.execute(decode)
    finally:
        runner.compiled_step = step
    return compiled, layered, compiled_pool, runner.pool.storage


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_decode_step_gives_the_layer_by_layer_logits_and_kv(dtype, tiny_model):
    """bf16 runs the projections on oneDNN-packed weights (where the CPU has bf16): the compiled
    graph rounds fused elementwise ops once, eager code after every op, hence the tolerance."""
    model = load_reference(tiny_model("qwen3")).to(dtype)
    runner = ModelRunner(model, num_blocks=16, block_size=8, compile=True, blocks_per_attention_block=2)
    compiled, layered, compiled_pool, layered_pool = _decode_logits_both_ways(runner)
    tolerance = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(compiled, layered, **tolerance)
    torch.testing.assert_close(compiled_pool, layered_pool, **tolerance)
    assert not torch.equal(compiled_pool, torch.zeros_like(compiled_pool))


def test_the_compiled_step_is_off_where_it_does_not_apply(tiny_model):
    model = load_reference(tiny_model("llama"))
    for options in (dict(compile=False), dict(compile=True, compile_step=False),
                    dict(compile=True, deterministic=True)):
        runner = ModelRunner(model, num_blocks=16, block_size=8, **options)
        assert runner.compiled_step is None, options
