"""The physical KV pool: where written tokens land, block copies, swap round-trips, bad input.

A slot is one token position of the pool, ``slot = block * block_size + offset``; every
layer stores K and V as ``[1, kv_heads, num_blocks * block_size, head_dim]``.
"""

from __future__ import annotations

import os

import pytest
import torch

from attention_reference import BatchSpec, expected_positions_and_slots, gather_sequence_kv, make_block_tables
from flexpage.attention.kv_pool import KVPool, allocate_pool, fault_in, write_kv
from flexpage.attention.paging import build_paged_batch
from flexpage.recipes.causal import causal

LAYERS, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 3, 10, 4, 2, 8


def make_pool(dtype: torch.dtype = torch.float32, *, random: bool = False, seed: int = 0) -> KVPool:
    pool = KVPool(num_layers=LAYERS, num_blocks=BLOCKS, block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS,
                  head_dim=HEAD_DIM, dtype=dtype)
    if random:
        pool.storage.copy_(torch.randn(pool.storage.shape, generator=torch.Generator().manual_seed(seed)))
    return pool


def block(pool: KVPool, layer: int, kv: int, block_id: int) -> torch.Tensor:
    """``[H, block_size, D]`` contents of one block of one layer's K (kv=0) or V (kv=1)."""
    return pool.layer(layer)[kv][0, :, block_id * BLOCK_SIZE:(block_id + 1) * BLOCK_SIZE]


# ---- layout ----------------------------------------------------------------------------------


def test_pool_layout_and_sizes():
    pool = make_pool()
    k, v = pool.layer(1)
    assert k.shape == v.shape == (1, KV_HEADS, BLOCKS * BLOCK_SIZE, HEAD_DIM)
    assert pool.num_slots == BLOCKS * BLOCK_SIZE
    assert pool.bytes_per_token == 2 * LAYERS * KV_HEADS * HEAD_DIM * 4
    assert make_pool(torch.bfloat16).bytes_per_token == 2 * LAYERS * KV_HEADS * HEAD_DIM * 2
    # layer views alias the single storage tensor (attention reads the pool in place)
    k.fill_(7.0)
    assert (pool.storage[1, 0] == 7.0).all() and (pool.storage[1, 1] == 0).all() and (pool.storage[0] == 0).all()
    assert torch.count_nonzero(pool.storage) == k.numel()


# ---- write_kv ----------------------------------------------------------------------------------


def _resident_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="resident memory is read from Linux's /proc")
def test_a_demand_paged_pool_costs_no_memory_until_it_is_written():
    """Anonymous memory committed on first touch: allocating 512 MiB barely moves the resident
    size, the pool reads as zeros, and writing part of it commits only that part."""
    before = _resident_mb()
    pool = allocate_pool((1, 8, 1 << 19, 64), torch.bfloat16, populate=False)  # 512 MiB
    assert _resident_mb() - before < 64
    assert pool.shape == (1, 8, 1 << 19, 64) and pool.dtype == torch.bfloat16 and pool.is_contiguous()
    assert not pool[0, 0, :4096].any()
    pool[0, 0, :4096] = 1.0
    assert pool[0, 0, :4096].all() and not pool[0, 1, :4096].any()
    assert _resident_mb() - before < 64


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="resident memory is read from Linux's /proc")
def test_a_pool_is_resident_when_made_so_no_step_pays_for_page_faults():
    before = _resident_mb()
    pool = allocate_pool((1, 4, 1 << 19, 64), torch.bfloat16)  # 256 MiB
    assert _resident_mb() - before > 240
    assert pool.is_contiguous() and not pool.any()


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="resident memory is read from Linux's /proc")
def test_a_kv_pool_is_resident_once_it_has_waited_for_its_population_thread():
    before = _resident_mb()
    pool = KVPool(num_layers=2, num_blocks=8192, block_size=16, num_kv_heads=4, head_dim=64,
                  dtype=torch.bfloat16)  # 256 MiB
    pool.wait_until_resident()
    assert _resident_mb() - before > 240
    assert not pool.storage.any()


def _vm_flags(address: int) -> set[str]:
    """The ``VmFlags`` of the mapping holding ``address`` (Linux's /proc/self/smaps)."""
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            first = line.split()[0]
            if "-" in first and ":" not in first:
                low, high = (int(part, 16) for part in first.split("-"))
                inside = low <= address < high
            elif inside and first == "VmFlags:":
                return set(line.split()[1:])
    raise LookupError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="page advice is read from Linux's /proc")
