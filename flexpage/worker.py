"""``python -m flexpage.worker``: one rank of a tensor-parallel server.

Spawned by ``flexpage serve --tensor-parallel-size N`` on this host, or started on every host
by torchrun::

    torchrun --nnodes 2 --nproc-per-node 1 --node-rank R --rdzv-backend c10d \\
        --rdzv-endpoint HOST0:29500 -m flexpage.worker serve --model /models/x --host 0.0.0.0

Rank 0 runs ``flexpage`` with the arguments given (``serve ...``, with
``--tensor-parallel-size`` set to the world size); every other rank runs rank 0's steps on its
shard of the model (:func:`flexpage.parallel.launch.run_worker`). See docs/scaling.md.
"""

from __future__ import annotations

import logging
import os
import sys


def main(argv: list[str]) -> int:
    rank = int(os.environ.get("RANK", "-1"))
    if rank < 0 or "WORLD_SIZE" not in os.environ:
        print("flexpage.worker: RANK and WORLD_SIZE are not set; start it with torchrun, or let "
              "`flexpage serve --tensor-parallel-size N` spawn it", file=sys.stderr)
        return 2
    if rank == 0:
        from flexpage.cli import app

        world = os.environ["WORLD_SIZE"]
        return app(args=[*argv, "--tensor-parallel-size", world], standalone_mode=False) or 0
    from flexpage.parallel.launch import run_worker

    try:
        return run_worker()
    except Exception:
        logging.getLogger("flexpage.worker").exception("tensor parallel rank %d failed", rank)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
