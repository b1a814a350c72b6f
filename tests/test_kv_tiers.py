"""Tiers behind the prefix cache (Pensieve): what is spilled, restored, moved to disk and
dropped, that the bytes follow, and that a later chat turn is unchanged by any of it.

Bookkeeping (``KVTiers``, ``BlockManager``) is checked on symbolic KV (``ShadowKV``: a slot
holds the token prefix whose KV it contains), so a restore of the wrong bytes, or copies
run in the wrong order, fail at once. The engine tests compare a later turn's greedy tokens
(fp32) with an engine that recomputes the whole history.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from engine_models import random_prompts
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from shadow_kv import ShadowKV

from flexpage import SamplingParams
from flexpage.attention.virtual_arena import resident_bytes
from flexpage.core import BlockManager, Sequence
from flexpage.core.kv_tiers import KVTiers, TierOp, TierOpKind


def drained(tiers: KVTiers) -> list[TierOp]:
    """The ops ``tiers`` decided since the last call (the block manager's plan drains them so)."""
    ops = list(tiers.ops)
    tiers.ops.clear()
    return ops


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def key(i: int) -> bytes:
    return bytes([i])


# -- KVTiers ------------------------------------------------------------------------------------

def test_spill_restore_and_a_second_spill_of_the_same_content():
    tiers = KVTiers(2)
    tiers.spill(key(1), device_block=7, position=0, last_used=0.0)
    tiers.spill(key(1), device_block=9, position=0, last_used=1.0)  # already there: no copy
    assert drained(tiers) == [TierOp(TierOpKind.SPILL, 7, 0)]
    assert tiers.where(key(1)) == "host"
    tiers.restore(key(1), device_block=3)
    assert drained(tiers) == [TierOp(TierOpKind.RESTORE, 0, 3)]
    assert key(1) in tiers and tiers.stats().restored_host_blocks == 1  # a restore keeps the entry


def test_retention_value_drops_the_cheapest_to_recompute_of_equally_idle_blocks_first():
    clock = Clock()
    tiers = KVTiers(3, policy="retention", cost=lambda position: 1.0 + position, clock=clock)
    for position in (2, 0, 1):  # one conversation, all released at t=0
        tiers.spill(key(position), position + 10, position, last_used=0.0)
    clock.now = 10.0
    tiers.spill(key(9), 20, 0, last_used=10.0)
    assert key(0) not in tiers and all(key(p) in tiers for p in (1, 2, 9))
    assert tiers.stats().dropped_blocks == 1


def test_retention_value_keeps_a_recent_block_over_an_idle_expensive_one():
    clock = Clock()
    tiers = KVTiers(1, policy="retention", cost=lambda position: 1.0 + position, clock=clock)
    tiers.spill(key(1), 1, position=50, last_used=0.0)  # value 51 / 100 at t=100
    clock.now = 100.0
    tiers.spill(key(2), 2, position=0, last_used=99.0)  # value 1 / 1
    assert key(2) in tiers and key(1) not in tiers


def test_lru_drops_the_least_recently_used_whatever_its_position():
    clock = Clock()
    tiers = KVTiers(2, policy="lru", clock=clock)
    tiers.spill(key(1), 1, position=0, last_used=5.0)
    tiers.spill(key(2), 2, position=9, last_used=1.0)
    tiers.spill(key(3), 3, position=0, last_used=6.0)
    assert key(2) not in tiers and key(1) in tiers and key(3) in tiers


@pytest.mark.parametrize("policy", ["retention", "lru"])
def test_a_copy_the_pool_still_holds_goes_before_any_idle_entry(policy):
    clock = Clock()
    tiers = KVTiers(2, 1, policy=policy, cost=lambda position: 1.0 + position, clock=clock)
    tiers.spill(key(1), 1, position=0, last_used=0.0)  # idle since t=0: the policy's first victim
    clock.now = 10.0
    tiers.spill(key(2), 2, position=5, last_used=10.0)
    tiers.restore(key(2), 3)  # running again: the pool holds key 2 as well as the tier
    tiers.in_pool = lambda k: k == key(2)
    drained(tiers)
    tiers.spill(key(3), 4, position=0, last_used=10.0)
    assert drained(tiers) == [TierOp(TierOpKind.SPILL, 4, 1)]  # key 2's slot, nothing copied to disk
    assert [tiers.where(key(i)) for i in (1, 2, 3)] == ["host", None, "host"]
    stats = tiers.stats()
    assert (stats.released_blocks, stats.dropped_blocks, stats.demoted_blocks) == (1, 0, 0)


def test_a_full_host_tier_moves_its_victim_to_disk_before_reusing_the_slot():
    tiers = KVTiers(1, 1, policy="lru")
    tiers.spill(key(1), 5, 0, last_used=0.0)
    tiers.spill(key(2), 6, 0, last_used=1.0)  # key 1 -> disk, its slot 0 -> key 2
    tiers.spill(key(3), 7, 0, last_used=2.0)  # key 2 -> disk: key 1's file is deleted first
    assert drained(tiers) == [
        TierOp(TierOpKind.SPILL, 5, 0),
        TierOp(TierOpKind.DEMOTE, 0, 0), TierOp(TierOpKind.SPILL, 6, 0),
        TierOp(TierOpKind.DELETE, 0), TierOp(TierOpKind.DEMOTE, 0, 1), TierOp(TierOpKind.SPILL, 7, 0),
    ]
    assert [tiers.where(key(i)) for i in (1, 2, 3)] == [None, "disk", "host"]
    tiers.restore(key(2), 4)
    assert drained(tiers) == [TierOp(TierOpKind.LOAD, 1, 4)]
    assert tiers.clear() == 2 and drained(tiers) == [TierOp(TierOpKind.DELETE, 1)] and len(tiers) == 0


def test_pinned_entries_are_never_evicted_and_a_spill_that_cannot_fit_is_skipped():
    tiers = KVTiers(1)
    tiers.spill(key(1), 5, 0, last_used=0.0)
    tiers.pinned = {key(1)}
    tiers.spill(key(2), 6, 0, last_used=1.0)
    assert key(1) in tiers and key(2) not in tiers and tiers.stats().host_used == 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(host_slots=-1), "host_slots"),
    (dict(host_slots=0, disk_slots=2), "needs a host tier"),
    (dict(host_slots=2, policy="fifo"), "policy must be one of"),
])
def test_bad_tier_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KVTiers(**kwargs)


