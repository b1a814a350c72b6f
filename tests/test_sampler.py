import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexpage.model.sampler import (
    SamplerOutput,
    TokenHistory,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    make_generator,
    row_argmax,
    sample,
)
from flexpage.sampling_params import SamplingParams

V = 32


def _logits(batch: int, vocab: int = V, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=g) * scale


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)



@pytest.mark.parametrize("vocab", [49152, 128256, 50257, 96, 1024])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_argmax_is_torch_argmax(vocab, dtype):
    """The sampler's argmax (chunk maxima first) picks torch's index in every row: ties and
    NaNs resolve to the first, across chunks and within one; rows of -inf give index 0."""
    x = _logits(6, vocab, seed=vocab).to(dtype)
    x[1, :] = float("-inf")
    x[2, vocab // 3] = x[2, vocab - 1] = 1e4  # a tie across chunks
    x[3, 5] = x[3, 6] = 1e4  # a tie inside one
    x[4, vocab // 2] = x[4, 7] = float("nan")
    assert torch.equal(row_argmax(x), x.argmax(-1))

# ---------------------------------------------------------------- greedy family


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_greedy_equals_argmax(dtype):
    logits = _logits(8).to(dtype)
    logits[3, :] = 1.0  # all tied -> lowest index
    logits[5, 7] = logits[5, 20] = logits[5].max() + 1  # tie between 7 and 20
    before = logits.clone()
    out = sample(logits, [SamplingParams.greedy()] * 8)
    assert isinstance(out, SamplerOutput)
    assert out.token_ids.dtype == torch.long and out.token_ids.shape == (8,)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids[3] == 0 and out.token_ids[5] == 7
    assert out.logprobs is None
    assert torch.equal(logits, before)  # input untouched


def test_top_k_1_equals_greedy():
    logits = _logits(64)
    out = sample(logits, [SamplingParams(top_k=1)] * 64, generator=_gen(1))
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_tiny_top_p_equals_greedy():
    logits = _logits(64)
    out = sample(logits, [SamplingParams(top_p=1e-6)] * 64, generator=_gen(2))
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_tiny_temperature_is_near_greedy():
    logits = _logits(64)
    out = sample(logits, [SamplingParams(temperature=1e-4)] * 64, generator=_gen(3))
    assert torch.equal(out.token_ids, logits.argmax(-1))
    # absurdly small temperatures must not produce NaNs either
    out = sample(logits, [SamplingParams(temperature=1e-30)] * 64, generator=_gen(3))
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_min_p_excludes_low_probability_tokens():
    probs = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.02])
    logits = probs.log().expand(4000, -1).contiguous()
    params = [SamplingParams(min_p=0.3)] * 4000  # threshold 0.12 -> {0, 1, 2}
    out = sample(logits, params, generator=_gen(4))
    seen = set(out.token_ids.tolist())
    assert seen == {0, 1, 2}


def test_mixed_batch_greedy_rows_unaffected():
    logits = _logits(6)
    params = [SamplingParams.greedy() if i % 2 == 0 else SamplingParams(top_k=3) for i in range(6)]
    out = sample(logits, params, generator=_gen(5))
    assert torch.equal(out.token_ids[0::2], logits[0::2].argmax(-1))
    top3 = logits.topk(3, dim=-1).indices
    for i in range(1, 6, 2):
        assert out.token_ids[i] in top3[i]


# ---------------------------------------------------------------- penalties


def test_repetition_penalty_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0]])
    p = SamplingParams(repetition_penalty=2.0)
    h = TokenHistory(prompt_ids=[0, 1], output_ids=[3, 3])
    got = apply_penalties(logits, [p], [h])
    assert torch.equal(got, torch.tensor([[1.0, -2.0, 0.5, -6.0, 1.0]]))


