"""Online serving benchmark: ``flexpage serve`` vs ``transformers serve`` under Poisson load,
plus a multi-turn chat workload with prefix caching on and off.

Run (from the repository root; every server is started and stopped by the script, on
127.0.0.1 and free ports)::

    python -m bench.serve --out bench/results/serve.json --plot docs/img/serve-latency.png

Workloads (all from one fixed seed):

* **ShareGPT-like** (``--rates``): requests arrive as a Poisson process (exponential
  inter-arrival times) at each rate for ``--duration`` seconds. Prompt and output lengths
  are long-tailed like ShareGPT's, drawn from log-normal distributions and clipped:
  prompt ~ LogNormal(ln 64, 0.8) in [8, 512] tokens, output ~ LogNormal(ln 24, 0.6) in
  [4, 128] tokens (ShareGPT's medians are ~4x larger; scaled down for a small CPU box).
  Prompts are random English words. Every request generates exactly its output length
  (flexpage: ``ignore_eos``; transformers: a ``generation_config`` without EOS), greedy.
* **Multi-turn** (``--multi-turn``): ``--users`` concurrent users, ``--turns`` turns each,
  closed loop (a user sends the next turn as soon as the previous answer is complete).
  Turn 1 carries a ``--doc-tokens`` (1000) token document; later turns add a short question;
  every answer is ``--answer-tokens`` tokens and goes back into the history. Run against
  flexpage with and without ``--no-prefix-caching``.

Metrics per rate: TTFT (send -> first token, queueing included), TPOT ((e2e - TTFT) /
(tokens - 1)), ITL (gaps between streamed chunks), p50/p99 of each; request and token
throughput; goodput = requests per second that met the SLO (TTFT <= ``--slo-ttft`` and
TPOT <= ``--slo-tpot``). Capacity = the highest tested rate whose p99 TTFT stays within
``--slo-ttft``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent

# -- workload -----------------------------------------------------------------------------------
BLOCK_SIZE = 8  # flexpage serve's default --block-size (the prefix cache reuses whole blocks)
PROMPT_DIST = {"median": 64, "sigma": 0.8, "min": 8, "max": 512}
OUTPUT_DIST = {"median": 24, "sigma": 0.6, "min": 4, "max": 128}


def lognormal_int(rng: random.Random, dist: dict[str, float]) -> int:
    value = rng.lognormvariate(math.log(dist["median"]), dist["sigma"])
    return int(min(dist["max"], max(dist["min"], round(value))))


class TextMaker:
    """Random-word texts of an exact token length (as this model's tokenizer counts them)."""

    def __init__(self, tokenizer: Any, seed: int) -> None:
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)
        vocab = [w for w in tokenizer.get_vocab() if w.startswith("Ġ") and w[1:].isalpha() and w[1:].islower()
                 and 3 <= len(w) <= 9]
        vocab.sort()
        self.words = [w[1:] for w in vocab]

    def text(self, num_tokens: int) -> str:
        words = " ".join(self.rng.choice(self.words) for _ in range(num_tokens + 8))
        ids = self.tokenizer(words, add_special_tokens=False).input_ids[:num_tokens]
        return self.tokenizer.decode(ids).strip()


def sharegpt_like(tokenizer: Any, *, rate: float, duration: float, seed: int) -> list[dict[str, Any]]:
    """Poisson arrivals at ``rate`` for ``duration`` s (at least 8 requests)."""
    rng = random.Random(seed * 1000 + int(rate * 1000))
    maker = TextMaker(tokenizer, seed)
    requests, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t > duration and len(requests) >= 8:
            break
        requests.append({"at": t, "prompt": maker.text(lognormal_int(rng, PROMPT_DIST)),
                         "max_tokens": lognormal_int(rng, OUTPUT_DIST)})
    return requests