# -- the block manager with tiers ----------------------------------------------------------------

BS = 4


def compute_all(bm: BlockManager, kv: ShadowKV, seq: Sequence) -> None:
    """Prefill everything computable, jumping over restored ranges, as the engine does."""
    while seq.num_uncomputed_tokens:
        n = bm.computable_tokens(seq)
        bm.append_slots(seq, n)
        kv.apply(bm.drain_ops())
        kv.write(bm.block_tables(seq), seq, seq.num_computed_tokens, n)
        seq.num_computed_tokens = bm.mark_computed(seq, n)


def admit(bm: BlockManager, kv: ShadowKV, seq: Sequence) -> None:
    seq.num_computed_tokens = bm.allocate(seq)
    kv.apply(bm.drain_ops())


def test_a_dropped_head_is_recomputed_in_front_of_blocks_restored_from_disk():
    clock = Clock()
    bm = BlockManager(8, BS, tiers=KVTiers(2, 2, cost=lambda p: 1.0 + p, clock=clock))
    kv = ShadowKV(BS)
    chat = Sequence(0, list(range(1, 22)))  # 5 full blocks + 1 token
    admit(bm, kv, chat)
    compute_all(bm, kv, chat)
    bm.free(chat)
    clock.now = 1.0
    other = Sequence(1, [30] * 28)  # needs all 7 usable blocks: the chat's 5 cached blocks spill
    admit(bm, kv, other)
    compute_all(bm, kv, other)
    bm.free(other)
    tiers = bm.tiers.stats()
    assert tiers.spilled_blocks == 5 and tiers.dropped_blocks == 1  # 4 fit (2 host + 2 disk)
    assert bm.tiers.where(bm._hashes(chat, 1)[0]) is None  # the cheapest, block 0, went
    clock.now = 2.0
    turn = Sequence(2, list(range(1, 22)) + [40, 41, 42])
    admit(bm, kv, turn)
    assert turn.num_computed_tokens == 0 and bm.computable_tokens(turn) == BS  # only block 0 to compute
    assert bm.reused_tokens(turn) == 4 * BS and bm.num_hole_tokens == BS
    assert bm.tiers.stats().restored_disk_blocks == 2 and bm.tiers.stats().restored_host_blocks == 2
    compute_all(bm, kv, turn)
    kv.check(bm.block_tables(turn), turn)  # every position holds exactly its prefix's KV
    bm.free(turn)
    assert bm.stats().used == 0


