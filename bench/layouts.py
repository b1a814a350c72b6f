"""Paged vs virtual KV layout (vAttention), same machine, same model, side by side.

    python -m bench.layouts [--rounds 2] [--quick]

Each layout runs in a process of its own (peak RSS is per process), rounds alternate
paged / virtual, and every number is the median over rounds of a median over repeats:

* **decode step** at batch 1/4/16 x context 512/2k/8k: the sequences' KV is written into
  their blocks (the virtual layout's rows are touched first, outside the timing), then
  the compiled decode step is timed (``ModelRunner.execute``, 2 warm-up + 8 timed steps);
* **prefill**: 4 x 512 new tokens, and one 512-token chunk behind 4,096 cached tokens
  (the paged layout copies the cached keys out for each layer; the virtual one reads its
  row in place);
* **TTFT** of a 1,024-token prompt on a warm engine, first touch included (a virtual row
  released by the previous request is faulted in again);
* the **ShareGPT-like** throughput workload of bench/throughput.py (48 prompts), output tok/s;
* **shared prefix**: 16 requests = one 512-token system prompt + 32 own tokens, 32 output
  tokens each: peak KV bytes in use (paged: blocks held, the prefix once; virtual: resident
  pages, the prefix in every row) and tok/s;
* peak RSS of the process (the paged pool is claimed whole at start).

SmolLM2-135M-Instruct in the engine's default dtype for this CPU. Writes --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.throughput import sharegpt_like
from flexpage import LLM, SamplingParams
from flexpage.core.sequence import Sequence
from flexpage.model.runner import StepInputs

LAYOUTS = ("paged", "virtual")
BATCHES = (1, 4, 16)
CONTEXTS = (512, 2048, 8192)
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "layouts.json"


def make_llm(layout: str, quick: bool) -> LLM:
    longest = max(CONTEXTS[:2] if quick else CONTEXTS)
    # enough for 16 sequences of the longest context; the virtual layout's cap is the same
    memory = "2GiB" if quick else "7GiB"
    extra = {"kv_resident_bytes": memory} if layout == "virtual" else {"kv_cache_memory": memory}
    return LLM(None, kv_layout=layout, max_model_len=longest + 64, max_num_seqs=16, **extra)


def median_ms(fn, repeats: int, warmup: int) -> float:  # noqa: ANN001
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


class HeldSequences:
    """Sequences placed in the pool by the block manager with their KV written (no forward)."""

    def __init__(self, llm: LLM, batch: int, context: int, rng: np.random.Generator) -> None:
        self.engine = llm.engine
        self.seqs = [Sequence(10**6 + i, rng.integers(100, 40000, context + 1).tolist(), max_tokens=1)
                     for i in range(batch)]
        bm, pool = self.engine.block_manager, self.engine.runner.pool
        for seq in self.seqs:
            bm.allocate(seq)
            table = bm.block_table(seq)
            start, end = table[0] * pool.block_size, (table[-1] + 1) * pool.block_size
            if table == list(range(table[0], table[-1] + 1)):  # one run: one slice
                pool.storage[..., start:end, :].fill_(0.01)
            else:
                pool.storage[..., torch.tensor(table)[:, None] * pool.block_size + torch.arange(pool.block_size), :] = 0.01

    def decode_inputs(self) -> StepInputs:
        bm = self.engine.block_manager
        n = len(self.seqs)
        return StepInputs([7] * n, [bm.block_table(s) for s in self.seqs], [s.num_tokens for s in self.seqs],
                          [1] * n, list(range(n)))

    def prefill_inputs(self, new: int) -> StepInputs:
        bm = self.engine.block_manager
        tokens = [t for s in self.seqs for t in s.token_ids[-new:]]
        return StepInputs(tokens, [bm.block_table(s) for s in self.seqs], [s.num_tokens for s in self.seqs],
                          [new] * len(self.seqs), [(i + 1) * new - 1 for i in range(len(self.seqs))])

    def free(self) -> None:
        for seq in self.seqs:
            self.engine.block_manager.free(seq)
        self.engine.step()  # releases the virtual layout's rows


def kv_bytes_in_use(llm: LLM) -> int:
    engine = llm.engine
    if engine.runner.pool.arena is not None:
        return engine.runner.pool.resident_bytes()
    return engine.block_manager.stats().used * engine.runner.pool.bytes_per_token * engine.config.block_size


def run_workload(llm: LLM, prompts: list[list[int]], outputs: list[int]) -> tuple[float, int]:
    """Output tok/s of one batch of requests, and the peak KV bytes in use between steps."""
    engine = llm.engine
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=o, ignore_eos=True), request_id=f"w{i}")
    peak, start = 0, time.perf_counter()
    while engine.requests:
        engine.step()
        peak = max(peak, kv_bytes_in_use(llm))
    return sum(outputs) / (time.perf_counter() - start), peak


def run_worker(layout: str, quick: bool) -> dict:
    rng = np.random.default_rng(0)
    llm = make_llm(layout, quick)
    llm.engine.warm_up()
    runner = llm.engine.runner
    result: dict = {"layout": layout, "dtype": str(llm.engine.dtype).replace("torch.", "")}
    contexts = CONTEXTS[:2] if quick else CONTEXTS
    for context in contexts:
        for batch in BATCHES:
            held = HeldSequences(llm, batch, context, rng)
            ms = median_ms(lambda: runner.execute(held.decode_inputs()), repeats=8, warmup=2)
            result[f"decode_ms_b{batch}_c{context}"] = ms
            held.free()
    held = HeldSequences(llm, 4, 511, rng)
    result["prefill_4x512_ms"] = median_ms(lambda: runner.execute(held.prefill_inputs(512)), repeats=5, warmup=2)
    held.free()
    held = HeldSequences(llm, 1, 4096 + 511, rng)
    result["prefill_512_after_4096_ms"] = median_ms(lambda: runner.execute(held.prefill_inputs(512)), 5, 2)
    held.free()
    prompt = rng.integers(100, 40000, 1024).tolist()
    greedy_one = SamplingParams(temperature=0, max_tokens=1)
    result["ttft_1024_ms"] = median_ms(lambda: llm.generate({"prompt_token_ids": prompt}, greedy_one),
                                       repeats=5, warmup=1)
    workload = sharegpt_like(48, seed=1)
    result["throughput_tok_s"], result["throughput_peak_kv_mb"] = (
        x / s for x, s in zip(run_workload(llm, [p for p, _ in workload], [o for _, o in workload]), (1, 2**20)))
    system = rng.integers(100, 40000, 512).tolist()
    shared = [system + rng.integers(100, 40000, 32).tolist() for _ in range(16)]
    tok_s, peak = run_workload(llm, shared, [32] * 16)
    result["shared_prefix_tok_s"], result["shared_prefix_peak_kv_mb"] = tok_s, peak / 2**20
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


def run_round(layout: str, quick: bool) -> dict:
    command = [sys.executable, "-m", "bench.layouts", "--worker", layout] + (["--quick"] if quick else [])
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{layout} worker failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarise(rounds: list[dict]) -> dict:
    metrics = [m for m in rounds[0] if m not in ("layout", "dtype")]
    median = {layout: {m: statistics.median(r[m] for r in rounds if r["layout"] == layout) for m in metrics}
              for layout in LAYOUTS}
    per_round = {layout: {m: [round(r[m], 2) for r in rounds if r["layout"] == layout] for m in metrics}
                 for layout in LAYOUTS}
    return {"dtype": rounds[0]["dtype"], "median": median, "per_round": per_round,
            "virtual_over_paged": {m: median["virtual"][m] / median["paged"][m] for m in metrics}}


def print_table(result: dict) -> None:
    paged, virtual, ratio = result["median"]["paged"], result["median"]["virtual"], result["virtual_over_paged"]
    print(f"{'metric':34s} {'paged':>10s} {'virtual':>10s} {'virtual/paged':>14s}")
    for m in paged:
        print(f"{m:34s} {paged[m]:10.1f} {virtual[m]:10.1f} {ratio[m]:14.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="contexts 512/2k only, smaller pools (a smoke run)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--worker", choices=LAYOUTS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(run_worker(args.worker, args.quick)))
        return
    rounds = []
    for r in range(args.rounds):
        for layout in LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]:
            rounds.append(run_round(layout, args.quick))
            print(f"round {r + 1}: {layout} done", file=sys.stderr)
    result = summarise(rounds)
    print_table(result)
    if not args.quick:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
