"""The offline API, ``LLM(...).generate`` / ``.chat``, as a vLLM user relies on it.

* Seeded sampling is reproducible across calls and whatever else is in the batch;
  ``n`` samples come back with indices ``0..n-1``.
* Bad input raises ``ValueError`` naming the problem before anything is scheduled, and a
  rejected batch leaves nothing running.
* Stop strings, stop token ids, EOS, ``max_tokens``, ``min_tokens``, ``ignore_eos`` and
  ``logprobs`` behave like HF transformers / vLLM.
* After every test, every KV block is back in the pool (``kv_blocks_returned``).

The models are tiny random-weight checkpoints (``tests/engine_models.py``) run in float32
with eager attention.
"""

from __future__ import annotations

import pytest
import torch

from engine_models import EOS_ID, VOCAB_SIZE, hf_greedy, hf_logprobs, load_reference, random_prompts
from flexpage import SamplingParams

pytestmark = pytest.mark.usefixtures("single_torch_thread", "kv_blocks_returned")

PROMPTS = random_prompts((7, 20, 41), seed=11)


def inputs(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def llm(llama, llm_factory):
    return llm_factory(llama)


def assert_idle(llm) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests() and not engine.scheduler.has_unfinished()
    assert engine.block_manager.stats().used == 0


# --------------------------------------------------------------------------- seeds and n


def test_seeded_sampling_is_reproducible_across_calls(llm):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    first = llm.generate(inputs(PROMPTS), params)
    second = llm.generate(inputs(PROMPTS), params)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]
    assert len({tuple(o.outputs[0].token_ids) for o in first}) == len(PROMPTS)


def test_seeded_request_is_independent_of_its_batch(llm):
    """The same seeded request alone, and in the middle of a batch of unseeded and other-seeded ones."""
    seeded = SamplingParams(temperature=1.0, seed=77, max_tokens=10, ignore_eos=True)
    [alone] = llm.generate(inputs(PROMPTS[1:2]), seeded)
    others = [SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.7, top_p=0.9, seed=5, n=2, max_tokens=12, ignore_eos=True)]
    batch = llm.generate(inputs([PROMPTS[0], PROMPTS[1], PROMPTS[2]]), [others[0], seeded, others[1]])
    assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_n_samples_have_indices_and_differ(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    [out] = llm.generate(inputs(PROMPTS[:1]), params)
    assert [s.index for s in out.outputs] == [0, 1, 2]
    assert all(len(s.token_ids) == 8 and s.finish_reason == "length" for s in out.outputs)
    assert len({tuple(s.token_ids) for s in out.outputs}) > 1
    [again] = llm.generate(inputs(PROMPTS[:1]), params)
    assert [s.token_ids for s in again.outputs] == [s.token_ids for s in out.outputs]


def test_greedy_n_samples_are_identical(llm):
    [out] = llm.generate(inputs(PROMPTS[2:]), SamplingParams(n=2, temperature=0, max_tokens=6))
    assert out.outputs[0].token_ids == out.outputs[1].token_ids


def test_outputs_come_back_in_prompt_order_with_progress_callbacks(llm):
    seen = []
    lengths = [12, 1, 5]
    outputs = llm.generate(inputs(PROMPTS), [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                             for n in lengths], on_progress=lambda o: seen.append(o.request_id))
    assert [o.prompt_token_ids for o in outputs] == PROMPTS
    assert [len(o.outputs[0].token_ids) for o in outputs] == lengths
    assert sorted(seen) == sorted(o.request_id for o in outputs) and len(set(seen)) == 3
    assert seen[0] == outputs[1].request_id  # the one-token request finishes first


def test_chat_applies_the_chat_template(llm):
    tokenizer = llm.get_tokenizer()
    conversations = [[{"role": "user", "content": "Hello!"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]]
    outputs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=3))
    for conversation, out in zip(conversations, outputs):
        expected = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
        assert out.prompt_token_ids == list(expected)
        assert tokenizer.decode(out.prompt_token_ids).endswith("<|im_start|>assistant\n")
    [single] = llm.chat(conversations[0], SamplingParams(temperature=0, max_tokens=3))
    assert single.outputs[0].token_ids == outputs[0].outputs[0].token_ids


