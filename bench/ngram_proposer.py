"""What does a prompt-lookup proposal cost per sequence and step?

    python -m bench.ngram_proposer [--tokens 4096] [--calls 256]

Times :meth:`flexpage.speculative.ngram.NgramProposer.propose` the way a decode loop calls
it: the sequence grows by one token between calls (so the numpy mirror copies one token),
from ``--tokens`` tokens on, over SmolLM2's vocabulary size (49,152), in three contexts:

* ``copying``: a 1,000-token passage, other text, then the passage again, cut short -- the
  suffix matches once and the proposal is the passage's next tokens;
* ``nothing to copy``: uniformly random tokens (no n-gram of 2+ tokens recurs);
* ``repetitive``: a 7-token pattern over and over -- every position matches, the worst case
  for the number of occurrences to rank.

k = 4, n in [2, 4], one and four branches. Prints microseconds per call (median of 5 runs)
and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from flexpage.speculative.config import SpeculativeConfig
from flexpage.speculative.ngram import NgramProposer

VOCAB = 49152


def contexts(tokens: int, seed: int = 0) -> dict[str, list[int]]:
    rng = np.random.default_rng(seed)
    passage = rng.integers(0, VOCAB, 1000)
    filler = rng.integers(0, VOCAB, tokens)
    copying = np.concatenate([filler[: tokens - 2000], passage, filler[-300:], passage])[: tokens]
    pattern = rng.integers(0, VOCAB, 7)
    return {"copying": copying.tolist(), "nothing to copy": rng.integers(0, VOCAB, tokens).tolist(),
            "repetitive": np.resize(pattern, tokens).tolist()}


def time_calls(proposer: NgramProposer, tokens: list[int], calls: int) -> float:
    """Microseconds per ``propose`` while the sequence grows from ``len(tokens) - calls``
    tokens by one per call (appended to one list, as a running sequence's are)."""
    growing = tokens[: len(tokens) - calls]
    proposer.release(0)
    proposer.propose(0, growing)  # the prompt's conversion, once, as in serving
    elapsed = 0.0
    for token in tokens[len(growing):]:
        growing.append(token)
        start = time.perf_counter()
        proposer.propose(0, growing)
        elapsed += time.perf_counter() - start
    return elapsed / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=256)
    parser.add_argument("--out", type=Path, default=Path("bench/results/ngram_proposer.json"))
    args = parser.parse_args()
    results = []
    for name, tokens in contexts(args.tokens + args.calls).items():
        for branches in (1, 4):
            config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4,
                                                  "prompt_lookup_min": 2, "prompt_lookup_max": 4,
                                                  "max_branches": branches})
            proposer = NgramProposer(config)
            seconds = statistics.median(time_calls(proposer, tokens, args.calls) for _ in range(5))
            tree = proposer.propose(0, tokens)
            results.append({"context": name, "max_branches": branches, "us_per_call": round(seconds, 1),
                            "tree_nodes": tree.num_nodes})
            print(f"{name:>16}  branches={branches}  {seconds:6.1f} us/call  ({tree.num_nodes - 1} proposed)",
                  flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"tokens": args.tokens, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
