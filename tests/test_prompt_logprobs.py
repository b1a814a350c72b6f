"""``SamplingParams(prompt_logprobs=k)``: every prompt token's log-probability after the ones
before it, equal to HF's log-softmax of the same forward (float32, 1e-4), whatever the chunking,
the prefix cache or the number of samples."""

from __future__ import annotations

import pytest
import torch

from engine_models import load_reference, random_prompts
from flexpage import SamplingParams
from flexpage.errors import InvalidParameter

PROMPTS = random_prompts((5, 40, 23), seed=4)


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def hf_prompt_logprobs(model):
    reference = load_reference(model)
    with torch.no_grad():
        return [reference(torch.tensor([p])).logits[0].float().log_softmax(-1) for p in PROMPTS]


def _check(outputs, hf_prompt_logprobs, top):
    for prompt, out, logprobs in zip(PROMPTS, outputs, hf_prompt_logprobs):
        entries = out.prompt_logprobs
        assert len(entries) == len(prompt) and entries[0] is None
        for position, (token, entry) in enumerate(zip(prompt[1:], entries[1:])):
            row = logprobs[position]
            assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            best = [entry_id for entry_id, lp in entry.items() if lp.rank is not None and lp.rank <= top]
            assert sorted(best) == sorted(row.topk(top).indices.tolist())


@pytest.mark.usefixtures("kv_blocks_returned")
def test_prompt_logprobs_equal_hf_in_chunks_and_after_a_cache_hit(model, llm_factory, hf_prompt_logprobs):
    llm = llm_factory(model, max_num_batched_tokens=16)  # the 40-token prompt takes three chunks
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2)
    first = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    _check(first, hf_prompt_logprobs, 2)
    again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)  # cached: computed again regardless
    assert [o.prompt_logprobs for o in again] == [o.prompt_logprobs for o in first]
    plain = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0.0, max_tokens=3))
    assert [o.prompt_logprobs for o in plain] == [None] * len(PROMPTS)
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in first]


@pytest.mark.usefixtures("kv_blocks_returned")
def test_parallel_samples_and_preemption_score_the_prompt_once(model, llm_factory, hf_prompt_logprobs):
    llm = llm_factory(model, num_blocks=9, block_size=16, max_num_batched_tokens=32)
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=40, prompt_logprobs=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert llm.engine.scheduler.num_preemptions > 0
    _check(outputs, hf_prompt_logprobs, 0)


@pytest.mark.parametrize("value", [-1, 21, 1.5])
def test_bad_prompt_logprobs_are_refused_by_name(value):
    with pytest.raises(InvalidParameter, match="prompt_logprobs") as raised:
        SamplingParams(prompt_logprobs=value)
    assert raised.value.param == "prompt_logprobs"
