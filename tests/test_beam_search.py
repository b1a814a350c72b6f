"""Beam search in the engine: the same beams and scores as HF ``generate(num_beams=k)``,
beams sharing their blocks, scheduled as one unit, and every block back at the end.

The tiny Llama's EOS is set to a token its beams often produce (``FREQUENT``), so that
hypotheses finish early and every ``early_stopping`` mode and length penalty is exercised.
"""

from __future__ import annotations

import pytest

from engine_models import hf_beams, load_reference, random_prompts
from flexpage import BeamSearchParams, SamplingParams
from flexpage.beam_search import BeamGroup
from flexpage.errors import InvalidParameter
from flexpage.features import UnsupportedCombination

FREQUENT = 14349  # the tiny Llama (seed 0) writes it often: as EOS, some beams end early
PROMPTS = random_prompts((5, 17, 33), seed=3)
NEW_TOKENS = 32
BLOCK = 16


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama", eos_token_id=FREQUENT)


@pytest.fixture(scope="module")
def reference(model):
    return load_reference(model)


def _ours(llm, prompt, **params):
    out = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(**params))[0]
    return [(beam.output_token_ids, beam.score) for beam in out.sequences], out


def _assert_same_beams(got, want):
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    for (_, ours), (_, theirs) in zip(got, want):
        assert ours == pytest.approx(theirs, abs=1e-4, rel=1e-6)  # float32 sums in HF


# ---- the same beams as HF ----------------------------------------------------------------

@pytest.mark.usefixtures("kv_blocks_returned")
@pytest.mark.parametrize("beam_width, length_penalty, early_stopping",
                         [(2, 1.0, False), (4, 1.0, False), (4, 0.0, True), (4, 2.0, "never"), (3, -1.0, False)])
def test_beams_and_scores_equal_hf_generate(model, reference, llm_factory, beam_width, length_penalty,
                                            early_stopping):
    llm = llm_factory(model)
    finished_early = 0
    for prompt in PROMPTS:
        want = hf_beams(reference, prompt, beam_width, NEW_TOKENS, length_penalty=length_penalty,
                        early_stopping=early_stopping)
        got, out = _ours(llm, prompt, beam_width=beam_width, max_tokens=NEW_TOKENS, length_penalty=length_penalty,
                         early_stopping=early_stopping)
        _assert_same_beams(got, want)
        assert len(out.sequences) == beam_width
        for beam in out.sequences:
            assert beam.tokens[:len(prompt)] == prompt
            assert beam.finish_reason == ("stop" if beam.tokens[-1] == FREQUENT else "length")
            assert beam.score == pytest.approx(beam.cum_logprob / len(beam.output_token_ids) ** length_penalty)
        finished_early += sum(len(tokens) < NEW_TOKENS for tokens, _ in got)
    if length_penalty <= 1.0:  # a beam ending at EOS was returned: the finished-hypothesis path ran
        assert finished_early > 0


@pytest.mark.slow
@pytest.mark.usefixtures("kv_blocks_returned")
def test_default_model_beams_equal_hf_generate(llm_factory, default_model_path):
    """SmolLM2-135M-Instruct in float32: widths 2 and 4, 32 new tokens, a chat-like and a code prompt."""
    import torch
    from transformers import AutoModelForCausalLM

    llm = llm_factory(None, num_blocks=16)
    tokenizer = llm.get_tokenizer()
    reference = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32,
                                                     local_files_only=True).eval()
    for text in ("The three primary colors are", "def fibonacci(n):"):
        prompt = tokenizer(text).input_ids
        for width in (2, 4):
            got, _ = _ours(llm, prompt, beam_width=width, max_tokens=NEW_TOKENS)
            _assert_same_beams(got, hf_beams(reference, prompt, width, NEW_TOKENS))


