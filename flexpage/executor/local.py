"""The executor of one process: KV operations, the forward pass, block scores, sampling.

:meth:`LocalExecutor.execute` runs a :class:`~flexpage.executor.plan.StepPlan` in its order:
the KV operations (block ops on the runner's pool, tier ops on the tier storage), the
forward pass, the eviction policy's block scores (they read the pool after the forward pass
wrote this step's K/V), and sampling. A failure of the forward pass or the scores is one
:class:`~flexpage.executor.plan.ForwardFailed` (the engine retries the rows alone to find
whose it is); a failure of sampling is found row by row and reported per row.
"""

from __future__ import annotations

from itertools import accumulate, groupby

import torch
from torch import Tensor

from flexpage.core.kv_ops import BlockOp, KVOp, TierOp
from flexpage.core.scheduler_output import ScoreRequest, StepInputs
from flexpage.executor.plan import ForwardFailed, SampleRow, StepPlan, StepResult
from flexpage.attention.eviction import EvictionPolicy
from flexpage.model.kv_eviction import block_scores
from flexpage.model.kv_tier_storage import TierStorage
from flexpage.model.runner import ModelRunner
from flexpage.model.sampler import TokenLogprobs, sample, token_logprobs
from flexpage.model.tensor_parallel import RankFailure
from flexpage.speculative.verify import verify_branches, verify_chains
from flexpage.structured.bitmask import apply_bitmask

__all__ = ["LocalExecutor"]


