"""Multi-turn chat over a pool too small for the history: what keeping KV across turns buys.

    python -m bench.multiturn [--think 1 4 16] [--users 64] [--repeats 2] [--quick]

Workload (fixed seed, the same for every mode): synthetic ShareGPT-like conversations --
turns per conversation geometric with mean 5.5 (at most 10), short user messages (log-normal,
median 40 tokens) and long replies (median 96 tokens; ShareGPT's are longer, scaled down for a
2-core CPU), random token ids, ``ignore_eos``. Users arrive as a Poisson process; each runs a
closed loop: send turn k (the whole history plus a new message), wait for the reply, think
(exponential, mean swept by ``--think``), send turn k+1. The KV pool holds a fraction of the
live history, so a conversation's KV is evicted while its user thinks, and the host tier a
fraction of what the pool evicts, so the two tier policies choose differently. The users
arrive within seconds and are many enough that the engine, not their pacing, bounds the
run at short think times; the sweep crosses the knee where recomputing every history
saturates the engine while keeping it does not.

Compared in one run, each in a fresh engine of the same process (compiled kernels shared):

* ``stateless``: prefix caching off; every turn recomputes the whole history;
* ``pool``: the prefix cache as it is without tiers (history survives only in the pool);
* ``tiers-lru``: a host tier behind the pool, least recently used dropped first;
* ``tiers-retention``: the same tier, Pensieve's retention value (recompute cost / idle time).

Reported per mode (medians over ``--repeats`` runs, modes interleaved; spread printed):
output tokens/s over the run, TTFT p50/p90 of turns >= 2, history tokens recomputed, the
tiers' hit counts, key-block scatter (as ``bench.pool_reuse`` counts it: the key blocks the
running sequences' attention visits over the fewest their blocks allow, a count immune to
timing noise), RSS growth over the baseline before the engine was built (an untimed
engine runs first, so compile caches are not charged to the first mode). One PNG of the
pool and tiers mid-run (``flexpage top``'s picture) and one of the results go to docs/img/.
"""

from __future__ import annotations

import argparse
import gc
import heapq
import json
import resource
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MODES = ("stateless", "pool", "tiers-lru", "tiers-retention")


@dataclass(frozen=True)
class Turn:
    message: list[int]
    reply_tokens: int
    think_unit: float  # exponential(1) draw, scaled by the think-time mean