# -- servers ------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Backend:
    name: str
    command: list[str]
    model_id: str
    port: int
    extra_body: dict[str, Any] = field(default_factory=dict)  # makes outputs exactly max_tokens long
    proc: subprocess.Popen | None = None
    log: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float) -> float:
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"serve-bench-{self.name}-", suffix=".log", delete=False)
        start = time.monotonic()
        self.proc = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; log: {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready after {timeout:.0f} s; log: {self.log.name}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def flexpage_backend(model_path: str, args: argparse.Namespace, *, prefix_caching: bool = True,
                     name: str = "flexpage") -> Backend:
    port = free_port()
    command = [sys.executable, "-m", "flexpage.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--dtype", args.dtype, "--num-blocks", str(args.num_blocks),
               "--max-num-seqs", str(args.max_num_seqs),
               "--max-model-len", "4096", "--served-model-name", "bench-model"]
    if not prefix_caching:
        command.append("--no-prefix-caching")
    return Backend(name, command, "bench-model", port, {"ignore_eos": True})


def transformers_backend(model_path: str, args: argparse.Namespace, *, continuous_batching: bool) -> Backend:
    port = free_port()
    exe = Path(sys.executable).with_name("transformers")
    command = [str(exe), "serve", model_path, "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype,
               "--device", "cpu", "--log-level", "warning"]
    if continuous_batching:
        command.append("--continuous-batching")
    # a generation_config without eos_token_id: generation runs to max_tokens, like ignore_eos
    return Backend("transformers-cb" if continuous_batching else "transformers", command, model_path, port,
                   {"generation_config": json.dumps({"do_sample": False})})


# -- one streamed request ----------------------------------------------------------------------------
@dataclass
class Result:
    ok: bool
    ttft: float = math.nan
    e2e: float = math.nan
    tokens: int = 0
    itls: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    prompt_tokens: int = 0
    text: str = ""
    error: str = ""

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.tokens - 1) if self.tokens > 1 else math.nan


async def stream_request(client: httpx.AsyncClient, backend: Backend, path: str, body: dict[str, Any],
                         timeout: float) -> Result:
    body = {**body, "model": backend.model_id, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}, **backend.extra_body}
    start = time.perf_counter()
    result = Result(ok=False)
    last = None
    chunks = 0
    try:
        async with client.stream("POST", backend.url + path, json=body, timeout=timeout) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                now = time.perf_counter()
                if data.get("usage"):
                    usage = data["usage"]
                    result.tokens = usage.get("completion_tokens", 0)
                    result.prompt_tokens = usage.get("prompt_tokens", 0)
                    result.cached_tokens = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                for choice in data.get("choices") or []:
                    piece = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                    if piece:
                        result.text += piece
                        chunks += 1
                        if last is None:
                            result.ttft = now - start
                        else:
                            result.itls.append(now - last)
                        last = now
        result.e2e = time.perf_counter() - start
        result.tokens = result.tokens or chunks
        result.ok = last is not None
    except (httpx.HTTPError, asyncio.TimeoutError) as error:
        result.error = f"{type(error).__name__}: {error}"
    return result


