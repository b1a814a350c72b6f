"""Long contexts under a KV budget: passkey accuracy per eviction policy, and decode speed.

    python -m bench.longcontext [--lengths 2048 4096] [--samples 4] [--budgets 256 512 1024]
                                [--openvino-python PATH] [--speed-only | --accuracy-only]

**Accuracy.** Passkey retrieval (Mohtashami & Jaggi 2023): a 5-digit key hidden in a
repeated filler text at depths 0, 0.25, 0.5, 0.75, 1 of a raw completion prompt of about
``length`` tokens, answered greedily. Per (length, budget, policy) cell: exact-match accuracy
over ``5 x samples`` prompts (fixed seed) and the mean teacher-forced log-probability of the
key's tokens (each key token fed in turn, decoding under the pruned cache). Policies:
``none`` (the full cache), ``streaming_llm``, ``key_norm``, ``paged_eviction``
(``recipes/``). With ``--openvino-python``, OpenVINO GenAI's own cache eviction
(``CacheEvictionConfig``, attention-score based, SUM aggregation) at the same budgets runs
the same prompts in that interpreter.

**Speed.** Batch 8 of ``--speed-length`` tokens, 64 greedy tokens each: decode tok/s (after
the last first token) and KV bytes per sequence, full cache vs ``--speed-budget``,
alternating rounds; medians reported.

Writes ``bench/results/longcontext.json`` and ``docs/img/longcontext.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).parent / "results" / "longcontext.json"
PLOT = Path(__file__).parent.parent / "docs" / "img" / "longcontext.png"
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
POLICIES = ("none", "streaming_llm", "key_norm", "paged_eviction")
DEFAULT_OV_MODEL = Path.home() / ".cache" / "flexpage" / "openvino" / "SmolLM2-135M-Instruct-fp16"

_TASK = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.\n")
_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
_QUESTION = "\nWhat is the pass key? The pass key is"
#: the "varied" haystack: these sentences in a shuffled order, so no two stretches of filler repeat
_SENTENCES = (
    "A river bends around the old mill.", "The library opens at nine on weekdays.",
    "Seven boats waited near the harbour wall.", "Her bicycle had a loose front wheel.",
    "Snow fell quietly over the northern hills.", "The baker sold out of rye bread by noon.",
    "Two owls nested in the chapel tower.", "The train to the coast was twenty minutes late.",
    "A red kite circled above the barley field.", "The museum keeps a map drawn in 1820.",
    "His garden grows beans, leeks and tall sunflowers.", "The market square fills with stalls on Fridays.",
    "Fog rolled in from the bay before dawn.", "The teacher read a story about a lighthouse.",
    "A narrow bridge crosses the canal by the school.", "The orchestra rehearsed in the empty hall.",
    "Rain tapped against the greenhouse roof.", "The shop on the corner repairs old clocks.",
    "Wild thyme grows between the stones of the path.", "A fox crossed the road near the farm gate.",
)


def passkey_prompt(tokenizer, length: int, depth: float, key: int, haystack: str = "repeat",  # noqa: ANN001
                   rng: np.random.Generator | None = None) -> str:
    """A raw completion prompt of about ``length`` tokens with the key at ``depth`` of the filler."""
    fixed = len(tokenizer(_TASK + _NEEDLE.format(key=key) + _QUESTION).input_ids)
    if haystack == "repeat":
        sentences = [_FILLER]
        per_sentence = len(tokenizer(_FILLER * 10).input_ids) / 10
    else:
        rng = rng or np.random.default_rng(0)
        sentences = [_SENTENCES[i] + " " for i in rng.permutation(len(_SENTENCES) * 40) % len(_SENTENCES)]
        per_sentence = len(tokenizer("".join(sentences[:40])).input_ids) / 40
    count = max(1, int((length - fixed) / per_sentence))
    filler = [sentences[i % len(sentences)] for i in range(count)]
    before = round(count * depth)
    return _TASK + "".join(filler[:before]) + _NEEDLE.format(key=key) + "".join(filler[before:]) + _QUESTION


def passkey_cases(tokenizer, length: int, samples: int, seed: int = 0, haystack: str = "repeat") -> list[dict]:  # noqa: ANN001
    rng = np.random.default_rng(seed + length)
    cases = []
    for depth in DEPTHS:
        for _ in range(samples):
            key = int(rng.integers(10000, 100000))
            prompt = passkey_prompt(tokenizer, length, depth, key, haystack, rng)
            cases.append({"depth": depth, "key": key, "prompt": prompt})
    return cases


def first_number(text: str) -> int | None:
    match = re.search(r"\d+", text)
    return int(match.group()) if match else None


# -- flexpage ------------------------------------------------------------------------------------
def flexpage_accuracy(policy: str, cases: list[dict], budgets: list[int], dtype: str) -> dict:
    """Per budget: answers and teacher-forced key log-probabilities (one engine per policy)."""
    import torch

    from flexpage import LLM, SamplingParams

    llm = LLM(dtype=dtype, kv_eviction=policy, max_model_len=8192, kv_cache_memory="4GiB")  # every prompt stays cached
    engine = llm.engine
    out: dict = {}
    for budget in ([None] if policy == "none" else budgets):
        params = SamplingParams(temperature=0, max_tokens=8, kv_budget=budget)
        answers = llm.generate([c["prompt"] for c in cases], params)
        key_logprobs = [forced_logprob(engine, c["prompt"], " " + str(c["key"]), budget, torch)
                        for c in cases]
        out[str(budget)] = {
            "correct": [first_number(a.outputs[0].text) == c["key"] for a, c in zip(answers, cases)],
            "key_logprob": key_logprobs,
            "evicted_tokens": [a.metrics.evicted_tokens for a in answers],
        }
    return out


def forced_logprob(engine, prompt: str, forced_text: str, budget: int | None, torch) -> float:  # noqa: ANN001
    """Sum of log p(token) over ``forced_text``'s tokens, each fed to the engine in turn (decoding
    under the pruned cache, as generation would): the engine's sampling step is wrapped to read
    the full distribution and replace the sampled token with the forced one."""
    from flexpage import SamplingParams

    forced = engine.tokenizer(forced_text, add_special_tokens=False).input_ids
    request_id = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=len(forced), kv_budget=budget,
                                                           ignore_eos=True))
    seq = engine.requests[request_id].seqs[0]
    executor = engine.executor
    total, original = 0.0, executor._sample

    def sample_forced(logits, rows, result):  # noqa: ANN001, ANN202
        nonlocal total  # the only request in flight: one row
        i = seq.num_output_tokens
        total += float(torch.log_softmax(logits[rows[0].logits_row].float(), -1)[forced[i]])
        original(logits, rows, result)
        result.token_ids[0] = [forced[i]]  # appended instead of the sampled one; the next step computes its KV

    executor._sample = sample_forced
    try:
        while request_id in engine.requests:
            engine.step()
    finally:
        del executor._sample
    return total


def flexpage_speed(budget: int | None, length: int, batch: int, dtype: str) -> dict:
    """Decode tok/s of ``batch`` sequences of ``length`` prompt tokens, from the step after the
    last one's first token to the end, and the KV blocks they hold meanwhile."""
    from flexpage import LLM, SamplingParams

    llm = LLM(dtype=dtype, max_model_len=8192, enable_prefix_caching=False)
    engine = llm.engine
    engine.warm_up()
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, kv_budget=budget)

    def run() -> tuple[float, int]:
        ids = [engine.add_request({"prompt_token_ids": rng.integers(100, 40000, size=length).tolist()}, params)
               for _ in range(batch)]
        seqs = [engine.requests[i].seqs[0] for i in ids]
        while not all(s.num_output_tokens for s in seqs):  # prefills
            engine.step()
        start, decoded, held = time.perf_counter(), sum(s.num_output_tokens for s in seqs), 0
        while engine.has_unfinished_requests():
            held = max(held, engine.block_manager.stats().used)
            engine.step()
        return (batch * 64 - decoded) / (time.perf_counter() - start), held

    run()  # the same shapes once, warm
    tok_s, held = run()
    bytes_per_block = engine.runner.pool.bytes_per_token * engine.config.block_size
    return {"decode_tok_s": tok_s, "kv_bytes_per_seq": held * bytes_per_block / batch}


