"""Weight-only int8 against bf16: decode and prefill speed, memory, and greedy agreement.

    python -m bench.int8 [--rounds 2] [--skip-1b]

Two models in bf16, each configuration (``quantization``) in a fresh process per round:

* **SmolLM2-135M-Instruct** (the default model): ``none`` (its bf16 weights, packed for
  oneDNN), ``auto`` (computed from the GGUF's own Q4_1/Q8_0 blocks) and ``int8``.
* **a random-weight Llama-3.2-1B-shaped model** (hidden 2048, 16 layers, 32/8 heads, MLP 8192,
  vocabulary 128,256, tied embeddings; built once and cached): ``none`` and ``int8``. Its
  decode is firmly memory-bound: ~2.5 GB of bf16 weights a step.

Per configuration: a decode step's time at batch 1 and 8 (128-token prompts; median of 10
steps after 2, as ``bench.tp`` times them), a step prefilling 4 x 256 tokens, peak RSS, and
greedy outputs of 16 fixed prompts (32 tokens each) compared with ``none``'s: how many are
identical and the mean length of the common prefix. Medians over rounds; writes --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
from pathlib import Path

import torch

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "int8.json"
#: Llama-3.2-1B's shape
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=4096,
                rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=500000.0)
MODELS = {"smollm2-135m": ("none", "auto", "int8"), "llama-1b-random": ("none", "int8")}
AGREEMENT_PROMPTS, AGREEMENT_TOKENS = 16, 32


def agreement_prompts() -> list[list[int]]:
    """Fixed prompts of 24-120 token ids (the default model's vocabulary, which the 1B shape covers)."""
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 49152, (int(length),), generator=g).tolist()
            for length in torch.randint(24, 121, (AGREEMENT_PROMPTS,), generator=g)]


def measure_one(model: str, quantization: str) -> dict:
    """Everything for one configuration, in this process."""
    from bench.tp import decode_ms, prefill_ms, random_llama_folder
    from flexpage import LLM, SamplingParams

    path = None if model == "smollm2-135m" else str(random_llama_folder("bench-int8-llama-1b", LLAMA_1B))
    llm = LLM(path, dtype="bfloat16", quantization=quantization, max_num_seqs=16, max_model_len=2048,
              kv_cache_memory="1GiB")
    params = SamplingParams(temperature=0.0, max_tokens=AGREEMENT_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in agreement_prompts()], params)
    result = {"decode_b1_ms": decode_ms(llm, 1, 0)[0], "decode_b8_ms": decode_ms(llm, 8, 0)[0],
              "prefill_4x256_ms": prefill_ms(llm),
              "tokens": [o.outputs[0].token_ids for o in outputs]}
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    llm.engine.close()
    return result


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> dict:
    def common(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    return {"identical": sum(a == b for a, b in zip(tokens, reference)), "of": len(reference),
            "mean_common_prefix": statistics.mean(common(a, b) for a, b in zip(tokens, reference))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip-1b", action="store_true", help="the default model only")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "QUANTIZATION"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure_one(*args.one)))
        return
    models = {m: q for m, q in MODELS.items() if not (args.skip_1b and m != "smollm2-135m")}
    runs: dict[str, dict[str, list[dict]]] = {m: {q: [] for q in qs} for m, qs in models.items()}
    for round_ in range(args.rounds):
        for model, quantizations in models.items():
            for quantization in quantizations if round_ % 2 == 0 else reversed(quantizations):
                done = subprocess.run([sys.executable, "-m", "bench.int8", "--one", model, quantization],
                                      check=True, capture_output=True, text=True)
                run = json.loads(done.stdout.strip().splitlines()[-1])
                runs[model][quantization].append(run)
                print(f"round {round_} {model} {quantization}: " + ", ".join(
                    f"{k} {v:.1f}" for k, v in run.items() if k != "tokens"), flush=True)
    result: dict = {"rounds": args.rounds, "torch": torch.__version__, "models": {}}
    for model, by_quantization in runs.items():
        reference = by_quantization["none"][0]["tokens"]
        result["models"][model] = {}
        for quantization, rounds in by_quantization.items():
            medians = {k: statistics.median(r[k] for r in rounds) for k in rounds[0] if k != "tokens"}
            medians["per_round"] = {k: [round(r[k], 2) for r in rounds] for k in medians}
            medians["greedy_vs_none"] = agreement(rounds[0]["tokens"], reference)
            result["models"][model][quantization] = medians
            print(f"{model} {quantization}: " + ", ".join(f"{k} {v:.1f}" for k, v in medians.items()
                                                          if isinstance(v, float)) + f"; {medians['greedy_vs_none']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
