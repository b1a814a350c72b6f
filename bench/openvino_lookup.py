"""OpenVINO GenAI prompt-lookup decoding as a baseline for the speculative-decoding benchmark.

Standalone: run it with the OpenVINO environment's python (it imports only openvino,
openvino_genai and numpy, never flexpage or torch)::

    /work/ov-venv/bin/python bench/openvino_lookup.py --model /work/ov-models/smollm2-135m-fp16 \
        --requests IN.json --out OUT.json [--k 4] [--max-ngram 3] [--rounds 1]

IN.json is a list of {"prompt_token_ids": [...], "max_new_tokens": N}. Each request is fed as
exactly those token ids (an ov.Tensor inside TokenizedInputs: no chat template, no BOS added)
and decoded greedily with EOS ignored, by two pipelines on the CPU:

- ``prompt_lookup``: ``LLMPipeline(model, "CPU", prompt_lookup=True)`` with
  ``num_assistant_tokens=k`` and ``max_ngram_size=max_ngram``;
- ``plain``: ``LLMPipeline(model, "CPU")``, same config without the lookup fields.

Each pipeline is warmed up once. With ``--rounds R`` the whole request list runs R times per
mode, requests one after another (batch 1), the mode that goes first alternating by round; a
mode's figure is the median over rounds of (total output tokens / total seconds of its
``generate`` calls). Output token ids of the two modes are compared request by request
(greedy decoding: they should be identical).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import openvino as ov
import openvino_genai as genai

MODES = ("prompt_lookup", "plain")


def make_config(mode: str, max_new_tokens: int, k: int, max_ngram: int) -> genai.GenerationConfig:
    config = genai.GenerationConfig()
    config.max_new_tokens = max_new_tokens
    config.min_new_tokens = max_new_tokens
    config.do_sample = False
    config.ignore_eos = True
    config.stop_token_ids = set()
    config.stop_strings = set()
    config.apply_chat_template = False
    if mode == "prompt_lookup":
        config.num_assistant_tokens = k
        config.max_ngram_size = max_ngram
    return config


def make_inputs(prompt_token_ids: list[int]) -> genai.TokenizedInputs:
    ids = np.asarray([prompt_token_ids], dtype=np.int64)
    return genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))


def perf_summary(result) -> dict:  # noqa: ANN001
    """Engine-side metrics where the API gives them (ms); never needed for the main figures."""
    out = {}
    try:
        pm = result.perf_metrics
        out["ttft_ms"] = pm.get_ttft().mean
        out["tpot_ms"] = pm.get_tpot().mean
        out["generate_ms"] = pm.get_generate_duration().mean
    except Exception:  # noqa: BLE001
        pass
    return out


def run_one(pipe: genai.LLMPipeline, request: dict, config: genai.GenerationConfig) -> dict:
    inputs = make_inputs(request["prompt_token_ids"])
    start = time.perf_counter()
    result = pipe.generate(inputs, config)
    seconds = time.perf_counter() - start
    tokens = [int(t) for t in result.tokens[0]]
    return {"tokens": tokens, "n_out": len(tokens), "seconds": seconds, **perf_summary(result)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="OpenVINO IR folder (with openvino_tokenizer/detokenizer)")
    p.add_argument("--requests", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--k", type=int, default=4, help="num_assistant_tokens: tokens proposed per step")
    p.add_argument("--max-ngram", type=int, default=3, help="max_ngram_size of the prompt lookup")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--device", default="CPU")
    args = p.parse_args()

    requests = json.loads(args.requests.read_text())
    assert requests and all("prompt_token_ids" in r and "max_new_tokens" in r for r in requests)

    load = {}
    t0 = time.perf_counter()
    pipes = {"prompt_lookup": genai.LLMPipeline(args.model, args.device, prompt_lookup=True)}
    load["prompt_lookup"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    pipes["plain"] = genai.LLMPipeline(args.model, args.device)
    load["plain"] = time.perf_counter() - t0

    def config_for(mode: str, request: dict) -> genai.GenerationConfig:
        return make_config(mode, int(request["max_new_tokens"]), args.k, args.max_ngram)

    warm = {"prompt_token_ids": requests[0]["prompt_token_ids"],
            "max_new_tokens": min(16, int(requests[0]["max_new_tokens"]))}
    warmup = {m: run_one(pipes[m], warm, config_for(m, warm))["seconds"] for m in MODES}

    per_request = []
    per_round = {m: [] for m in MODES}
    for r in range(args.rounds):
        order = MODES if r % 2 == 0 else MODES[::-1]
        results = {}
        for mode in order:
            results[mode] = [run_one(pipes[mode], req, config_for(mode, req)) for req in requests]
            tokens = sum(x["n_out"] for x in results[mode])
            seconds = sum(x["seconds"] for x in results[mode])
            per_round[mode].append({"round": r, "first": mode == order[0], "output_tokens": tokens,
                                    "seconds": seconds, "tok_s": tokens / seconds})
        for i, req in enumerate(requests):
            entry = {"round": r, "index": i, "prompt_tokens": len(req["prompt_token_ids"]),
                     "max_new_tokens": int(req["max_new_tokens"])}
            for mode in MODES:
                entry[mode] = results[mode][i]
            entry["outputs_match"] = results["prompt_lookup"][i]["tokens"] == results["plain"][i]["tokens"]
            per_request.append(entry)

    modes = {}
    for mode in MODES:
        modes[mode] = {
            "tok_s_median": statistics.median(x["tok_s"] for x in per_round[mode]),
            "rounds": per_round[mode],
            "load_seconds": load[mode],
            "warmup_seconds": warmup[mode],
        }
    modes["prompt_lookup"].update(num_assistant_tokens=args.k, max_ngram_size=args.max_ngram)
    out = {
        "openvino_genai_version": genai.__version__,
        "openvino_version": ov.__version__,
        "model": str(args.model),
        "device": args.device,
        "n_requests": len(requests),
        "rounds": args.rounds,
        "modes": modes,
        "speedup_prompt_lookup_over_plain": modes["prompt_lookup"]["tok_s_median"] / modes["plain"]["tok_s_median"],
        "all_outputs_match": all(e["outputs_match"] for e in per_request),
        "per_request": per_request,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    for mode in MODES:
        print(f"{mode:14s} {modes[mode]['tok_s_median']:8.1f} tok/s (median of {args.rounds})")
    print(f"speedup {out['speedup_prompt_lookup_over_plain']:.2f}x, outputs match: {out['all_outputs_match']}")


if __name__ == "__main__":
    main()