def test_presence_frequency_penalty_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0]])
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    # prompt tokens are NOT penalised by presence/frequency (OpenAI semantics)
    h = TokenHistory(prompt_ids=[0, 0, 4], output_ids=[1, 2, 2, 2])
    got = apply_penalties(logits, [p], [h])
    want = torch.tensor([[2.0, -1.0 - 0.25 - 0.5, 0.5 - 0.75 - 0.5, -3.0, 1.0]])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_penalties_combined_and_per_row():
    logits = torch.tensor([[1.0, 1.0, -1.0], [1.0, 1.0, -1.0]])
    params = [
        SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0),
        SamplingParams(),  # no penalties on this row
    ]
    hist = [TokenHistory([0], [1, 1]), TokenHistory([0], [1, 1])]
    got = apply_penalties(logits, params, hist)
    want = torch.tensor([[0.5, 0.5 - 2.0, -1.0], [1.0, 1.0, -1.0]])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_repetition_penalty_matches_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = _logits(3, vocab=50, seed=7)
    prompts = [[1, 2, 3, 4], [10, 10, 49], [0]]
    outputs = [[5, 1], [7, 8, 9], [2, 2, 2, 3, 4]]
    for penalty in (0.7, 1.3, 2.0):
        params = [SamplingParams(repetition_penalty=penalty)] * 3
        got = apply_penalties(logits, params, [TokenHistory(p, o) for p, o in zip(prompts, outputs)])
        proc = RepetitionPenaltyLogitsProcessor(penalty=penalty)
        for i in range(3):
            ids = torch.tensor([prompts[i] + outputs[i]])
            want = proc(ids, logits[i : i + 1].clone())
            torch.testing.assert_close(got[i : i + 1], want, rtol=0, atol=0)


def test_penalties_require_histories_and_valid_ids():
    logits = _logits(1)
    with pytest.raises(ValueError, match="histories"):
        sample(logits, [SamplingParams(presence_penalty=1.0)])
    with pytest.raises(ValueError, match="outside"):
        sample(logits, [SamplingParams(presence_penalty=1.0)], [TokenHistory([0], [V])])


def test_penalties_change_sampled_token():
    logits = torch.tensor([[5.0, 4.9, 0.0, 0.0]])
    hist = [TokenHistory([], [0])]
    out = sample(logits, [SamplingParams.greedy(presence_penalty=1.0)], hist)
    assert out.token_ids.item() == 1


# ---------------------------------------------------------------- filters vs transformers


def test_top_k_support_matches_transformers():
    from transformers import TopKLogitsWarper

    logits = _logits(16, vocab=100, seed=8)
    logits[0, :10] = 7.0  # ties straddling the threshold
    for k in (1, 5, 50, 100):
        got = apply_top_k_top_p(logits, torch.full((16,), k), None)
        want = TopKLogitsWarper(top_k=k)(torch.zeros(16, 1, dtype=torch.long), logits.clone())
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        assert torch.equal(got[~torch.isinf(got)], logits[~torch.isinf(got)])


def test_top_p_support_matches_transformers():
    from transformers import TopPLogitsWarper

    logits = _logits(16, vocab=100, seed=9)
    for p in (0.05, 0.3, 0.9, 0.999):
        got = apply_top_k_top_p(logits, None, torch.full((16,), p))
        want = TopPLogitsWarper(top_p=p)(torch.zeros(16, 1, dtype=torch.long), logits.clone())
        assert torch.equal(torch.isinf(got), torch.isinf(want))


def test_min_p_support_matches_transformers():
    from transformers import MinPLogitsWarper

    logits = _logits(16, vocab=100, seed=10)
    for mp in (0.01, 0.1, 0.5):
        got = apply_min_p(logits, torch.full((16,), mp))
        want = MinPLogitsWarper(min_p=mp)(torch.zeros(16, 1, dtype=torch.long), logits.clone())
        assert torch.equal(torch.isinf(got), torch.isinf(want))


def test_disabled_filters_leave_logits_untouched():
    logits = _logits(4)
    logits[0, 0] = -200.0  # prob underflows to 0 but must not be masked when disabled
    got = apply_top_k_top_p(logits, torch.tensor([0, -1, 0, 0]), torch.ones(4))
    assert torch.equal(got, logits)
    assert torch.equal(apply_min_p(logits, torch.zeros(4)), logits)


# ---------------------------------------------------------------- seeds / randomness