# -- workloads ------------------------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float:
    values = sorted(v for v in values if not math.isnan(v))
    if not values:
        return math.nan
    k = (len(values) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


async def run_poisson(backend: Backend, requests: list[dict[str, Any]], *, rate: float, max_wait: float,
                      slo_ttft: float, slo_tpot: float) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(limits=limits) as client:
        start = time.perf_counter()
        deadline = start + requests[-1]["at"] + max_wait

        async def one(req: dict[str, Any]) -> Result:
            await asyncio.sleep(max(0.0, start + req["at"] - time.perf_counter()))
            remaining = max(1.0, deadline - time.perf_counter())
            try:
                return await asyncio.wait_for(
                    stream_request(client, backend, "/v1/completions",
                                   {"prompt": req["prompt"], "max_tokens": req["max_tokens"]}, remaining),
                    timeout=remaining)
            except asyncio.TimeoutError:
                return Result(ok=False, error="timeout")

        results = await asyncio.gather(*[one(r) for r in requests])
        duration = time.perf_counter() - start
    done = [r for r in results if r.ok]
    good = [r for r in done if r.ttft <= slo_ttft and (r.tokens <= 1 or r.tpot <= slo_tpot)]
    itls = [x for r in done for x in r.itls]
    out_tokens = sum(r.tokens for r in done)
    summary = {
        "rate": rate, "num_requests": len(results), "completed": len(done), "failed": len(results) - len(done),
        "duration_s": duration,
        "request_throughput": len(done) / duration, "output_token_throughput": out_tokens / duration,
        "goodput": len(good) / duration, "slo_attainment": len(good) / len(results),
        "mean_output_tokens": out_tokens / max(1, len(done)),
    }
    for name, values in (("ttft", [r.ttft for r in done]), ("tpot", [r.tpot for r in done]), ("itl", itls),
                         ("e2e", [r.e2e for r in done])):
        summary[f"{name}_p50"] = pct(values, 50)
        summary[f"{name}_p99"] = pct(values, 99)
    errors = [r.error for r in results if not r.ok]
    if errors:
        summary["errors"] = sorted(set(errors))[:5]
    return summary


WARMUP_GROUPS = [[2], [3], [5], [9], [17], [33], [65], [129], [300], [3, 5], [9, 17], [33, 65], [24] * 5, [24] * 16]


async def warmup(backend: Backend, tokenizer: Any, seed: int) -> None:
    """Untimed traffic so kernel compilation / lazy init is not measured: every prompt-length bucket
    alone and in small batches, a full batch, then a short burst of the real workload's shape."""
    maker = TextMaker(tokenizer, seed + 99)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=100)) as client:
        for group in WARMUP_GROUPS:
            await asyncio.gather(*[stream_request(client, backend, "/v1/completions",
                                                  {"prompt": maker.text(n), "max_tokens": 3}, 600) for n in group])
    burst = sharegpt_like(tokenizer, rate=2.0, duration=12.0, seed=seed + 12345)
    await run_poisson(backend, burst, rate=2.0, max_wait=120.0, slo_ttft=1.0, slo_tpot=1.0)