def hf_agreement(cases: list[dict]) -> dict:
    """Full-cache answers of flexpage and HF transformers' ``generate`` (greedy, fp32) on the same prompts."""
    import torch
    from transformers import AutoModelForCausalLM

    from flexpage import LLM, SamplingParams
    from flexpage.model.loader import resolve_model_path

    llm = LLM(dtype="float32", max_model_len=8192, kv_cache_memory="4GiB")
    ours = [o.outputs[0].token_ids for o in llm.generate([c["prompt"] for c in cases],
                                                            SamplingParams(temperature=0, max_tokens=8))]
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(None), dtype=torch.float32).eval()
    theirs = []
    for case in cases:
        ids = llm.engine.tokenizer(case["prompt"], return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                                 pad_token_id=llm.engine.tokenizer.eos_token_id)
        theirs.append(out[0, ids.shape[1]:].tolist())
    return {"equal": [a == b[:len(a)] for a, b in zip(ours, theirs)],
            "hf_correct": [first_number(llm.engine.tokenizer.decode(t)) == c["key"] for t, c in zip(theirs, cases)]}


# -- OpenVINO GenAI ------------------------------------------------------------------------------
def openvino_accuracy(model: str, cases: list[dict], budgets: list[int]) -> dict:
    import openvino_genai as genai

    out: dict = {}
    for budget in [None, *budgets]:  # None: its full cache
        scheduler = genai.SchedulerConfig()
        scheduler.cache_size = 2
        scheduler.max_num_batched_tokens = 8192
        if budget is not None:  # start 32 tokens (one of its blocks), recent a quarter of the budget
            scheduler.use_cache_eviction = True
            scheduler.cache_eviction_config = genai.CacheEvictionConfig(32, max(32, budget // 4), budget,
                                                                        genai.AggregationMode.SUM)
        pipe = genai.ContinuousBatchingPipeline(model, scheduler, "CPU")
        config = genai.GenerationConfig()
        config.max_new_tokens, config.do_sample = 8, False
        config.apply_chat_template = False  # a raw completion prompt, as flexpage gets it
        results = pipe.generate([c["prompt"] for c in cases], [config] * len(cases))
        out[str(budget)] = {"correct": [first_number(r.m_generation_ids[0]) == c["key"]
                                        for r, c in zip(results, cases)]}
        del pipe
    return out


# -- driver --------------------------------------------------------------------------------------
def run_worker(args: argparse.Namespace) -> dict:
    if args.worker == "speed":
        return flexpage_speed(args.budget, args.speed_length, args.batch, args.dtype)
    cases = json.loads(Path(args.cases).read_text())  # built once by the driver (the OpenVINO venv lacks flexpage's model)
    if args.worker == "hf":
        return hf_agreement(cases)
    if args.worker == "openvino":
        return openvino_accuracy(str(args.openvino_model), cases, args.budgets)
    return flexpage_accuracy(args.worker, cases, args.budgets, args.dtype)


def in_subprocess(python: str, *argv: str) -> dict:
    """Each engine in its own process (a fresh pool, no allocator state carried over)."""
    cmd = [python, "-m", "bench.longcontext", *argv]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parent.parent,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarise_cell(cell: dict) -> dict:
    summary = {"accuracy": sum(cell["correct"]) / len(cell["correct"]), "n": len(cell["correct"])}
    if "key_logprob" in cell:
        summary["key_logprob"] = statistics.mean(cell["key_logprob"])
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--haystack", choices=("repeat", "varied"), default="repeat",
                   help="repeat: one filler passage over and over (Mohtashami & Jaggi); varied: 20 distinct "
                        "sentences in shuffled order (results in longcontext-varied.json)")
    p.add_argument("--samples", type=int, default=4, help="prompts per depth (5 depths)")
    p.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--openvino-python", default=os.environ.get("FLEXPAGE_OPENVINO_PYTHON"))
    p.add_argument("--openvino-model", type=Path, default=DEFAULT_OV_MODEL)
    p.add_argument("--speed-length", type=int, default=4096)
    p.add_argument("--speed-budget", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2, help="speed rounds per configuration")
    p.add_argument("--speed-only", action="store_true")
    p.add_argument("--accuracy-only", action="store_true")
    p.add_argument("--check-hf", action="store_true", help="first: flexpage's full-cache answers vs HF generate, fp32")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--cases", help=argparse.SUPPRESS)
    p.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(run_worker(args)))
        return

    results, plot_path = RESULTS, PLOT
    if args.haystack != "repeat":
        results = RESULTS.with_name(f"longcontext-{args.haystack}.json")
        plot_path = PLOT.with_name(f"longcontext-{args.haystack}.png")
    result: dict = {"haystack": args.haystack, "budgets": args.budgets, "samples_per_cell": 5 * args.samples, "dtype": args.dtype,
                    "accuracy": {}, "speed": {}}
    common = ["--dtype", args.dtype, "--budgets", *map(str, args.budgets)]
    case_files = {}
    if not args.speed_only or args.check_hf:
        from flexpage.model.loader import load_tokenizer, resolve_model_path

        tokenizer = load_tokenizer(resolve_model_path(None))
        for length in args.lengths:
            case_files[length] = Path(tempfile.mkdtemp()) / f"passkey-{length}.json"
            case_files[length].write_text(json.dumps(passkey_cases(tokenizer, length, args.samples,
                                                                   haystack=args.haystack)))
    if args.check_hf:
        for length in args.lengths:
            raw = in_subprocess(sys.executable, "--worker", "hf", "--cases", str(case_files[length]), *common)
            result["hf_agreement"] = {**result.get("hf_agreement", {}), str(length): {
                "flexpage_equals_hf": sum(raw["equal"]) / len(raw["equal"]),
                "hf_accuracy": sum(raw["hf_correct"]) / len(raw["hf_correct"]), "n": len(raw["equal"])}}
            print(length, "flexpage vs HF generate (fp32):", result["hf_agreement"][str(length)], flush=True)
    if not args.speed_only:
        for length in args.lengths:
            cells: dict = {}
            for policy in POLICIES:
                raw = in_subprocess(sys.executable, "--worker", policy, "--cases", str(case_files[length]), *common)
                for budget, cell in raw.items():
                    cells[f"{policy}@{budget}"] = summarise_cell(cell)
                print(length, policy, {k: v for k, v in cells.items() if k.startswith(policy)}, flush=True)
            if args.openvino_python:
                raw = in_subprocess(args.openvino_python, "--worker", "openvino", "--cases", str(case_files[length]),
                                    "--openvino-model", str(args.openvino_model), *common)
                for budget, cell in raw.items():
                    cells[f"openvino@{budget}"] = summarise_cell(cell)
                print(length, "openvino", {k: v for k, v in cells.items() if k.startswith("openvino")}, flush=True)
            result["accuracy"][str(length)] = cells
    if not args.accuracy_only:
        runs: dict = {"full": [], "budget": []}
        for _ in range(args.rounds):  # alternating, each in a fresh process
            for name, budget in (("full", None), ("budget", args.speed_budget)):
                argv = ["--worker", "speed", "--speed-length", str(args.speed_length), "--batch", str(args.batch),
                        "--dtype", args.dtype] + ([] if budget is None else ["--budget", str(budget)])
                runs[name].append(in_subprocess(sys.executable, *argv))
                print(name, runs[name][-1], flush=True)
        med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
        result["speed"] = {"length": args.speed_length, "batch": args.batch, "budget": args.speed_budget,
                           "runs": runs, "median": med,
                           "decode_speedup": med["budget"]["decode_tok_s"] / med["full"]["decode_tok_s"],
                           "kv_bytes_ratio": med["budget"]["kv_bytes_per_seq"] / med["full"]["kv_bytes_per_seq"]}
        print(json.dumps({k: v for k, v in result["speed"].items() if k != "runs"}, indent=1))
    results.parent.mkdir(exist_ok=True)
    if results.exists():  # keep the other half when only one half ran
        old = json.loads(results.read_text())
        for part in ("accuracy", "speed", "hf_agreement"):
            result[part] = result.get(part) or old.get(part, {})
    results.write_text(json.dumps(result, indent=1))
    if result["accuracy"]:
        plot(result, plot_path)


