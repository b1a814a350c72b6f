"""Beam search on shared blocks: KV blocks held and tokens/s against independent samples.

    python -m bench.beam [--rounds 3] [--widths 1 2 4 8] [--prompt-lengths 128 1024] [--quick] [--out PATH]

On the default model (SmolLM2-135M-Instruct, the engine's defaults: bf16, compiled step,
prefix caching on), one random-token prompt per length and, for each width ``k``, 64 new
tokens per beam (``ignore_eos``: every run generates ``k x 64`` tokens):

* ``beam``: ``LLM.beam_search`` with ``beam_width=k`` (the prompt computed once, beams
  forking copy-on-write);
* ``n``: one request with ``n=k`` samples (temperature 1, seeded): the same rows per step,
  and the prompt shared too (the siblings fork after it), so only the bookkeeping differs;
* ``independent``: ``k`` separate requests of the same prompt on an engine without prefix
  caching: nothing shared (the paper's baseline for the memory saving).

Each run drives the engine step by step and records the most KV blocks in use after any
step (``block_manager.stats().used``) and the wall time; tokens/s = generated tokens / time.
Rounds alternate the order of the three; medians over rounds. Writes --out
(bench/results/beam.json).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from flexpage import LLM, BeamSearchParams, SamplingParams

DEFAULT_OUT = Path("bench/results/beam.json")
NEW_TOKENS = 64


def run(llm: LLM, prompts: list[list[int]], params: list[Any]) -> tuple[float, int, int]:
    """Seconds, peak KV blocks in use and tokens generated for ``prompts`` run together."""
    engine = llm.engine
    start = time.perf_counter()
    ids = [engine.add_request({"prompt_token_ids": p}, q) for p, q in zip(prompts, params)]
    peak, tokens = 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id in ids:
                assert out.error is None, out.error
                tokens += sum(len(o.token_ids) for o in out.outputs)
        peak = max(peak, engine.block_manager.stats().used)
    return time.perf_counter() - start, peak, tokens


def measure(shared: LLM, unshared: LLM, prompt: list[int], width: int, round_index: int) -> dict[str, dict[str, float]]:
    ways = {
        "beam": (shared, [prompt], [BeamSearchParams(beam_width=width, max_tokens=NEW_TOKENS, ignore_eos=True)]),
        "n": (shared, [prompt], [SamplingParams(n=width, temperature=1.0, seed=round_index, max_tokens=NEW_TOKENS,
                                                ignore_eos=True)]),
        "independent": (unshared, [prompt] * width,
                        [SamplingParams(temperature=1.0, seed=round_index + i, max_tokens=NEW_TOKENS, ignore_eos=True)
                         for i in range(width)]),
    }
    order = list(ways)
    order = order[round_index % 3:] + order[:round_index % 3]
    results = {}
    for name in order:
        llm, prompts, params = ways[name]
        llm.engine.reset_prefix_cache()  # every run computes its prompt
        seconds, peak, tokens = run(llm, prompts, params)
        results[name] = {"seconds": seconds, "peak_blocks": peak, "tokens": tokens, "tok_s": tokens / seconds}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--quick", action="store_true", help="one round, widths 1 and 4, a 128-token prompt")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.widths, args.prompt_lengths = 1, [1, 4], [128]

    shared = LLM()
    unshared = LLM(enable_prefix_caching=False)
    for llm in (shared, unshared):
        llm.engine.warm_up()
    vocab = shared.engine.vocab_size
    rows = []
    for length in args.prompt_lengths:
        prompt = random.Random(length).choices(range(100, vocab), k=length)
        run(shared, [prompt], [BeamSearchParams(beam_width=max(args.widths), max_tokens=4)])  # first-use costs
        for width in args.widths:
            rounds = [measure(shared, unshared, prompt, width, r) for r in range(args.rounds)]
            row: dict[str, Any] = {"prompt_tokens": length, "width": width}
            for name in ("beam", "n", "independent"):
                row[name] = {key: statistics.median(r[name][key] for r in rounds)
                             for key in ("tok_s", "peak_blocks", "seconds")}
                row[name]["tok_s_rounds"] = [round(r[name]["tok_s"], 1) for r in rounds]
            row["beam_blocks_over_independent"] = row["beam"]["peak_blocks"] / row["independent"]["peak_blocks"]
            row["beam_blocks_over_n"] = row["beam"]["peak_blocks"] / row["n"]["peak_blocks"]
            row["beam_tok_s_over_n"] = row["beam"]["tok_s"] / row["n"]["tok_s"]
            rows.append(row)
            print(f"prompt {length:5d} width {width}: blocks beam {row['beam']['peak_blocks']:.0f} / n "
                  f"{row['n']['peak_blocks']:.0f} / independent {row['independent']['peak_blocks']:.0f} "
                  f"({row['beam_blocks_over_independent']:.2f}x); tok/s beam {row['beam']['tok_s']:.1f} / n "
                  f"{row['n']['tok_s']:.1f} ({row['beam_tok_s_over_n']:.2f}x) / independent "
                  f"{row['independent']['tok_s']:.1f}; beam rounds {row['beam']['tok_s_rounds']}, n rounds "
                  f"{row['n']['tok_s_rounds']}", flush=True)
    config = shared.engine.config
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": str(shared.engine.model_path), "dtype": str(shared.engine.dtype),
                                    "block_size": config.block_size, "new_tokens": NEW_TOKENS,
                                    "rounds": args.rounds, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