@pytest.mark.usefixtures("kv_blocks_returned")
def test_ignore_eos_runs_every_beam_to_max_tokens(model, llm_factory):
    got, out = _ours(llm_factory(model), PROMPTS[0], beam_width=3, max_tokens=12, ignore_eos=True)
    assert [len(tokens) for tokens, _ in got] == [12, 12, 12]
    assert {beam.finish_reason for beam in out.sequences} == {"length"}
    assert [score for _, score in got] == sorted((score for _, score in got), reverse=True)


# ---- sharing and scheduling -----------------------------------------------------------------

def _run_tracking_blocks(engine, prompt, params):
    request_id = engine.add_request({"prompt_token_ids": prompt}, params)
    peak, result = 0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id == request_id:
                result = out
        peak = max(peak, engine.block_manager.stats().used)
    return peak, result


@pytest.mark.usefixtures("kv_blocks_returned")
def test_beams_share_the_prompt_and_fork_only_partial_blocks(model, llm_factory):
    """Width 4 on a 128-token prompt (8 blocks): the beams hold the prompt once; each has at
    most its own 16 new tokens' blocks (2) beyond it, where 4 independent copies hold 4 x 10."""
    engine = llm_factory(model, enable_prefix_caching=False, block_size=BLOCK).engine
    prompt = random_prompts((128,), seed=5)[0]
    peak, out = _run_tracking_blocks(engine, prompt, BeamSearchParams(beam_width=4, max_tokens=16, ignore_eos=True))
    assert len(out.outputs) == 4
    prompt_blocks = 128 // BLOCK
    assert peak <= prompt_blocks + 4 * 2
    assert peak <= 0.5 * 4 * (prompt_blocks + 2)


@pytest.mark.usefixtures("kv_blocks_returned")
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_a_beam_group_under_preemption_gives_the_same_beams(model, reference, llm_factory, preemption_mode,
                                                            monkeypatch):
    """A pool too small for the beams and three other requests at once: the group is
    preempted and comes back as one unit, and its beams are still HF's."""
    swap = {"swap_space": "1MiB"} if preemption_mode == "swap" else {}
    llm = llm_factory(model, num_blocks=14, block_size=BLOCK, max_num_batched_tokens=32, max_model_len=128,
                      preemption_mode=preemption_mode, **swap)
    engine = llm.engine
    preempt, preempted = engine.scheduler._preempt, []

    def record(seq, out):  # which group each preempted sequence is of, and how many of it still run
        preempt(seq, out)
        running = engine.scheduler.running
        preempted.append((seq.beam_group, sum(s.beam_group == seq.beam_group for s in running)))

    monkeypatch.setattr(engine.scheduler, "_preempt", record)
    for prompt in random_prompts((40, 40, 40), seed=9):
        engine.add_request({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=24,
                                                                        ignore_eos=True))
    beam = engine.add_request({"prompt_token_ids": PROMPTS[2]}, BeamSearchParams(beam_width=3, max_tokens=24))
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    groups = [left for group, left in preempted if group is not None]
    assert groups, "the beam group was never preempted"
    # each time the group is preempted all its running beams go: the count left falls to 0
    assert groups[-1] == 0 and all(left == 0 or later == left - 1 for left, later in zip(groups, groups[1:]))
    want = hf_beams(reference, PROMPTS[2], 3, 24)
    got = [(o.token_ids, o.cumulative_logprob / len(o.token_ids)) for o in outputs[beam].outputs]
    _assert_same_beams(got, want)