@pytest.mark.parametrize("slow", [False, True], ids=["fast", "slow"])
def test_a_pool_that_populates_slowly_puts_the_rest_on_small_pages(slow: bool):
    """``hg``: advised onto 2 MB pages; ``nh``: onto 4 KB pages. The first chunk (8 MB) stays as it was."""
    pool = allocate_pool((1, 2, 1 << 19, 64), torch.bfloat16, populate=False)  # 128 MiB
    fault_in(pool, slow_rate=float("inf") if slow else 0.0)
    assert "hg" in _vm_flags(pool.data_ptr())
    assert ("nh" if slow else "hg") in _vm_flags(pool.data_ptr() + pool.nbytes - 1)
    assert not pool.any()


def test_small_pools_are_ordinary_tensors():
    assert allocate_pool((2, 3), torch.float32).equal(torch.zeros(2, 3))



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_written_tokens_land_exactly_at_their_slots(dtype: torch.dtype):
    g = torch.Generator().manual_seed(1)
    pool = make_pool(dtype)
    slots = torch.randperm(pool.num_slots, generator=g)[:13]  # scattered, unordered, across blocks
    key = torch.randn(13, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    value = torch.randn(13, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    pool.write(2, slots, key, value)
    k, v = pool.layer(2)
    for i, slot in enumerate(slots.tolist()):
        assert torch.equal(k[0, :, slot], key[i]) and torch.equal(v[0, :, slot], value[i])
    untouched = torch.ones(pool.num_slots, dtype=torch.bool)
    untouched[slots] = False
    assert (k[0, :, untouched] == 0).all() and (v[0, :, untouched] == 0).all()
    assert (pool.storage[:2] == 0).all(), "other layers unchanged"


def test_rewriting_a_slot_overwrites_it():
    pool = make_pool()
    k, v = pool.layer(0)
    slots = torch.tensor([5, 6])
    write_kv(k, v, slots, torch.ones(2, KV_HEADS, HEAD_DIM), torch.ones(2, KV_HEADS, HEAD_DIM))
    write_kv(k, v, slots[:1], torch.full((1, KV_HEADS, HEAD_DIM), 3.0), torch.full((1, KV_HEADS, HEAD_DIM), 4.0))
    assert (k[0, :, 5] == 3).all() and (v[0, :, 5] == 4).all()
    assert (k[0, :, 6] == 1).all() and (v[0, :, 6] == 1).all()


def test_a_planned_batch_is_written_where_its_sequences_read_it():
    """Tokens written at ``build_paged_batch(...).slots`` are read back, through each sequence's
    block table, at their logical positions -- with shuffled and shared pages."""
    spec = BatchSpec("mixed", seq_lens=(9, 13, 4, 1), query_lens=(1, 6, 4, 1), shared_prefix=((0, 1, 1),))
    g = torch.Generator().manual_seed(2)
    pool = make_pool()
    tables = make_block_tables(spec, page_size=BLOCK_SIZE, num_pages=BLOCKS, width=4, generator=g)
    seq_lens, query_lens = spec.tensors()
    batch = build_paged_batch(tables, seq_lens, query_lens, page_size=BLOCK_SIZE, num_pages=BLOCKS, recipe=causal())
    positions, slots = expected_positions_and_slots(spec, tables, BLOCK_SIZE)
    assert torch.equal(batch.slots.long(), slots)
    key = torch.randn(spec.num_tokens, KV_HEADS, HEAD_DIM, generator=g)
    value = torch.randn(spec.num_tokens, KV_HEADS, HEAD_DIM, generator=g)
    pool.write(0, batch.slots, key, value)
    k_pool, v_pool = pool.layer(0)
    token = 0
    for row, (seq_len, q_len) in enumerate(zip(spec.seq_lens, spec.query_lens)):
        k_seq = gather_sequence_kv(k_pool, tables[row], seq_len, BLOCK_SIZE)
        v_seq = gather_sequence_kv(v_pool, tables[row], seq_len, BLOCK_SIZE)
        for pos in range(seq_len - q_len, seq_len):
            assert torch.equal(k_seq[:, pos], key[token]) and torch.equal(v_seq[:, pos], value[token])
            token += 1
    assert token == spec.num_tokens


# ---- block copies and swapping ------------------------------------------------------------------


def test_copy_blocks_copies_whole_blocks_in_every_layer():
    pool = make_pool(random=True, seed=3)
    before = pool.storage.clone()
    pool.copy_blocks([(2, 5), (7, 1)])
    for layer in range(LAYERS):
        for kv in (0, 1):
            assert torch.equal(block(pool, layer, kv, 5), before[layer, kv, 0, :, 8:12])
            assert torch.equal(block(pool, layer, kv, 1), before[layer, kv, 0, :, 28:32])
    changed = torch.zeros(BLOCKS, dtype=torch.bool)
    changed[[5, 1]] = True
    per_block = pool.storage.view(LAYERS, 2, 1, KV_HEADS, BLOCKS, BLOCK_SIZE, HEAD_DIM)
    old = before.view_as(per_block)
    assert torch.equal(per_block[:, :, :, :, ~changed], old[:, :, :, :, ~changed]), "other blocks unchanged"


def test_copy_blocks_with_no_pairs_is_a_no_op():
    pool = make_pool(random=True, seed=4)
    before = pool.storage.clone()
    pool.copy_blocks([])
    assert torch.equal(pool.storage, before)


def test_read_blocks_shape_and_content():
    pool = make_pool(random=True, seed=5)
    data = pool.read_blocks([3, 8])
    assert data.shape == (LAYERS * 2 * KV_HEADS, 2 * BLOCK_SIZE, HEAD_DIM)
    rows = pool.storage.view(LAYERS * 2 * KV_HEADS, BLOCKS * BLOCK_SIZE, HEAD_DIM)
    assert torch.equal(data[:, :BLOCK_SIZE], rows[:, 12:16])
    assert torch.equal(data[:, BLOCK_SIZE:], rows[:, 32:36])
    data.fill_(0)  # a copy, not a view (the pool may reuse the blocks after swapping out)
    assert not torch.equal(rows[:, 12:16], torch.zeros_like(rows[:, 12:16]))


def test_swap_out_and_in_round_trips_to_other_blocks():
    """read_blocks (swap out), then write_blocks into different blocks (swap in) restores the data."""
    pool = make_pool(random=True, seed=6)
    before = pool.storage.clone()
    data = pool.read_blocks([3, 8, 4])
    pool.storage.zero_()
    pool.write_blocks([9, 1, 6], data)
    assert torch.equal(pool.read_blocks([9, 1, 6]), data)
    for layer in range(LAYERS):
        for kv in (0, 1):
            for src, dst in ((3, 9), (8, 1), (4, 6)):
                assert torch.equal(block(pool, layer, kv, dst), before[layer, kv, 0, :, src * 4:(src + 1) * 4])
    assert torch.count_nonzero(pool.read_blocks([0, 2, 3, 4, 5, 7, 8])) == 0, "only the target blocks written"


# ---- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("num_layers", 0, r"num_layers: got 0, expected a positive int"),
        ("num_blocks", -3, r"num_blocks: got -3, expected a positive int"),
        ("num_blocks", 1, r"num_blocks: got 1, expected at least 2 \(block 0 is the null block\)"),
        ("block_size", 0, r"block_size: got 0, expected a positive int"),
        ("num_kv_heads", 2.0, r"num_kv_heads: got 2.0, expected a positive int"),
        ("head_dim", "64", r"head_dim: got '64', expected a positive int"),
    ],
)
def test_pool_with_bad_sizes_is_rejected(name: str, value, message: str):
    sizes = dict(num_layers=1, num_blocks=4, block_size=4, num_kv_heads=2, head_dim=8)
    sizes[name] = value
    with pytest.raises(ValueError, match=message):
        KVPool(**sizes)


