"""Paged vs virtual KV layout (vAttention), same machine, same model, side by side.

    python -m bench.layouts [--rounds 2] [--quick]

Step timings run both layouts in one process, taking turns on every repeat (this machine's
speed wobbles by tens of percent between minutes, so a slow moment must hit both); the
workloads run each layout in a process of its own (peak RSS is per process), rounds
alternating paged / virtual, medians over rounds:

* **decode step** at batch 1/4/16 x context 512/2k/8k: the sequences' KV is written into
  their blocks (the virtual layout's rows are touched first, outside the timing), then
  the compiled decode step is timed (``ModelRunner.execute``, 2 warm-up + 10 timed steps);
* **prefill**: 4 x 512 new tokens, and one 512-token chunk behind 4,096 cached tokens
  (the paged layout copies the cached keys out for each layer; the virtual one reads its
  row in place);
* **TTFT** of a new 1,024-token prompt on a warm engine, first touch included (a virtual
  row released by the previous request is faulted in again);
* the **ShareGPT-like** throughput workload of bench/throughput.py (48 prompts), output tok/s;
* **shared prefix**: 16 requests = one 512-token system prompt + 32 own tokens, 32 output
  tokens each: peak KV bytes in use (paged: blocks held, the prefix once; virtual: resident
  pages, the prefix in every row) and tok/s;
* peak RSS of the workload process (the paged pool is claimed whole at start).

SmolLM2-135M-Instruct in the engine's default dtype for this CPU, at most 16 sequences at
once (the virtual layout reserves that many rows of 8k tokens). Writes --out (JSON)."""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
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
DEFAULT_PLOT = Path(__file__).resolve().parents[1] / "docs" / "img" / "layouts.png"


def make_llm(layout: str, quick: bool) -> LLM:
    longest = max(CONTEXTS[:2] if quick else CONTEXTS)
    # enough for 16 sequences of the longest context; the virtual layout's cap is the same
    memory = "2GiB" if quick else "7GiB"
    extra = {"kv_resident_bytes": memory} if layout == "virtual" else {"kv_cache_memory": memory}
    return LLM(None, kv_layout=layout, max_model_len=longest + 64, max_num_seqs=16, **extra)


