"""Speculative decoding in the engine: proposals verified in the normal paged step, the same
tokens out, every rejected slot rolled back.

Three layers, each against a second implementation:

* the scheduler and block manager alone (a fake model, as in ``test_scheduler.py``): random
  proposals, some right and some wrong, are verified; after every step each computed
  position holds its own prefix's KV (a symbolic shadow of the pool), blocks holding only
  rejected positions go back to the pool, and what the prefix cache serves a later sequence
  is that sequence's prefix -- never a rejected proposal's;
* the engine on tiny random-weight models: greedy tokens with prompt lookup equal plain
  decoding and HF transformers', across architectures whose recipes the verification rows
  must respect (sliding window, soft-capping), with stops, ``max_tokens``, ``n > 1``,
  logprobs and grammars; seeded sampling is reproducible;
* the policy: what is proposed, and when nothing is (load, per-request opt-out, backoff).

The statistical check of speculative sampling (every token distributed as the target's) is
in ``test_rejection_sampler.py``.
"""

from __future__ import annotations

import contextlib
import random
from types import SimpleNamespace

import pytest

from engine_models import hf_greedy, load_reference, random_prompts
from flexpage import SamplingParams, StructuredOutputsParams
from flexpage.config import EngineConfig
from flexpage.core import BlockManager, Scheduler, SchedulerConfig, Sequence, SequenceStatus
from flexpage.core.kv_ops import BlockOpKind
from flexpage.features import UnsupportedCombination
from flexpage.speculative.config import SpeculativeConfig
from flexpage.speculative.speculator import Speculator

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
TREE = {**NGRAM, "max_branches": 3}


# -- scheduler and block manager, with a fake model ---------------------------------------


def fake_token(seq_id: int, position: int) -> int:
    """The 'model': the token at ``position`` depends only on the sequence and the position."""
    return (seq_id * 31 + position * 7) % 97


