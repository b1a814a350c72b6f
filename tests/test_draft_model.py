"""Draft-model speculation: a second model proposes, the target verifies, the same tokens out.

Checked against second implementations: the proposer's cached KV against a fresh proposer
that computes the same sequence from nothing (after rejected proposals were rolled back),
the engine's tokens against plain decoding and HF transformers' greedy ``generate``.
Drafts: the target itself (every greedy proposal must be accepted: any stale or misplaced
draft KV would break that) and the target's first layer (``save_layer_draft``: some
proposals accepted, some rolled back).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine_models import hf_greedy, load_reference, random_prompts
from flexpage import SamplingParams
from flexpage.core import Sequence, SequenceStatus
from flexpage.speculative.draft_model import DraftModelProposer, save_layer_draft

engine_test = pytest.mark.usefixtures("single_torch_thread", "kv_blocks_returned")
PROMPTS = random_prompts((20, 40, 9, 27), seed=5)
GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def first_layer_draft(target, tmp_path_factory):
    return save_layer_draft(str(target), 1, str(tmp_path_factory.mktemp("draft")))


def draft_config(model, k: int = 3) -> dict:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k}


def proposer(model, num_blocks: int = 16, block_size: int = 8) -> DraftModelProposer:
    return DraftModelProposer(str(model), dtype=torch.float32, vocab_size=49152, block_size=block_size,
                              num_blocks=num_blocks, compile=False)


def generate(llm, prompts, params):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [[list(c.token_ids) for c in o.outputs] for o in outputs], [o.metrics.speculation for o in outputs]


def test_a_proposal_after_rollback_equals_a_fresh_proposers(first_layer_draft):
    """Rejected proposals leave stale K/V in the draft pool; the next call must not read them."""
    cached, fresh = proposer(first_layer_draft), proposer(first_layer_draft)
    prompt = PROMPTS[0]
    chain = cached.propose_chains([(0, prompt, 4)])[0]
    assert len(chain) == 4
    assert fresh.propose_chains([(0, prompt, 4)])[0] == chain  # a second proposer, same weights
    # the target accepted one proposal and chose its own token after it
    accepted = [*prompt, chain[0], (chain[1] + 1) % 49152]
    again = proposer(first_layer_draft)
    assert cached.propose_chains([(0, accepted, 3)]) == again.propose_chains([(0, accepted, 3)])
    # nothing accepted: back to the prompt plus the target's own token
    rejected = [*prompt, (chain[0] + 7) % 49152]
    assert cached.propose_chains([(0, rejected, 2)]) == proposer(first_layer_draft).propose_chains([(0, rejected, 2)])


def test_batched_proposals_equal_one_at_a_time_and_blocks_come_back(first_layer_draft):
    batched = proposer(first_layer_draft)
    batched.warm_up()
    assert batched.num_free_blocks == batched.num_blocks
    wanted = [(i, p, k) for i, (p, k) in enumerate(zip(PROMPTS, (1, 4, 2, 3)))]
    chains = batched.propose_chains(wanted)
    assert [len(c) for c in chains] == [1, 4, 2, 3]
    assert chains == [proposer(first_layer_draft).propose_chains([w])[0] for w in wanted]
    for seq_id, _, _ in wanted:
        batched.release(seq_id)
    assert batched.num_free_blocks == batched.num_blocks


def test_a_full_draft_pool_takes_blocks_from_idle_sequences_then_proposes_nothing(first_layer_draft):
    small = proposer(first_layer_draft, num_blocks=8)  # 64 tokens
    assert small.propose_chains([(0, PROMPTS[1], 2)])[0]  # 41 positions: 6 blocks
    # sequence 0 does not propose this step: its blocks go to sequence 1
    assert small.propose_chains([(1, PROMPTS[0], 2)])[0]
    # both at once do not fit (6 + 3 blocks): the one that does not fit proposes nothing
    chains = small.propose_chains([(1, PROMPTS[0], 2), (0, PROMPTS[1], 2)])
    assert chains[0] and chains[1] == []
    # a sequence longer than the whole pool evicts nobody: sequence 1 keeps its 3 blocks
    assert small.propose_chains([(2, PROMPTS[1] * 3, 2)]) == [[]]
    assert small.num_free_blocks == small.num_blocks - 3
    small.release(0)
    small.release(1)
    assert small.num_free_blocks == small.num_blocks


def test_a_draft_with_another_vocabulary_is_refused_by_name(tiny_model):
    with pytest.raises(ValueError, match="vocabulary of 49152 tokens, the target's has 32000"):
        DraftModelProposer(str(tiny_model("llama")), dtype=torch.float32, vocab_size=32000, block_size=8,
                           num_blocks=4, compile=False)


def test_a_failed_draft_forward_gives_its_sequences_blocks_back_and_the_step_proposes_nothing(first_layer_draft):
    from flexpage.speculative.config import SpeculativeConfig
    from flexpage.speculative.speculator import Speculator

    failing = proposer(first_layer_draft)
    failing.propose_chains([(0, PROMPTS[0], 2)])

    def broken(inputs):
        raise RuntimeError("draft forward failed")

    failing._argmax = broken
    speculator = Speculator(SpeculativeConfig.from_dict(draft_config(first_layer_draft)), max_model_len=2048,
                            proposer=failing)
    seq = Sequence(0, [*PROMPTS[0], 7], max_tokens=100,
                   request=SimpleNamespace(params=SamplingParams(), grammars=None))
    seq.status = SequenceStatus.RUNNING
    seq.num_computed_tokens = seq.num_tokens - 1
    speculator.propose([seq])
    assert seq.draft_token_ids == []
    assert failing.num_free_blocks == failing.num_blocks


@engine_test
def test_the_target_as_its_own_draft_has_every_greedy_proposal_accepted(target, llm_factory):
    plain = llm_factory(target, block_size=8)
    spec = llm_factory(target, block_size=8, speculative_config=draft_config(target))
    expected, _ = generate(plain, PROMPTS, GREEDY)
    tokens, counts = generate(spec, PROMPTS, GREEDY)
    assert tokens == expected
    assert all(c.draft_tokens > 0 and c.accepted_tokens == c.draft_tokens for c in counts)


@engine_test
def test_greedy_tokens_with_a_first_layer_draft_equal_plain_decoding_and_hf(target, first_layer_draft,
                                                                             llm_factory):
    plain = llm_factory(target, block_size=8)
    spec = llm_factory(target, block_size=8, speculative_config=draft_config(first_layer_draft))
    expected, _ = generate(plain, PROMPTS, GREEDY)
    tokens, counts = generate(spec, PROMPTS, GREEDY)
    assert tokens == expected
    drafted = sum(c.draft_tokens for c in counts)
    accepted = sum(c.accepted_tokens for c in counts)
    assert 0 < accepted < drafted  # some proposals accepted, some rolled back
    reference = load_reference(target)
    assert [[hf_greedy(reference, p, GREEDY.max_tokens, stop_at_eos=False)] for p in PROMPTS] == expected


@engine_test
def test_seeded_sampling_with_a_draft_is_reproducible_and_n_samples_differ(target, first_layer_draft, llm_factory):
    spec = llm_factory(target, block_size=8, speculative_config=draft_config(first_layer_draft))
    params = SamplingParams(temperature=1.0, max_tokens=20, seed=11, n=2, ignore_eos=True)
    first, _ = generate(spec, PROMPTS[:2], params)
    again, _ = generate(spec, PROMPTS[:2], params)
    assert first == again
    assert all(len(samples) == 2 and samples[0] != samples[1] for samples in first)
