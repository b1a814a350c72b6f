"""Tensor parallelism: one process vs two ranks on this machine, for a ~1B Llama-shaped model.

    python -m bench.tp [--rounds 2] [--quick]

The model has TinyLlama-1.1B's shape (22 layers, hidden 2048, 32 query / 4 KV heads, MLP
5632, vocabulary 32000) with random weights, in the engine's default dtype for this CPU. Each
round builds a TP=1 engine, measures it, closes it, then does the same with TP=2 (two ranks
spawned on this host, each with half the cores); rounds alternate the order. Per engine,
after its warm-up (compiled step):

* **decode step** at batch 1 and 32 (128-token prompts, prefilled first): median of 10
  ``engine.step()`` calls after 2 untimed ones;
* **prefill step**: 4 new 256-token prompts in one step;
* **communication per decode step** (TP=2), two ways: rank 0's time inside the collectives
  -- the sums, the logits' gather and the step's broadcast -- from ``torch.profiler`` over 4
  decode steps (``_c10d_functional`` and ``c10d`` events; waits included, so the time rank 0
  waits for a slower peer counts here), and the collectives alone: the same ones, same shapes,
  in one compiled graph on two fresh ranks with nothing else to do (median of 10); and the
  bytes each step's collectives carry.

Medians over rounds; TP=2 / TP=1 ratios. Writes --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from flexpage import LLM, SamplingParams
from flexpage.model.loader import resolve_model_path

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "tp.json"
CACHE = Path(os.environ.get("FLEXPAGE_BENCH_CACHE", Path.home() / ".cache" / "flexpage"))
#: TinyLlama-1.1B's shape (a Llama-2-architecture model of ~1.1B parameters)
SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
             num_key_value_heads=4, head_dim=64, vocab_size=32000, max_position_embeddings=2048,
             rms_norm_eps=1e-5, tie_word_embeddings=False)
QUICK_LAYERS = 2
PROMPT, PREFILL = 128, 256
BATCHES = (1, 32)
#: profiler event names of communication (functional collectives in the compiled graph, the
#: step broadcast through torch.distributed)
COMM_EVENTS = ("_c10d_functional::", "c10d::", "gloo:")


def model_folder(quick: bool) -> Path:
    """A random-weight checkpoint of :data:`SHAPE` (built once, then cached on disk)."""
    layers = QUICK_LAYERS if quick else SHAPE["num_hidden_layers"]
    return random_llama_folder(f"bench-tp-llama-{layers}l", {**SHAPE, "num_hidden_layers": layers})


def random_llama_folder(name: str, shape: dict) -> Path:
    """A random-weight bf16 Llama checkpoint of ``shape`` under the bench cache as ``name`` (built
    once, then cached on disk), with the default model's tokenizer files."""
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

    folder = CACHE / name
    if (folder / "config.json").is_file():
        return folder
    config = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2)
    model.save_pretrained(folder)
    tokenizer = resolve_model_path(None)  # its ids cover ours; only detokenising uses it
    for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer / file).is_file():
            shutil.copy(tokenizer / file, folder / file)
    return folder


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, SHAPE["vocab_size"], (length,), generator=g).tolist() for _ in range(count)]


def decode_ms(llm: LLM, batch: int, profile_steps: int) -> tuple[float, float]:
    """Median ms of a decode step of ``batch`` sequences, and rank 0's ms in collectives per
    step (profiled separately, after the timed steps)."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    for i, p in enumerate(prompts(batch, PROMPT, seed=batch)):
        engine.add_request({"prompt_token_ids": p}, params, request_id=f"d{batch}-{i}")
    while any(not r.outputs[0].token_ids for r in engine.requests.values()):
        engine.step()
    times = []
    for _ in range(12):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    comm = 0.0
    if profile_steps:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(profile_steps):
                engine.step()
        comm = sum(e.cpu_time_total for e in prof.key_averages()
                   if e.key.startswith(COMM_EVENTS)) / 1000 / profile_steps
    for request_id in list(engine.requests):
        engine.abort(request_id)
    engine.step()
    return statistics.median(times[2:]) * 1000, comm


def prefill_ms(llm: LLM) -> float:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for r in range(3):
        for i, p in enumerate(prompts(4, PREFILL, seed=100 + r)):
            engine.add_request({"prompt_token_ids": p}, params, request_id=f"p{r}-{i}")
        start = time.perf_counter()
        while engine.requests:
            engine.step()
        times.append(time.perf_counter() - start)
    engine.reset_prefix_cache()
    return statistics.median(times) * 1000


def bytes_per_decode_step(batch: int, tp: int, dtype: torch.dtype, layers: int) -> int:
    """What one decode step's collectives carry out of each rank: two all-reduces per layer and
    one for the embedding, of ``[rows, hidden]`` (rows padded as the compiled step pads them), and
    the LM head's slice of the logits gathered from every rank."""
    if tp == 1:
        return 0
    from flexpage.model.packed_linear import padded_rows

    size = torch.empty((), dtype=dtype).element_size()
    rows = padded_rows(batch)
    reduces = (2 * layers + 1) * rows * SHAPE["hidden_size"] * size
    logits = padded_rows(batch) * SHAPE["vocab_size"] // tp * size
    return reduces + logits