def _run_steps(logits_per_step, params, seeds_for_gens, steps):
    gens = [make_generator(s) if s is not None else None for s in seeds_for_gens]
    shared = _gen(12345)
    toks = []
    for t in range(steps):
        out = sample(logits_per_step[t], params, generators=gens, generator=shared)
        toks.append(out.token_ids)
    return torch.stack(toks, dim=1)  # [B, steps]


def test_seeded_rows_reproducible_across_runs_and_batches():
    steps = 6
    target = SamplingParams(seed=1234, temperature=1.3, top_p=0.95, top_k=20)
    target_logits = [_logits(1, seed=100 + t, scale=1.0) for t in range(steps)]

    alone = _run_steps(target_logits, [target], [target.seed], steps)
    again = _run_steps(target_logits, [target], [target.seed], steps)
    assert torch.equal(alone, again)

    others = [
        SamplingParams(seed=7),
        SamplingParams(),  # unseeded -> shared generator
        SamplingParams.greedy(),
        SamplingParams(seed=99, min_p=0.05),
    ]
    batch_params = others[:2] + [target] + others[2:]
    batch_seeds = [p.seed for p in batch_params]
    batch_logits = []
    for t in range(steps):
        rest = _logits(4, seed=200 + t, scale=1.0)
        batch_logits.append(torch.cat([rest[:2], target_logits[t], rest[2:]]))
    batched = _run_steps(batch_logits, batch_params, batch_seeds, steps)
    assert torch.equal(batched[2], alone[0])

    # different batch order / size again
    batch_params2 = [target, SamplingParams(seed=5)]
    batch_logits2 = [torch.cat([target_logits[t], _logits(1, seed=300 + t)]) for t in range(steps)]
    batched2 = _run_steps(batch_logits2, batch_params2, [target.seed, 5], steps)
    assert torch.equal(batched2[0], alone[0])

    # a different seed gives a different stream (overwhelmingly likely over 6 flat steps)
    other_seed = _run_steps(target_logits, [target], [target.seed + 1], steps)
    assert not torch.equal(other_seed, alone)


def test_seed_without_generator_rejected():
    with pytest.raises(ValueError, match="seed"):
        sample(_logits(1), [SamplingParams(seed=3)])
    # greedy rows never draw noise, so no generator is needed
    sample(_logits(1), [SamplingParams.greedy(seed=3)])


def test_make_generator_accepts_any_int():
    a = torch.rand(3, generator=make_generator(-1))
    b = torch.rand(3, generator=make_generator(2**64 - 1))
    assert torch.equal(a, b)
    make_generator(2**80)


def test_unseeded_sampling_follows_distribution():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 4000
    logits = probs.log().expand(n, -1).contiguous()
    out = sample(logits, [SamplingParams()] * n, generator=_gen(2024))
    counts = torch.bincount(out.token_ids, minlength=4).double()
    expected = probs.double() * n
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    assert chi2 < 25.0, (counts, chi2)  # df=3: p(chi2 > 25) ~ 1.6e-5


def test_temperature_flattens_distribution():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 4000
    logits = probs.log().expand(n, -1).contiguous()
    out = sample(logits, [SamplingParams(temperature=2.0)] * n, generator=_gen(7))
    want = probs.sqrt() / probs.sqrt().sum()
    counts = torch.bincount(out.token_ids, minlength=4).double()
    expected = want.double() * n
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    assert chi2 < 25.0, (counts, chi2)


# ---------------------------------------------------------------- min_tokens


