"""Tensor parallelism on ``torch.distributed`` (Megatron-style, as vLLM does it).

* :mod:`~flexpage.parallel.group`: a rank's place in the group and the collectives a
  sharded forward needs (traceable by ``torch.compile``);
* :mod:`~flexpage.parallel.sharding`: which slice of every weight a rank keeps;
* :mod:`~flexpage.parallel.wire`: one step's inputs as one int64 tensor;
* :mod:`~flexpage.parallel.launch`: starting the ranks (spawned here or by ``torchrun``),
  checking them, and the worker loop of ranks other than 0;
* :mod:`~flexpage.parallel.leader`: rank 0's runner, which sends each step to the others
  before running its own share.

The scheduler and block manager run once, on rank 0; every rank holds its heads' share of the
KV pool with the same block tables. See docs/scaling.md.
"""