class SpeculatingLoop:
    """The engine loop with a fake model and a shadow of the pool: slot -> the token prefix
    whose KV it holds (proposed tokens included, as the model computes them). With
    ``branches > 1`` each sequence proposes that many continuations, verified as a tree."""

    def __init__(self, sched: Scheduler, rng: random.Random, right: float, branches: int = 1) -> None:
        self.sched, self.rng, self.right, self.branches = sched, rng, right, branches
        self.bm = sched.block_manager
        self.kv: dict[int, list] = {}
        self.adopted = 0  # verifications that accepted a branch other than the first

    def propose(self, seq: Sequence) -> list[int]:
        """Up to 4 proposals (none past ``max_tokens``), each the model's token with probability ``right``."""
        drafts = []
        for i in range(min(self.rng.randint(0, 4), seq.max_tokens - seq.num_output_tokens - 1)):
            true = fake_token(seq.seq_id, seq.num_tokens + i)
            drafts.append(true if self.rng.random() < self.right else (true + 1) % 97)
        return drafts

    def step(self) -> None:
        for seq in self.sched.running:
            proposals = [self.propose(seq) for _ in range(self.branches)] if seq.num_uncomputed_tokens == 1 else []
            proposals = [p for p in proposals if p]
            seq.draft_token_ids, seq.draft_branches = (proposals[0], proposals[1:]) if proposals else ([], [])
        out = self.sched.schedule()
        size = self.bm.block_size
        assert all(op.kind is BlockOpKind.COPY for op in out.kv_ops)
        read = [list(self.kv.get(op.src, [None] * size)) for op in out.kv_ops]  # one gather, then one scatter,
        for op, block in zip(out.kv_ops, read):  # as the runner copies
            self.kv[op.dst] = block
        for item in (piece for whole in out.scheduled for piece in (whole, *whole.branches)):
            tokens = item.seq.token_ids[: item.start] + item.token_ids
            for p in range(item.start, item.start + item.num_new_tokens):
                block = self.kv.setdefault(self.bm.block_table(item.seq)[p // size], [None] * size)
                block[p % size] = tuple(tokens[: p + 1])
        self.sched.mark_computed(out)
        for item in out.scheduled:
            seq = item.seq
            if not item.sample:
                continue
            # the model's tokens after the last one, along the branch that agrees longest (a
            # greedy walk of the tree: at each node, the child the model would pick)
            truth = [fake_token(seq.seq_id, seq.num_tokens + i) for i in range(len(item.drafts) + 1)]
            truth = truth + [fake_token(seq.seq_id, seq.num_tokens + len(truth) + i) for i in range(8)]
            agree = [next((i for i, (d, t) in enumerate(zip(drafts, truth)) if d != t), len(drafts))
                     for drafts in (item.drafts, *(b.drafts for b in item.branches))]
            accepted = max(agree)
            self.adopted += agree[0] < accepted
            for _ in range(accepted + 1):
                seq.append_token(fake_token(seq.seq_id, seq.num_tokens))
            if item.drafts:
                self.sched.accept_drafts(seq, accepted)
            self.check(seq)
            if seq.num_output_tokens >= seq.max_tokens:
                self.sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
        self.sched.release_branches()

    def check(self, seq: Sequence) -> None:
        size, table = self.bm.block_size, self.bm.block_table(seq)
        for p in range(seq.num_computed_tokens):
            assert self.kv[table[p // size]][p % size] == tuple(seq.token_ids[: p + 1]), (seq, p)
        assert len(table) <= -(-seq.num_tokens // size)  # nothing held past the next token's block

    def run(self) -> None:
        for _ in range(5000):
            if not self.sched.has_unfinished():
                return
            self.step()
        raise AssertionError("no progress")


def make_scheduler(num_blocks: int = 64, block_size: int = 4, **config) -> Scheduler:
    config.setdefault("watermark", 0.0)
    return Scheduler(SchedulerConfig(**config), BlockManager(num_blocks, block_size))


@pytest.mark.parametrize("branches", [1, 3])
@pytest.mark.parametrize("right", [0.0, 0.5, 1.0])
def test_verified_proposals_keep_every_computed_slot_right_and_rejected_ones_roll_back(right, branches):
    """With several branches, each runs on its own copy of the last block; the sequence goes
    on with the blocks of the branch that was accepted, and every other branch's go back."""
    rng = random.Random(int(right * 10) + branches)
    sched = make_scheduler(max_num_batched_tokens=24 * branches, max_model_len=128)
    seqs = [Sequence(i, [rng.randrange(97) for _ in range(rng.randint(3, 20))], max_tokens=30) for i in range(6)]
    for seq in seqs:
        sched.add(seq)
    loop = SpeculatingLoop(sched, rng, right, branches)
    loop.run()
    for seq in seqs:
        assert seq.output_token_ids == [fake_token(seq.seq_id, seq.num_prompt_tokens + i) for i in range(30)]
    stats = sched.block_manager.stats()
    assert stats.used == 0 and stats.free + stats.cached == stats.total - 1
    if branches > 1 and right == 0.5:
        assert loop.adopted > 0  # some sequences went on with another branch's blocks


def test_the_prefix_cache_serves_accepted_tokens_never_rejected_proposals():
    """A sequence whose proposals were all rejected leaves its blocks cached; a later prompt
    made of its tokens is served from the cache and every reused slot holds that prompt's prefix."""
    rng = random.Random(5)
    sched = make_scheduler(max_num_batched_tokens=64, max_model_len=128)
    first = Sequence(0, [rng.randrange(97) for _ in range(10)], max_tokens=20)
    sched.add(first)
    loop = SpeculatingLoop(sched, rng, right=0.3)
    loop.run()
    again = Sequence(1, list(first.token_ids), max_tokens=2)
    sched.add(again)
    loop.right = 0.0
    loop.step()
    assert again.num_cached_tokens >= 16
    size, table = sched.block_manager.block_size, sched.block_manager.block_table(again)
    for p in range(again.num_cached_tokens):
        assert loop.kv[table[p // size]][p % size] == tuple(again.token_ids[: p + 1])
    loop.run()


def test_proposals_are_dropped_rather_than_preempting_anything():
    """With one free block left and another sequence still to decode, no proposal takes it."""
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64, max_model_len=64)
    a, b = Sequence(0, list(range(7)), max_tokens=10), Sequence(1, list(range(20, 28)), max_tokens=10)
    for seq in (a, b):
        sched.add(seq)
    out = sched.schedule()
    sched.mark_computed(out)
    for seq in (a, b):
        seq.append_token(1)
    # a's next token fits its second block, its proposals would take the one free block, which b needs next
    a.draft_token_ids = [5, 6, 7]
    out = sched.schedule()
    assert [item.drafts for item in out.scheduled] == [(), ()]
    assert not out.preempted and a.draft_token_ids == []
    for seq in (a, b):
        sched.finish(seq, SequenceStatus.FINISHED_ABORTED)


# -- the policy ----------------------------------------------------------------------------


def decoding(seq_id: int, tokens: list[int], **request) -> Sequence:
    seq = Sequence(seq_id, tokens, max_tokens=100,
                   request=SimpleNamespace(params=SamplingParams(**request), grammars=None))
    seq.status = SequenceStatus.RUNNING
    seq.num_computed_tokens = len(tokens) - 1
    return seq


def test_nothing_is_proposed_above_the_batch_size_that_disables_it():
    spec = Speculator(SpeculativeConfig.from_dict({**NGRAM, "disable_by_batch_size": 2}), max_model_len=512)
    looping = [1, 2, 3, 1, 2, 3, 1, 2]
    two = [decoding(i, looping) for i in range(2)]
    spec.propose(two)
    assert [s.draft_token_ids for s in two] == [[3, 1, 2, 3]] * 2
    three = [decoding(i, looping) for i in range(3)]
    spec.propose(three)
    assert [s.draft_token_ids for s in three] == [[], [], []]


def test_a_request_opts_out_or_lowers_k_and_no_proposal_passes_max_tokens():
    spec = Speculator(SpeculativeConfig.from_dict(NGRAM), max_model_len=512)
    looping = [1, 2, 3, 1, 2, 3, 1, 2]
    off, two = decoding(0, looping, num_speculative_tokens=0), decoding(1, looping, num_speculative_tokens=2)
    near_end = decoding(2, looping)
    near_end.max_tokens = 3  # room for 3 tokens: 2 proposals and the one after them
    spec.propose([off, two, near_end])
    assert off.draft_token_ids == [] and two.draft_token_ids == [3, 1] and near_end.draft_token_ids == [3, 1]


def test_k_adapts_to_acceptance_and_outright_rejections_back_off():
    # a proposal accepted in part shrinks k; one accepted whole restores it; rejected outright, a pause
    spec = Speculator(SpeculativeConfig.from_dict(NGRAM), max_model_len=512)
    seq = decoding(0, [1, 2, 3, 1, 2, 3, 1, 2])
    spec.propose([seq])
    assert len(seq.draft_token_ids) == 4
    spec.verified(seq, 4, 1)  # k drops to accepted + 1
    spec.propose([seq])
    assert len(seq.draft_token_ids) == 2
    spec.verified(seq, 2, 0)  # rejected outright: skip one step, then propose again
    spec.propose([seq])
    assert seq.draft_token_ids == []
    spec.propose([seq])
    assert len(seq.draft_token_ids) == 1
    spec.verified(seq, 1, 1)  # fully accepted: back to the configured k at once
    spec.propose([seq])
    assert len(seq.draft_token_ids) == 4
    assert (spec.num_draft_tokens, spec.num_accepted_tokens, spec.num_verifications) == (7, 2, 3)


class AlwaysProposes:
    """A proposer stub: one token for every sequence asked."""

    def propose_chains(self, wanted):
        return [[5] for _ in wanted]

    def release(self, seq_id):
        pass

    def warm_up(self):
        pass


@pytest.mark.parametrize(("spec", "longest"), [(NGRAM, 8), ({"model": "/m/draft", "num_speculative_tokens": 4}, 64)])
def test_outright_rejections_back_off_doubling_up_to_a_cap_that_depends_on_the_proposers_cost(spec, longest):
    speculator = Speculator(SpeculativeConfig.from_dict(spec), max_model_len=4096, proposer=AlwaysProposes())
    seq = decoding(0, [1, 2, 3])
    waits, waited = [], 0
    while len(waits) < 9:
        speculator.propose([seq])
        if seq.draft_token_ids:
            waits.append(waited)
            waited = 0
            speculator.verified(seq, 1, 0)
        else:
            waited += 1
    expected = [0, 1, 2, 4, 8, 16, 32, 64, 64]
    assert waits == [min(w, longest) for w in expected]


def test_engine_options_that_do_not_combine_are_refused_by_name():
    with pytest.raises(UnsupportedCombination, match="speculative_config.*kv_budget|kv_budget.*speculative_config"):
        EngineConfig(speculative_config=NGRAM, kv_budget_tokens=64, block_size=8)
    with pytest.raises(UnsupportedCombination, match="kv_layout='virtual'.*max_branches > 1"):
        EngineConfig(speculative_config={**NGRAM, "max_branches": 2}, kv_layout="virtual")
    assert EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}').speculative_config \
        == SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})


# -- the engine ---------------------------------------------------------------------------

engine_test = pytest.mark.usefixtures("single_torch_thread", "kv_blocks_returned")

#: prompts that repeat themselves, so that prompt lookup finds something to propose
PROMPTS = [p + p[:12] for p in random_prompts((20, 40, 9, 27), seed=3)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=37, ignore_eos=True)


def engines(llm_factory, folder, **config):
    plain = llm_factory(folder, block_size=8, **config)
    spec = llm_factory(folder, block_size=8, speculative_config=NGRAM, **config)
    return plain, spec


def generate(llm, prompts, params, metrics: list | None = None):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    if metrics is not None:
        metrics += [o.metrics for o in outputs]
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


def spec_counts(llm) -> tuple[int, int]:
    stats = llm.engine.stats()
    return stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]


@engine_test
@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])
def test_greedy_tokens_with_prompt_lookup_equal_plain_decoding(kind, tiny_model, llm_factory):
    """Mistral's sliding window and Gemma2's soft-capping apply to the verification rows too."""
    plain, spec = engines(llm_factory, tiny_model(kind))
    before = spec_counts(spec)
    expected = generate(plain, PROMPTS, GREEDY)
    metrics: list = []
    assert generate(spec, PROMPTS, GREEDY, metrics) == expected
    drafted, accepted = (now - then for now, then in zip(spec_counts(spec), before))
    assert 0 < accepted < drafted  # proposals were verified, some accepted and some rolled back
    # each request reports its own share (vLLM's counters are engine-wide only)
    assert sum(m.speculation.draft_tokens for m in metrics) == drafted
    assert sum(m.speculation.accepted_tokens for m in metrics) == accepted
    assert max(m.speculation.mean_accepted_length for m in metrics) > 0
    if kind == "llama":
        reference = load_reference(tiny_model(kind))
        assert [[hf_greedy(reference, p, GREEDY.max_tokens, stop_at_eos=False)] for p in PROMPTS] == expected


class KnowsTheAnswer:
    """A proposer of three branches per sequence that knows each prompt's greedy output
    (``answers``): depending on the position, the right continuation is the first, second or
    third branch, in full or cut short, and the second shares a prefix with the third. What
    it proposes depends only on the sequence's tokens (seeded runs repeat)."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]]) -> None:
        self.answers = answers

    def propose_branches(self, wanted):
        proposals = []
        for _, token_ids, k in wanted:
            prompt = next(p for p in self.answers if tuple(token_ids[: len(p)]) == p)
            done = len(token_ids) - len(prompt)
            truth = self.answers[prompt][done : done + k]
            if not truth:
                proposals.append([])
                continue
            wrong = [(t + 1) % 1000 for t in truth]
            cut = max(1, len(truth) // 2)
            branches = [wrong, truth[:cut] + wrong[cut:], truth]
            branches.insert(done % 3, branches.pop(2))
            proposals.append([b for b in branches if b])
        return proposals

    def release(self, seq_id):
        pass

    def warm_up(self):
        pass


@contextlib.contextmanager
def proposing(llm, proposer):
    """``llm``'s speculator proposes with ``proposer`` inside the block."""
    speculator = llm.engine.speculator
    own, speculator.proposer = speculator.proposer, proposer
    try:
        yield
    finally:
        speculator.proposer = own


@engine_test
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_greedy_tokens_verifying_several_branches_equal_plain_decoding(kind, tiny_model, llm_factory):
    """Each branch's rows run on a copy of the sequence's last block; where another branch
    than the first is accepted, the sequence goes on with that branch's blocks (Mistral: its
    sliding window sees the branch's own slots)."""
    plain = llm_factory(tiny_model(kind), block_size=8)
    tree = llm_factory(tiny_model(kind), block_size=8, speculative_config=TREE)
    expected = generate(plain, PROMPTS, GREEDY)
    bm = tree.engine.block_manager
    adopted = []
    adopt = bm.adopt_branch
    bm.adopt_branch = lambda seq, branch: (adopted.append(seq.seq_id), adopt(seq, branch))
    before = spec_counts(tree)
    try:
        with proposing(tree, KnowsTheAnswer({tuple(p): out for p, [out] in zip(PROMPTS, expected)})):
            assert generate(tree, PROMPTS, GREEDY) == expected
    finally:
        del bm.adopt_branch
    drafted, accepted = (now - then for now, then in zip(spec_counts(tree), before))
    assert 0 < accepted < drafted
    assert len(adopted) > len(PROMPTS)  # accepted proposals were often another branch's
    assert tree.engine.stats()["spec_decode_num_tree_drafts"] > 0
    # prompt lookup with several branches: the same tokens
    prompts = [p + p[:6] + p[2:9] for p in PROMPTS]
    assert generate(tree, prompts, GREEDY) == generate(plain, prompts, GREEDY)


@engine_test
def test_branches_with_sampling_logprobs_and_parallel_samples(tiny_model, llm_factory):
    """Penalties see each node's own path; logprobs come from the rows of the accepted path;
    seeded sampling (recursive rejection sampling over the branches) repeats."""
    plain = llm_factory(tiny_model("llama"), block_size=8)
    tree = llm_factory(tiny_model("llama"), block_size=8, speculative_config=TREE)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, n=2, logprobs=2,
                            repetition_penalty=1.2)
    want = plain.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    answers = KnowsTheAnswer({tuple(p): list(out.outputs[0].token_ids) for p, out in zip(PROMPTS, want)})
    before = tree.engine.stats()["spec_decode_num_tree_drafts"]
    with proposing(tree, answers):
        have = tree.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        for expected, got in zip(want, have):
            for a, b in zip(expected.outputs, got.outputs):
                assert b.token_ids == a.token_ids
                for x, y in zip(a.logprobs, b.logprobs):
                    assert x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
        seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=30, ignore_eos=True, seed=5)
        first = generate(tree, PROMPTS, seeded)
        assert generate(tree, PROMPTS, seeded) == first
    assert tree.engine.stats()["spec_decode_num_tree_drafts"] > before


