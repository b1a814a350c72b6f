"""What deterministic mode costs: flexpage with and without ``deterministic=True``, same workload, one run.

    python -m bench.deterministic [--rounds 2]

The workload and metrics are bench/anchors.py's (48 prompts of log-normal length, 64 greedy
tokens each, all at once; batch-1 TTFT, prefill and decode; each engine in a fresh process,
rounds alternating which goes first). Prints the medians and deterministic / default per
metric (higher is slower for every metric but ``tok_s``) and writes
bench/results/deterministic.json.

    python -m bench.deterministic --kernels

times one layer's attention call instead, default and deterministic plans and kernels
interleaved in one process (SmolLM2's heads, bf16 pool, 8-token pages in aligned runs): a
decode step of 48 sequences with the workload's prompt lengths + 32 generated tokens, a
4x256 prefill, and 128 tokens after 512 cached. Writes bench/results/deterministic-kernels.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.anchors import METRICS, run_round, summarise, workload

ENGINES = ("flexpage", "flexpage-deterministic")


def kernel_cases() -> dict[str, tuple]:
    """(query, K pool, V pool, plan(deterministic)) per case: SmolLM2's 9/3 heads of 64 dims."""
    import numpy as np
    import torch

    from flexpage.attention.paging import build_paged_batch
    from flexpage.attention.recipe import CAUSAL

    page, run, heads, kv_heads, dim = 8, 16, 9, 3, 64  # the engine's bf16 layout: 128-token key blocks
    gen = torch.Generator().manual_seed(0)

    def case(seq_lens: np.ndarray, query_lens: np.ndarray) -> tuple:
        pages = -(-seq_lens // page)
        runs = -(-pages // run)
        tables = np.zeros((len(seq_lens), int(runs.max()) * run), dtype=np.int32)
        starts = (np.cumsum(runs) - runs + 1) * run  # run 0 holds the null page
        for i, (start, n) in enumerate(zip(starts, pages)):
            tables[i, :n] = np.arange(start, start + n)
        num_pages = int(runs.sum() + 1) * run
        k = torch.randn(1, kv_heads, num_pages * page, dim, generator=gen).bfloat16()
        v = torch.randn(1, kv_heads, num_pages * page, dim, generator=gen).bfloat16()
        q = torch.randn(int(query_lens.sum()), heads, dim, generator=gen).bfloat16()

        def plan(deterministic: bool):  # noqa: ANN202
            return build_paged_batch(torch.from_numpy(tables), torch.from_numpy(seq_lens),
                                     torch.from_numpy(query_lens), page_size=page, num_pages=num_pages,
                                     recipe=CAUSAL, pages_per_block=run, deterministic=deterministic)
        return q, k, v, plan

    decode_lens = np.array([len(p) for p in workload(0)]) + 32
    return {"decode 48 rows": case(decode_lens, np.ones(len(decode_lens), dtype=np.int64)),
            "prefill 4x256": case(np.full(4, 256), np.full(4, 256)),
            "prefill 128 after 512": case(np.array([640]), np.array([128]))}


def time_kernels(reps: int, out: Path) -> None:
    from bench.prefill import time_interleaved
    from flexpage.attention.flex import FlexRunner, raised_compile_limits
    from flexpage.attention.recipe import CAUSAL

    runners = {mode: FlexRunner(CAUSAL, deterministic=mode == "deterministic") for mode in ("default", "deterministic")}
    result = {}
    with raised_compile_limits():
        for name, (q, k, v, plan) in kernel_cases().items():
            fns = {}
            for mode, runner in runners.items():
                batch = plan(mode == "deterministic")
                fns[mode] = lambda runner=runner, batch=batch: runner(q, k, v, batch)
                fns[mode]()  # compile
            times = time_interleaved(fns, reps, warmup=3)
            ratio = times["deterministic"]["median_ms"] / times["default"]["median_ms"]
            result[name] = {**times, "deterministic_over_default": ratio}
            print(f"{name:>22}: default {times['default']['median_ms']:.2f} ms, deterministic "
                  f"{times['deterministic']['median_ms']:.2f} ms = {ratio:.2f}x", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--kernels", action="store_true", help="time one layer's attention call per plan instead")
    p.add_argument("--reps", type=int, default=31, help="--kernels: timed calls per mode and case")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON results (default bench/results/deterministic.json; "
                        "with --kernels, deterministic-kernels.json)")
    args = p.parse_args()
    if args.kernels:
        time_kernels(args.reps, args.out or Path("bench/results/deterministic-kernels.json"))
        return
    args.out = args.out or Path("bench/results/deterministic.json")
    rounds = []
    for r in range(args.rounds):
        for engine in ENGINES if r % 2 == 0 else reversed(ENGINES):
            rounds.append(run_round(engine, seed=r, python=sys.executable, model=Path()))
            print(f"round {r} {engine}: " + ", ".join(f"{m} {rounds[-1][m]:.1f}" for m in METRICS), flush=True)
    result = {"rounds": args.rounds, **summarise(rounds)}
    default, deterministic = (result["median"][e] for e in ENGINES)
    result["deterministic_over_default"] = {m: deterministic[m] / default[m] for m in METRICS}
    for engine in ENGINES:
        print(f"{engine:>22}: " + ", ".join(f"{m} {v:.1f}" for m, v in result["median"][engine].items()))
    print("deterministic / default: " + ", ".join(f"{m} {v:.2f}"
                                                  for m, v in result["deterministic_over_default"].items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