def test_without_tiers_nothing_is_kept_past_the_pool():
    bm = BlockManager(8, BS)
    assert bm.tiers is None and bm.drain_ops() == []
    assert BlockManager(8, BS, enable_prefix_caching=False, tiers=KVTiers(4)).tiers is None


class ConversationMachine(RuleBasedStateMachine):
    """Chats take turns over a pool too small for them: every turn's KV must be exactly its
    prefix's, whether it came from the pool, host, disk or was recomputed around a hole."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.bm = BlockManager(14, BS, tiers=KVTiers(2, 2, cost=lambda p: 1.0 + p, clock=self.clock))
        self.kv = ShadowKV(BS)
        self.chats: list[list[int]] = []
        self.live: list[Sequence] = []
        self.next_id = 0

    @rule(data=st.data(), message=st.lists(st.integers(0, 2), min_size=1, max_size=9), keep=st.booleans(),
          new_chat=st.booleans())
    def turn(self, data: st.DataObject, message: list[int], keep: bool, new_chat: bool) -> None:
        self.clock.now += data.draw(st.floats(0.5, 10.0))
        history = [] if new_chat or not self.chats else data.draw(st.sampled_from(self.chats))
        seq = Sequence(self.next_id, history + message if history else [3 + self.next_id % 4] + message)
        self.next_id += 1
        if not self.bm.can_allocate(seq):
            return
        admit(self.bm, self.kv, seq)
        self.kv.check_restored(self.bm, seq)
        if not self.bm.can_append_slots(seq, seq.num_uncomputed_tokens):
            self.bm.free(seq)
            return
        compute_all(self.bm, self.kv, seq)
        seq.append_token(data.draw(st.integers(0, 2)))  # the reply
        if self.bm.can_append_slots(seq, 1):
            compute_all(self.bm, self.kv, seq)
        self.kv.check(self.bm.block_tables(seq), seq)
        if seq.num_tokens < 9 * BS:  # chats that still fit the pool with room for others
            self.chats.append(list(seq.token_ids[: seq.num_computed_tokens]))
        if keep:
            self.live.append(seq)
        else:
            self.bm.free(seq)

    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        if self.live:
            self.bm.free(self.live.pop(data.draw(st.integers(0, len(self.live) - 1))))

    @rule()
    def reset(self) -> None:
        self.bm.reset_prefix_cache()
        self.kv.apply(self.bm.drain_ops())
        assert len(self.bm.tiers) == 0 and not self.kv.disk

    @invariant()
    def accounting(self) -> None:
        tiers, stats = self.bm.tiers.stats(), self.bm.stats()
        assert tiers.host_used <= tiers.host_capacity and tiers.disk_used <= tiers.disk_capacity
        assert len(self.bm.tiers) == tiers.host_used + tiers.disk_used == tiers.host_used + len(self.kv.disk)
        assert stats.free + stats.cached + stats.used == stats.total - 1

    def teardown(self) -> None:
        for seq in self.live:
            self.bm.free(seq)
        stats = self.bm.stats()
        assert stats.used == 0 and stats.free + stats.cached == stats.total - 1


TestConversationMachine = ConversationMachine.TestCase
TestConversationMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


# -- the bytes: host memory and files --------------------------------------------------------------

def small_pool(num_blocks: int = 8):
    from flexpage.attention.kv_pool import KVPool

    return KVPool(num_layers=2, num_blocks=num_blocks, block_size=4, num_kv_heads=2, head_dim=8)


def test_storage_runs_ops_in_order_through_host_and_disk(tmp_path):
    from flexpage.model.kv_tier_storage import TierStorage

    pool = small_pool()
    pool.storage.copy_(torch.randn(pool.storage.shape))
    before = pool.read_blocks([1, 2])
    storage = TierStorage(pool, host_slots=1, disk_dir=tmp_path)
    storage.apply([TierOp(TierOpKind.SPILL, 1, 0), TierOp(TierOpKind.DEMOTE, 0, 7), TierOp(TierOpKind.SPILL, 2, 0)])
    assert (tmp_path / "kv-7.safetensors").exists() and storage.disk_bytes > before.numel() * 2
    pool.storage.zero_()
    storage.apply([TierOp(TierOpKind.LOAD, 7, 3), TierOp(TierOpKind.RESTORE, 0, 4), TierOp(TierOpKind.DELETE, 7)])
    assert torch.equal(pool.read_blocks([3, 4]), before)
    assert not list(tmp_path.glob("kv-*")) and storage.disk_bytes == 0
    storage.close()


def test_a_disk_directory_left_by_a_killed_engine_is_cleaned_and_cannot_be_shared(tmp_path):
    from flexpage.model.kv_tier_storage import TierStorage

    (tmp_path / "kv-3.tmp").write_bytes(b"torn half of a file")  # killed mid-write
    (tmp_path / "kv-1.safetensors").write_bytes(b"\x00" * 10)  # a garbage entry under a real name
    (tmp_path / "notes.txt").write_text("not ours")
    storage = TierStorage(small_pool(), host_slots=2, disk_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "notes.txt"]
    with pytest.raises(ValueError, match="in use by another flexpage engine"):
        TierStorage(small_pool(), host_slots=2, disk_dir=tmp_path)
    storage.close()
    TierStorage(small_pool(), host_slots=2, disk_dir=tmp_path).close()  # released: usable again


def test_an_engine_killed_mid_write_leaves_whole_files_and_the_next_one_starts_clean(tmp_path):
    """SIGKILL while blocks stream to disk: every file under a real name is complete (written
    to a temporary name, then renamed), the lock dies with the process, and the next storage
    on the directory deletes what is left."""
    from safetensors import safe_open

    from flexpage.model.kv_tier_storage import TierStorage

    script = r"""