@engine_test
def test_stops_inside_an_accepted_run_end_the_output_where_plain_decoding_does(tiny_model, llm_factory):
    plain, spec = engines(llm_factory, tiny_model("llama"))
    free = generate(plain, PROMPTS, GREEDY)
    for prompt, [tokens] in zip(PROMPTS, free):
        stop = tokens[len(tokens) // 2]
        params = SamplingParams(temperature=0.0, max_tokens=37, stop_token_ids=[stop])
        assert generate(spec, [prompt], params) == generate(plain, [prompt], params)
    for max_tokens in (1, 2, 5):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        assert generate(spec, PROMPTS, params) == [[t[:max_tokens]] for [t] in free]


@engine_test
def test_parallel_samples_logprobs_and_penalties_under_speculation(tiny_model, llm_factory):
    plain, spec = engines(llm_factory, tiny_model("llama"))
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, n=2, logprobs=2)
    expected = plain.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    got = spec.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for want, have in zip(expected, got):
        for a, b in zip(want.outputs, have.outputs):
            assert b.token_ids == a.token_ids
            for x, y in zip(a.logprobs, b.logprobs):
                assert x.keys() == y.keys()
                assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
    penalised = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3,
                               frequency_penalty=0.4)
    assert generate(spec, PROMPTS, penalised) == generate(plain, PROMPTS, penalised)


