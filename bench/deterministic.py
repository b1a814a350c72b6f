"""What deterministic mode costs: flexpage with and without ``deterministic=True``, same workload, one run.

    python -m bench.deterministic [--rounds 2]

The workload and metrics are bench/anchors.py's (48 prompts of log-normal length, 64 greedy
tokens each, all at once; batch-1 TTFT, prefill and decode; each engine in a fresh process,
rounds alternating which goes first). Prints the medians and deterministic / default per
metric (higher is slower for every metric but ``tok_s``) and writes
bench/results/deterministic.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.anchors import DEFAULT_OV_MODEL, METRICS, run_round, summarise

ENGINES = ("flexpage", "flexpage-deterministic")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("bench/results/deterministic.json"))
    args = p.parse_args()
    rounds = []
    for r in range(args.rounds):
        for engine in ENGINES if r % 2 == 0 else reversed(ENGINES):
            rounds.append(run_round(engine, seed=r, python=sys.executable, ov_model=DEFAULT_OV_MODEL))
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