def _collectives_rank(rank: int, port: int, rows: int, layers: int, out: dict) -> None:
    """One of two ranks timing a decode step's collectives alone (see :func:`collectives_ms`)."""
    import torch.distributed as dist

    from flexpage.model.tensor_parallel import TensorParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    parallel = TensorParallel(rank, 2, dist.new_group(backend="gloo"))
    hidden = torch.randn(rows, SHAPE["hidden_size"])
    logits = torch.randn(rows, SHAPE["vocab_size"] // 2)

    def step(h: torch.Tensor, lg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for _ in range(2 * layers + 1):  # o and down per layer, and the embedding
            h = parallel.all_reduce(h) * 0.5
        return h, parallel.gather_columns(lg)

    compiled = torch.compile(step, fullgraph=True)
    times = []
    for i in range(12):
        dist.barrier(parallel.group)
        start = time.perf_counter()
        compiled(hidden, logits)
        times.append(time.perf_counter() - start)
    if rank == 0:
        out["ms"] = statistics.median(times[2:]) * 1000
    dist.destroy_process_group()


def collectives_ms(batch: int, layers: int) -> float:
    """Median ms of one decode step's collectives alone on two fresh ranks (compiled, as in the step)."""
    import torch.multiprocessing as mp

    from flexpage.model.packed_linear import padded_rows
    from flexpage.parallel.launch import free_port

    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_collectives_rank, args=(free_port(), padded_rows(batch), layers, out), nprocs=2)
        return out["ms"]


def measure(tp: int, quick: bool) -> dict:
    folder = model_folder(quick)
    start = time.perf_counter()
    llm = LLM(str(folder), tensor_parallel_size=tp, max_num_seqs=32, max_model_len=2048, kv_cache_memory="1GiB")
    load_s = time.perf_counter() - start
    try:
        warm_s = llm.engine.warm_up()
        result: dict = {"tp": tp, "load_s": load_s, "warm_up_s": warm_s, "dtype": str(llm.engine.dtype)}
        for batch in BATCHES:
            step, comm = decode_ms(llm, batch, profile_steps=4 if tp > 1 else 0)
            result[f"decode_b{batch}_ms"] = step
            if tp > 1:
                layers = len(llm.engine.runner.compact.layers)
                result[f"comm_b{batch}_ms"] = comm
                result[f"comm_b{batch}_bytes"] = bytes_per_decode_step(batch, tp, llm.engine.dtype, layers)
        result["prefill_4x256_ms"] = prefill_ms(llm)
    finally:
        llm.engine.close()
    if tp > 1:  # after the engine is gone: the ranks then have the machine to themselves
        for batch in BATCHES:
            result[f"collectives_alone_b{batch}_ms"] = collectives_ms(batch, layers)
    return result


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


def summarise(rounds: list[dict]) -> dict:
    by_tp: dict[int, dict[str, float]] = {}
    for tp in (1, 2):
        runs = [r for r in rounds if r["tp"] == tp]
        keys = [k for k in runs[0] if k.endswith(("_ms", "_s", "_bytes"))]
        by_tp[tp] = {k: statistics.median(r[k] for r in runs) for k in keys}
    one, two = by_tp[1], by_tp[2]
    ratios = {k: two[k] / one[k] for k in one if k.startswith(("decode", "prefill"))}
    comm_share = {f"b{b}": two[f"comm_b{b}_ms"] / two[f"decode_b{b}_ms"] for b in BATCHES}
    alone_share = {f"b{b}": two[f"collectives_alone_b{b}_ms"] / two[f"decode_b{b}_ms"] for b in BATCHES}
    return {"shape": SHAPE, "rounds": rounds, "median": {str(k): v for k, v in by_tp.items()},
            "tp2_over_tp1": ratios, "comm_share_of_decode_step": comm_share,
            "collectives_alone_share_of_decode_step": alone_share,
            "machine": {"cpus": os.cpu_count(), "torch_threads_tp1": torch.get_num_threads()}}


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    one, two = result["median"]["1"], result["median"]["2"]
    table = Table(title="TP=1 vs TP=2, ~1.1B Llama shape (median over rounds)")
    for column in ("", "TP=1", "TP=2", "TP=2 / TP=1", "rank 0 in collectives", "collectives alone", "bytes"):
        table.add_column(column, justify="right")
    for batch in BATCHES:
        key, b = f"decode_b{batch}_ms", f"b{batch}"
        table.add_row(f"decode step, batch {batch}", f"{one[key]:.0f} ms", f"{two[key]:.0f} ms",
                      f"{two[key] / one[key]:.2f}",
                      f"{two[f'comm_{b}_ms']:.0f} ms ({result['comm_share_of_decode_step'][b]:.0%})",
                      f"{two[f'collectives_alone_{b}_ms']:.0f} ms "
                      f"({result['collectives_alone_share_of_decode_step'][b]:.0%})",
                      f"{two[f'comm_{b}_bytes'] / 1e6:.1f} MB")
    table.add_row("prefill step, 4 x 256", f"{one['prefill_4x256_ms']:.0f} ms", f"{two['prefill_4x256_ms']:.0f} ms",
                  f"{two['prefill_4x256_ms'] / one['prefill_4x256_ms']:.2f}", "", "", "")
    table.add_row("load / warm-up", f"{one['load_s']:.0f} / {one['warm_up_s']:.0f} s",
                  f"{two['load_s']:.0f} / {two['warm_up_s']:.0f} s", "", "", "", "")
    Console().print(table)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2, help="rounds, each measuring TP=1 and TP=2 (order alternating)")
    p.add_argument("--quick", action="store_true", help=f"{QUICK_LAYERS} layers only (a smoke run; nothing written)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    rounds = []
    for r in range(args.rounds):
        for tp in ((1, 2) if r % 2 == 0 else (2, 1)):
            log(f"round {r + 1}: TP={tp}")
            rounds.append(measure(tp, args.quick))
            log(json.dumps(rounds[-1]))
    result = summarise(rounds)
    print_table(result)
    if not args.quick:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
