"""``attn_implementation="flexpage"`` against HF's own kernels, through ``model.generate``, in one run.

    python -m bench.hf_backend [--dtype float32] [--rounds 3] [--skip-compiled] [--out PATH]

What a transformers user sees when they switch one argument (issue 19). One model object
serves every implementation (``set_attn_implementation`` between runs), so all of them read
the same weights from the same memory; greedy decoding, random prompt token ids, fixed seeds:

* ``lengths``: batch 4, prompts of 128, 100, 77 and 300 tokens, 32 new tokens. flexpage's
  first call at each length (compiles included, counted), then warm medians of sdpa and
  flexpage interleaved round by round;
* ``batch8``: batch 8, 128-token prompts, 64 new tokens, output tok/s;
* ``gemma2``: a random-weight Gemma2 shaped like SmolLM2 (soft-capping 50, a 64-token window
  on alternate layers), batch 4, 128-token prompts, 32 new tokens: ``eager`` (the only other
  implementation that runs it: sdpa refuses soft-capping) against flexpage;
* ``sweep``: 20 prompt lengths from 16 to 2,048 at batch 1 (4 new tokens): Dynamo graphs
  compiled in all and after the first three lengths, and the first-seen time against sdpa;
* ``compiled``: ``torch.compile(model.forward)`` around the whole model (HF's static cache),
  sdpa and flexpage: first call (compiling) and warm, batch 4, 128-token prompts.

Prints a table; writes JSON (``--out``). Numbers wobble on a shared 2-core machine: every
ratio comes from runs interleaved in this one process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

DEFAULT_OUT = Path("bench/results/hf_backend.json")
LENGTHS = (128, 100, 77, 300)
VOCAB_RANGE = (100, 49000)


def prompts(batch: int, length: int, seed: int, vocab: tuple[int, int] = VOCAB_RANGE) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(*vocab, (batch, length)))


def unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def generate_seconds(model: Any, implementation: str, ids: torch.Tensor, new_tokens: int, **kwargs: Any) -> float:
    model.set_attn_implementation(implementation)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **kwargs)
    elapsed = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + new_tokens
    return elapsed


def interleaved(model: Any, implementations: tuple[str, ...], ids: torch.Tensor, new_tokens: int, rounds: int,
                **kwargs: Any) -> dict[str, float]:
    """Median seconds per implementation, the implementations alternating round by round."""
    samples: dict[str, list[float]] = {impl: [] for impl in implementations}
    for r in range(rounds):
        order = implementations if r % 2 == 0 else implementations[::-1]
        for impl in order:
            samples[impl].append(generate_seconds(model, impl, ids, new_tokens, **kwargs))
    return {impl: statistics.median(s) for impl, s in samples.items()}


def bench_lengths(model: Any, rounds: int) -> list[dict]:
    rows = []
    for n, length in enumerate(LENGTHS):
        ids = prompts(4, length, seed=n)
        before = unique_graphs()
        first = generate_seconds(model, "flexpage", ids, 32)
        compiled = unique_graphs() - before
        warm = interleaved(model, ("sdpa", "flexpage"), ids, 32, rounds)
        rows.append({"prompt": length, "sdpa_s": warm["sdpa"], "flexpage_first_s": first, "graphs_compiled": compiled,
                     "flexpage_warm_s": warm["flexpage"], "warm_ratio": warm["flexpage"] / warm["sdpa"],
                     "first_ratio": first / warm["sdpa"]})
        print(f"  batch 4, {length:4d}-token prompts, 32 new: sdpa {warm['sdpa']:.2f} s | flexpage first {first:.2f} s "
              f"({compiled} graphs compiled), warm {warm['flexpage']:.2f} s = {rows[-1]['warm_ratio']:.2f}x sdpa",
              flush=True)
    return rows


def bench_batch8(model: Any, rounds: int) -> dict:
    ids = prompts(8, 128, seed=10)
    generate_seconds(model, "flexpage", ids, 64)
    warm = interleaved(model, ("sdpa", "flexpage"), ids, 64, rounds)
    row = {impl + "_tok_s": 8 * 64 / s for impl, s in warm.items()}
    row["ratio"] = row["flexpage_tok_s"] / row["sdpa_tok_s"]
    print(f"  batch 8, 128-token prompts, 64 new: sdpa {row['sdpa_tok_s']:.1f} tok/s | flexpage "
          f"{row['flexpage_tok_s']:.1f} tok/s = {row['ratio']:.2f}x", flush=True)
    return row


def gemma2_model(dtype: torch.dtype) -> Any:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, query_pre_attn_scalar=64, sliding_window=64,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, max_position_embeddings=2048,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    return Gemma2ForCausalLM._from_config(config, attn_implementation="eager", dtype=dtype).eval()


def bench_gemma2(dtype: torch.dtype, rounds: int) -> dict:
    model = gemma2_model(dtype)
    ids = prompts(4, 128, seed=20)
    generate_seconds(model, "flexpage", ids, 32)
    warm = interleaved(model, ("eager", "flexpage"), ids, 32, rounds)
    row = {"eager_s": warm["eager"], "flexpage_s": warm["flexpage"], "ratio": warm["flexpage"] / warm["eager"]}
    print(f"  Gemma2 (soft-cap + window), batch 4, 128-token prompts, 32 new: eager {row['eager_s']:.2f} s | "
          f"flexpage {row['flexpage_s']:.2f} s = {row['ratio']:.2f}x", flush=True)
    return row


def bench_sweep(model: Any) -> dict:
    lengths = np.unique(np.geomspace(16, 2048, 20).astype(int)).tolist()
    graphs, ratios = [], []
    start = unique_graphs()
    for n, length in enumerate(lengths):
        ids = prompts(1, length, seed=100 + n)
        first = generate_seconds(model, "flexpage", ids, 4)
        graphs.append(unique_graphs() - start)
        ratios.append(first / generate_seconds(model, "sdpa", ids, 4))
    row = {"lengths": lengths, "graphs_total": graphs[-1], "graphs_after_three": graphs[-1] - graphs[2],
           "first_seen_ratios": ratios, "first_seen_ratio_max_after_three": max(ratios[3:])}
    print(f"  {len(lengths)} prompt lengths {lengths[0]}-{lengths[-1]}, batch 1: {row['graphs_total']} graphs compiled, "
          f"{row['graphs_after_three']} after the first three lengths; first-seen / sdpa after three: "
          f"max {row['first_seen_ratio_max_after_three']:.2f}x", flush=True)
    return row


def bench_compiled(model: Any, rounds: int) -> dict:
    """``torch.compile`` around the model, HF's static cache (each implementation its own compile)."""
    ids = prompts(4, 128, seed=30)
    plain_forward = model.forward
    row: dict[str, float] = {}
    for impl in ("sdpa", "flexpage"):
        model.set_attn_implementation(impl)
        model.forward = torch.compile(plain_forward)
        row[impl + "_first_s"] = generate_seconds(model, impl, ids, 32, cache_implementation="static")
        row[impl + "_s"] = statistics.median(
            generate_seconds(model, impl, ids, 32, cache_implementation="static") for _ in range(rounds))
        model.forward = plain_forward
        torch._dynamo.reset()
    row["ratio"] = row["flexpage_s"] / row["sdpa_s"]
    print(f"  torch.compile(model), static cache, batch 4, 128-token prompts, 32 new: sdpa {row['sdpa_s']:.2f} s "
          f"(first {row['sdpa_first_s']:.1f} s) | flexpage {row['flexpage_s']:.2f} s (first {row['flexpage_first_s']:.1f} s)"
          f" = {row['ratio']:.2f}x", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="auto", help="float32 / bfloat16 / auto (the engine's choice for this CPU)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-compiled", action="store_true", help="leave out the torch.compile(model) row")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    import flexpage  # noqa: F401  (registers attn_implementation="flexpage")
    from bench.attention import environment
    from flexpage.model.dtypes import parse_dtype
    from flexpage.model.loader import load_hf_model, resolve_model_path

    dtype = parse_dtype(args.dtype)
    env = environment()
    print(f"{env.get('cpu')}, torch {torch.__version__}, {torch.get_num_threads()} threads, {dtype}", flush=True)
    model = load_hf_model(resolve_model_path(None), dtype, "sdpa")
    generate_seconds(model, "sdpa", prompts(4, 16, seed=99), 4)  # first-call costs outside the rows
    print("SmolLM2-135M-Instruct, model.generate, greedy:", flush=True)
    result: dict[str, Any] = {"environment": env, "dtype": str(dtype), "rounds": args.rounds,
                              "lengths": bench_lengths(model, args.rounds), "batch8": bench_batch8(model, args.rounds),
                              "sweep": bench_sweep(model)}
    result["gemma2"] = bench_gemma2(dtype, args.rounds)
    if not args.skip_compiled:
        result["compiled"] = bench_compiled(model, args.rounds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
