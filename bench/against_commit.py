"""This checkout's engine against an earlier commit's, on bench.anchors' workload, alternating.

    python -m bench.against_commit BASE [--rounds 3] [--gguf FILE] [--out bench/results/against_commit.json]

Is a change (a refactor, say) within noise of the code before it? Each round runs
``bench.anchors``' flexpage worker once from this checkout and once from a git worktree of
``BASE`` (made in a temporary folder, removed afterwards), each in a fresh process, the
order alternating between rounds so that neither always runs on a warmer machine. The
worker measures what bench.anchors does: output tokens per second over 48 random prompts
with 64 greedy tokens each, the workload's prefill, TTFT of a 16-token prompt, a 128-token
prefill, batch-1 decode per token, time to ready, peak RSS; on SmolLM2, or ``--gguf``'s model. Printed: the medians of each
side and this checkout's over the base's, with every round's numbers so a wobble shows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.anchors import METRICS
from flexpage.backends.cpu.description import describe

ROOT = Path(__file__).resolve().parents[1]


def run_worker(tree: Path, seed: int, model: Path | None) -> dict:
    """bench.anchors' flexpage worker from ``tree``'s code, in a fresh process."""
    command = [sys.executable, "-m", "bench.anchors", "--worker", "flexpage", "--seed", str(seed),
               "--model", str(model or "")]
    done = subprocess.run(command, capture_output=True, text=True, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)})
    if done.returncode != 0:
        raise RuntimeError(f"worker in {tree} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="the commit to compare against (anything git rev-parse takes)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gguf", type=Path, default=None, help="another model (default: SmolLM2's)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/against_commit.json"))
    args = parser.parse_args()
    base = subprocess.run(["git", "rev-parse", args.base], capture_output=True, text=True, check=True,
                          cwd=ROOT).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                          cwd=ROOT).stdout.strip()
    with tempfile.TemporaryDirectory() as folder:
        base_tree = Path(folder) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base_tree), base], check=True, cwd=ROOT,
                       capture_output=True)
        try:
            rounds: dict[str, list[dict]] = {"head": [], "base": []}
            for r in range(args.rounds):
                order = [("head", ROOT), ("base", base_tree)]
                for name, tree in order if r % 2 == 0 else order[::-1]:
                    rounds[name].append(run_worker(tree, seed=r, model=args.gguf))
                    print(name, {m: round(rounds[name][-1][m], 2) for m in METRICS}, flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT, capture_output=True)
    median = {name: {m: statistics.median(x[m] for x in runs) for m in METRICS} for name, runs in rounds.items()}
    result = {
        "base": base, "head": head, "model": str(args.gguf or "SmolLM2-135M-Instruct"), "cpu": describe().summary(), "rounds": args.rounds, "median": median,
        "head_over_base": {m: median["head"][m] / median["base"][m] for m in METRICS},
        "per_round": {name: {m: [round(x[m], 2) for x in runs] for m in METRICS} for name, runs in rounds.items()},
    }
    print(f"{'metric':<15}{'head':>10}{'base':>10}{'head/base':>11}")
    for m in METRICS:
        print(f"{m:<15}{median['head'][m]:>10.2f}{median['base'][m]:>10.2f}{result['head_over_base'][m]:>11.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