def test_text_prompts_are_tokenized_with_the_model_tokenizer(llm):
    [out] = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=2))
    assert out.prompt == "The capital of France is"
    assert out.prompt_token_ids == llm.get_tokenizer()("The capital of France is").input_ids


# --------------------------------------------------------------------------- bad input


BAD_INPUTS = [
    pytest.param("", None, "empty", id="empty-prompt"),
    pytest.param({"prompt_token_ids": []}, None, "prompt_token_ids", id="empty-token-ids"),
    pytest.param({"prompt_token_ids": [VOCAB_SIZE]}, None, "prompt_token_ids", id="token-id-out-of-vocab"),
    pytest.param({"prompt_token_ids": [5] * 4096}, None, "max_model_len", id="longer-than-max-model-len"),
    pytest.param(3.5, None, "prompt", id="prompt-of-wrong-type"),
    pytest.param(["Hi", 3.5], None, "expected str, list of token ids or dict", id="prompt-list-with-wrong-type"),
    pytest.param("Hi", dict(temperature=-0.5), "temperature must be >= 0", id="negative-temperature"),
    pytest.param("Hi", dict(top_p=0.0), r"top_p must be in \(0, 1\]", id="top-p-zero"),
    pytest.param("Hi", dict(top_p=1.5), r"top_p must be in \(0, 1\]", id="top-p-above-one"),
    pytest.param("Hi", dict(n=0), "n must be >= 1", id="n-zero"),
    pytest.param("Hi", dict(max_tokens=0), "max_tokens must be >= 1", id="max-tokens-zero"),
    pytest.param("Hi", dict(stop=5), "stop must be a str", id="stop-int"),
    pytest.param("Hi", dict(stop=["ok", 3]), "stop must contain only str", id="stop-list-with-int"),
    pytest.param("Hi", dict(stop_token_ids="2"), "stop_token_ids must be a list", id="stop-token-ids-str"),
    pytest.param("Hi", dict(logprobs=21), "logprobs must be in", id="too-many-logprobs"),
    pytest.param("Hi", dict(min_tokens=5, max_tokens=2), "min_tokens must be <= max_tokens", id="min-above-max"),
]


@pytest.mark.parametrize(("prompt", "params", "message"), BAD_INPUTS)
def test_bad_input_raises_before_anything_is_scheduled(prompt, params, message, llm):
    before = llm.engine.stats()
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, SamplingParams(**params) if params is not None else None)
    assert_idle(llm)
    assert llm.engine.stats()["finished_requests"] == before["finished_requests"]


def test_wrong_sampling_params_are_rejected(llm):
    with pytest.raises(ValueError, match="2 entries for 3 prompts"):
        llm.generate(inputs(PROMPTS), [SamplingParams(), SamplingParams()])
    with pytest.raises(ValueError, match="expected SamplingParams"):
        llm.generate(inputs(PROMPTS), [SamplingParams(), {"temperature": 0}, SamplingParams()])
    assert_idle(llm)


def test_one_bad_request_in_a_batch_rejects_the_batch_and_leaves_nothing_running(llm, llama):
    good = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(inputs([PROMPTS[0], PROMPTS[1], [7] * 5000, PROMPTS[2]]), good)
    assert_idle(llm)
    outputs = llm.generate(inputs(PROMPTS), good)  # the engine is still usable, and still exact
    model = load_reference(llama)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model, p, 4, stop_at_eos=False) for p in PROMPTS]


def test_a_rejected_batch_leaves_the_counters_alone(llm):
    """The valid requests before the bad one were never run, so they are not counted."""
    before = llm.engine.stats()
    with pytest.raises(ValueError):
        llm.generate(inputs([PROMPTS[0], []]), SamplingParams(max_tokens=2))
    assert llm.engine.stats()["prompt_tokens"] == before["prompt_tokens"]


# --------------------------------------------------------------------------- stopping


