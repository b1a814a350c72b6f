"""Symbolic KV for the block-manager property tests: each slot holds the token prefix whose
KV it contains, so a cache hit, a copy or a tier restore that delivers the wrong bytes (or
runs in the wrong order) is caught by comparing tuples."""

from __future__ import annotations

from flexpage.core import BlockManager, Sequence
from flexpage.core.kv_ops import BlockOp, BlockOpKind, KVOp, TierOp, TierOpKind


class ShadowKV:
    """Symbolic KV: slot (block, offset) holds the token prefix whose KV it contains."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.dev: dict[int, list] = {}
        self.host: dict[int, list] = {}
        self.tier_host: dict[int, list] = {}  # KVTiers' host slots
        self.disk: dict[int, list] = {}  # KVTiers' disk files

    def apply(self, ops: list[KVOp]) -> None:
        """Run a plan's KV operations one by one in the order given, as the executor does
        (an op that relies on a later one's effect is caught by the next check)."""
        where = {BlockOpKind.SWAP_OUT: (self.dev, self.host), BlockOpKind.SWAP_IN: (self.host, self.dev),
                 BlockOpKind.COPY: (self.dev, self.dev)}
        for op in ops:
            if isinstance(op, TierOp):
                self.apply_tier_ops([op])
            elif op.kind is BlockOpKind.RELEASE:  # the OS takes the memory back: zeros
                for block in range(op.src, op.dst):
                    self.dev.pop(block, None)
            else:
                self.copy([(op.src, op.dst)], *where[op.kind])

    def apply_tier_ops(self, ops: list[TierOp]) -> None:
        """Run :class:`KVTiers` ops in order, as the runner's TierStorage does."""
        where = {TierOpKind.SPILL: (self.dev, self.tier_host), TierOpKind.RESTORE: (self.tier_host, self.dev),
                 TierOpKind.DEMOTE: (self.tier_host, self.disk), TierOpKind.WRITE: (self.dev, self.disk),
                 TierOpKind.LOAD: (self.disk, self.dev)}
        for op in ops:
            if op.kind is TierOpKind.DELETE:
                del self.disk[op.src]
            else:
                src, dst = where[op.kind]
                assert op.kind is not TierOpKind.LOAD or op.src in self.disk
                self.copy([(op.src, op.dst)], src, dst)

    def _blk(self, store: dict[int, list], b: int) -> list:
        return store.setdefault(b, [None] * self.bs)

    def copy(self, pairs: list[tuple[int, int]], src: dict, dst: dict) -> None:
        data = [list(self._blk(src, s)) for s, _ in pairs]  # gather, then scatter
        for (_, d), blk in zip(pairs, data):
            dst[d] = blk

    def write(self, tables: list[list[int]], seq: Sequence, start: int, n: int, pruned: object = None) -> None:
        """``pruned``: the KV is computed over a context the sequence's KV budget pruned (tagged
        with it, so that no other sequence may take it for the plain prefix's KV)."""
        for table in tables:  # every layer group computes the new positions
            for p in range(start, start + n):
                assert table[p // self.bs] != 0, (seq, p)
                prefix = tuple(seq.token_ids[: p + 1])
                self._blk(self.dev, table[p // self.bs])[p % self.bs] = prefix if pruned is None else (pruned, prefix)

    def check(self, tables: list[list[int]], seq: Sequence, pruned: object = None) -> None:
        for table in tables:
            for p in range(seq.num_computed_tokens):
                if table[p // self.bs] == 0:  # released by a sliding group or evicted: nobody reads it again
                    continue
                got = self._blk(self.dev, table[p // self.bs])[p % self.bs]
                prefix = tuple(seq.token_ids[: p + 1])
                assert got == prefix or (pruned is not None and got == (pruned, prefix)), (seq, p, got)

    def check_restored(self, bm: BlockManager, seq: Sequence) -> None:
        """Blocks restored behind a hole (not reached by computing yet) hold their prefix's KV."""
        start = seq.num_computed_tokens + bm.computable_tokens(seq)
        for p in range(start, start + bm.reused_tokens(seq) - seq.num_computed_tokens):
            got = self._blk(self.dev, bm.block_table(seq)[p // self.bs])[p % self.bs]
            assert got == tuple(seq.token_ids[: p + 1]), (seq, p, got)