def test_min_tokens_blocks_eos_and_stop_ids():
    eos = 3
    logits = torch.zeros(4, 6)
    logits[:, eos] = 50.0
    logits[:, 5] = 40.0
    logits[:, 1] = 10.0
    p = SamplingParams.greedy(min_tokens=2, stop_token_ids=[5])
    short = TokenHistory([0], [1])
    done = TokenHistory([0], [1, 1])
    out = sample(logits, [p, p, SamplingParams.greedy(), p], [short, done, short, short], eos_token_id=eos)
    assert out.token_ids.tolist() == [1, eos, eos, 1]

    # ignore_eos: EOS is not masked (vLLM), stop_token_ids still are
    p_ign = SamplingParams.greedy(min_tokens=2, stop_token_ids=[5], ignore_eos=True)
    out = sample(logits[:1], [p_ign], [short], eos_token_id=eos)
    assert out.token_ids.item() == eos

    # sampled rows never produce EOS before min_tokens either
    n = 500
    flat = torch.zeros(n, 6)
    flat[:, eos] = 2.0
    ps = [SamplingParams(min_tokens=5)] * n
    out = sample(flat, ps, [TokenHistory([0], [])] * n, eos_token_id=eos, generator=_gen(0))
    assert eos not in out.token_ids.tolist()
    with pytest.raises(ValueError, match="histories"):
        sample(flat[:1], ps[:1], eos_token_id=eos)


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax():
    logits = _logits(4, seed=11).to(torch.bfloat16)
    params = [
        SamplingParams(logprobs=5, temperature=0.5, top_k=3, presence_penalty=1.0),
        SamplingParams(),  # no logprobs
        SamplingParams.greedy(logprobs=0),
        SamplingParams(logprobs=20, seed=1),
    ]
    hist = [TokenHistory([1], [2, 2])] * 4
    gens = [None, None, None, make_generator(1)]
    out = sample(logits, params, hist, gens, generator=_gen(0))
    raw = logits.float().log_softmax(-1)
    assert out.logprobs is not None and len(out.logprobs) == 4
    assert out.logprobs[1] is None
    for i, k in ((0, 5), (2, 0), (3, 20)):
        lp = out.logprobs[i]
        tok = out.token_ids[i].item()
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(raw[i, tok].item(), abs=1e-6)
        assert lp.rank == int((raw[i] > raw[i, tok]).sum()) + 1
        assert len(lp.top) == k
        if k:
            vals, ids = raw[i].topk(k)
            assert [t for t, _ in lp.top] == ids.tolist()
            assert [v for _, v in lp.top] == pytest.approx(vals.tolist(), abs=1e-6)
            assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:]))
    assert out.logprobs[2].rank == 1  # greedy picks the most likely raw token (no penalty)


# ---------------------------------------------------------------- property: support


@st.composite
def _case(draw):
    vocab = draw(st.integers(2, 40))
    logits = draw(
        st.lists(
            st.floats(-20, 20, allow_nan=False, width=32).map(lambda x: round(x, 1)),
            min_size=vocab,
            max_size=vocab,
        )
    )
    params = SamplingParams(
        temperature=draw(st.sampled_from([1e-3, 0.3, 1.0, 2.0])),
        top_k=draw(st.sampled_from([-1, 0, 1, 2, 5, 50])),
        top_p=draw(st.sampled_from([1e-3, 0.2, 0.5, 0.9, 1.0])),
        min_p=draw(st.sampled_from([0.0, 0.05, 0.5, 1.0])),
        seed=draw(st.integers(0, 2**31)),
    )
    return logits, params


@settings(max_examples=250, deadline=None)
@given(_case())
def test_sampled_token_within_allowed_support(case):
    values, p = case
    logits = torch.tensor([values], dtype=torch.float32)
    tok = sample(logits, [p], generators=[make_generator(p.seed)]).token_ids.item()

    x = [v / p.temperature for v in values]  # reference in float64
    # top-k: fewer than k tokens strictly above the chosen one
    if p.top_k > 0:
        assert sum(v > values[tok] for v in values) < p.top_k
        kth = sorted(values, reverse=True)[min(p.top_k, len(values)) - 1]
        kept = [i for i, v in enumerate(values) if v >= kth]
    else:
        kept = list(range(len(values)))
    assert tok in kept
    # top-p over the top-k-renormalised distribution: mass strictly above < top_p
    m = max(x[i] for i in kept)
    w = {i: math.exp(x[i] - m) for i in kept}
    z = sum(w.values())
    above = sum(w[i] for i in kept if x[i] > x[tok]) / z
    assert above < p.top_p + 1e-4
    # min-p: prob(tok) >= min_p * max prob (ratio is renormalisation-invariant)
    assert math.exp(x[tok] - max(x)) >= p.min_p * (1 - 1e-4) or x[tok] == max(x)