def make_workload(users: int, seed: int, mean_turns: float = 5.5, vocab: int = 49152) -> list[list[Turn]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(users):
        turns = int(min(10, rng.geometric(1 / mean_turns)))
        out.append([Turn(rng.integers(100, vocab - 100, int(np.clip(rng.lognormal(np.log(40), 0.6), 8, 160))).tolist(),
                         int(np.clip(rng.lognormal(np.log(96), 0.5), 16, 256)), float(rng.exponential()))
                    for _ in range(turns)])
    return out


def rss_bytes() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()


def engine_config(mode: str, args: argparse.Namespace) -> dict:
    config = dict(dtype=args.dtype, kv_cache_memory=args.pool, max_model_len=2048, max_num_seqs=32)
    if mode == "stateless":
        config["enable_prefix_caching"] = False
    if mode.startswith("tiers"):
        config.update(host_kv_bytes=args.host, kv_tier_policy=mode.split("-")[1])
    return config


def run_mode(mode: str, workload: list[list[Turn]], think_mean: float, args: argparse.Namespace,
             snapshot_path: Path | None = None) -> dict:
    from bench.pool_reuse import key_blocks_of_running
    from flexpage import LLM, SamplingParams

    gc.collect()
    base_rss = rss_bytes()
    llm = LLM(None, **engine_config(mode, args))
    engine = llm.engine
    engine.warm_up()
    rng = np.random.default_rng(args.seed + 1)
    arrivals = np.cumsum(rng.exponential(1 / args.arrival_rate, len(workload)))
    events = [(float(t), user, 0) for user, t in enumerate(arrivals)]  # (due, user, turn index)
    heapq.heapify(events)
    history: list[list[int]] = [[] for _ in workload]
    live: dict[str, tuple[int, int, float]] = {}  # request id -> (user, turn, submitted)
    ttft: list[float] = []
    output_tokens = 0
    peak_rss = rss_bytes()
    snapshot = None
    visited = fewest = 0  # key blocks the running sequences' attention visits, and the fewest possible
    start = time.monotonic()
    while events or live:
        now = time.monotonic() - start
        while events and events[0][0] <= now:
            _, user, k = heapq.heappop(events)
            turn = workload[user][k]
            prompt = history[user] + turn.message
            request_id = engine.add_request({"prompt_token_ids": prompt},
                                            SamplingParams(temperature=0, max_tokens=turn.reply_tokens,
                                                           ignore_eos=True), conversation_id=f"user-{user}")
            live[request_id] = (user, k, time.monotonic())
            history[user] = prompt
        if not engine.has_unfinished_requests():
            if events:
                time.sleep(max(0.0, min(0.05, events[0][0] - (time.monotonic() - start))))
            continue
        step_visited, step_fewest = key_blocks_of_running(engine)
        visited, fewest = visited + step_visited, fewest + step_fewest
        for out in engine.step():
            if not out.finished:
                continue
            user, k, submitted = live.pop(out.request_id)
            if k > 0:
                ttft.append(out.metrics.first_token_time - out.metrics.arrival_time)
            reply = out.outputs[0].token_ids
            output_tokens += len(reply)
            history[user] = history[user] + list(reply)
            if k + 1 < len(workload[user]) and len(history[user]) + 180 + 256 < 2048:
                due = time.monotonic() - start + workload[user][k].think_unit * think_mean
                heapq.heappush(events, (due, user, k + 1))
        peak_rss = max(peak_rss, rss_bytes())
        if snapshot is None and snapshot_path is not None and time.monotonic() - start > args.snapshot_at:
            snapshot = engine.kv_view()
    makespan = time.monotonic() - start
    stats = engine.stats()
    engine.close()
    result = {
        "mode": mode, "think_mean_s": think_mean, "makespan_s": makespan, "output_tokens": output_tokens,
        "output_tok_s": output_tokens / makespan, "turns_after_first": len(ttft),
        "ttft_p50_s": float(np.percentile(ttft, 50)) if ttft else None,
        "ttft_p90_s": float(np.percentile(ttft, 90)) if ttft else None,
        "history_tokens": stats["conversation_history_tokens"],
        "history_recomputed_tokens": stats["conversation_recomputed_tokens"],
        "history_reused_tokens": stats["conversation_reused_tokens"],
        "prefix_cache_hit_rate": stats["prefix_cache_hit_rate"],
        "restored_host_tokens": stats["kv_restored_host_tokens"],
        "hole_recomputed_tokens": stats["kv_hole_recomputed_tokens"],
        "dropped_tokens": stats["kv_dropped_tokens"], "spilled_tokens": stats["kv_spilled_tokens"],
        "released_tokens": stats["kv_released_tokens"],
        "preemptions": stats["preemptions"], "rss_growth_mb": (peak_rss - base_rss) / 2**20,
        "recompute_cost_slope": engine.recompute_cost_slope,
        "key_block_scatter": visited / max(fewest, 1),
    }
    if snapshot is not None:
        plot_snapshot(snapshot, snapshot_path, f"{mode}, think {think_mean:g} s, t = {args.snapshot_at:g} s")
    del llm, engine
    return result


def summarise(runs: list[dict]) -> dict:
    """Medians over repeated runs of one (mode, think time), with each metric's spread."""
    out = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, (int, float)) and key != "think_mean_s":
            values = [r[key] for r in runs if r[key] is not None]
            out[key] = statistics.median(values)
            out[key + "_range"] = [min(values), max(values)]
    out["repeats"] = len(runs)
    return out


