"""Passkey accuracy when a prompt over its KV budget keeps whole blocks, single tokens, or
each layer its own blocks.

PagedEviction (arXiv 2509.04377) picks the best-scoring *tokens* of a prompt and packs them
into blocks, and scores each layer's cache on its own; flexpage keeps whole blocks (their
tokens keep contiguous positions, so the paging translation stays per block) chosen by one
score averaged over layers, because one block table serves every layer (docs/kv-budget.md).
Does either of the paper's choices find the key more often? This answers it outside the
engine, with HF transformers in float32: one forward over the prompt, each layer's cache cut
to its kept tokens (at their true positions: RoPE is in the keys), then greedy decoding of
the answer. Every choice keeps the first block and the prompt's last (partial) block, and
fills the rest of the budget by the policy's token scores: ``blocks`` by their mean score
over layers (the engine's choice), ``tokens`` single tokens by the same score, ``layers``
whole blocks by each layer's own score. The ``full cache`` row keeps everything. Unlike
the engine, which computes the first answer token in the prefill over the whole prompt,
the replay feeds the prompt's last token as a decode step over the kept cache.

Run (from the repository root)::

    python -m bench.prefill_selection --samples 4 --out bench/results/prefill_selection.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.longcontext import first_number, passkey_cases

BLOCK = 8  # the engine's default block size
POLICIES = ("paged_eviction", "key_norm")  # eviction recipes whose token scores choose
CHOICES = ("blocks", "tokens", "layers")


def kept_tokens(scores: torch.Tensor, budget: int, per_token: bool) -> torch.Tensor:
    """Indices of the ``budget`` tokens kept of a prompt with these token ``scores``."""
    length = scores.numel()
    last = (length - 1) // BLOCK * BLOCK  # start of the last (possibly partial) block
    middle = scores[BLOCK:last]
    room = budget - BLOCK - (length - last)
    if per_token:
        chosen = middle.topk(room).indices + BLOCK
    else:
        blocks = middle.view(-1, BLOCK).mean(dim=1).topk(room // BLOCK).indices + 1
        chosen = (blocks[:, None] * BLOCK + torch.arange(BLOCK)).flatten()
    return torch.cat([torch.arange(BLOCK), chosen, torch.arange(last, length)]).sort().values


@torch.no_grad()
def answer(model, ids: torch.Tensor, keep: list[torch.Tensor], cache, tokens: int = 8) -> list[int]:  # noqa: ANN001
    """Greedy tokens after the prompt's last token, attending to the kept part of ``cache``
    (``keep[i]``: the tokens layer ``i`` keeps)."""
    from transformers import DynamicCache

    pruned = DynamicCache()
    for i, layer in enumerate(cache.layers):
        pruned.update(layer.keys[:, :, keep[i]], layer.values[:, :, keep[i]], i)
    token, position, out = ids[:, -1:], ids.shape[1] - 1, []
    for _ in range(tokens):
        logits = model(input_ids=token, position_ids=torch.tensor([[position]]), cache=pruned).logits
        token = logits[:, -1:].argmax(dim=-1)
        out.append(int(token))
        position += 1
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=4, help="prompts per depth (5 depths)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--haystack", choices=("repeat", "varied"), default="varied")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from flexpage.model.kv_eviction import resolve_eviction_policy
    from flexpage.model.loader import default_model_dir, load_hf_model, load_tokenizer

    path = default_model_dir()
    tokenizer, model = load_tokenizer(path), load_hf_model(path, torch.float32)
    cases = passkey_cases(tokenizer, args.length, args.samples, haystack=args.haystack)
    found: dict[str, list[bool]] = {}
    for case in cases:
        ids = tokenizer(case["prompt"], return_tensors="pt").input_ids
        with torch.no_grad():
            cache = model(input_ids=ids[:, :-1], use_cache=True).cache
        keys = torch.stack([layer.keys[0] for layer in cache.layers])  # [layers, kv heads, tokens, dim]
        values = torch.stack([layer.values[0] for layer in cache.layers])
        positions = torch.arange(keys.shape[2])
        layers = range(keys.shape[0])
        text = tokenizer.decode(answer(model, ids, [positions] * len(layers), cache))
        found.setdefault("full cache", []).append(first_number(text) == case["key"])
        for policy in POLICIES:
            token_scores = resolve_eviction_policy(policy).token_scores
            scores = token_scores(keys, values, positions)
            per_layer = [token_scores(keys[i:i + 1], values[i:i + 1], positions) for i in layers]
            for budget in args.budgets:
                for choice in CHOICES:
                    if choice == "layers":
                        keep = [kept_tokens(s, budget, per_token=False) for s in per_layer]
                    else:
                        keep = [kept_tokens(scores, budget, per_token=choice == "tokens")] * len(layers)
                    text = tokenizer.decode(answer(model, ids, keep, cache))
                    cell = f"{policy}, budget {budget}, {choice}"
                    found.setdefault(cell, []).append(first_number(text) == case["key"])
    result = {"length": args.length, "haystack": args.haystack, "prompts": len(cases), "dtype": "float32",
              "accuracy": {cell: sum(hits) / len(hits) for cell, hits in found.items()}}
    for cell, accuracy in result["accuracy"].items():
        print(f"{cell:40s} {accuracy:.2f}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
