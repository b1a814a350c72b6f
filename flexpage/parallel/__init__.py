"""Tensor parallelism on ``torch.distributed`` (Megatron-style, as vLLM does it): the ranks.

* :mod:`~flexpage.parallel.wire`: rank 0's commands (a step's inputs, its block operations)
  as int64 tensors;
* :mod:`~flexpage.parallel.launch`: starting the ranks (spawned here or by ``torchrun``),
  checking them, and the worker loop of ranks other than 0;
* rank 0 itself is an executor (:mod:`flexpage.executor.tensor_parallel`), which sends each
  command to the others before running its own share.

What a rank computes lives with the model: :mod:`flexpage.model.sharding` (which slice of
every weight a rank keeps) and :mod:`flexpage.model.tensor_parallel` (a rank's group and the
collectives of a sharded forward). The scheduler and block manager run once, on rank 0; every
rank holds its heads' share of the KV pool with the same block tables. See docs/scaling.md.
"""
