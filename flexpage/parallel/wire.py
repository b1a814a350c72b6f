"""Rank 0's commands to the other ranks, as int64 tensors.

Every step, rank 0 broadcasts what the other ranks need to run the same forward: the step's
token ids, sequence and query lengths, sampled rows and block tables (all layer groups), or
the plan's block operations (swaps, copies, released rows) that keep their pools in step
with its own, in the plan's order. Nothing is
pickled per step: a command is a fixed header (:data:`HEADER` int64s: the command and its
field lengths, the payload's length) and a payload of concatenated int64 fields, sent as two
broadcasts (the other ranks size the payload from the header).
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np
import torch
from torch import Tensor

from flexpage.core.kv_ops import BlockOp, BlockOpKind
from flexpage.core.scheduler_output import ScoreRequest, StepInputs

__all__ = ["Command", "HEADER", "pack_block_ops", "pack_scores", "pack_step", "pack_stop", "payload_size",
           "unpack_block_ops", "unpack_scores", "unpack_step"]

HEADER = 8  # int64s: command, up to 6 field lengths, the payload's length


class Command(IntEnum):
    STEP = 1  # StepInputs
    BLOCK_OPS = 2  # a plan's block operations, in order
    SCORE = 3  # blocks to score with the eviction policy (each rank its heads, then averaged)
    STOP = 4  # leave the worker loop


def _header(command: Command, payload: Tensor, *lengths: int) -> Tensor:
    header = torch.zeros(HEADER, dtype=torch.int64)
    header[0] = int(command)
    header[1:1 + len(lengths)] = torch.tensor(lengths, dtype=torch.int64)
    header[-1] = payload.numel()
    return header


def payload_size(header: Tensor) -> int:
    """The payload's int64 count (the receiving ranks allocate it before its broadcast)."""
    return int(header[-1])


def pack_step(inputs: StepInputs) -> tuple[Tensor, Tensor]:
    """``(header, payload)`` of one step."""
    per_group = inputs.group_block_tables or [inputs.block_tables]
    table_lengths = [len(table) for tables in per_group for table in tables]
    fields = [inputs.token_ids, inputs.seq_lens, inputs.query_lens, inputs.sample_rows, table_lengths,
              [table_id for tables in per_group for table in tables for table_id in table]]
    payload = torch.from_numpy(np.concatenate([np.asarray(f, dtype=np.int64) for f in fields]))
    header = _header(Command.STEP, payload, len(inputs.token_ids), len(inputs.seq_lens), len(inputs.sample_rows),
                     len(per_group), int(inputs.evicted_pages), int(bool(inputs.group_block_tables)))
    return header, payload


def unpack_step(header: Tensor, payload: Tensor) -> StepInputs:
    """The :class:`StepInputs` :func:`pack_step` packed."""
    tokens, seqs, sampled, groups, evicted, grouped = (int(v) for v in header[1:7])
    values = payload.tolist()
    fields, start = [], 0
    for length in (tokens, seqs, seqs, sampled, groups * seqs):
        fields.append(values[start:start + length])
        start += length
    token_ids, seq_lens, query_lens, sample_rows, table_lengths = fields
    tables: list[list[int]] = []
    for length in table_lengths:
        tables.append(values[start:start + length])
        start += length
    per_group = [tables[g * seqs:(g + 1) * seqs] for g in range(groups)]
    return StepInputs(token_ids, per_group[0], seq_lens, query_lens, sample_rows,
                      group_block_tables=per_group if grouped else [], evicted_pages=bool(evicted))


def pack_scores(requests: list[ScoreRequest]) -> tuple[Tensor, Tensor]:
    """``(header, payload)`` of a plan's score requests: per request its block and group
    counts, then its pages (group after group) and first positions."""
    values: list[int] = []
    for r in requests:
        values += [len(r.first_positions), len(r.pages)]
        values += [page for group in r.pages for page in group] + list(r.first_positions)
    payload = torch.tensor(values, dtype=torch.int64)
    return _header(Command.SCORE, payload, len(requests)), payload


def unpack_scores(payload: Tensor) -> list[ScoreRequest]:
    """The score requests :func:`pack_scores` packed (``seq_id`` and ``blocks`` are rank 0's
    business: -1 and empty)."""
    values, requests, i = payload.tolist(), [], 0
    while i < len(values):
        blocks, groups = values[i], values[i + 1]
        i += 2
        pages = [values[i + g * blocks:i + (g + 1) * blocks] for g in range(groups)]
        i += groups * blocks
        requests.append(ScoreRequest(-1, [], pages, values[i:i + blocks]))
        i += blocks
    return requests


def pack_stop() -> Tensor:
    """The header of :attr:`Command.STOP` (it has no payload)."""
    return _header(Command.STOP, torch.empty(0, dtype=torch.int64))


_KINDS = list(BlockOpKind)


def pack_block_ops(ops: list[BlockOp]) -> tuple[Tensor, Tensor]:
    """``(header, payload)`` of a plan's block operations: ``(kind, src, dst)`` per op."""
    payload = torch.tensor([v for op in ops for v in (_KINDS.index(op.kind), op.src, op.dst)], dtype=torch.int64)
    return _header(Command.BLOCK_OPS, payload, len(ops)), payload


def unpack_block_ops(payload: Tensor) -> list[BlockOp]:
    """The block operations :func:`pack_block_ops` packed, in their order."""
    values = payload.tolist()
    return [BlockOp(_KINDS[values[i]], values[i + 1], values[i + 2]) for i in range(0, len(values), 3)]
