"""What bounds prompt lookup on the grounded workload: its recorded outputs replayed through the proposer.

    python -m bench.speculative_replay [--results bench/results/speculative.json]
                                       [--step-costs bench/results/speculative_step_costs.json]

Takes the grounded batch-1 outputs ``bench.speculative`` recorded (greedy: the tokens do not
depend on speculation) and steps through each the way the engine's speculator does -- propose
with :func:`~flexpage.speculative.ngram.find_continuations` (k = 10), accept the proposal's
prefix that matches the recorded tokens, adapt k, back off after outright rejections -- then
prices every step with the measured cost of a step of that many rows (``--step-costs``,
``bench.speculative --step-costs``). Prints the predicted speed-up over plain decoding and how
many steps verified, found nothing, or waited out a backoff, for the engine's policy and for
variants (no backoff; n-grams down to 1 or 2 tokens; every step priced as a decode step).
No model runs: a few seconds.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

K = 10


def replay(prompts: list[list[int]], outputs: list[list[int]], cost: Callable[[int], float],
           backoff: Callable[[int], int], min_n: int, max_n: int = 5) -> dict:
    """Predicted ms and tokens over every request, and the steps by kind."""
    from flexpage.speculative.ngram import find_continuations

    ms, tokens, counts = 0.0, 0, {"steps": 0, "verified": 0, "nothing_found": 0, "backing_off": 0}
    for prompt, output in zip(prompts, outputs):
        seq, i, k, skip, last_backoff = list(prompt), 0, K, 0, 0
        while i < len(output):
            counts["steps"] += 1
            room, proposal = len(output) - i - 1, []
            if skip:
                skip -= 1
                counts["backing_off"] += 1
            elif room > 0:
                found = find_continuations(np.array(seq), min_n=min_n, max_n=max_n, k=min(k, room))
                proposal = found[0] if found else []
                counts["nothing_found"] += not proposal
            accepted = 0
            while accepted < len(proposal) and proposal[accepted] == output[i + accepted]:
                accepted += 1
            ms += cost(len(proposal))
            seq += output[i : i + accepted + 1]
            i += accepted + 1
            tokens += accepted + 1
            if proposal:
                counts["verified"] += 1
                k = K if accepted == len(proposal) else max(1, accepted + 1)
                last_backoff = 0 if accepted else backoff(last_backoff)
                skip = last_backoff
    return {"ms": ms, "tokens": tokens, **counts}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=Path("bench/results/speculative.json"))
    p.add_argument("--step-costs", type=Path, default=Path("bench/results/speculative_step_costs.json"))
    args = p.parse_args()

    from bench.speculative import grounded_chats
    from flexpage.model.loader import load_tokenizer, resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path(None))
    prompts = [list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False))
               for c in grounded_chats()]
    outputs = json.loads(args.results.read_text())["runs"]["grounded_b1"]["outputs"]
    measured = {int(key[1:]): ms for key, ms in json.loads(args.step_costs.read_text())["step_ms"].items()}
    known = sorted(measured)

    def cost(proposed: int) -> float:  # a step of proposed + 1 rows, interpolated between the measured ones
        return float(np.interp(proposed, known, [measured[r] for r in known]))

    decode = measured[0]
    engine = lambda last: min(8, max(1, 2 * last))  # noqa: E731  (MAX_BACKOFF["ngram"], doubling)
    variants = {
        "engine (n-grams 3-5, backoff 1-8)": (cost, engine, 3),
        "no backoff": (cost, lambda last: 0, 3),
        "n-grams 2-5": (cost, engine, 2),
        "n-grams 1-5, no backoff": (cost, lambda last: 0, 1),
        "every step priced as a decode step": (lambda proposed: decode, engine, 3),
    }
    for name, (price, backoff, min_n) in variants.items():
        row = replay(prompts, outputs, price, backoff, min_n)
        plain_ms = row["tokens"] * decode
        print(f"{name}: {plain_ms / row['ms']:.2f}x plain decoding; {row['tokens'] / row['steps']:.2f} tokens per "
              f"step; steps {row['steps']}: verified {row['verified']}, nothing found {row['nothing_found']}, "
              f"backing off {row['backing_off']}")


if __name__ == "__main__":
    main()
