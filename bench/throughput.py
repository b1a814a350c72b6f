"""Offline throughput: flexpage LLM.generate vs HF transformers, one run, same workload.

    python -m bench.throughput [--num-prompts 32] [--quick] [--skip-hf]

Workload ("ShareGPT-like", fixed seed): prompt lengths log-normal with median 96 tokens
(sigma 0.8, clipped to 16-512), output lengths log-normal with median 64 (sigma 0.6,
clipped to 8-192); token ids drawn uniformly from the vocabulary's ordinary range and
``ignore_eos`` so every request generates exactly its output length (HF baselines use
``min_new_tokens == max_new_tokens`` per batch for the same reason).

Measured side by side: flexpage (bf16, compiled attention) against HF ``model.generate``
in static padded batches of 8 and HF ``generate_batch`` (transformers' paged continuous
batching; it takes one GenerationConfig, so every request generates the longest output --
flexpage is also run on that same work); flexpage's steady decode at batch 64 -- with its
compact Llama forward and with HF's modules around the paged attention -- interleaved
with the model's matmuls alone at batch 64 (eager ``F.linear``: the practical roofline;
and with oneDNN-packed weights, as flexpage runs them); and a shared-system-prompt
workload with prefix caching on and off. Writes JSON to --out. Leaves the OpenMP
environment alone (see docs/throughput-benchmark.md).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from flexpage import LLM, SamplingParams
from flexpage.frame_stack import reserved_frame_stack
from flexpage.model.loader import load_hf_model, resolve_model_path
from flexpage.model.packed_linear import PackedLinear


def sharegpt_like(num: int, seed: int, vocab: int = 49152) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    prompt_lens = np.clip(rng.lognormal(np.log(96), 0.8, num), 16, 512).astype(int)
    output_lens = np.clip(rng.lognormal(np.log(64), 0.6, num), 8, 192).astype(int)
    return [(rng.integers(100, vocab - 100, p).tolist(), int(o)) for p, o in zip(prompt_lens, output_lens)]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@reserved_frame_stack
def run_flexpage(llm: LLM, workload: list[tuple[list[int], int]], step_shapes: list | None = None) -> dict:
    """Run ``workload`` to completion; ``step_shapes`` (if given) collects each forward's
    (tokens, sampled rows), for :func:`workload_matmul_seconds`."""
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in workload]
    inputs = [{"prompt_token_ids": p} for p, _ in workload]
    engine = llm.engine
    utilisation: list[float] = []
    if step_shapes is not None:
        execute = engine.runner.execute

        def recorded(inputs):  # noqa: ANN001, ANN202
            step_shapes.append((len(inputs.token_ids), len(inputs.sample_rows)))
            return execute(inputs)

        engine.runner.execute = recorded
    start = time.perf_counter()
    for prompt, p in zip(inputs, params):
        engine.add_request(prompt, p)
    generated = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                generated += len(out.outputs[0].token_ids)
        if engine.scheduler.running:
            utilisation.append(engine.kv_utilization())
    elapsed = time.perf_counter() - start
    if step_shapes is not None:
        del engine.runner.execute
    return {"output_tokens": generated, "seconds": elapsed, "tokens_per_s": generated / elapsed,
            "kv_utilisation_mean": statistics.mean(utilisation) if utilisation else None}


def run_hf_static(model: torch.nn.Module, workload: list[tuple[list[int], int]], batch: int = 8) -> dict:
    start = time.perf_counter()
    generated = 0
    for i in range(0, len(workload), batch):
        chunk = workload[i : i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        new = max(o for _, o in chunk)
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)
        generated += sum(o for _, o in chunk)  # tokens each request asked for; padding rows' extras not counted
    elapsed = time.perf_counter() - start
    return {"output_tokens": generated, "seconds": elapsed, "tokens_per_s": generated / elapsed}


def run_hf_generate_batch(model: torch.nn.Module, workload: list[tuple[list[int], int]]) -> dict:
    from transformers import GenerationConfig

    new = max(o for _, o in workload)
    config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    start = time.perf_counter()
    with torch.no_grad():
        outputs = model.generate_batch(inputs=[p for p, _ in workload], generation_config=config, progress_bar=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.generated_tokens) for o in outputs.values())
    return {"output_tokens": generated, "seconds": elapsed, "tokens_per_s": generated / elapsed,
            "note": "all requests generate the workload's longest output (one GenerationConfig per call)"}


def start_decoding(llm: LLM, batch: int, max_tokens: int, prompt_len: int = 128, seed: int = 7) -> list[str]:
    """Admit ``batch`` requests of ``prompt_len`` random tokens and step until each has its first
    token, so every later step is a pure decode step of ``batch`` sequences."""
    rng = np.random.default_rng(seed)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request({"prompt_token_ids": rng.integers(100, 40000, prompt_len).tolist()}, params)
           for _ in range(batch)]
    while any(not engine.requests[i].outputs or not engine.requests[i].outputs[0].token_ids for i in ids):
        engine.step()
    return ids


def median_ms(step: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def matmul_only_step(model: torch.nn.Module, batch: int, packed: bool = False) -> Callable[[], None]:
    """One decode step's linear layers (+ LM head) at ``batch`` rows, eager ``F.linear`` on the
    HF weights (the issue's roofline) or, ``packed``, the same layers with oneDNN-packed weights."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    x = {m.in_features: torch.randn(batch, m.in_features, dtype=m.weight.dtype) for m in linears}
    calls = [(PackedLinear(m.weight) if packed else m, x[m.in_features]) for m in linears]

    def step() -> None:
        for linear, inputs in calls:
            linear(inputs)

    step()
    return step


def workload_matmul_seconds(model: torch.nn.Module, step_shapes: list[tuple[int, int]], reps: int = 2) -> float:
    """The workload's matmuls alone: every recorded forward's decoder linears at its token count
    and the LM head at its sampled rows, with oneDNN-packed weights (minimum over ``reps``
    replays). No engine can beat this on this machine without faster matmuls."""
    head = model.get_output_embeddings()
    linears = [PackedLinear(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    lm_head = PackedLinear(head.weight)
    inputs: dict[tuple[int, int], torch.Tensor] = {}

    def x(rows: int, features: int) -> torch.Tensor:
        if (rows, features) not in inputs:
            inputs[rows, features] = torch.randn(rows, features, dtype=head.weight.dtype)
        return inputs[rows, features]

    totals = []
    for _ in range(reps):
        start = time.perf_counter()
        for tokens, sampled in step_shapes:
            for linear in linears:
                linear(x(tokens, linear.in_features))
            lm_head(x(sampled, lm_head.in_features))
        totals.append(time.perf_counter() - start)
    return min(totals)


def decode_vs_matmul(engines: dict[str, LLM], model: torch.nn.Module, batch: int = 64, num_rounds: int = 5,
                     steps: int = 6) -> dict:
    """Steady decode at ``batch`` sequences of each engine, interleaved with the matmul-only step.

    Each of ``num_rounds`` rounds times ``steps`` engine steps per engine (median) and ``steps``
    matmul-only steps (eager and packed): the machine's load changes within seconds, so
    every ratio is a median over rounds of ratios measured back to back.
    """
    eager, packed = matmul_only_step(model, batch), matmul_only_step(model, batch, packed=True)
    requests = {name: start_decoding(llm, batch, max_tokens=num_rounds * steps + 16) for name, llm in engines.items()}
    rounds: dict[str, list[float]] = {name: [] for name in [*engines, "matmul_only", "matmul_only_packed"]}
    for _ in range(num_rounds):
        for name, llm in engines.items():
            rounds[name].append(median_ms(llm.engine.step, steps))
        rounds["matmul_only"].append(median_ms(eager, steps))
        rounds["matmul_only_packed"].append(median_ms(packed, steps))
    for name, llm in engines.items():
        for request_id in requests[name]:
            llm.engine.abort(request_id)
    result: dict = {"batch": batch, "context": f"128-{128 + num_rounds * steps + 8} tokens"}
    for name, times in rounds.items():
        ms = statistics.median(times)
        result[name] = {"step_ms_median": ms, "tokens_per_s": batch / ms * 1e3, "step_ms_per_round": times}
    for name in engines:
        result[name]["fraction_of_matmul_only"] = statistics.median(
            m / e for m, e in zip(rounds["matmul_only"], rounds[name]))
        result[name]["fraction_of_packed_matmul_only"] = statistics.median(
            m / e for m, e in zip(rounds["matmul_only_packed"], rounds[name]))
    return result


def shared_prefix(llm_on: LLM, llm_off: LLM, num: int = 16, system_len: int = 512, seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    system = rng.integers(100, 40000, system_len).tolist()
    prompts = [{"prompt_token_ids": system + rng.integers(100, 40000, 32).tolist()} for _ in range(num)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    result = {}
    for name, llm in (("prefix_caching_on", llm_on), ("prefix_caching_off", llm_off)):
        llm.generate(prompts[:1], params)  # warm: the first request fills the cache when caching is on
        start = time.perf_counter()
        outs = llm.generate(prompts[1:], params)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        result[name] = {"seconds": elapsed, "tokens_per_s": tokens / elapsed,
                        "cached_prompt_tokens": sum(o.num_cached_tokens for o in outs)}
    result["speedup"] = result["prefix_caching_on"]["tokens_per_s"] / result["prefix_caching_off"]["tokens_per_s"]
    return result


def plot(results: dict, path: Path) -> None:
    """Two panels: output tok/s per method on the workload; batch-64 decode against the matmul-only rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [("flexpage", "flexpage"), ("hf_generate_batch", "HF\ngenerate_batch*"),
               ("hf_static_batch8", "HF static\nbatches of 8"), ("flexpage_all_longest", "flexpage, same\nwork as *")]
    methods = [(k, label) for k, label in methods if k in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar([label for _, label in methods], [results[k]["tokens_per_s"] for k, _ in methods],
             color=["tab:blue", "tab:orange", "tab:gray", "tab:cyan"][: len(methods)])
    left.tick_params(axis="x", labelsize=8)
    left.set_ylabel("output tokens / s")
    if "hf_generate_batch" in results:
        left.axhline(10 * results["hf_generate_batch"]["tokens_per_s"], color="tab:red", linestyle="--",
                     linewidth=1, label="10x generate_batch (target)")
    left.axhline(results["workload_matmul_roofline"]["tokens_per_s"], color="tab:olive", linestyle=":",
                 linewidth=1.5, label="this workload's matmuls alone (packed)")
    left.legend(fontsize=8)
    left.set_title(f"{results['workload']['num_prompts']} ShareGPT-like prompts, bf16")
    decode = results["decode_batch64"]
    bars = [("flexpage", "flexpage", "tab:blue"), ("flexpage_hf_modules", "flexpage,\nHF modules", "tab:cyan"),
            ("matmul_only", "matmuls only\n(eager)", "tab:green"),
            ("matmul_only_packed", "matmuls only\n(packed)", "tab:olive")]
    right.bar([label for _, label, _ in bars], [decode[k]["tokens_per_s"] for k, _, _ in bars],
              color=[c for _, _, c in bars])
    right.axhline(decode["matmul_only"]["tokens_per_s"] / 2, color="k", linestyle="--", linewidth=1,
                  label="50% of eager matmuls (target)")
    right.tick_params(axis="x", labelsize=8)
    right.set_ylabel("output tokens / s")
    right.set_title(f"decode at batch 64: {decode['flexpage']['fraction_of_matmul_only']:.0%} of matmul-only")
    right.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="8 prompts, no HF static baseline")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("bench/results/throughput.json"))
    parser.add_argument("--plot", type=Path, default=Path("docs/img/throughput.png"))
    args = parser.parse_args()
    num = 8 if args.quick else args.num_prompts
    workload = sharegpt_like(num, args.seed)
    dtype = torch.bfloat16
    results: dict = {"workload": {"num_prompts": num, "seed": args.seed,
                                  "prompt_tokens": sum(len(p) for p, _ in workload),
                                  "output_tokens": sum(o for _, o in workload)},
                     "torch_threads": torch.get_num_threads()}

    llm = LLM(dtype="bfloat16", max_num_seqs=args.max_num_seqs, max_num_batched_tokens=1024)
    llm.engine.warm_up()  # compile every attention variant (the server's warm-up), so no timed run compiles
    run_flexpage(llm, sharegpt_like(4, args.seed + 1))
    step_shapes: list[tuple[int, int]] = []
    results["flexpage"] = run_flexpage(llm, workload, step_shapes)
    results["flexpage"]["kv_bytes_per_token"] = llm.engine.runner.pool.bytes_per_token
    results["flexpage"]["peak_rss_mb"] = peak_rss_mb()
    print("flexpage", results["flexpage"], flush=True)
    # the work generate_batch does: every request generates the workload's longest output
    longest = max(o for _, o in workload)
    results["flexpage_all_longest"] = run_flexpage(llm, [(p, longest) for p, _ in workload])
    print("flexpage, every request to the longest output", results["flexpage_all_longest"], flush=True)

    hf = load_hf_model(resolve_model_path(None), dtype, attn_implementation="sdpa")
    # the same engine with HF's own modules around attention (model_impl="transformers"), to
    # show which path the benchmark favours; it shares the compiled kernels of the first
    llm_hf_modules = LLM(dtype="bfloat16", max_num_seqs=64, kv_cache_memory="512MB", model_impl="transformers")
    decode = decode_vs_matmul({"flexpage": llm, "flexpage_hf_modules": llm_hf_modules}, hf, batch=64)
    del llm_hf_modules
    results["decode_batch64"] = decode
    results["flexpage_decode_batch64"] = decode["flexpage"]
    results["matmul_only_batch64"] = decode["matmul_only"]
    results["matmul_only_batch32"] = {"batch": 32, "step_ms": (ms := median_ms(matmul_only_step(hf, 32), 10)),
                                      "tokens_per_s": 32 / ms * 1e3}
    print("decode b64 vs matmul only", json.dumps(decode, indent=1), flush=True)
    seconds = workload_matmul_seconds(hf, step_shapes)
    results["workload_matmul_roofline"] = {
        "steps": len(step_shapes), "seconds": seconds,
        "tokens_per_s": results["flexpage"]["output_tokens"] / seconds,
        "note": "the workload's own forwards (tokens, sampled rows per step), linears only, packed weights"}
    print("workload matmul roofline", results["workload_matmul_roofline"], flush=True)
    if not args.skip_hf:
        if not args.quick:
            results["hf_static_batch8"] = run_hf_static(hf, workload)
            print("hf static", results["hf_static_batch8"], flush=True)
        results["hf_generate_batch"] = run_hf_generate_batch(hf, workload)
        print("hf generate_batch", results["hf_generate_batch"], flush=True)
        results["speedup_vs_generate_batch"] = (
            results["flexpage"]["tokens_per_s"] / results["hf_generate_batch"]["tokens_per_s"])
        results["speedup_vs_generate_batch_same_work"] = (
            results["flexpage_all_longest"]["tokens_per_s"] / results["hf_generate_batch"]["tokens_per_s"])
        results["roofline_vs_generate_batch"] = (
            results["workload_matmul_roofline"]["tokens_per_s"] / results["hf_generate_batch"]["tokens_per_s"])
    results["fraction_of_matmul_roofline_b64"] = decode["flexpage"]["fraction_of_matmul_only"]
    del hf

    llm_off = LLM(dtype="bfloat16", max_num_seqs=args.max_num_seqs, enable_prefix_caching=False)
    results["shared_system_prompt"] = shared_prefix(llm, llm_off, num=8 if args.quick else 16)
    print("shared prefix", results["shared_system_prompt"], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    plot(results, args.plot)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
