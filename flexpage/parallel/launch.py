"""Starting a tensor-parallel group, and the loop of every rank but 0.

Two ways to get ranks, as with vLLM:

* **spawned here**: rank 0 (the engine's process) starts ``size - 1`` processes of
  ``python -m flexpage.worker`` on this host and meets them on a free local port;
* **torchrun**: ``torchrun --nnodes ... -m flexpage.worker serve ...`` starts every rank on
  every host; its rendezvous sets ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``, rank 0
  runs the server and the others :func:`run_worker`.

Rank 0 then sends one :class:`WorkerSpec` (pickled once, at start-up), and every rank loads the
model, keeps its shard and builds its runner. Three process groups, by how long a wait may last:
the default group meets the ranks and carries the start-up messages (:data:`STARTUP_TIMEOUT`:
processes start, import torch and load the model); the forward's collectives run on a group
whose timeout (``tensor_parallel_timeout``) bounds how long a rank waits for a hung peer; rank
0's commands go out on a group with no practical timeout, because between requests the other
ranks wait for the next one as long as the server idles; rank 0's side of each command waits at
most ``tensor_parallel_timeout`` for them to take it (``Group.send_timeout``).
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from flexpage.model.tensor_parallel import RankFailure, TensorParallel, sum_check
from flexpage.parallel.wire import HEADER, Command, payload_size, unpack_block_ops, unpack_scores, unpack_step

__all__ = ["Group", "WorkerSpec", "check_workers", "free_port", "run_worker", "serve_commands", "start_group",
           "stop_workers"]

log = logging.getLogger(__name__)

#: how long the ranks may take to start and load their shards
STARTUP_TIMEOUT = timedelta(minutes=10)
#: how long the other ranks wait for rank 0's next command (an idle server sends none)
_COMMAND_TIMEOUT = timedelta(days=365)
#: set in spawned workers: the pid whose exit ends them (no orphans if rank 0 is killed)
_PARENT_ENV = "FLEXPAGE_TP_PARENT"


@dataclass
class WorkerSpec:
    """What every rank builds its runner from (sent once by rank 0)."""

    model_path: str
    dtype: torch.dtype
    recipe: Any  # EngineConfig.recipe: a name, file or None (functions do not travel)
    runner_kwargs: dict[str, Any] = field(default_factory=dict)
    prime_rows: tuple[int, int] = (0, 0)  # CompactDecoder.prime's max rows and sampled rows
    timeout_s: float = 120.0  # EngineConfig.tensor_parallel_timeout
    kv_eviction: Any = "none"  # EngineConfig.kv_eviction: a name or 'module:attr' (functions do not travel)


@dataclass
class Group:
    """Rank 0's view of a started group."""

    parallel: TensorParallel
    commands: dist.ProcessGroup  # rank 0's commands to the others (see the module docstring)
    #: how long rank 0 waits for every rank to take a command (gloo's send waits for the
    #: receiver: a hung rank would hold it forever); the forward's collectives' timeout
    send_timeout: timedelta
    workers: list[subprocess.Popen] = field(default_factory=list)  # spawned here; empty under torchrun
    threads_before: int = 0  # rank 0's torch threads before the host's cores were split (restored at stop)


def start_group(size: int, spec: WorkerSpec) -> Group:
    """Make this process rank 0 of ``size`` ranks: spawn the others here, or join the ranks
    ``torchrun`` started (``WORLD_SIZE`` in the environment), and send them ``spec``. Raises
    ValueError on a world that does not match ``size`` or a process group that already exists."""
    if not dist.is_available() or not dist.is_gloo_available():
        raise ValueError("tensor_parallel_size: this torch build has no torch.distributed gloo backend")
    if dist.is_initialized():
        raise ValueError("tensor_parallel_size: this process already belongs to a torch.distributed group "
                         "(one tensor-parallel engine per process)")
    try:
        pickle.dumps(spec)
    except Exception as error:  # a recipe given as a closure: it cannot travel to the other ranks
        raise ValueError(f"tensor parallelism: the other ranks cannot receive this configuration ({error}); give "
                         "the recipe by name ('module:attr' or 'file.py[:attr]')") from error
    workers: list[subprocess.Popen] = []
    threads_before = torch.get_num_threads()
    if "WORLD_SIZE" in os.environ:  # started by torchrun
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ.get("RANK", "0"))
        if world != size:
            raise ValueError(f"tensor_parallel_size: got {size}, but torchrun started WORLD_SIZE={world} ranks")
        if rank != 0:
            raise ValueError(f"the engine runs on rank 0; this is RANK={rank} (start ranks with -m flexpage.worker)")
        dist.init_process_group("gloo", init_method="env://", rank=0, world_size=size, timeout=STARTUP_TIMEOUT)
    else:
        # the host's cores split between its ranks (rank 0 included), as torch would give one process
        threads = max(1, torch.get_num_threads() // size)
        torch.set_num_threads(threads)
        port = free_port()
        workers = [_spawn(rank, size, port, threads) for rank in range(1, size)]
        try:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=size,
                                    timeout=STARTUP_TIMEOUT)
        except BaseException:
            _stop(workers, kill=True)
            torch.set_num_threads(threads_before)
            raise
    try:
        dist.broadcast_object_list([spec], src=0)  # the one pickled message
    except BaseException:
        _stop(workers, kill=True)
        dist.destroy_process_group()
        torch.set_num_threads(threads_before)
        raise
    forward, commands = _step_groups(spec.timeout_s)
    return Group(TensorParallel(0, size, forward), commands, timedelta(seconds=spec.timeout_s), workers,
                 threads_before)