def plot_snapshot(view: dict, path: Path, title: str) -> None:
    """The pool as ``flexpage top`` draws it: one cell per block coloured by state, tier bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    states = ".cus"
    codes = np.array([states.index(s) for s in view["blocks"]])
    width = int(np.ceil(np.sqrt(len(codes) * 3)))
    grid = np.full(int(np.ceil(len(codes) / width)) * width, np.nan)
    grid[: len(codes)] = codes
    fig, (ax, bars) = plt.subplots(2, 1, figsize=(9, 5.2), height_ratios=[4, 1.2])
    ax.imshow(grid.reshape(-1, width), cmap=ListedColormap(["#e0e0e0", "#4c72b0", "#55a868", "#dd8452"]),
              vmin=-0.5, vmax=3.5, interpolation="nearest", aspect="equal")
    ax.set_xticks([])
    ax.set_yticks([])
    pool = view["pool"]
    ax.set_title(f"KV pool, {len(codes)} blocks of {view['block_size']} tokens ({title}): "
                 f"free {pool['free']}, cached {pool['cached']}, used {pool['used']}, shared {pool['shared']}",
                 fontsize=9)
    host = view["tiers"]["host"]
    rows = [("pool held", len(codes) - pool["free"], len(codes)), ("host tier", host["blocks_used"], host["blocks_total"])]
    for i, (label, used, total) in enumerate(rows):
        bars.barh(i, total, color="#e0e0e0")
        bars.barh(i, used, color="#4c72b0")
        bars.text(total, i, f"  {used} / {total} blocks", va="center", fontsize=8)
    bars.set_yticks(range(len(rows)), [r[0] for r in rows])
    bars.set_xticks([])
    bars.invert_yaxis()
    for side in ("top", "right", "bottom"):
        bars.spines[side].set_visible(False)
    fig.tight_layout()
    path.parent.mkdir(exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_results(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    thinks = sorted({r["think_mean_s"] for r in results})
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for ax, key, label in zip(axes, ("output_tok_s", "ttft_p50_s", "history_recomputed_tokens"),
                              ("output tokens / s", "TTFT p50, turns >= 2 (s)", "history tokens recomputed")):
        for i, mode in enumerate(MODES):
            ys = [next(r[key] for r in results if r["mode"] == mode and r["think_mean_s"] == t) for t in thinks]
            ax.bar(np.arange(len(thinks)) + (i - 1.5) * 0.2, ys, 0.2, label=mode)
        ax.set_xticks(range(len(thinks)), [f"think {t:g} s" for t in thinks])
        ax.set_title(label)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--think", type=float, nargs="+", default=[1.0, 4.0, 16.0], help="think-time means (s)")
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--arrival-rate", type=float, default=8.0, help="users per second (Poisson)")
    parser.add_argument("--pool", default="256MiB", help="KV pool (kv_cache_memory)")
    parser.add_argument("--host", default="192MiB", help="host tier (host_kv_bytes) of the tiers modes")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--snapshot-at", type=float, default=30.0, help="seconds into the run the PNG shows")
    parser.add_argument("--quick", action="store_true", help="4 users, one think time (a smoke run)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/multiturn.json"))
    parser.add_argument("--img", type=Path, default=Path("docs/img"))
    args = parser.parse_args()
    if args.quick:
        args.users, args.think, args.repeats = 4, [1.0], 1
    workload = make_workload(args.users, args.seed)
    print(f"{args.users} users, {sum(map(len, workload))} turns, pool {args.pool}, host tier {args.host}")
    from flexpage import LLM

    LLM(None, **engine_config("pool", args)).engine.warm_up()  # untimed: compile caches, allocator pools
    runs = []
    for think in args.think:
        for repeat in range(args.repeats):
            for mode in args.modes:
                snapshot = (args.img / "multiturn-kv.png" if mode == "tiers-retention" and repeat == 0
                            and think == args.think[0] else None)
                result = run_mode(mode, workload, think, args, snapshot)
                runs.append(result)
                print(f"think {think:5.1f} s  {mode:16s} {result['output_tok_s']:6.1f} tok/s  TTFT p50 "
                      f"{result['ttft_p50_s']:.2f} s p90 {result['ttft_p90_s']:.2f} s  recomputed "
                      f"{result['history_recomputed_tokens']:6d} / {result['history_tokens']:6d}  restored "
                      f"{result['restored_host_tokens']:6d}  holes {result['hole_recomputed_tokens']:5d}  "
                      f"scatter {result['key_block_scatter']:.2f}  RSS +{result['rss_growth_mb']:.0f} MB", flush=True)
    results = [summarise([r for r in runs if r["mode"] == mode and r["think_mean_s"] == think])
               for think in args.think for mode in args.modes]
    for think in args.think:
        by = {r["mode"]: r for r in results if r["think_mean_s"] == think}
        if {"stateless", "pool", "tiers-retention"} <= set(by):
            best = by["tiers-retention"]
            print(f"think {think:g} s: tiers-retention throughput {best['output_tok_s'] / by['stateless']['output_tok_s']:.2f}x "
                  f"stateless, {best['output_tok_s'] / by['pool']['output_tok_s']:.2f}x pool; TTFT p50 "
                  f"{by['pool']['ttft_p50_s'] / best['ttft_p50_s']:.2f}x better than pool")
        if {"tiers-lru", "tiers-retention"} <= set(by):
            lru, retention = (by[m]["history_recomputed_tokens"] for m in ("tiers-lru", "tiers-retention"))
            print(f"think {think:g} s: the retention value recomputes {retention / max(lru, 1) - 1:+.1%} history "
                  f"tokens against LRU ({retention} vs {lru})")
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results,
                                    "runs": runs}, indent=1))
    if len(args.modes) == len(MODES):
        plot_results(results, args.img / "multiturn.png")


if __name__ == "__main__":
    main()