def test_write_kv_with_wrong_key_shape_is_rejected():
    k, v = make_pool().layer(0)
    slots = torch.tensor([1, 2, 3])
    good = torch.zeros(3, KV_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match=r"key: got \(3, 2, 16\), expected shape \(3, 2, 8\) \(tokens, kv heads, head dim\)"):
        write_kv(k, v, slots, torch.zeros(3, KV_HEADS, 16), good)
    with pytest.raises(ValueError, match=r"key: got \(2, 2, 8\), expected shape \(3, 2, 8\)"):
        write_kv(k, v, slots, good[:2], good)
    with pytest.raises(ValueError, match=r"value: got \(3, 1, 8\), expected shape \(3, 2, 8\)"):
        write_kv(k, v, slots, good, torch.zeros(3, 1, HEAD_DIM))


def test_write_kv_with_wrong_key_dtype_is_rejected():
    k, v = make_pool().layer(0)
    good = torch.zeros(3, KV_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match=r"key.dtype: got torch.bfloat16, expected the pool dtype torch.float32"):
        write_kv(k, v, torch.tensor([1, 2, 3]), good.bfloat16(), good)


def test_write_kv_with_wrong_value_dtype_is_rejected():
    """Like the key: a ValueError naming ``value.dtype`` and both dtypes.

    BUG (flexpage/attention/kv_pool.py, ``write_kv``): only ``key.dtype`` is checked; a
    bfloat16 ``value`` reaches ``index_copy_`` and fails with a RuntimeError that names no argument.
    """
    k, v = make_pool().layer(0)
    good = torch.zeros(3, KV_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match=r"value.dtype: got torch.bfloat16, expected the pool dtype torch.float32"):
        write_kv(k, v, torch.tensor([1, 2, 3]), good, good.bfloat16())