import sys
from flexpage.attention.kv_pool import KVPool
from flexpage.core.kv_tiers import TierOp, TierOpKind
from flexpage.model.kv_tier_storage import TierStorage
pool = KVPool(num_layers=8, num_blocks=4, block_size=64, num_kv_heads=4, head_dim=64)  # 1 MiB blocks
storage = TierStorage(pool, host_slots=1, disk_dir=sys.argv[1])
storage.apply([TierOp(TierOpKind.SPILL, 1, 0), TierOp(TierOpKind.DEMOTE, 0, 0)])
print("writing", flush=True)
i = 1
while True:
    storage.apply([TierOp(TierOpKind.DEMOTE, 0, i), TierOp(TierOpKind.DELETE, i - 1)])
    i += 1
"""
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.stdout.readline().strip() == "writing"
    time.sleep(0.5)
    proc.kill()
    proc.wait(30)
    complete = list(tmp_path.glob("kv-*.safetensors"))
    assert complete
    for path in complete:
        with safe_open(str(path), "pt") as f:
            assert f.get_tensor("kv").numel() * 4 == 1 << 20
    storage = TierStorage(small_pool(), host_slots=2, disk_dir=tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [".lock"]
    storage.close()


def test_host_tier_memory_grows_with_use_and_never_past_its_cap():
    """The host tier's own pages: nothing resident until written (give or take one 2 MB huge
    page), its cap once full, and no more however many blocks spill through it afterwards."""
    from flexpage.attention.kv_pool import KVPool
    from flexpage.model.kv_tier_storage import TierStorage

    pool = KVPool(num_layers=8, num_blocks=9, block_size=64, num_kv_heads=4, head_dim=64)
    pool.storage.fill_(1.0)
    storage = TierStorage(pool, host_slots=64)
    cap, block = 64 << 20, 1 << 20
    assert storage.block_bytes == block and storage.host.numel() * 4 == cap
    assert resident_bytes(storage.host) <= 2 * block
    tiers = KVTiers(64, policy="lru")
    grown = []
    for i in range(3 * 64):
        tiers.spill(i.to_bytes(4, "little"), 1 + i % 8, 0, float(i))
        storage.apply(drained(tiers))
        if i + 1 in (32, 64, 3 * 64):
            grown.append(resident_bytes(storage.host))
    assert 32 * block <= grown[0] <= 34 * block  # half full: half resident (or a huge page more)
    edges = 2 * 4096  # the partly covered first and last pages belong to neighbours too
    assert cap <= grown[1] <= cap + edges and cap <= grown[2] <= cap + edges


# -- the engine: a later turn is unchanged ---------------------------------------------------------

BLOCK = 8  # the engine's default block size
TURN = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
TINY_LLAMA_BLOCK_BYTES = 2 * 2 * 2 * BLOCK * 16 * 4  # layers x (K, V) x KV heads x tokens x head dim x fp32


def chat_with_a_flood_in_between(llm) -> tuple[list[int], object]:
    """Turn 1, then one prompt that needs the whole pool (every cached block of turn 1 is
    evicted), then turn 2 = turn 1's prompt and reply plus a new message."""
    first, flood, message = random_prompts((60, 305, 10), seed=11)
    reply = llm.generate([{"prompt_token_ids": first}], TURN)[0].outputs[0].token_ids
    llm.generate([{"prompt_token_ids": flood}], SamplingParams(max_tokens=7, ignore_eos=True))  # 39 blocks: all
    second = llm.generate([{"prompt_token_ids": first + reply + message}], TURN)[0]
    return reply, second