def _step_groups(timeout_s: float) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """The forward's group and the commands' group (every rank makes them, in this order)."""
    return (dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)),
            dist.new_group(backend="gloo", timeout=_COMMAND_TIMEOUT))


def run_worker() -> int:
    """The life of a rank other than 0: join the group, build this rank's runner, run rank 0's
    commands until it says stop. Returns the exit code."""
    from flexpage.model.kv_eviction import resolve_eviction_policy
    from flexpage.model.loader import load_hf_model
    from flexpage.model.layer_recipes import engine_recipes
    from flexpage.model.runner import ModelRunner

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if rank == 0:
        raise ValueError("run_worker: rank 0 runs the engine, not the worker loop")
    # Ctrl-C reaches every rank (a terminal's process group, torchrun forwarding it): rank 0
    # drains its requests and then sends STOP; the others must keep serving its steps till then
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if os.environ.get(_PARENT_ENV):
        _exit_with_parent(int(os.environ[_PARENT_ENV]))
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=size, timeout=STARTUP_TIMEOUT)
    received: list[Any] = [None]
    dist.broadcast_object_list(received, src=0)
    spec: WorkerSpec = received[0]
    forward, commands = _step_groups(spec.timeout_s)
    model = load_hf_model(spec.model_path, spec.dtype)
    parallel = TensorParallel(rank, size, forward)
    runner = ModelRunner(model, recipes=engine_recipes(spec.recipe, model.config), parallel=parallel,
                         **spec.runner_kwargs)
    if runner.compact is not None and spec.prime_rows[0]:
        runner.compact.prime(*spec.prime_rows)
    sum_check(parallel)
    serve_commands(runner, commands, resolve_eviction_policy(spec.kv_eviction))
    dist.destroy_process_group()
    return 0


def serve_commands(runner: Any, commands: dist.ProcessGroup, eviction_policy: Any = None) -> None:
    """Run rank 0's commands on this rank's ``runner`` until :attr:`Command.STOP`
    (``eviction_policy``: what :attr:`Command.SCORE` scores with)."""
    from flexpage.model.kv_eviction import block_scores_over_ranks

    header = torch.empty(HEADER, dtype=torch.int64)
    while True:
        try:
            dist.broadcast(header, 0, group=commands)
        except RuntimeError as error:  # rank 0 is gone without a STOP (killed, or its launcher ended it)
            log.warning("tensor parallel: rank 0 has gone (%s); this rank stops", str(error).splitlines()[0])
            return
        payload = torch.empty(payload_size(header), dtype=torch.int64)
        if payload.numel():
            dist.broadcast(payload, 0, group=commands)
        command = Command(int(header[0]))
        if command == Command.STOP:
            return
        if command == Command.STEP:
            with torch.inference_mode():
                runner.execute(unpack_step(header, payload))
        elif command == Command.BLOCK_OPS:
            runner.apply_block_ops(unpack_block_ops(payload))
        elif command == Command.SCORE:
            block_scores_over_ranks(runner.pool, eviction_policy, unpack_scores(payload), runner.parallel)


def stop_workers(group: Group, timeout_s: float = 10.0, kill: bool = False) -> None:
    """Wait for spawned workers to leave (after STOP; ``kill``: at once), killing any still there
    after ``timeout_s``; rank 0 gets its torch threads back."""
    _stop(group.workers, timeout_s, kill)
    if group.threads_before:
        torch.set_num_threads(group.threads_before)


def check_workers(group: Group) -> None:
    """Raise :class:`RankFailure` naming a spawned rank that has exited."""
    for rank, worker in enumerate(group.workers, start=1):
        code = worker.poll()
        if code is not None:
            raise RankFailure(f"tensor parallel rank {rank} (pid {worker.pid}) exited with code {code}")


def _spawn(rank: int, size: int, port: int, threads: int) -> subprocess.Popen:
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads), **{_PARENT_ENV: str(os.getpid())})
    return subprocess.Popen([sys.executable, "-m", "flexpage.worker"], env=env)


def _stop(workers: list[subprocess.Popen], timeout_s: float = 10.0, kill: bool = False) -> None:
    deadline = time.monotonic() + timeout_s
    for worker in workers:
        if kill:
            worker.kill()
        try:
            worker.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_with_parent(parent: int) -> None:
    """End this process when ``parent`` (rank 0, which spawned it) is gone, whatever this
    rank is blocked in: killed rank 0s leave no orphans."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="flexpage-parent-watch", daemon=True).start()