class LocalExecutor:
    """Runs step plans on one process's :class:`ModelRunner`."""

    def __init__(self, runner: ModelRunner, *, eviction_policy: EvictionPolicy, eos_token_id: int | None,
                 seed: int = 0, tier_storage: TierStorage | None = None) -> None:
        """``eos_token_id``: masked for rows below their ``min_tokens``; ``seed``: the generator
        of samples without a seed of their own; ``tier_storage``: the bytes of the tiers
        behind the prefix cache (None: no tiers)."""
        #: the model runner of this process (rank 0's under tensor parallelism)
        self.runner = runner
        self.tier_storage = tier_storage
        self.eviction_policy = eviction_policy
        self.eos_token_id = eos_token_id
        self._generator = torch.Generator().manual_seed(seed)

    @torch.inference_mode()  # no autograd state on any tensor made in a step: 1-4% faster steps than no_grad
    def execute(self, plan: StepPlan) -> StepResult:
        """Run ``plan`` (see :mod:`flexpage.executor.plan`)."""
        self._run_kv_ops(plan.kv_ops)
        result = StepResult()
        if plan.inputs is None:
            return result
        try:  # always run: a step of prefill chunks that samples nothing still computes their K/V
            logits = self._forward(plan.inputs)
            result.block_scores = self._score(plan.scores) if plan.scores else []
            result.prompt_logprobs = [
                token_logprobs(logits[rows.logits_rows.start:rows.logits_rows.stop], torch.tensor(rows.targets),
                               [rows.top] * len(rows.targets)) for rows in plan.prompt_logprobs]
        except RankFailure:  # not one request's fault, and no retry can help
            raise
        except Exception as error:
            raise ForwardFailed from error
        if plan.samples:
            self._sample(logits, plan, result)
        return result

    def _run_kv_ops(self, ops: list[KVOp]) -> None:
        for is_tier, run in groupby(ops, key=lambda op: isinstance(op, TierOp)):
            if is_tier:
                self._run_tier_ops(list(run))  # type: ignore[arg-type]
            else:
                self._run_block_ops(list(run))  # type: ignore[arg-type]

    def _run_tier_ops(self, ops: list[TierOp]) -> None:
        if self.tier_storage is None:
            raise ValueError(f"step plan: {len(ops)} tier operations, but this executor has no tier storage")
        self.tier_storage.apply(ops)

    def _run_block_ops(self, ops: list[BlockOp]) -> None:
        self.runner.apply_block_ops(ops)

    def _forward(self, inputs: StepInputs) -> Tensor:
        return self.runner.execute(inputs)

    def _score(self, requests: list[ScoreRequest]) -> list[list[float]]:
        return [block_scores(self.runner.pool, self.eviction_policy, r.pages, r.first_positions) for r in requests]

    def _sample(self, logits: Tensor, plan: StepPlan, result: StepResult) -> None:
        """Sample every row at once; if that raises, row by row, so that only the rows whose
        own parameters break sampling fail. Rows under a grammar sample only the tokens their
        bitmask allows; rows with proposed tokens verify them."""
        rows = plan.samples
        counts = [row.num_rows for row in rows]
        firsts = list(accumulate(counts, initial=0))
        wanted = [row.logits_row + j for row, n in zip(rows, counts) for j in range(n)]
        if wanted != list(range(logits.shape[0])):
            logits = logits[wanted]  # n > 1 samples share their prompt's row
        if plan.token_bitmask is not None:
            _constrain(logits, [firsts[i] for i in plan.constrained], plan.token_bitmask)
        try:
            picks = self._draw(logits, rows)
        except Exception:
            picks = []
            for i, row in enumerate(rows):
                try:
                    picks += self._draw(logits[firsts[i] : firsts[i + 1]], [row])
                except Exception as error:
                    result.errors[i] = error
                    picks.append(([], []))
        for tokens, logprobs in picks:
            result.token_ids.append(tokens)
            result.logprobs.append(logprobs)

    def _draw(self, logits: Tensor, rows: list[SampleRow]) -> list[tuple[list[int], list[TokenLogprobs | None]]]:
        """Per row, its tokens and their logprobs: one each from the sampler, or, for a row
        with proposals (``logits`` holds its rows one after another), the accepted proposals
        and one more. Rows without proposals draw from the sampler alone, as in a step where
        nothing verifies: a seeded request's tokens do not depend on its neighbours' proposals.
        A row with several branches verifies them as one tree."""
        firsts = list(accumulate((row.num_rows for row in rows), initial=0))
        plain = [i for i, row in enumerate(rows) if not row.drafts]
        drafted = [i for i, row in enumerate(rows) if row.drafts and not row.branches]
        trees = [i for i, row in enumerate(rows) if row.branches]
        picks: list = [None] * len(rows)
        if plain:
            sub = [rows[i] for i in plain]
            own = logits[[firsts[i] for i in plain]] if len(plain) < len(rows) else logits
            out = sample(own, [r.params for r in sub], [r.history for r in sub], [r.generator for r in sub],
                         self.eos_token_id, generator=self._generator)
            for i, token, lp in zip(plain, out.token_ids.tolist(), out.logprobs or [None] * len(sub)):
                picks[i] = ([token], [lp])
        if drafted:
            sub = [rows[i] for i in drafted]
            verified = verify_chains(logits[[j for i in drafted for j in range(firsts[i], firsts[i + 1])]],
                                     [r.drafts for r in sub], [r.params for r in sub], [r.history for r in sub],
                                     [r.generator for r in sub], self.eos_token_id, generator=self._generator)
            for i, pick in zip(drafted, verified):
                picks[i] = pick
        for i in trees:
            row = rows[i]
            picks[i] = verify_branches(logits[firsts[i] : firsts[i + 1]], [row.drafts, *row.branches], row.params,
                                       row.history, row.generator, self.eos_token_id, shared=self._generator)
        return picks

    def check_health(self) -> None:
        """Raise if a part of the executor outside this process has failed (nothing here)."""

    def close(self) -> None:
        """Release what outlives the process otherwise (the disk tier's files and lock)."""
        if self.tier_storage is not None:
            self.tier_storage.close()


def _constrain(logits: Tensor, rows: list[int], bitmask: Tensor) -> None:
    """Mask, in place, the tokens row ``rows[i]`` of ``logits`` may not take (``bitmask[i]``)."""
    if rows == list(range(logits.shape[0])):
        apply_bitmask(logits, bitmask)
    else:
        index = torch.tensor(rows)
        constrained = logits.index_select(0, index)
        apply_bitmask(constrained, bitmask)
        logits.index_copy_(0, index, constrained)