async def run_multi_turn(backend: Backend, tokenizer: Any, args: argparse.Namespace) -> dict[str, Any]:
    maker = TextMaker(tokenizer, args.seed + 7)
    rng = random.Random(args.seed + 7)
    conversations = []
    for u in range(args.users):
        first = f"Read this document and answer my questions.\n\n{maker.text(args.doc_tokens)}\n\nQuestion 1: " \
                f"{maker.text(12)}?"
        questions = [f"Question {t + 2}: {maker.text(rng.randint(16, 40))}?" for t in range(args.turns - 1)]
        conversations.append((first, questions))
    per_turn: list[list[Result]] = [[] for _ in range(args.turns)]
    reusable = [0, 0]  # [reusable history tokens, cached tokens reported] over turns >= 2
    limits = httpx.Limits(max_connections=100)

    async with httpx.AsyncClient(limits=limits) as client:
        async def user(first: str, questions: list[str]) -> None:
            messages = [{"role": "user", "content": first}]
            previous: Result | None = None
            for turn in range(args.turns):
                result = await stream_request(client, backend, "/v1/chat/completions",
                                              {"messages": messages, "max_tokens": args.answer_tokens}, 900)
                per_turn[turn].append(result)
                if not result.ok:
                    return
                if previous is not None:
                    # KV the previous turn left in full blocks (its last sampled token is never computed);
                    # all of it is reusable iff the template re-renders the answer token-exactly
                    reusable[0] += (previous.prompt_tokens + previous.tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
                    reusable[1] += result.cached_tokens
                previous = result
                messages = messages + [{"role": "assistant", "content": result.text}]
                if turn < len(questions):
                    messages.append({"role": "user", "content": questions[turn]})

        start = time.perf_counter()
        await asyncio.gather(*[user(f, q) for f, q in conversations])
        duration = time.perf_counter() - start
    results = [r for turn in per_turn for r in turn]
    done = [r for r in results if r.ok]
    return {
        "users": args.users, "turns": args.turns, "duration_s": duration,
        "completed_turns": len(done), "failed_turns": len(results) - len(done) + args.users * args.turns - len(results),
        "turn_throughput": len(done) / duration,
        "output_token_throughput": sum(r.tokens for r in done) / duration,
        "prompt_tokens": sum(r.prompt_tokens for r in done),
        "cached_tokens": sum(r.cached_tokens for r in done),
        "history_reuse": {"reusable_tokens": reusable[0], "cached_tokens": reusable[1],
                          "fraction": reusable[1] / reusable[0] if reusable[0] else None},
        "ttft_p50": pct([r.ttft for r in done], 50), "ttft_p99": pct([r.ttft for r in done], 99),
        "per_turn": [{"turn": i + 1, "mean_prompt_tokens": sum(r.prompt_tokens for r in t) / max(1, len(t)),
                      "mean_cached_tokens": sum(r.cached_tokens for r in t) / max(1, len(t)),
                      "mean_ttft": sum(r.ttft for r in t if r.ok) / max(1, len([r for r in t if r.ok]))}
                     for i, t in enumerate(per_turn)],
    }


# -- report --------------------------------------------------------------------------------------------------
def capacity(rows: list[dict[str, Any]], slo_ttft: float) -> float:
    """Highest tested rate whose p99 TTFT is within the SLO and nothing failed (0 if none)."""
    ok = [r["rate"] for r in rows if r["failed"] == 0 and r["ttft_p99"] <= slo_ttft]
    return max(ok, default=0.0)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    slo = results["meta"]["slo"]
    colors = {"flexpage": "tab:blue", "transformers": "tab:red", "transformers-cb": "tab:orange"}
    for name, rows in results["poisson"].items():
        rates = [r["rate"] for r in rows]
        color = colors.get(name)
        axes[0].plot(rates, [r["ttft_p99"] for r in rows], "o-", color=color, label=f"{name} p99")
        axes[0].plot(rates, [r["ttft_p50"] for r in rows], "x--", color=color, alpha=0.5, label=f"{name} p50")
        axes[1].plot(rates, [r["output_token_throughput"] for r in rows], "o-", color=color, label=f"{name} tokens/s")
        axes[1].plot(rates, [r["goodput"] * 10 for r in rows], "x--", color=color, alpha=0.5,
                     label=f"{name} goodput x10")
    axes[0].axhline(slo["ttft_s"], color="grey", lw=0.8, ls=":", label=f"SLO {slo['ttft_s']:g} s")
    axes[0].set(xscale="log", yscale="log", xlabel="request rate (req/s, Poisson)", ylabel="TTFT (s)",
                title="Time to first token")
    axes[1].set(xscale="log", xlabel="request rate (req/s, Poisson)", ylabel="output tokens/s  |  goodput x10 (req/s)",
                title="Throughput and goodput")
    for ax in axes[:2]:
        if ax.get_lines():
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3, which="both")
    mt = results.get("multi_turn") or {}
    if mt:
        names = [k for k in ("prefix_caching_on", "prefix_caching_off") if k in mt]
        values = [mt[k]["output_token_throughput"] for k in names]
        axes[2].bar([n.replace("prefix_caching_", "caching ") for n in names], values, color=["tab:green", "tab:red"])
        for i, v in enumerate(values):
            axes[2].text(i, v, f"{v:.1f}", ha="center", va="bottom")
        axes[2].set(ylabel="output tokens/s", title=f"Multi-turn ({mt[names[0]]['users']} users x "
                                                    f"{mt[names[0]]['turns']} turns)")
    else:
        axes[2].axis("off")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def markdown(results: dict[str, Any]) -> str:
    """The result tables as Markdown (for docs/serve-benchmark.md)."""
    def f(x: Any, nd: int = 2) -> str:
        return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{nd}f}"

    lines = ["| backend | rate (req/s) | done | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | ITL p50 / p99 (ms) "
             "| req/s | output tok/s | goodput (req/s) |", "|---|---|---|---|---|---|---|---|---|"]
    for name, rows in results.get("poisson", {}).items():
        for r in rows:
            ms = lambda v: f(v * 1000 if v is not None else None, 0)  # noqa: E731
            lines.append(f"| {name} | {r['rate']:g} | {r['completed']}/{r['num_requests']} | {f(r['ttft_p50'])} / "
                         f"{f(r['ttft_p99'])} | {ms(r['tpot_p50'])} / {ms(r['tpot_p99'])} | {ms(r['itl_p50'])} / "
                         f"{ms(r['itl_p99'])} | {f(r['request_throughput'])} | {f(r['output_token_throughput'], 1)} "
                         f"| {f(r['goodput'])} |")
    cap = results.get("capacity_at_slo_ttft_p99") or {}
    if cap:
        lines += ["", f"Capacity (highest tested rate with p99 TTFT <= {results['meta']['slo']['ttft_s']:g} s, "
                      "nothing failed): " + ", ".join(f"{k} {v:g} req/s" for k, v in cap.items())]
    mt = results.get("multi_turn") or {}
    if mt:
        lines += ["", "| prefix caching | turns | wall (s) | output tok/s | turns/s | TTFT p50 / p99 (s) "
                      "| cached / prompt tokens | history reused |", "|---|---|---|---|---|---|---|---|"]
        for key in ("prefix_caching_on", "prefix_caching_off"):
            if key not in mt:
                continue
            r = mt[key]
            reuse = (r.get("history_reuse") or {}).get("fraction")
            lines.append(f"| {key.rsplit('_', 1)[-1]} | {r['completed_turns']} | {f(r['duration_s'], 1)} | "
                         f"{f(r['output_token_throughput'], 1)} | {f(r['turn_throughput'])} | {f(r['ttft_p50'])} / "
                         f"{f(r['ttft_p99'])} | {r['cached_tokens']} / {r['prompt_tokens']} | "
                         f"{'-' if reuse is None else f'{reuse:.1%}'} |")
        if "speedup" in mt:
            lines += ["", f"Multi-turn throughput with history reuse: {mt['speedup']:.2f}x"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF folder; default: flexpage's SmolLM2-135M-Instruct")
    parser.add_argument("--rates", default="0.1,0.25,0.5,1,2,4", help="Poisson request rates (req/s)")
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per rate")
    parser.add_argument("--max-wait", type=float, default=120.0, help="seconds to wait after the last arrival")
    parser.add_argument("--backends", default="flexpage,transformers,transformers-cb")
    parser.add_argument("--no-poisson", action="store_true", help="skip the ShareGPT-like Poisson runs")
    parser.add_argument("--multi-turn", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--doc-tokens", type=int, default=1000)
    parser.add_argument("--answer-tokens", type=int, default=24)
    parser.add_argument("--slo-ttft", type=float, default=5.0, help="SLO: time to first token (s)")
    parser.add_argument("--slo-tpot", type=float, default=0.5, help="SLO: time per output token (s)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=64, help="flexpage batch limit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--out", default="bench/results/serve.json")
    parser.add_argument("--plot", default="docs/img/serve-latency.png")
    parser.add_argument("--report", action="store_true", help="print --out's tables as Markdown and exit")
    parser.add_argument("--update", action="store_true",
                        help="merge into an existing --out file: replace only the backends / sections run now")
    args = parser.parse_args(argv)
    if args.report:
        print(markdown(json.loads(Path(args.out).read_text())))
        return 0

    from flexpage.model.loader import load_tokenizer, resolve_model_path

    model_path = str(resolve_model_path(args.model))
    tokenizer = load_tokenizer(model_path)
    rates = [float(r) for r in args.rates.split(",") if r]
    results: dict[str, Any] = {
        "meta": {
            "command": " ".join(["python -m bench.serve", *(argv if argv is not None else sys.argv[1:])]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "model": model_path, "dtype": args.dtype,
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "processor": _cpu_name(),
                        "loadavg_at_start": os.getloadavg()},
            "versions": _versions(),
            "workload": {"prompt_tokens_lognormal": PROMPT_DIST, "output_tokens_lognormal": OUTPUT_DIST,
                         "arrivals": "Poisson", "duration_s": args.duration, "seed": args.seed},
            "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot},
            "flexpage": {"num_blocks": args.num_blocks, "max_num_seqs": args.max_num_seqs},
        },
        "poisson": {}, "startup_s": {},
    }
    out = Path(args.out)
    if args.update and out.exists():
        previous = json.loads(out.read_text())
        results["poisson"] = previous.get("poisson", {})
        results["startup_s"] = previous.get("startup_s", {})
        if previous.get("multi_turn") and not args.multi_turn:
            results["multi_turn"] = previous["multi_turn"]
        results["meta"]["previous_runs"] = previous["meta"].get("previous_runs", []) + [
            {k: previous["meta"][k] for k in ("command", "date", "machine")}]

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(_clean(results), indent=2))

    factories = {
        "flexpage": lambda: flexpage_backend(model_path, args),
        "transformers": lambda: transformers_backend(model_path, args, continuous_batching=False),
        "transformers-cb": lambda: transformers_backend(model_path, args, continuous_batching=True),
    }
    if not args.no_poisson:
        for name in [b for b in args.backends.split(",") if b]:
            backend = factories[name]()
            try:
                results["startup_s"][name] = backend.start(args.start_timeout)
                print(f"[{name}] ready in {results['startup_s'][name]:.0f} s; warming up", flush=True)
                asyncio.run(warmup(backend, tokenizer, args.seed))
                rows = []
                for rate in rates:
                    requests = sharegpt_like(tokenizer, rate=rate, duration=args.duration, seed=args.seed)
                    row = asyncio.run(run_poisson(backend, requests, rate=rate, max_wait=args.max_wait,
                                                  slo_ttft=args.slo_ttft, slo_tpot=args.slo_tpot))
                    rows.append(row)
                    print(f"[{name}] rate {rate:g}/s: {row['completed']}/{row['num_requests']} done, "
                          f"TTFT p50 {row['ttft_p50']:.2f} p99 {row['ttft_p99']:.2f} s, TPOT p50 "
                          f"{row['tpot_p50'] * 1000:.0f} ms, {row['output_token_throughput']:.1f} tok/s, "
                          f"goodput {row['goodput']:.2f} req/s", flush=True)
                    results["poisson"][name] = rows
                    save()
                    if row["failed"] > row["num_requests"] // 2 or row["ttft_p99"] > 10 * args.slo_ttft:
                        print(f"[{name}] overloaded at {rate:g}/s: skipping higher rates", flush=True)
                        break
            finally:
                backend.stop()
        save()
    results["capacity_at_slo_ttft_p99"] = {name: capacity(rows, args.slo_ttft)
                                           for name, rows in results["poisson"].items()}

    if args.multi_turn:
        results["multi_turn"] = {}
        for caching in (True, False):
            key = "prefix_caching_on" if caching else "prefix_caching_off"
            backend = flexpage_backend(model_path, args, prefix_caching=caching, name=f"flexpage-{key}")
            try:
                backend.start(args.start_timeout)
                asyncio.run(warmup(backend, tokenizer, args.seed))
                results["multi_turn"][key] = asyncio.run(run_multi_turn(backend, tokenizer, args))
                row = results["multi_turn"][key]
                print(f"[multi-turn, {key}] {row['completed_turns']} turns in {row['duration_s']:.1f} s: "
                      f"{row['output_token_throughput']:.1f} tok/s, TTFT p50 {row['ttft_p50']:.2f} s, "
                      f"cached {row['cached_tokens']}/{row['prompt_tokens']} prompt tokens", flush=True)
                save()
            finally:
                backend.stop()
        mt = results["multi_turn"]
        if all(k in mt for k in ("prefix_caching_on", "prefix_caching_off")):
            mt["speedup"] = mt["prefix_caching_on"]["output_token_throughput"] / max(
                1e-9, mt["prefix_caching_off"]["output_token_throughput"])
    save()
    if args.plot:
        plot(results, Path(args.plot))
    print(json.dumps({"capacity_at_slo_ttft_p99": results.get("capacity_at_slo_ttft_p99"),
                      "multi_turn_speedup": (results.get("multi_turn") or {}).get("speedup")}, indent=2))
    return 0


def _clean(value: Any) -> Any:
    """JSON-safe copy: NaN/inf -> None, tuples -> lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for pkg in ("torch", "transformers", "fastapi", "uvicorn"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "?"
    return out


if __name__ == "__main__":
    sys.exit(main())