@pytest.fixture(scope="module")
def free_run(llm):
    """Greedy continuation of PROMPTS[1] for 16 tokens, ignoring EOS: tokens and text."""
    [out] = llm.generate(inputs(PROMPTS[1:2]), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    return out.outputs[0]


def test_max_tokens_ends_with_length(llm, free_run):
    [out] = llm.generate(inputs(PROMPTS[1:2]), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    sample = out.outputs[0]
    assert sample.token_ids == free_run.token_ids[:5]
    assert sample.finish_reason == "length" and sample.stop_reason is None
    assert free_run.text.startswith(sample.text)


def test_stop_string_cuts_the_text_before_it(llm, free_run):
    text = free_run.text
    middle = len(text) // 2
    stop = text[middle : middle + 3]
    assert stop.strip(), f"no usable stop string in {text!r}"
    [out] = llm.generate(inputs(PROMPTS[1:2]), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                               stop=["never-in-the-text", stop]))
    sample = out.outputs[0]
    assert sample.text == text[: text.index(stop)]
    assert sample.finish_reason == "stop" and sample.stop_reason == stop
    tokenizer = llm.get_tokenizer()
    k = len(sample.token_ids)  # generation stops at the token that completes the stop string
    assert sample.token_ids == free_run.token_ids[:k]
    assert stop in tokenizer.decode(free_run.token_ids[:k]) and stop not in tokenizer.decode(free_run.token_ids[:k - 1])


def test_earliest_stop_string_wins(llm, free_run):
    text = free_run.text
    early, late = text[2:5], text[-3:]
    [out] = llm.generate(inputs(PROMPTS[1:2]),
                         SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[late, early]))
    assert out.outputs[0].stop_reason == early and out.outputs[0].text == text[: text.index(early)]


def test_stop_token_id_ends_generation_after_it(llm, free_run):
    k = next(i for i in range(3, 16) if free_run.token_ids[i] not in free_run.token_ids[:i])
    stop_id = free_run.token_ids[k]
    [out] = llm.generate(inputs(PROMPTS[1:2]), SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_id]))
    sample = out.outputs[0]
    assert sample.token_ids == free_run.token_ids[: k + 1]
    assert sample.finish_reason == "stop" and sample.stop_reason == stop_id
    assert free_run.text.startswith(sample.text)


def test_min_tokens_masks_stop_token_ids_like_hf_min_new_tokens(llm, llama, free_run):
    """With its first token as a stop token and min_tokens=5, generation runs past it like HF's
    ``min_new_tokens`` (which masks every EOS id until then)."""
    stop_id = free_run.token_ids[0]
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=5, stop_token_ids=[stop_id])
    [out] = llm.generate(inputs(PROMPTS[1:2]), params)
    sample = out.outputs[0]
    expected = hf_greedy(load_reference(llama), PROMPTS[1], 12, eos_token_id=[EOS_ID, stop_id], min_new_tokens=5)
    assert sample.token_ids == expected
    assert len(sample.token_ids) >= 5 and stop_id not in sample.token_ids[:5]


@pytest.fixture(scope="module")
def eos_model(tiny_model, llama):
    """The tiny llama, with an EOS id it emits as its 4th (or later) greedy token on PROMPTS[1]."""
    output = hf_greedy(load_reference(llama), PROMPTS[1], 16, stop_at_eos=False)
    k = next(i for i in range(3, 16) if output[i] not in output[:i])
    folder = tiny_model("llama", eos_token_id=output[k])
    return folder, output[k], k


def test_eos_ends_generation_like_hf(eos_model, llm_factory):
    folder, eos_id, k = eos_model
    llm = llm_factory(folder)
    [out] = llm.generate(inputs(PROMPTS[1:2]), SamplingParams(temperature=0, max_tokens=16))
    sample = out.outputs[0]
    assert sample.token_ids == hf_greedy(load_reference(folder), PROMPTS[1], 16, eos_token_id=eos_id)
    assert len(sample.token_ids) == k + 1 and sample.token_ids[-1] == eos_id
    assert sample.finish_reason == "stop" and sample.stop_reason is None