@pytest.fixture(scope="module")
def stateless_turns(tiny_model, llm_factory):
    reply, second = chat_with_a_flood_in_between(llm_factory(tiny_model("llama"), num_blocks=40,
                                                              enable_prefix_caching=False))
    return reply, second.outputs[0].token_ids


@pytest.mark.usefixtures("kv_blocks_returned")
@pytest.mark.parametrize("tiers, restored_from", [
    (dict(host_kv_bytes=64 * TINY_LLAMA_BLOCK_BYTES), "host"),
    (dict(host_kv_bytes=2 * TINY_LLAMA_BLOCK_BYTES, disk_kv_bytes=f"{64 * 16}KiB"), "disk"),
    (dict(host_kv_bytes=4 * TINY_LLAMA_BLOCK_BYTES), "hole"),
    (dict(host_kv_bytes=4 * TINY_LLAMA_BLOCK_BYTES, kv_tier_policy="lru"), "lru"),
])
def test_a_later_turn_equals_a_stateless_recompute_of_the_whole_history(tiers, restored_from, stateless_turns,
                                                                       tiny_model, llm_factory, tmp_path_factory):
    if "disk_kv_bytes" in tiers:
        tiers["disk_kv_dir"] = str(tmp_path_factory.mktemp("disk-tier"))
    llm = llm_factory(tiny_model("llama"), num_blocks=40, **tiers)
    reply, second = chat_with_a_flood_in_between(llm)
    assert (reply, second.outputs[0].token_ids) == stateless_turns
    stats = llm.engine.stats()
    history_blocks = (60 + 16 - 1) // BLOCK
    assert stats["kv_spilled_tokens"] >= history_blocks * BLOCK  # the flood evicted all of turn 1
    restored = stats["kv_restored_host_tokens"] + stats["kv_restored_disk_tokens"]
    assert second.num_cached_tokens == restored  # nothing of turn 1 was left in the pool
    if restored_from == "host":
        assert restored == history_blocks * BLOCK and stats["kv_hole_recomputed_tokens"] == 0
    elif restored_from == "disk":
        assert stats["kv_restored_disk_tokens"] > 0 and stats["kv_restored_host_tokens"] > 0
        assert stats["kv_hole_recomputed_tokens"] == 0
    elif restored_from == "hole":  # the retention value kept the 4 most expensive blocks: the last ones
        assert restored == 4 * BLOCK and stats["kv_hole_recomputed_tokens"] == (history_blocks - 4) * BLOCK
    else:  # LRU kept the 4 spilled last, which the pool evicts tail first: the leading ones
        assert restored == 4 * BLOCK and stats["kv_hole_recomputed_tokens"] == 0


