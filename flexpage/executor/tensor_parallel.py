"""Rank 0's executor: a plan's block operations and forward pass go to the other ranks first,
then run on rank 0's shard; sampling and everything else runs on rank 0 alone.

The engine drives it as it drives a :class:`~flexpage.executor.local.LocalExecutor`: one
plan in, one result out. A step that fails here cannot be retried request by request as in
one process: the other ranks are in the middle of the same step, out of step with rank 0.
Any failure is a :class:`~flexpage.model.tensor_parallel.RankFailure`, which ends the engine.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from flexpage.attention.eviction import EvictionPolicy
from flexpage.attention.recipe import Recipe
from flexpage.core.kv_ops import BlockOp, TierOp
from flexpage.core.scheduler_output import ScoreRequest, StepInputs
from flexpage.executor.local import LocalExecutor
from flexpage.model.runner import ModelRunner, check_parallel_supported
from flexpage.model.sharding import check_shardable
from flexpage.model.tensor_parallel import RankFailure, sum_check
from flexpage.parallel import launch
from flexpage.model.kv_eviction import block_scores_over_ranks
from flexpage.parallel.wire import pack_block_ops, pack_scores, pack_step, pack_stop

__all__ = ["TensorParallelExecutor", "start_leader"]

T = TypeVar("T")

#: how long closing waits for the other ranks to take the stop command
_STOP_TIMEOUT_S = 10.0


def start_leader(model: torch.nn.Module, spec: launch.WorkerSpec, recipes: tuple[Recipe, ...], size: int, *,
                 eviction_policy: EvictionPolicy, eos_token_id: int | None, seed: int = 0) -> TensorParallelExecutor:
    """Start ``size`` ranks with this process as rank 0 and build every rank's runner from
    ``spec`` (rank 0's from ``model``, which it shards). The model is checked before any rank
    starts: a head count ``size`` does not divide is a ValueError naming it."""
    check_parallel_supported(model, spec.runner_kwargs.get("model_impl", "auto"),
                             spec.runner_kwargs.get("deterministic", False))
    check_shardable(model.config.get_text_config(), size)
    group = launch.start_group(size, spec)
    try:
        runner = ModelRunner(model, recipes=recipes, parallel=group.parallel, **spec.runner_kwargs)
        sum_check(group.parallel)
    except BaseException:
        launch.stop_workers(group, kill=True)
        dist.destroy_process_group()
        raise
    return TensorParallelExecutor(runner, group, eviction_policy=eviction_policy, eos_token_id=eos_token_id,
                                  seed=seed)


class TensorParallelExecutor(LocalExecutor):
    """Rank 0's executor: a :class:`LocalExecutor` over rank 0's shard plus the broadcast
    that keeps the other ranks in step."""

    def __init__(self, runner: ModelRunner, group: launch.Group, **kwargs: Any) -> None:
        super().__init__(runner, **kwargs)
        self.group = group
        self.closed = False
        self.failure: RankFailure | None = None  # the group is out of step: no more commands

    def _forward(self, inputs: StepInputs) -> Tensor:
        self._send(*pack_step(inputs))
        return self._run(self.runner.execute, inputs)

    def _run_block_ops(self, ops: list[BlockOp]) -> None:
        self._send(*pack_block_ops(ops))
        self._run(self.runner.apply_block_ops, ops)

    def _score(self, requests: list[ScoreRequest]) -> list[list[float]]:
        self._send(*pack_scores(requests))
        return self._run(block_scores_over_ranks, self.runner.pool, self.eviction_policy, requests,
                         self.runner.parallel)

    def _run_tier_ops(self, ops: list[TierOp]) -> None:
        raise RankFailure("tier operations under tensor parallelism: every rank would need its own tier storage")

    def check_health(self) -> None:
        """Raise :class:`RankFailure` if a rank spawned here has exited."""
        launch.check_workers(self.group)

    def close(self) -> None:
        """Tell the other ranks to stop, wait for the spawned ones (killing what is left after
        a failure), leave the process group."""
        if self.closed:
            return
        if self.failure is None:  # a failed group's ranks may be unable even to receive it
            try:
                work = dist.broadcast(pack_stop(), 0, group=self.group.commands, async_op=True)
                work.wait(timeout=timedelta(seconds=_STOP_TIMEOUT_S))
            except RuntimeError:
                pass  # a rank that cannot take the command is killed below (if spawned here)
        self.closed = True
        launch.stop_workers(self.group, kill=self.failure is not None)
        dist.destroy_process_group()
        super().close()

    def _send(self, header: Tensor, payload: Tensor) -> None:
        if self.closed or self.failure is not None:
            raise RankFailure(f"tensor parallel group is {'closed' if self.closed else 'out of step'}")
        try:
            for tensor in (header, payload) if payload.numel() else (header,):
                work = dist.broadcast(tensor, 0, group=self.group.commands, async_op=True)
                work.wait(timeout=self.group.send_timeout)
        except Exception as error:
            raise self._failure(error) from error

    def _run(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(*args)
        except Exception as error:
            raise self._failure(error) from error

    def _failure(self, error: Exception) -> RankFailure:
        self.failure = self._explain(error)
        return self.failure

    def _explain(self, error: Exception) -> RankFailure:
        deadline = time.monotonic() + 2.0  # a rank whose socket closed may take a moment to be reaped
        while True:
            try:
                launch.check_workers(self.group)  # a rank that exited names itself
            except RankFailure as exited:
                return RankFailure(f"{exited}; the step failed on rank 0 with {type(error).__name__}: {error}")
            if time.monotonic() > deadline or not self.group.workers:
                break
            time.sleep(0.1)
        return RankFailure(f"tensor parallel step failed on rank 0 ({type(error).__name__}: {error}); the ranks are "
                           "out of step")
