"""A pool that has filled with cached prefixes: does throughput hold?

    python -m bench.pool_reuse [--rounds 6]

A server keeps finished requests' full blocks as prefix cache until it needs the room, so
after a while its pool holds no wholly free run of blocks. This runs issue 12's workload
(``bench.anchors.workload``: 48 prompts, log-normal lengths 16-1024, 64 greedy tokens each,
a fresh seed every round) round after round on two engines in one process, alternating:
prefix caching on (the default; the pool fills with cached blocks after ~3 rounds of the
default 1 GiB pool) and off (every block is freed, so the pool never fills: the reference).
Per round it prints output tok/s, the pool's free runs and cached blocks afterwards, and
**scatter**: over every decode step, the key blocks the running sequences' attention visits
(distinct runs their blocks lie in) divided by the fewest their block counts allow. The
kernel pays per key block, so scatter above 1 is attention time spent on other sequences'
pages; it is a count, immune to the machine's timing noise. Writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench.anchors import OUTPUT_TOKENS, workload
from flexpage import LLM, SamplingParams
from flexpage.engine import LLMEngine


def key_blocks_of_running(engine: LLMEngine) -> tuple[int, int]:
    """The key blocks the running sequences' attention visits (distinct runs their blocks lie
    in), and the fewest their block counts allow."""
    manager = engine.scheduler.block_manager
    run_length = manager.pool.run_length
    visited = fewest = 0
    for seq in engine.scheduler.running:
        table = manager.block_table(seq)
        visited += len({block // run_length for block in table})
        fewest += -(-len(table) // run_length)
    return visited, fewest


def run_round(llm: LLM, seed: int) -> dict:
    """One workload to completion, step by step, counting the key blocks running sequences visit."""
    engine, manager = llm.engine, llm.engine.scheduler.block_manager
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    for prompt in workload(seed):
        engine.add_request({"prompt_token_ids": prompt}, params)
    visited = fewest = generated = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        step_visited, step_fewest = key_blocks_of_running(engine)
        visited, fewest = visited + step_visited, fewest + step_fewest
        generated += sum(len(out.outputs[0].token_ids) for out in engine.step() if out.finished)
    seconds = time.perf_counter() - start
    pool = manager.pool
    return {"tok_s": generated / seconds, "scatter": visited / max(fewest, 1),
            "free_runs": pool.num_free_runs, "cached_blocks": pool.num_cached, "blocks": pool.num_blocks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", type=Path, default=Path("bench/results/pool_reuse.json"))
    args = parser.parse_args()
    engines = {"prefix cache on": LLM(), "prefix cache off": LLM(enable_prefix_caching=False)}
    for llm in engines.values():
        llm.engine.warm_up()
        run_round(llm, seed=1234)  # the workload's shapes once, as bench.anchors does
    rounds: dict[str, list[dict]] = {name: [] for name in engines}
    for seed in range(args.rounds):
        for name, llm in engines.items():
            result = run_round(llm, seed)
            rounds[name].append(result)
            print(f"round {seed} {name:>16}: {result['tok_s']:6.1f} tok/s, scatter {result['scatter']:.2f}, "
                  f"{result['free_runs']} free runs, {result['cached_blocks']}/{result['blocks']} blocks cached",
                  flush=True)
    full = list(range(args.rounds // 2, args.rounds))  # the later half: by then the cache has filled the pool
    summary = {name: {key: statistics.median(rs[i][key] for i in full) for key in ("tok_s", "scatter")}
               for name, rs in rounds.items()}
    ratio = summary["prefix cache on"]["tok_s"] / summary["prefix cache off"]["tok_s"]
    print(f"rounds {full}: on {summary['prefix cache on']}, off {summary['prefix cache off']}; on/off tok/s {ratio:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rounds": rounds, "measured_rounds": full, "median": summary,
                                    "on_over_off_tok_s": ratio}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
