"""The 8-bit KV cache against the model-dtype cache: capacity, accuracy and decode speed, in one run.

    python -m bench.kv_dtype [--rounds 3] [--contexts 512 8192] [--batch 8] [--nll-tokens 4096]
                             [--chat-prompts 50] [--passkey-lengths 2048 4096] [--samples 2] [--quick]

Two engines on the default model (SmolLM2-135M-Instruct, the engine's defaults otherwise),
``kv_cache_dtype="auto"`` (bf16 where the CPU computes bf16, else float32) and ``"int8"``, each
with the same ``kv_cache_memory``:

* **capacity**: the tokens each pool holds (``kv_capacity_tokens``) and their ratio;
* **likelihood**: the mean teacher-forced negative log-likelihood of a fixed ~4k-token text
  (Python's topic documentation from its middle; the int8 scales are calibrated on its start)
  through ``SamplingParams(prompt_logprobs=0)``;
* **greedy agreement**: the first 64 greedy tokens of ``--chat-prompts`` chat prompts (one user
  turn each, built from fixed tasks and subjects), identical or not; beside it two floors: the
  model-dtype engine against itself with each of the first 20 prompts run alone (in bf16 a
  batch's composition alone changes continuations at near-ties), and the same comparison of
  the caches on float32 engines (``--float32-agreement``: where batching changes nothing, only
  the cache's rounding differs);
* **passkey**: ``bench.longcontext``'s passkey retrieval at 2k and 4k tokens (5 depths x
  ``--samples``), exact match;
* **decode speed**: ``--batch`` sequences of each ``--contexts`` length of random tokens, 64
  greedy tokens each; tok/s from the step after the last first token to the end. The prompts are
  prefilled in a first round and cached; every timed round reuses them (prefix caching), so it
  times decode only, each sequence reading its own KV. Rounds alternate the two engines; medians.
  With ``--openvino-python``, OpenVINO GenAI's ``ContinuousBatchingPipeline`` (its u8 KV cache,
  the x86 default, asked for by name; prefix caching on) decodes the same prompts in that
  interpreter: per round the time of 65 new tokens less the time of 1 (both after a first run
  cached the prompts), 64 x batch tokens over the difference.

Writes bench/results/kv_dtype.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

from bench.longcontext import first_number, passkey_cases


def in_subprocess(python: str, *argv: str) -> dict:
    """``python -m bench.kv_dtype *argv`` in another interpreter; its last line of output, as JSON."""
    root = Path(__file__).parent.parent
    done = subprocess.run([python, "-m", "bench.kv_dtype", *argv], capture_output=True, text=True, cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)})
    if done.returncode:
        raise RuntimeError(f"the OpenVINO worker failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])

RESULTS = Path(__file__).parent / "results" / "kv_dtype.json"
DTYPES = ("auto", "int8")
TASKS = ("Explain in two sentences what {} is.", "Write a short poem about {}.", "Give three facts about {}.",
         "What is the history of {}?", "How would you teach {} to a child?")
SUBJECTS = ("photosynthesis", "the French revolution", "prime numbers", "the moon", "coffee", "volcanoes",
            "the internet", "honey bees", "chess", "rainbows")


def chat_prompts(tokenizer, count: int) -> list[list[int]]:  # noqa: ANN001
    """``count`` one-turn chat prompts (task x subject), as token ids through the chat template."""
    texts = [task.format(subject) for subject in SUBJECTS for task in TASKS][:count]
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
             for t in texts]
    return [tokenizer(chat, add_special_tokens=False).input_ids for chat in chats]


def scored_text(tokenizer, tokens: int) -> list[int]:  # noqa: ANN001
    """``tokens`` token ids from the middle of Python's topic documentation (the calibration text's start excluded)."""
    from pydoc_data.topics import topics

    ids = tokenizer("\n\n".join(topics[k] for k in sorted(topics))).input_ids
    middle = len(ids) // 2
    return ids[middle:middle + tokens]


def nll(llm, ids: list[int]) -> float:  # noqa: ANN001
    from flexpage import SamplingParams

    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    logprobs = [entry[token].logprob for token, entry in zip(ids[1:], out.prompt_logprobs[1:])]
    return -float(np.mean(logprobs))


def identical(a: list[list[int]], b: list[list[int]]) -> dict:
    same = [x == y for x, y in zip(a, b)]
    return {"count": sum(same), "of": len(same), "fraction": sum(same) / len(same)}


def decode_speed(llm, prompts: list[list[int]]) -> float:  # noqa: ANN001
    """Decode tok/s of ``prompts`` run together, 64 greedy tokens each (see the module docstring)."""
    from flexpage import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    seqs = [engine.requests[engine.add_request({"prompt_token_ids": p}, params)].seqs[0] for p in prompts]
    while not all(s.num_output_tokens for s in seqs):
        engine.step()
    start, decoded = time.perf_counter(), sum(s.num_output_tokens for s in seqs)
    while engine.has_unfinished_requests():
        engine.step()
    return (len(prompts) * 64 - decoded) / (time.perf_counter() - start)


def openvino_decode(model: str, contexts: list[int], batch: int, rounds: int) -> dict:
    """OpenVINO GenAI's decode tok/s with its u8 KV cache (see the module docstring)."""
    import openvino as ov
    import openvino_genai as genai

    scheduler = genai.SchedulerConfig()
    scheduler.cache_size = 2  # GB
    scheduler.max_num_batched_tokens = 2048
    scheduler.enable_prefix_caching = True
    pipe = genai.ContinuousBatchingPipeline(model, scheduler, "CPU", {"KV_CACHE_PRECISION": "u8"})

    def run(prompts: list[list[int]], new_tokens: int) -> float:
        config = genai.GenerationConfig()
        config.max_new_tokens, config.ignore_eos, config.do_sample = new_tokens, True, False
        start = time.perf_counter()
        pipe.generate([ov.Tensor(np.array([p], dtype=np.int64)) for p in prompts], [config] * len(prompts))
        return time.perf_counter() - start

    rng = np.random.default_rng(0)
    out = {}
    for context in contexts:
        prompts = [rng.integers(100, 40000, size=context).tolist() for _ in range(batch)]
        run(prompts, 1)  # into its prefix cache
        rates = [batch * 64 / (run(prompts, 65) - run(prompts, 1)) for _ in range(rounds)]
        out[str(context)] = {"rounds": rates, "median": statistics.median(rates)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 8192])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--nll-tokens", type=int, default=4096)
    parser.add_argument("--chat-prompts", type=int, default=50)
    parser.add_argument("--passkey-lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument("--quick", action="store_true", help="small sizes, to check the script runs")
    parser.add_argument("--float32-agreement", action="store_true",
                        help="also compare the caches' greedy tokens on float32 engines")
    parser.add_argument("--openvino-python", help="an interpreter with openvino_genai: its u8 cache decodes too")
    parser.add_argument("--openvino-model", help="the default model as OpenVINO IR (bench.anchors exports one)")
    parser.add_argument("--openvino-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.openvino_worker:
        print(json.dumps(openvino_decode(args.openvino_model, args.contexts, args.batch, args.rounds)))
        return
    if args.quick:
        args.rounds, args.contexts, args.batch, args.nll_tokens = 1, [256], 2, 256
        args.chat_prompts, args.passkey_lengths, args.samples = 4, [512], 1

    from flexpage import LLM, SamplingParams

    longest = max(args.contexts + args.passkey_lengths + [args.nll_tokens]) + 256
    llms = {dtype: LLM(kv_cache_dtype=dtype, kv_cache_memory=args.kv_cache_memory, max_model_len=longest)
            for dtype in DTYPES}
    tokenizer = llms["auto"].engine.tokenizer
    result: dict = {"dtype": {d: str(llm.engine.runner.pool.dtype).replace("torch.", "") for d, llm in llms.items()},
                    "args": {k: str(v) for k, v in vars(args).items()}}

    result["capacity_tokens"] = {d: int(llm.engine.stats()["kv_capacity_tokens"]) for d, llm in llms.items()}
    result["capacity_ratio"] = result["capacity_tokens"]["int8"] / result["capacity_tokens"]["auto"]

    ids = scored_text(tokenizer, args.nll_tokens)
    result["nll"] = {d: nll(llm, ids) for d, llm in llms.items()}
    result["nll_vs_auto_percent"] = 100 * (result["nll"]["int8"] / result["nll"]["auto"] - 1)

    prompts = chat_prompts(tokenizer, args.chat_prompts)
    greedy = SamplingParams(temperature=0, max_tokens=64)
    tokens = {d: [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)]
              for d, llm in llms.items()}
    result["greedy_identical"] = identical(tokens["auto"], tokens["int8"])
    alone = [llms["auto"].generate([{"prompt_token_ids": p}], greedy)[0].outputs[0].token_ids for p in prompts[:20]]
    result["greedy_identical_auto_alone_vs_batched"] = identical(tokens["auto"][:20], alone)
    if args.float32_agreement:
        fp32 = {}
        for dtype in DTYPES:
            llm = LLM(kv_cache_dtype=dtype, dtype="float32", kv_cache_memory="512MiB", max_model_len=1024)
            fp32[dtype] = [o.outputs[0].token_ids
                           for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)]
            llm.engine.close()
        result["greedy_identical_float32"] = identical(fp32["auto"], fp32["int8"])

    result["passkey"] = {}
    for length in args.passkey_lengths:
        cases = passkey_cases(tokenizer, length, args.samples)
        cell = {}
        for d, llm in llms.items():
            answers = llm.generate([c["prompt"] for c in cases], SamplingParams(temperature=0, max_tokens=8))
            cell[d] = sum(first_number(a.outputs[0].text) == c["key"] for a, c in zip(answers, cases)) / len(cases)
        result["passkey"][str(length)] = cell

    rng = np.random.default_rng(0)
    result["decode_tok_s"] = {}
    for context in args.contexts:
        batch = [rng.integers(100, 40000, size=context).tolist() for _ in range(args.batch)]
        for llm in llms.values():
            decode_speed(llm, batch)  # prefills the prompts into the prefix cache, compiles the shapes
        times: dict[str, list[float]] = {d: [] for d in DTYPES}
        for r in range(args.rounds):
            for d in (DTYPES if r % 2 == 0 else DTYPES[::-1]):
                times[d].append(decode_speed(llms[d], batch))
        medians = {d: statistics.median(v) for d, v in times.items()}
        result["decode_tok_s"][str(context)] = {"rounds": times, "median": medians,
                                                "int8_over_auto": medians["int8"] / medians["auto"]}
        print(f"context {context} x {args.batch}: {medians} -> int8 {medians['int8'] / medians['auto']:.2f}x", flush=True)

    if args.openvino_python:
        llms.clear()  # the pools' memory back before OpenVINO's cache
        llm = None
        ov = in_subprocess(args.openvino_python, "--openvino-worker", "--openvino-model", args.openvino_model,
                           "--batch", str(args.batch), "--rounds", str(args.rounds),
                           "--contexts", *map(str, args.contexts))
        result["openvino_u8_decode_tok_s"] = ov
        for context, cell in ov.items():
            result["decode_tok_s"][context]["int8_over_openvino_u8"] = (
                result["decode_tok_s"][context]["median"]["int8"] / cell["median"])
    print(json.dumps({k: v for k, v in result.items() if k != "args"}, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