def test_ignore_eos_runs_to_max_tokens(eos_model, llm_factory, free_run):
    folder, eos_id, k = eos_model
    [out] = llm_factory(folder).generate(inputs(PROMPTS[1:2]),
                                         SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert out.outputs[0].token_ids == free_run.token_ids  # same weights; EOS emitted and passed over
    assert out.outputs[0].token_ids[k] == eos_id and out.outputs[0].finish_reason == "length"


def test_min_tokens_masks_eos_like_hf(eos_model, llm_factory):
    folder, eos_id, k = eos_model
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=k + 3)
    [out] = llm_factory(folder).generate(inputs(PROMPTS[1:2]), params)
    expected = hf_greedy(load_reference(folder), PROMPTS[1], 16, eos_token_id=eos_id, min_new_tokens=k + 3)
    assert out.outputs[0].token_ids == expected
    assert eos_id not in expected[: k + 3]


def test_max_model_len_caps_generation(llama, llm_factory):
    llm = llm_factory(llama, max_model_len=24)
    [out] = llm.generate(inputs([PROMPTS[1]]), SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 24 - len(PROMPTS[1]) and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(inputs([list(range(3, 27))]), SamplingParams(max_tokens=1))


# --------------------------------------------------------------------------- logprobs


def assert_rank_up_to_ties(rank: int, reference: torch.Tensor, token: int, tol: float) -> None:
    """``rank`` is 1 + the number of tokens strictly more likely, counted on the engine's own
    logprobs. Those equal the reference's within ``tol``, so a token whose reference logprob
    is within ``2 * tol`` of the chosen one's may fall either side: the rank must lie in the
    range those near-ties allow, and is exact when there are none."""
    chosen = reference[token]
    surely_above = int((reference > chosen + 2 * tol).sum())
    maybe_above = int((reference > chosen - 2 * tol).sum()) - 1  # the chosen token itself is not above
    assert 1 + surely_above <= rank <= 1 + maybe_above, (rank, surely_above, maybe_above)


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_logprobs_match_hf_log_softmax(kind, tiny_model, llm_factory):
    """Sampled (temperature 1) so chosen tokens are not always the top one; raw-model logprobs."""
    folder = tiny_model(kind)
    llm = llm_factory(folder)
    params = SamplingParams(temperature=1.0, seed=9, max_tokens=8, logprobs=5, ignore_eos=True)
    outputs = llm.generate(inputs(PROMPTS[:2]), params)
    model = load_reference(folder)
    tokenizer = llm.get_tokenizer()
    ranks = []
    for prompt, out in zip(PROMPTS[:2], outputs):
        sample = out.outputs[0]
        assert len(sample.logprobs) == len(sample.token_ids) == 8
        reference = hf_logprobs(model, prompt, sample.token_ids)
        for pos, (token, entry) in enumerate(zip(sample.token_ids, sample.logprobs)):
            expected = reference[pos]
            assert entry[token].logprob == pytest.approx(expected[token].item(), abs=1e-4)
            assert_rank_up_to_ties(entry[token].rank, expected, token, tol=1e-4)
            assert entry[token].decoded_token == tokenizer.decode([token])
            top_values, top_ids = expected.topk(5)
            top = sorted((lp for tid, lp in entry.items() if tid in top_ids.tolist()), key=lambda lp: lp.rank)
            assert [lp.rank for lp in top] == [1, 2, 3, 4, 5]
            assert [lp.logprob for lp in top] == pytest.approx(top_values.tolist(), abs=1e-4)
            assert set(entry) == set(top_ids.tolist()) | {token}
            ranks.append(entry[token].rank)
    assert max(ranks) > 1  # some sampled tokens were not the argmax


def test_logprobs_zero_returns_only_the_chosen_token(llm):
    [out] = llm.generate(inputs(PROMPTS[:1]), SamplingParams(temperature=0, max_tokens=3, logprobs=0))
    sample = out.outputs[0]
    assert [list(entry) for entry in sample.logprobs] == [[t] for t in sample.token_ids]
    assert all(entry[t].rank == 1 and entry[t].logprob <= 0 for t, entry in zip(sample.token_ids, sample.logprobs))


def test_no_logprobs_unless_asked(llm):
    [out] = llm.generate(inputs(PROMPTS[:1]), SamplingParams(temperature=0, max_tokens=2))
    assert out.outputs[0].logprobs is None