@pytest.mark.usefixtures("kv_blocks_returned")
def test_conversations_count_reused_history_and_the_view_shows_them(tiny_model, llm_factory):
    from rich.console import Console

    from flexpage.top import render

    llm = llm_factory(tiny_model("llama"), num_blocks=40, host_kv_bytes=8 * TINY_LLAMA_BLOCK_BYTES)
    first, message = random_prompts((60, 10), seed=12)
    reply = llm.generate([first], TURN, conversation_id="chat-a")[0].outputs[0].token_ids
    second = llm.generate([first + reply + message], TURN, conversation_id="chat-a")[0]
    conv = llm.engine.conversations.get("chat-a")
    history = len(first) + len(reply)
    assert conv.turns == 2 and conv.history_tokens == history + len(message) + 16
    assert conv.reused_tokens == second.num_cached_tokens == (history - 1) // BLOCK * BLOCK
    assert conv.recomputed_tokens == history - conv.reused_tokens
    view = llm.engine.kv_view()
    assert sum(view["pool"].values()) == len(view["blocks"]) == 39
    [entry] = [c for c in view["conversations"] if c["id"] == "chat-a"]
    assert entry["pool_blocks"] == view["blocks"].count("c") and entry["turns"] == 2
    assert all(view["owners"][o] == "chat-a" for o, s in zip(view["owner_of"], view["blocks"]) if s == "c")
    console = Console(width=100, record=True)
    console.print(render(view, width=100))
    frame = console.export_text()
    assert "KV pool: 39 blocks of 8 tokens" in frame and "chat-a" in frame
    with pytest.raises(ValueError, match="one id for 2 prompts"):
        llm.generate([first, message], TURN, conversation_id="chat-a")
    with pytest.raises(ValueError, match="conversation_id"):
        llm.generate([first], TURN, conversation_id="")


def test_salted_requests_share_blocks_only_with_the_same_salt():
    bm = BlockManager(16, BS)
    kv = ShadowKV(BS)
    tokens = list(range(1, 14))
    for seq_id, salt in enumerate(("key-a", "key-a", "key-b", None)):
        seq = Sequence(seq_id, tokens, cache_salt=salt)
        admit(bm, kv, seq)
        hit = seq.num_computed_tokens
        compute_all(bm, kv, seq)
        bm.free(seq)
        assert hit == (12 if seq_id == 1 else 0), (salt, hit)


@pytest.mark.parametrize("settings, message", [
    (dict(disk_kv_dir="/tmp/x", disk_kv_bytes="1GiB"), "a disk tier needs host_kv_bytes"),
    (dict(host_kv_bytes="1GiB", disk_kv_dir="/tmp/x"), "go together"),
    (dict(host_kv_bytes="1GiB", enable_prefix_caching=False), "enable_prefix_caching"),
    (dict(host_kv_bytes="1GiB", kv_tier_policy="fifo"), "kv_tier_policy"),
    (dict(host_kv_bytes="lots"), "host_kv_bytes: got 'lots'"),
])
def test_bad_tier_configs_name_the_setting(settings, message):
    from flexpage.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(**settings)


def test_warm_up_measures_the_recompute_cost_slope_and_leaves_the_engine_clean(tiny_model):
    from flexpage import LLM

    llm = LLM(str(tiny_model("llama")), dtype="float32", compile=False, num_blocks=80,
              host_kv_bytes=16 * TINY_LLAMA_BLOCK_BYTES)
    engine = llm.engine
    estimate = engine.recompute_cost_slope
    engine.warm_up()
    assert engine.recompute_cost_slope != estimate and engine.recompute_cost_slope >= 0
    assert engine._recompute_cost(9) == pytest.approx(1 + 9.5 * BLOCK * engine.recompute_cost_slope)
    stats = engine.stats()
    assert stats["kv_blocks_used"] == stats["kv_blocks_cached"] == 0 and stats["kv_host_blocks_used"] == 0
    assert not engine.requests
