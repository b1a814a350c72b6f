"""Soak: ``flexpage serve`` under mixed traffic for minutes; memory must stay flat, nothing may fail or leak.

Run (from the repository root; the script starts and stops the server on a free port)::

    python -m bench.soak --minutes 10 --out bench/results/soak.json

Traffic: ``--users`` closed-loop clients, each sending one request after another: chat or
completions (half each), streamed or not, ``n`` 1-3, a stop string on every third request,
and every fifth streamed request abandoned by its client after a few chunks (an abort). Prompts
are random English words of 8-400 tokens, answers 4-64 tokens, sampled at temperature 0.8
(seeded per request).

Reported per minute: requests, errors (any non-200 or malformed body), p50/p99 latency, the
server's RSS (from /proc) and KV blocks in use (``/metrics``). At the end, after the clients
stop and the server is idle: blocks in use (must be 0), and RSS growth from the end of the
first minute (warm-up: compiles, allocator pools) to the end -- the target is within 5%.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.serve import Backend, free_port

WORDS = ("the of and to in is was for on that with as by at from his her this which or had are not but be "
         "they one all were we there been has have their more when who will would no out so what up its into "
         "than them can only other new some could time these two may then do first any my now such like our "
         "over man me even most made after also did many before must through back years where much your way "
         "well down should because each just those people how too little state good very make world still own").split()


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def blocks_in_use(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("flexpage_kv_blocks_used"):
            return float(line.split()[-1])
    return float("nan")


def make_request(rng: random.Random) -> tuple[str, dict[str, Any], bool]:
    """(path, body, abandon): one request of the mix."""
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 400)))
    body: dict[str, Any] = {"model": "soak", "max_tokens": rng.randint(4, 64), "temperature": 0.8,
                            "seed": rng.randrange(1 << 30), "n": rng.randint(1, 3), "stream": rng.random() < 0.5}
    if rng.random() < 1 / 3:
        body["stop"] = [rng.choice(WORDS)]
    if rng.random() < 0.5:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        path, body["prompt"] = "/v1/completions", prompt
    abandon = body["stream"] and rng.random() < 0.2
    return path, body, abandon


async def one_request(client: httpx.AsyncClient, url: str, path: str, body: dict[str, Any], abandon: bool) -> str:
    """'' on success, else what went wrong."""
    if not body["stream"]:
        response = await client.post(url + path, json=body)
        if response.status_code != 200:
            return f"HTTP {response.status_code}: {response.text[:200]}"
        choices = response.json().get("choices", [])
        return "" if len(choices) == body["n"] else f"{len(choices)} choices for n={body['n']}"
    async with client.stream("POST", url + path, json=body) as response:
        if response.status_code != 200:
            return f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
        events = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return ""
            if "error" in json.loads(line[6:]):
                return f"error event: {line[:200]}"
            events += 1
            if abandon and events >= 3:
                return ""  # leaving the block closes the connection: the server must abort it
    return "stream ended without [DONE]"


async def run(url: str, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    stop_at = time.monotonic() + args.minutes * 60
    start = time.monotonic()
    samples: list[tuple[float, float, str]] = []  # (finish time, latency, error)
    minutes: list[dict[str, Any]] = []

    async def user(index: int) -> None:
        rng = random.Random(args.seed * 1000 + index)
        async with httpx.AsyncClient(timeout=300) as client:
            while time.monotonic() < stop_at:
                path, body, abandon = make_request(rng)
                t0 = time.monotonic()
                try:
                    error = await one_request(client, url, path, body, abandon)
                except httpx.HTTPError as exc:
                    error = f"{type(exc).__name__}: {exc}"
                samples.append((time.monotonic(), time.monotonic() - t0, error))

    async def monitor() -> None:
        minute = 1
        while time.monotonic() < stop_at:
            await asyncio.sleep(max(0.0, start + minute * 60 - time.monotonic()))
            window = [s for s in samples if start + (minute - 1) * 60 <= s[0] < start + minute * 60]
            latencies = sorted(s[1] for s in window)
            row = {"minute": minute, "requests": len(window), "errors": sum(1 for s in window if s[2]),
                   "p50_s": statistics.median(latencies) if latencies else None,
                   "p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else None,
                   "rss_mib": rss_mib(pid), "blocks_used": await asyncio.to_thread(blocks_in_use, url)}
            minutes.append(row)
            print(json.dumps(row), flush=True)
            minute += 1

    await asyncio.gather(monitor(), *(user(i) for i in range(args.users)))
    deadline = time.monotonic() + 30
    while blocks_in_use(url) and time.monotonic() < deadline:  # abandoned streams are aborted asynchronously
        await asyncio.sleep(0.5)
    errors = [s[2] for s in samples if s[2]]
    first, last = minutes[0]["rss_mib"], rss_mib(pid)
    return {"minutes": minutes, "requests": len(samples), "errors": len(errors), "error_examples": errors[:5],
            "blocks_used_at_end": blocks_in_use(url), "rss_after_first_minute_mib": first, "rss_at_end_mib": last,
            "rss_growth": last / first - 1}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", default="bench/results/soak.json")
    parser.add_argument("--server-arg", action="append", default=[], help="extra flexpage serve argument")
    args = parser.parse_args(argv)
    port = free_port()
    command = [sys.executable, "-m", "flexpage.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--dtype", args.dtype, "--served-model-name", "soak", *args.server_arg]
    server = Backend("flexpage", command, "soak", port)
    ready_s = server.start(timeout=600)
    print(f"server ready in {ready_s:.0f} s, RSS {rss_mib(server.proc.pid):.0f} MiB", flush=True)
    try:
        result = asyncio.run(run(server.url, server.proc.pid, args))
    finally:
        server.stop()
    result.update(command=" ".join(["python -m bench.soak", *(argv if argv is not None else sys.argv[1:])]),
                  ready_s=ready_s)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['requests']} requests, {result['errors']} errors, blocks in use at the end: "
          f"{result['blocks_used_at_end']:.0f}, RSS {result['rss_after_first_minute_mib']:.0f} -> "
          f"{result['rss_at_end_mib']:.0f} MiB ({100 * result['rss_growth']:+.1f}%)")
    ok = result["errors"] == 0 and result["blocks_used_at_end"] == 0 and result["rss_growth"] <= 0.05
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