def interleaved_ms(steps: dict[str, Callable[[], object]], repeats: int, warmup: int) -> dict[str, float]:
    """Median ms of each layout's step, the layouts taking turns on every repeat (so that a
    slow moment of the machine hits both)."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1000 for name, t in times.items()}


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
        return engine.runner.pool.arena.resident_bytes()
    return engine.block_manager.stats().used * engine.runner.pool.bytes_per_token * engine.config.block_size


def run_workload(llm: LLM, prompts: list[list[int]], outputs: list[int]) -> tuple[float, int]:
    """Output tok/s of one batch of requests (time in ``step`` only), and the peak KV bytes in
    use between steps (measured outside the timing: ``mincore`` over the arena is not free)."""
    engine = llm.engine
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=o, ignore_eos=True), request_id=f"w{i}")
    peak, elapsed = 0, 0.0
    while engine.requests:
        start = time.perf_counter()
        engine.step()
        elapsed += time.perf_counter() - start
        peak = max(peak, kv_bytes_in_use(llm))
    return sum(outputs) / elapsed, peak


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


def run_steps(quick: bool) -> dict:
    """Both layouts in this process, timed in turns: decode grid, prefill, TTFT."""
    rng = np.random.default_rng(0)
    llms = {layout: make_llm(layout, quick) for layout in LAYOUTS}
    for layout, llm in llms.items():
        log(f"{layout} warm-up {llm.engine.warm_up():.1f} s")
    result: dict = {layout: {} for layout in LAYOUTS}
    result["dtype"] = str(llms["paged"].engine.dtype).replace("torch.", "")

    def record(metric: str, ms: dict[str, float]) -> None:
        for layout, value in ms.items():
            result[layout][metric] = value
        log(f"{metric}: " + ", ".join(f"{layout} {value:.1f} ms" for layout, value in ms.items()))

    def held_steps(batch: int, context: int, new: int, repeats: int, warmup: int) -> dict[str, float]:
        held = {layout: HeldSequences(llm, batch, context, rng) for layout, llm in llms.items()}
        inputs = {layout: h.decode_inputs() if new == 1 else h.prefill_inputs(new) for layout, h in held.items()}
        ms = interleaved_ms({layout: (lambda layout=layout: llms[layout].engine.runner.execute(inputs[layout]))
                             for layout in LAYOUTS}, repeats, warmup)
        for h in held.values():
            h.free()
        return ms

    for context in CONTEXTS[:2] if quick else CONTEXTS:
        for batch in BATCHES:
            record(f"decode_ms_b{batch}_c{context}", held_steps(batch, context, 1, repeats=10, warmup=2))
    record("prefill_4x512_ms", held_steps(4, 511, 512, repeats=3, warmup=1))
    cached = 1024 if quick else 4096
    record(f"prefill_512_after_{cached}_ms", held_steps(1, cached + 511, 512, repeats=3, warmup=1))
    greedy_one = SamplingParams(temperature=0, max_tokens=1)

    def first_token(layout: str) -> Callable[[], object]:  # a new prompt each time: no prefix-cache hit
        return lambda: llms[layout].generate({"prompt_token_ids": rng.integers(100, 40000, 1024).tolist()}, greedy_one)

    record("ttft_1024_ms", interleaved_ms({layout: first_token(layout) for layout in LAYOUTS}, repeats=3, warmup=1))
    return result


def run_workloads(layout: str, quick: bool) -> dict:
    """One layout alone in this process: the throughput and shared-prefix workloads, peak RSS."""
    rng = np.random.default_rng(0)
    llm = make_llm(layout, quick)
    log(f"{layout} warm-up {llm.engine.warm_up():.1f} s")
    result: dict = {"layout": layout}
    workload = sharegpt_like(24 if quick else 48, seed=1)
    tok_s, peak = run_workload(llm, [p for p, _ in workload], [o for _, o in workload])
    result["throughput_tok_s"], result["throughput_peak_kv_mb"] = tok_s, peak / 2**20
    system = rng.integers(100, 40000, 512).tolist()
    shared = [system + rng.integers(100, 40000, 32).tolist() for _ in range(16)]
    tok_s, peak = run_workload(llm, shared, [32] * 16)
    result["shared_prefix_tok_s"], result["shared_prefix_peak_kv_mb"] = tok_s, peak / 2**20
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    log(f"{layout} workloads: {result}")
    return result


def run_part(part: str, quick: bool) -> dict:
    command = [sys.executable, "-m", "bench.layouts", "--part", part] + (["--quick"] if quick else [])
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, env=env)  # progress: stderr, as it goes
    if done.returncode != 0:
        raise RuntimeError(f"{part} worker failed ({done.returncode})")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarise(steps: dict, rounds: list[dict]) -> dict:
    median = {layout: dict(steps[layout]) for layout in LAYOUTS}
    metrics = [m for m in rounds[0] if m != "layout"]
    per_round = {layout: {m: [round(r[m], 2) for r in rounds if r["layout"] == layout] for m in metrics}
                 for layout in LAYOUTS}
    for layout in LAYOUTS:
        median[layout].update({m: statistics.median(per_round[layout][m]) for m in metrics})
    return {"dtype": steps["dtype"], "median": median, "workload_rounds": per_round,
            "virtual_over_paged": {m: median["virtual"][m] / median["paged"][m] for m in median["paged"]}}


def print_table(result: dict) -> None:
    paged, virtual, ratio = result["median"]["paged"], result["median"]["virtual"], result["virtual_over_paged"]
    print(f"{'metric':34s} {'paged':>10s} {'virtual':>10s} {'virtual/paged':>14s}")
    for m in paged:
        print(f"{m:34s} {paged[m]:10.1f} {virtual[m]:10.1f} {ratio[m]:14.3f}")


def plot(result: dict, path: Path) -> None:
    """virtual / paged per metric, drawn so that below 1 is the virtual layout ahead (time,
    memory; throughput inverted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = {m: (1 / r if m.endswith("tok_s") else r) for m, r in result["virtual_over_paged"].items()}
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.barh(list(ratios), list(ratios.values()), color=["tab:green" if r <= 1 else "tab:red" for r in ratios.values()])
    ax.axvline(1.0, color="k", linewidth=1)
    ax.set_xscale("log")
    ticks = [0.25, 0.5, 1, 2, 4, 8]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.invert_yaxis()
    ax.set_xlabel("virtual / paged (lower is better; tok/s drawn as time per token)")
    ax.set_title(f"KV layouts, SmolLM2-135M {result['dtype']}, same machine")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2, help="rounds of the workload processes (alternating layouts)")
    p.add_argument("--quick", action="store_true", help="contexts 512/2k only, smaller pools (a smoke run)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--plot", type=Path, default=DEFAULT_PLOT)
    p.add_argument("--plot-only", action="store_true", help="redraw --plot from --out without running")
    p.add_argument("--part", choices=("steps", *LAYOUTS), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.part:
        print(json.dumps(run_steps(args.quick) if args.part == "steps" else run_workloads(args.part, args.quick)))
        return
    if args.plot_only:
        plot(json.loads(args.out.read_text()), args.plot)
        return
    steps = run_part("steps", args.quick)
    rounds = [run_part(layout, args.quick) for r in range(args.rounds)
              for layout in (LAYOUTS if r % 2 == 0 else LAYOUTS[::-1])]
    result = summarise(steps, rounds)
    print_table(result)
    if not args.quick:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        plot(result, args.plot)


if __name__ == "__main__":
    main()
