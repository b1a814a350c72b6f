"""A float64 dense reference for paged attention, written independently of flexpage.

Nothing here imports flexpage's recipes, masks or paging code: every attention variant is
restated as a hand-written formula over *logical* positions (``q_pos``/``kv_pos`` are token
positions inside one sequence), and the reference reads the pool only through each
sequence's block table, one sequence at a time, with an explicit softmax in float64.

The module also holds the batch vocabulary the tests share: :class:`BatchSpec` (named
``seq_lens``/``query_lens`` pairs in the style of vLLM's
``tests/v1/attention/test_attention_backends.py``) and :func:`make_block_tables`, which
hands out *shuffled* physical pages and can make two sequences share prefix pages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

# --------------------------------------------------------------------------------------
# batch specs and block tables
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchSpec:
    """One engine step: ``seq_lens[i]`` tokens in the pool after the step, ``query_lens[i]`` of them new.

    ``shared_prefix`` lists ``(a, b, pages)``: sequence ``b``'s first ``pages`` logical pages
    are the *same physical pages* as sequence ``a``'s (prefix caching). Shared pages must be
    full and cached in both sequences (no new token is written into them).
    """

    name: str
    seq_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    shared_prefix: tuple[tuple[int, int, int], ...] = field(default=())

    def __post_init__(self) -> None:
        assert len(self.seq_lens) == len(self.query_lens), self.name
        assert all(1 <= q <= s for q, s in zip(self.query_lens, self.seq_lens)), self.name

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def context_lens(self) -> list[int]:
        return [s - q for s, q in zip(self.seq_lens, self.query_lens)]

    def tensors(self) -> tuple[Tensor, Tensor]:
        return torch.tensor(self.seq_lens), torch.tensor(self.query_lens)

    def __str__(self) -> str:  # pytest ids
        return self.name


def pages_needed(seq_len: int, page_size: int) -> int:
    return -(-seq_len // page_size)


def make_block_tables(
    spec: BatchSpec, *, page_size: int, num_pages: int, width: int, generator: torch.Generator,
    run_length: int = 1,
) -> Tensor:
    """``[S, width]`` int32 block tables: each sequence gets distinct pages from a random
    permutation of ``1..num_pages-1`` (page 0 is the null page and pads every row), except
    the prefix pages ``spec.shared_prefix`` says two sequences share.

    ``run_length > 1`` hands out pages the way a run-aware allocator does: logical page
    ``j`` goes to offset ``j % run_length`` of an aligned run of ``run_length`` pages
    picked at random, so some kernel blocks are wholly owned by one row and others (a
    shared prefix ending inside a run, a run left partly empty) are not."""
    pick = _run_pages(num_pages, run_length, generator) if run_length > 1 else _shuffled_pages(num_pages, generator)
    tables = torch.zeros(spec.num_seqs, width, dtype=torch.int32)
    contexts = spec.context_lens()
    shared = {b: (a, n) for a, b, n in spec.shared_prefix}
    for row, seq_len in enumerate(spec.seq_lens):
        need = pages_needed(seq_len, page_size)
        assert need <= width, f"{spec.name}: row {row} needs {need} pages, table width {width}"
        first = 0
        if row in shared:
            a, n = shared[row]
            assert a < row, "share with an earlier row"
            assert n * page_size <= min(contexts[a], contexts[row]), (
                f"{spec.name}: shared pages must be full and already cached in both rows"
            )
            tables[row, :n] = tables[a, :n]
            first = n
        for logical in range(first, need):
            tables[row, logical] = pick(logical, logical == first)
    return tables


def _shuffled_pages(num_pages: int, generator: torch.Generator):
    """Distinct pages from a random permutation of ``1..num_pages-1``."""
    order = (torch.randperm(num_pages - 1, generator=generator) + 1).tolist()
    return lambda logical, row_start: order.pop()


def _run_pages(num_pages: int, run_length: int, generator: torch.Generator):
    """Logical page ``j`` at offset ``j % run_length`` of a random aligned run, a fresh run
    at each row start and run boundary."""
    assert num_pages % run_length == 0, "the pool must hold whole runs"
    runs = (torch.randperm(num_pages // run_length - 1, generator=generator) + 1).tolist()  # run 0 holds page 0
    current = [0]

    def pick(logical: int, row_start: bool) -> int:
        if row_start or logical % run_length == 0:
            current[0] = runs.pop()
        return current[0] * run_length + logical % run_length

    return pick


def expected_positions_and_slots(spec: BatchSpec, block_tables: Tensor, page_size: int) -> tuple[Tensor, Tensor]:
    """The logical position and pool slot of every new token, in flat (sequence-major) order."""
    positions, slots = [], []
    for row, (seq_len, q_len) in enumerate(zip(spec.seq_lens, spec.query_lens)):
        for pos in range(seq_len - q_len, seq_len):
            positions.append(pos)
            slots.append(int(block_tables[row, pos // page_size]) * page_size + pos % page_size)
    return torch.tensor(positions), torch.tensor(slots)


def gather_sequence_kv(pool: Tensor, block_table_row: Tensor, seq_len: int, page_size: int) -> Tensor:
    """K or V of one sequence in logical order, ``[H_kv, seq_len, D]``, read page by page."""
    pieces = []
    for logical in range(pages_needed(seq_len, page_size)):
        page = int(block_table_row[logical])
        take = min(page_size, seq_len - logical * page_size)
        pieces.append(pool[0, :, page * page_size : page * page_size + take])
    return torch.cat(pieces, dim=1)


# --------------------------------------------------------------------------------------
# attention variants as dense formulas (independent of recipes/)
# --------------------------------------------------------------------------------------


class DenseVariant:
    """Dense form of an attention variant.

    ``mask(seq, q_pos, kv_pos)`` -> bool broadcastable to ``[H, Lq, Lk]`` (``q_pos`` is
    ``[Lq, 1]``, ``kv_pos`` is ``[1, Lk]``, both int64 logical positions);
    ``scores(s, seq, q_pos, kv_pos)`` transforms float64 logits ``s`` ``[H, Lq, Lk]``.
    """

    def mask(self, seq: int, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        return kv_pos <= q_pos

    def scores(self, s: Tensor, seq: int, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        return s


class Causal(DenseVariant):
    pass


class Bidirectional(DenseVariant):
    def mask(self, seq: int, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        return torch.ones(q_pos.shape[0], kv_pos.shape[1], dtype=torch.bool)


@dataclass
class SlidingWindow(DenseVariant):
    """The query and the ``window - 1`` tokens before it."""

    window: int

    def mask(self, seq: int, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        return (kv_pos <= q_pos) & (kv_pos > q_pos - self.window)


@dataclass
class ChunkedLocal(DenseVariant):
    """Causal within consecutive chunks of ``chunk`` positions (Llama 4's local layers)."""

    chunk: int

    def mask(self, seq: int, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        return (kv_pos <= q_pos) & (kv_pos // self.chunk == q_pos // self.chunk)


@dataclass
class AttentionSinks(DenseVariant):
    """Causal; the first ``sinks`` positions and the last ``window`` (StreamingLLM)."""

    sinks: int
    window: int

    def mask(self, seq: int, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        return (kv_pos <= q_pos) & ((kv_pos < self.sinks) | (kv_pos > q_pos - self.window))


@dataclass
class Softcap(DenseVariant):
    cap: float

    def scores(self, s: Tensor, seq: int, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        return self.cap * torch.tanh(s / self.cap)


def alibi_slopes_reference(num_heads: int) -> list[float]:
    """Press et al.'s ``get_slopes`` (the paper's reference code), restated."""

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(num_heads).is_integer():
        return power_of_two(num_heads)
    closest = 2 ** math.floor(math.log2(num_heads))
    return power_of_two(closest) + alibi_slopes_reference(2 * closest)[0::2][: num_heads - closest]


@dataclass
class Alibi(DenseVariant):
    num_heads: int

    def scores(self, s: Tensor, seq: int, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        slopes = torch.tensor(alibi_slopes_reference(self.num_heads), dtype=torch.float64)
        return s - slopes[:, None, None] * (q_pos - kv_pos).to(torch.float64)


@dataclass
class PrefixLM(DenseVariant):
    """Tokens before ``prefix_lengths[seq]`` are visible to every query; the rest is causal."""

    prefix_lengths: list[int]

    def mask(self, seq: int, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        return (kv_pos <= q_pos) | (kv_pos < self.prefix_lengths[seq])


@dataclass
class Documents(DenseVariant):
    """``document_ids[seq][pos]``: causal attention inside each packed document only."""

    document_ids: list[list[int]]

    def mask(self, seq: int, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        doc = torch.tensor(self.document_ids[seq])
        return (kv_pos <= q_pos) & (doc[q_pos] == doc[kv_pos])


class Both(DenseVariant):
    """Every mask AND-ed, score transforms applied in order."""

    def __init__(self, *parts: DenseVariant) -> None:
        self.parts = parts

    def mask(self, seq: int, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        out = self.parts[0].mask(seq, q_pos, kv_pos)
        for part in self.parts[1:]:
            out = out & part.mask(seq, q_pos, kv_pos)
        return out

    def scores(self, s: Tensor, seq: int, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        for part in self.parts:
            s = part.scores(s, seq, q_pos, kv_pos)
        return s


def dense_mask(variant: DenseVariant, seq: int, q_positions: Tensor, kv_positions: Tensor) -> Tensor:
    """``[Lq, Lk]`` (or ``[H, Lq, Lk]``) bool mask of a variant for given position vectors."""
    return variant.mask(seq, q_positions.long()[:, None], kv_positions.long()[None, :])


# --------------------------------------------------------------------------------------
# the reference itself
# --------------------------------------------------------------------------------------


def reference_paged_attention(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor | list[int],
    query_lens: Tensor | list[int],
    *,
    page_size: int,
    variant: DenseVariant | None = None,
    scale: float | None = None,
) -> Tensor:
    """Attention of the new tokens ``q`` ``[T, H, D]`` over each sequence's logical K/V, float64.

    For sequence ``i`` the new tokens are the last ``query_lens[i]`` of its ``seq_lens[i]``
    positions; its K/V is read from the pools ``[1, H_kv, slots, D]`` through
    ``block_tables[i]``. GQA/MQA: query head ``h`` reads kv head ``h // (H // H_kv)``.
    """
    variant = variant or Causal()
    seq_lens = [int(x) for x in seq_lens]
    query_lens = [int(x) for x in query_lens]
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    assert num_heads % num_kv_heads == 0
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float64)
    start = 0
    for seq, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens)):
        k = gather_sequence_kv(k_pool, block_tables[seq], seq_len, page_size).double()
        v = gather_sequence_kv(v_pool, block_tables[seq], seq_len, page_size).double()
        k = k.repeat_interleave(group, dim=0)  # [H, S, D]
        v = v.repeat_interleave(group, dim=0)
        qs = q[start : start + q_len].double().transpose(0, 1)  # [H, Lq, D]
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        kv_pos = torch.arange(seq_len)[None, :]
        s = (qs @ k.transpose(1, 2)) * scale
        s = variant.scores(s, seq, q_pos, kv_pos)
        visible = variant.mask(seq, q_pos, kv_pos).expand(num_heads, q_len, seq_len)
        assert visible.any(-1).all(), "every reference query must see at least one key"
        s = s.masked_fill(~visible, float("-inf"))
        out[start : start + q_len] = (torch.softmax(s, dim=-1) @ v).transpose(0, 1)
        start += q_len
    return out


def dense_causal_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None) -> Tensor:
    """Plain causal attention of one contiguous sequence, ``[H, L, D]`` in, float64 ``[H, L, D]`` out.

    Used to cross-check :func:`reference_paged_attention` against PyTorch's SDPA.
    """
    group = q.shape[0] // k.shape[0]
    return torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(group, 0), v.double().repeat_interleave(group, 0),
        is_causal=True, scale=scale,
    )


def rel_err(out: Tensor, ref: Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64."""
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


# --------------------------------------------------------------------------------------
# test harness: one engine step on flexpage's pool and planner (the oracle above does not
# use any of this; it reads the pool only through the block tables)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Geometry:
    """Attention shapes and the accuracy a dtype must reach: ``||out - ref|| / ||ref|| < tol``."""

    name: str
    dtype: torch.dtype
    q_heads: int
    kv_heads: int
    head_dim: int
    tol: float

    def __str__(self) -> str:
        return self.name


class PagedCase:
    """Inputs of one step: a pool with random garbage in *every* slot (null page included),
    shuffled/shared block tables, the step's plan, the new tokens' K/V stored with
    ``write_kv`` at the planned slots, and random queries (times ``q_scale``)."""

    def __init__(
        self, spec: BatchSpec, geometry: Geometry, recipe, *, page_size: int, num_pages: int, width: int,
        seed: int = 0, q_scale: float = 1.0, pages_per_block: int = 1,
    ) -> None:
        from flexpage.attention.kv_pool import KVPool, write_kv
        from flexpage.attention.paging import build_paged_batch

        g = torch.Generator().manual_seed(seed)
        self.spec, self.geometry, self.recipe, self.page_size = spec, geometry, recipe, page_size
        self.pool = KVPool(
            num_layers=1, num_blocks=num_pages, block_size=page_size, num_kv_heads=geometry.kv_heads,
            head_dim=geometry.head_dim, dtype=geometry.dtype,
        )
        self.k_pool, self.v_pool = self.pool.layer(0)
        self.pool.storage.copy_(torch.randn(self.pool.storage.shape, generator=g))
        self.block_tables = make_block_tables(spec, page_size=page_size, num_pages=num_pages, width=width, generator=g,
                                              run_length=pages_per_block)
        seq_lens, query_lens = spec.tensors()
        self.batch = build_paged_batch(
            self.block_tables, seq_lens, query_lens, page_size=page_size, num_pages=num_pages, recipe=recipe,
            pages_per_block=pages_per_block,
        )
        shape = (spec.num_tokens, geometry.kv_heads, geometry.head_dim)
        new_k = torch.randn(shape, generator=g).to(geometry.dtype)
        new_v = torch.randn(shape, generator=g).to(geometry.dtype)
        write_kv(self.k_pool, self.v_pool, self.batch.slots, new_k, new_v)
        q = torch.randn(spec.num_tokens, geometry.q_heads, geometry.head_dim, generator=g) * q_scale
        self.q = q.to(geometry.dtype)

    def run(self, *, compile: bool = True, scale: float | None = None) -> Tensor:
        from flexpage.attention.flex import FlexRunner

        return FlexRunner(self.recipe, compile=compile, scale=scale)(self.q, self.k_pool, self.v_pool, self.batch)

    def reference(self, variant: DenseVariant | None = None, scale: float | None = None) -> Tensor:
        return reference_paged_attention(
            self.q, self.k_pool, self.v_pool, self.block_tables, self.spec.seq_lens, self.spec.query_lens,
            page_size=self.page_size, variant=variant, scale=scale,
        )