@engine_test
def test_seeded_sampling_under_speculation_is_reproducible(tiny_model, llm_factory):
    _, spec = engines(llm_factory, tiny_model("llama"))
    params = SamplingParams(temperature=0.7, top_k=20, max_tokens=30, ignore_eos=True, seed=11)
    before = spec_counts(spec)
    first = generate(spec, PROMPTS, params)
    assert generate(spec, PROMPTS, params) == first
    assert spec_counts(spec)[0] > before[0]


@engine_test
def test_a_seeded_request_that_opts_out_draws_as_without_speculation_beside_requests_that_speculate(
        tiny_model, llm_factory):
    """Its rows are sampled by the sampler alone even in steps where its neighbours verify proposals."""
    plain, spec = engines(llm_factory, tiny_model("llama"))
    seeded = SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True, seed=3, num_speculative_tokens=0)
    before = spec_counts(spec)
    batch = spec.generate([{"prompt_token_ids": p} for p in PROMPTS], [GREEDY] * (len(PROMPTS) - 1) + [seeded])
    assert spec_counts(spec)[1] > before[1]  # the others' proposals were verified in the same steps
    assert [list(batch[-1].outputs[0].token_ids)] == generate(plain, PROMPTS[-1:], seeded)[0]


@engine_test
def test_a_request_that_opts_out_or_has_a_grammar_decodes_without_proposals(tiny_model, llm_factory):
    plain, spec = engines(llm_factory, tiny_model("llama"))
    before = spec_counts(spec)
    opted_out = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, num_speculative_tokens=0)
    assert generate(spec, PROMPTS, opted_out) == generate(plain, PROMPTS, opted_out)
    choice = SamplingParams(temperature=0.0, max_tokens=20,
                            structured_outputs=StructuredOutputsParams(regex="(ab|cd){1,8}"))
    assert generate(spec, PROMPTS, choice) == generate(plain, PROMPTS, choice)
    assert spec_counts(spec) == before


def test_usage_reports_what_speculation_proposed_and_got_accepted():
    from flexpage.outputs import SpeculationCounts
    from flexpage.server.engine_loop import Delta
    from flexpage.server.responses import _Usage

    usage = _Usage(2)
    usage.update(Delta(0, (), True, 10, 0, SpeculationCounts(8, 6, 3)))
    usage.update(Delta(1, (), True, 12, 0, SpeculationCounts(4, 0, 2)))
    assert usage.body()["speculative_decoding"] == {"draft_tokens": 12, "accepted_tokens": 6, "acceptance_rate": 0.5,
                                                    "mean_accepted_length": 1.2}
    plain = _Usage(1)
    plain.update(Delta(0, (), True, 10, 0))
    assert "speculative_decoding" not in plain.body()