def plot(result: dict, path: Path) -> None:
    """Accuracy (top) and teacher-forced key log-probability (bottom) against the budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = list(result["accuracy"])
    fig, axes = plt.subplots(2, len(lengths), figsize=(5 * len(lengths), 6.4), squeeze=False, sharex=True)
    styles = {"streaming_llm": "s-", "key_norm": "^-", "paged_eviction": "o-", "openvino": "x--"}
    for column, length in enumerate(lengths):
        cells = result["accuracy"][length]
        for row, metric in enumerate(("accuracy", "key_logprob")):
            ax = axes[row][column]
            for policy, style in styles.items():
                xs = [b for b in result["budgets"] if metric in cells.get(f"{policy}@{b}", {})]
                if xs:
                    ax.plot(xs, [cells[f"{policy}@{b}"][metric] for b in xs], style, label=policy, alpha=0.8)
            if metric in cells.get("none@None", {}):
                ax.axhline(cells["none@None"][metric], color="gray", linestyle=":", label="full cache")
            ax.set_xscale("log", base=2)
            ax.set_xticks(result["budgets"], [str(b) for b in result["budgets"]])
            ax.set_ylabel("exact-match accuracy" if metric == "accuracy" else "key log-prob (nats)")
            if row == 0:
                ax.set_title(f"passkey, {length} tokens")
                ax.set_ylim(-0.05, 1.05)
            else:
                ax.set_xlabel("KV budget (tokens per layer)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