@pytest.mark.usefixtures("kv_blocks_returned")
def test_a_preempted_group_too_big_to_readmit_fails_alone_instead_of_waiting_forever(model, llm_factory):
    """Four beams share a 60-token prompt in 12 usable blocks; an older request preempts them,
    and readmitted they would each hold their whole context (4 x 5 blocks): the group ends
    with an error naming the pool, the older request completes, every block comes back."""
    engine = llm_factory(model, num_blocks=13, block_size=BLOCK, max_num_batched_tokens=64, max_model_len=128).engine
    older = engine.add_request({"prompt_token_ids": random_prompts((40,), seed=1)[0]},
                               SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True))
    beam = engine.add_request({"prompt_token_ids": random_prompts((60,), seed=2)[0]},
                              BeamSearchParams(beam_width=4, max_tokens=30, ignore_eos=True))
    outputs = {}
    for _ in range(300):
        outputs.update((out.request_id, out) for out in engine.step() if out.finished)
        if not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests()
    assert outputs[older].error is None and len(outputs[older].outputs[0].token_ids) == 80
    assert "need more KV blocks than the pool has (12 usable)" in outputs[beam].error


@pytest.mark.usefixtures("kv_blocks_returned")
def test_abort_mid_search_frees_every_beam(model, llm_factory):
    engine = llm_factory(model).engine
    request_id = engine.add_request({"prompt_token_ids": PROMPTS[1]},
                                    BeamSearchParams(beam_width=4, max_tokens=30, ignore_eos=True))
    for _ in range(6):
        engine.step()
    assert len(engine.requests[request_id].seqs) == 4
    assert engine.abort(request_id)
    assert engine.block_manager.stats().used == 0 and not engine.requests


# ---- bad input and refused combinations -------------------------------------------------------

@pytest.mark.parametrize("field, value", [("beam_width", 0), ("max_tokens", 0), ("temperature", 0.7),
                                          ("length_penalty", float("nan")), ("early_stopping", "sometimes"),
                                          ("ignore_eos", 1)])
def test_bad_params_are_refused_by_name(field, value):
    params = dict(beam_width=2, max_tokens=8)
    params[field] = value
    with pytest.raises(InvalidParameter, match=field) as raised:
        BeamSearchParams(**params)
    assert raised.value.param == field


@pytest.mark.parametrize("config", [dict(kv_layout="virtual"), dict(kv_budget_tokens=64)], ids=["virtual", "budget"])
def test_engines_that_cannot_fork_beams_refuse_them_by_name(model, llm_factory, config):
    engine = llm_factory(model, **config).engine
    with pytest.raises(UnsupportedCombination, match="beam search"):
        engine.add_request({"prompt_token_ids": PROMPTS[0]}, BeamSearchParams(beam_width=2, max_tokens=4))
    assert not engine.requests


def test_only_top_width_candidates_can_finish_and_early_stopping_ends_when_full():
    """HF's rules on a hand-made step: an EOS candidate ranked below ``beam_width`` is dropped,
    the next beams are the best that did not end, and early_stopping=True ends once
    ``beam_width`` hypotheses are finished."""
    eos = 9
    group = BeamGroup(BeamSearchParams(beam_width=2, max_tokens=10, early_stopping=True), [eos], max_tokens=10)
    assert group.beams_to_keep == 4
    going = group.select([[(eos, -0.1), (5, -0.5), (6, -1.0), (7, -3.0)]], [[]])
    assert [(c.token, c.parent) for c in going] == [(5, 0), (6, 0)]
    assert [h.token_ids for h in group.finished] == [[eos]] and not group.done
    # beam 1's EOS ranks fourth of the four candidates: not finished
    going = group.select([[(8, -0.1), (3, -0.2), (eos, -2.0), (4, -5.0)], [(2, -0.1), (eos, -0.1), (1, -4.0),
                                                                           (0, -5.0)]], [[5], [6]])
    assert [(c.token, c.parent) for c in going] == [(8, 0), (3, 0)]
    assert [h.token_ids for h in group.finished] == [[eos]]
    going = group.select([[(eos, -0.01), (1, -4.0), (2, -4.0), (3, -5.0)], [(eos, -9.0)] * 4], [[5, 8], [5, 3]])
    assert group.done and going == []
    assert [h.token_ids for h in group.finished] == [[eos], [5, 8, eos]]
