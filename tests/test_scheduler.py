"""Tests for flexpage.core.scheduler: budgets, chunked prefill, preemption, order.

``drive`` simulates the engine loop (schedule -> apply block copies -> "run" the
model by writing a symbolic shadow KV -> mark_computed -> sample -> finish) and
checks after every step that each scheduled sequence's computed positions hold
exactly its own prefix's KV, so preemption, swapping and copy-on-write are
verified end to end, not just counted.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexpage.core import BlockManager, Scheduler, SchedulerConfig, SchedulerOutput, Sequence, SequenceStatus
from flexpage.core.kv_ops import BlockOpKind


def fake_token(seq_id: int, position: int) -> int:
    """Deterministic 'model': the token depends only on (request, position)."""
    return (seq_id * 31 + position * 7) % 97


def expected_output(seq: Sequence, max_tokens: int) -> list[int]:
    return [fake_token(seq.seq_id, seq.num_prompt_tokens + k) for k in range(max_tokens)]


class ShadowKV:
    """Slot (block, offset) -> the token prefix whose KV it holds."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.dev: dict[int, list] = {}
        self.host: dict[int, list] = {}

    def _copy(self, pairs: list[tuple[int, int]], src: dict, dst: dict) -> None:
        data = [list(src.get(s, [None] * self.bs)) for s, _ in pairs]
        for (_, d), blk in zip(pairs, data):
            dst[d] = blk

    def run(self, out: SchedulerOutput, bm: BlockManager) -> None:
        where = {BlockOpKind.SWAP_OUT: (self.dev, self.host), BlockOpKind.SWAP_IN: (self.host, self.dev),
                 BlockOpKind.COPY: (self.dev, self.dev)}
        for op in out.kv_ops:  # one by one, in the plan's order
            self._copy([(op.src, op.dst)], *where[op.kind])
        for item in out.scheduled:
            seq = item.seq
            for p in range(item.start, item.start + item.num_new_tokens):
                blk = self.dev.setdefault(bm.block_table(seq)[p // self.bs], [None] * self.bs)
                blk[p % self.bs] = tuple(seq.token_ids[: p + 1])

    def check(self, seq: Sequence, bm: BlockManager) -> None:
        for p in range(seq.num_computed_tokens):
            got = self.dev[bm.block_table(seq)[p // self.bs]][p % self.bs]
            assert got == tuple(seq.token_ids[: p + 1]), (seq, p)


class Engine:
    """The engine loop with a fake model; checks KV placement after every step."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.kv = ShadowKV(sched.block_manager.block_size)
        self.outs: list[SchedulerOutput] = []

    def step(self, sample: bool = True) -> SchedulerOutput:
        """schedule -> copies + forward (shadow) -> mark_computed -> [sample -> finish]."""
        sched, cfg = self.sched, self.sched.config
        out = sched.schedule()
        self.outs.append(out)
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert len(out.scheduled) <= cfg.max_num_seqs
        assert len({id(s.seq) for s in out.scheduled}) == len(out.scheduled)
        self.kv.run(out, sched.block_manager)
        sched.mark_computed(out)
        for item in out.scheduled:
            seq = item.seq
            self.kv.check(seq, sched.block_manager)
            assert item.sample == (seq.num_computed_tokens == seq.num_tokens)
            if item.sample and sample:
                seq.append_token(fake_token(seq.seq_id, seq.num_tokens))
                if seq.num_output_tokens >= seq.max_tokens:
                    sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
        return out

    def run(self, max_steps: int = 5000, between_steps=None) -> list[SchedulerOutput]:
        """Step until every sequence finished; returns the outputs of these steps."""
        first = len(self.outs)
        while self.sched.has_unfinished():
            assert len(self.outs) - first < max_steps, "no progress"
            out = self.step()
            if between_steps is not None:
                between_steps(self.sched, out)
        return self.outs[first:]


def drive(sched: Scheduler, **kwargs) -> list[SchedulerOutput]:
    return Engine(sched).run(**kwargs)


def assert_pool_full(bm: BlockManager) -> None:
    s = bm.stats()
    assert s.used == 0
    assert s.free + s.cached == s.total - 1
    assert s.host_free == s.host_total


def make(num_blocks: int = 64, block_size: int = 4, num_host_blocks: int = 0, **cfg) -> Scheduler:
    cfg.setdefault("watermark", 0.0)
    bm = BlockManager(num_blocks, block_size, num_host_blocks=num_host_blocks)
    return Scheduler(SchedulerConfig(**cfg), bm)


# -- budgets and prefill shapes ------------------------------------------------------


def test_token_budget_and_max_num_seqs_respected() -> None:
    rng = random.Random(0)
    sched = make(num_blocks=128, max_num_batched_tokens=32, max_num_seqs=6, max_model_len=128)
    seqs = [Sequence(i, [rng.randrange(50) for _ in range(rng.randint(5, 60))], max_tokens=5) for i in range(12)]
    for seq in seqs:
        sched.add(seq)
    outs = drive(sched)
    assert max(o.num_batched_tokens for o in outs) == 32  # the budget is actually used
    for seq in seqs:
        assert seq.status is SequenceStatus.FINISHED_LENGTH
        assert seq.output_token_ids == expected_output(seq, 5)
    assert_pool_full(sched.block_manager)


def test_chunked_prefill_splits_long_prompt_and_mixes_decodes() -> None:
    sched = make(max_num_batched_tokens=10, max_model_len=64)
    engine = Engine(sched)
    a = Sequence(0, range(4), max_tokens=10)
    sched.add(a)
    out = engine.step()
    assert [(s.seq, s.num_new_tokens, s.start, s.sample) for s in out.scheduled] == [(a, 4, 0, True)]
    b = Sequence(1, range(100, 125), max_tokens=1)
    sched.add(b)
    shapes = [[(s.seq.seq_id, s.num_new_tokens, s.start, s.sample) for s in engine.step().scheduled] for _ in range(3)]
    assert shapes == [
        [(0, 1, 4, True), (1, 9, 0, False)],  # decode first, then the first chunk
        [(0, 1, 5, True), (1, 9, 9, False)],
        [(0, 1, 6, True), (1, 7, 18, True)],  # final chunk samples
    ]
    last = engine.outs[-1].scheduled
    assert last[0].is_prefill is False and last[1].is_prefill is True
    assert b.status is SequenceStatus.FINISHED_LENGTH
    engine.run()
    assert_pool_full(sched.block_manager)


def test_no_chunking_schedules_whole_prompts_only() -> None:
    sched = make(max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False)
    seqs = [Sequence(0, range(10), max_tokens=3), Sequence(1, range(20, 30), max_tokens=3), Sequence(2, [5, 6, 7], max_tokens=3)]
    for seq in seqs:
        sched.add(seq)
    def whole_prompts(_sched: Scheduler, step: SchedulerOutput) -> None:
        for s in step.scheduled:
            assert s.sample  # every slice runs to the end of the sequence

    outs = drive(sched, between_steps=whole_prompts)
    # seq 1 does not fit the remaining budget; seq 2 would, but must not overtake it.
    assert [(s.seq.seq_id, s.num_new_tokens) for s in outs[0].scheduled] == [(0, 10)]
    assert [(s.seq.seq_id, s.num_new_tokens) for s in outs[1].scheduled] == [(0, 1), (1, 10), (2, 3)]
    assert_pool_full(sched.block_manager)


def test_shared_prefix_hits_cache_through_scheduler() -> None:
    sched = make(max_num_batched_tokens=64, max_model_len=64)
    system = list(range(200, 232))  # 8 blocks
    first = Sequence(0, system + [1, 2], max_tokens=2)
    sched.add(first)
    drive(sched)
    second = Sequence(1, system + [3, 4], max_tokens=2)
    sched.add(second)
    out = sched.schedule()
    assert second.num_cached_tokens == 32
    assert [(s.start, s.num_new_tokens) for s in out.scheduled] == [(32, 2)]


# -- preemption ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_when_pool_is_tiny(mode: str) -> None:
    sched = make(num_blocks=9, num_host_blocks=16 if mode == "swap" else 0, preemption_mode=mode,
                 max_num_batched_tokens=64, max_model_len=32)
    seqs = [Sequence(i, [i * 10 + k for k in range(6)], max_tokens=12) for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    outs = drive(sched)
    assert sched.num_preemptions > 0
    assert sum(len(o.preempted) for o in outs) == sched.num_preemptions
    if mode == "swap":
        assert any(o.blocks_to_swap_out for o in outs) and any(o.blocks_to_swap_in for o in outs)
    else:
        assert not any(o.blocks_to_swap_out for o in outs)
    for seq in seqs:
        assert seq.status is SequenceStatus.FINISHED_LENGTH
        assert seq.output_token_ids == expected_output(seq, 12)  # unchanged by preemption
    assert not any(o.finished for o in outs)
    assert_pool_full(sched.block_manager)


def test_preempts_most_recent_and_keeps_arrival_order() -> None:
    sched = make(num_blocks=7, max_num_batched_tokens=64, max_model_len=24)
    a, b = Sequence(0, range(8), max_tokens=12), Sequence(1, range(50, 58), max_tokens=12)
    c = Sequence(2, range(100, 112), max_tokens=1)
    for seq in (a, b, c):
        sched.add(seq)
    engine = Engine(sched)
    for _ in range(10):
        out = engine.step()
        if out.preempted:
            break
        assert c.status is SequenceStatus.WAITING  # never fits next to a and b
    assert out.preempted == [b]  # the most recently admitted running sequence
    assert [s.seq for s in out.scheduled] == [a]
    assert list(sched.waiting) == [b, c]  # back at the front, in arrival order
    assert (b.status, b.num_computed_tokens, sched.block_manager.block_table(b)) == (SequenceStatus.WAITING, 0, [])
    assert b.num_output_tokens == 5  # generated tokens are kept for recompute
    engine.run()
    first_step = {
        seq.seq_id: min(i for i, o in enumerate(engine.outs) if any(x.seq is seq and x.start == 0 for x in o.scheduled))
        for seq in (b, c)
    }
    assert first_step[1] < first_step[2] or b.num_cached_tokens  # b re-admitted before c
    assert c.status is SequenceStatus.FINISHED_LENGTH
    assert a.output_token_ids == expected_output(a, 12) and b.output_token_ids == expected_output(b, 12)
    assert_pool_full(sched.block_manager)


def test_lone_sequence_outgrowing_pool_is_finished_not_livelocked() -> None:
    sched = make(num_blocks=3, max_num_batched_tokens=16, max_model_len=64)
    seq = Sequence(0, range(6), max_tokens=100)
    sched.add(seq)
    outs = drive(sched)
    assert outs[-1].finished == [seq]
    assert seq.status is SequenceStatus.FINISHED_LENGTH and seq.num_tokens == 9
    assert_pool_full(sched.block_manager)


def test_fork_copy_on_write_through_scheduler() -> None:
    sched = make(max_num_batched_tokens=32, max_model_len=32)
    parent = Sequence(0, range(6), max_tokens=4)
    sched.add(parent)
    engine = Engine(sched)
    engine.step(sample=False)  # prefill; then sample n=2 tokens from the same logits
    child = sched.fork(parent, 100)
    parent.append_token(fake_token(0, 6))
    child.append_token(fake_token(100, 6))
    out = engine.step()
    assert out.blocks_to_copy == [(2, 3)]
    assert (sched.block_manager.block_table(parent), sched.block_manager.block_table(child)) == ([1, 3], [1, 2])
    engine.run()
    assert parent.output_token_ids == expected_output(parent, 4)
    assert child.output_token_ids == [fake_token(100, 6 + k) for k in range(4)]
    assert_pool_full(sched.block_manager)


def test_parallel_samples_fork_once_after_the_prompt_and_share_its_row() -> None:
    """An n = 3 sequence forks its two siblings when its prompt is computed (the engine then
    samples all three from the prompt's one logits row), and never again."""
    sched = make(max_num_batched_tokens=32, max_model_len=32)
    parent, other = Sequence(0, range(6), max_tokens=4, num_samples=3), Sequence(1, range(5), max_tokens=4)
    for seq in (parent, other):
        sched.add(seq)
    Engine(sched).step(sample=False)
    ids = iter(range(100, 200))
    rows = sched.fork_parallel_samples([parent, other], lambda: next(ids))
    assert [(row, seq.seq_id) for row, seq in rows] == [(0, 0), (0, 100), (0, 101), (1, 1)]
    assert all(sched.block_manager.block_table(seq) == sched.block_manager.block_table(parent) for _, seq in rows[:3])
    assert parent.samples_to_fork == 0 and all(seq.samples_to_fork == 0 for _, seq in rows)
    assert sched.fork_parallel_samples([parent], lambda: next(ids)) == [(0, parent)]


# -- abort, watermark, validation ---------------------------------------------------------


def test_abort_frees_blocks_at_once() -> None:
    sched = make(num_blocks=32, num_host_blocks=8, preemption_mode="swap", max_model_len=64)
    bm = sched.block_manager
    running, waiting = Sequence(0, range(20), max_tokens=5), Sequence(1, range(50, 60), max_tokens=5)
    sched.add(running)
    sched.schedule()
    sched.add(waiting)
    assert bm.stats().used == 5
    assert sched.abort(0) is running
    assert running.status is SequenceStatus.FINISHED_ABORTED and bm.block_table(running) == []
    assert bm.stats().used == 0
    assert sched.abort(0) is None
    assert sched.abort(1) is waiting and not sched.has_unfinished()
    swapped = Sequence(2, range(8), max_tokens=5)
    sched.add(swapped)
    sched.schedule()
    sched._preempt(swapped, SchedulerOutput())
    assert swapped.status is SequenceStatus.SWAPPED and bm.stats().host_used == 2
    sched.abort(2)
    assert_pool_full(bm)


def test_watermark_respected_at_admission() -> None:
    sched = make(num_blocks=101, watermark=0.1, max_num_batched_tokens=512, max_model_len=512)
    assert sched.watermark_blocks == 10
    a = Sequence(0, range(20), max_tokens=50)  # 5 blocks
    sched.add(a)
    sched.schedule()
    too_big = Sequence(1, [7] * (86 * 4), max_tokens=1)  # 95 free - 86 = 9 < 10
    sched.add(too_big)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [a] and too_big.status is SequenceStatus.WAITING
    sched.abort(1)
    fits = Sequence(2, [7] * (85 * 4), max_tokens=1)  # 95 free - 85 = 10
    sched.add(fits)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [a, fits]


def test_watermark_ignored_when_nothing_runs() -> None:
    sched = make(num_blocks=11, watermark=0.5, max_num_batched_tokens=64, max_model_len=64)
    seq = Sequence(0, range(40), max_tokens=1)  # all 10 usable blocks
    sched.add(seq)
    assert [s.seq for s in sched.schedule().scheduled] == [seq]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
        (dict(max_model_len=-1), "max_model_len"),
        (dict(preemption_mode="drop"), "preemption_mode"),
        (dict(watermark=1.0), "watermark"),
        (dict(watermark=-0.1), "watermark"),
        (dict(enable_chunked_prefill="yes"), "enable_chunked_prefill"),
        (dict(enable_chunked_prefill=False, max_num_batched_tokens=8, max_model_len=16), "max_num_batched_tokens"),
    ],
)
def test_bad_config_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kwargs)


def test_swap_mode_needs_host_blocks() -> None:
    with pytest.raises(ValueError, match="num_host_blocks"):
        Scheduler(SchedulerConfig(preemption_mode="swap"), BlockManager(8, 4))


def test_add_rejects_prompts_that_can_never_run() -> None:
    sched = make(num_blocks=5, max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len=32"):
        sched.add(Sequence(0, range(33)))
    with pytest.raises(ValueError, match="num_blocks=5"):
        sched.add(Sequence(1, range(17)))  # 5 blocks > 4 usable
    sched.add(Sequence(2, range(16)))
    with pytest.raises(ValueError, match="already"):
        sched.add(Sequence(2, range(3)))


def test_scheduler_stops_sequences_at_max_model_len() -> None:
    sched = make(max_num_batched_tokens=16, max_model_len=10)
    seq = Sequence(0, range(6), max_tokens=100)
    sched.add(seq)
    outs = drive(sched)
    assert outs[-1].finished == [seq] and outs[-1].scheduled == []
    assert seq.num_tokens == 10 and seq.status is SequenceStatus.FINISHED_LENGTH
    assert_pool_full(sched.block_manager)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    num_blocks=st.integers(4, 24),
    block_size=st.sampled_from([1, 2, 4]),
    budget=st.integers(1, 24),
    chunked=st.booleans(),
    mode=st.sampled_from(["recompute", "swap"]),
    max_num_seqs=st.integers(1, 5),
    watermark=st.sampled_from([0.0, 0.2]),
    num_host_blocks=st.integers(1, 12),
    prefix_caching=st.booleans(),
)
def test_random_workloads_always_drain(
    seed: int,
    num_blocks: int,
    block_size: int,
    budget: int,
    chunked: bool,
    mode: str,
    max_num_seqs: int,
    watermark: float,
    num_host_blocks: int,
    prefix_caching: bool,
) -> None:
    """Arrivals over time, shared prefixes, forks and aborts: everything finishes,
    KV placement stays right (checked every step) and the pool ends full."""
    rng = random.Random(seed)
    max_model_len = min(24, (num_blocks - 1) * block_size)
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget if chunked else max(budget, max_model_len),
        enable_chunked_prefill=chunked,
        preemption_mode=mode,
        watermark=watermark,
        max_model_len=max_model_len,
    )
    bm = BlockManager(
        num_blocks, block_size, enable_prefix_caching=prefix_caching, num_host_blocks=num_host_blocks if mode == "swap" else 0
    )
    sched = Scheduler(cfg, bm)
    prefixes = [[], [1, 2, 3, 4, 5, 6], [9] * 8]
    pending = []
    for i in range(rng.randint(1, 12)):
        prompt = (rng.choice(prefixes) + [rng.randrange(5) for _ in range(rng.randint(1, 10))])[:max_model_len]
        pending.append(Sequence(i, prompt, max_tokens=rng.randint(1, 12)))
    plain: list[Sequence] = []
    next_id = [1000]

    def chaos(s: Scheduler, _out: SchedulerOutput) -> None:
        if pending and rng.random() < 0.5:
            seq = pending.pop(0)
            s.add(seq)
            plain.append(seq)
        live = s.running + list(s.waiting) + list(s.swapped)
        if live and rng.random() < 0.05:
            s.abort(rng.choice(live).seq_id)
        decoding = [x for x in s.running if x.num_uncomputed_tokens == 1]
        if decoding and rng.random() < 0.05:
            s.fork(rng.choice(decoding), next_id[0])
            next_id[0] += 1

    engine = Engine(sched)
    for _ in range(3000):
        if not (sched.has_unfinished() or pending):
            break
        chaos(sched, engine.step() if sched.has_unfinished() else SchedulerOutput())
    else:
        pytest.fail("no progress")
    for seq in plain:
        assert seq.status.is_finished
        if seq.status is SequenceStatus.FINISHED_LENGTH:
            assert seq.output_token_ids == expected_output(seq, seq.max_tokens)[: seq.num_output_tokens]
    assert_pool_full(bm)


def test_fork_mid_prefill_is_rejected() -> None:
    sched = make(max_num_batched_tokens=4, max_model_len=32)
    seq = Sequence(0, range(10), max_tokens=2)
    sched.add(seq)
    Engine(sched).step()
    with pytest.raises(ValueError, match="mid-prefill"):
        sched.fork(seq, 1)
