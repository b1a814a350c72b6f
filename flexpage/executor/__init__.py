"""Executors: what runs a step's plan (:mod:`flexpage.executor.plan`) on the model.

Two implementations of one interface, :class:`Executor`:

* :class:`~flexpage.executor.local.LocalExecutor` -- one process: KV operations, the
  runner's forward pass, eviction scores, sampling;
* :class:`~flexpage.executor.tensor_parallel.TensorParallelExecutor` -- rank 0 of a
  tensor-parallel group: the same, with block operations and forward passes broadcast to the
  other ranks first.

:func:`~flexpage.executor.factory.build_executor` picks one from an engine config.
"""

from __future__ import annotations

from typing import Protocol

from flexpage.executor.plan import ForwardFailed, PromptLogprobRows, SampleRow, StepPlan, StepResult
from flexpage.model.kv_tier_storage import TierStorage
from flexpage.model.runner import ModelRunner

__all__ = ["Executor", "ForwardFailed", "PromptLogprobRows", "SampleRow", "StepPlan", "StepResult"]


class Executor(Protocol):
    """Runs one step's plan and returns its result; nothing else passes during a step."""

    #: the model runner of this process (rank 0's under tensor parallelism): its pool and
    #: compiled step, for warm-up and reports
    runner: ModelRunner
    #: the bytes of the tiers behind the prefix cache (None: no tiers)
    tier_storage: TierStorage | None

    def execute(self, plan: StepPlan) -> StepResult: ...

    def check_health(self) -> None:
        """Raise :class:`~flexpage.model.tensor_parallel.RankFailure` if a part of the executor
        outside this process has exited."""

    def close(self) -> None:
        """Release what outlives the process otherwise (tier files, other ranks)."""
