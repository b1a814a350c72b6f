"""Start-up benchmark: ``flexpage serve`` from process start to ``/health`` answering 200.

Run (from the repository root)::

    python -m bench.startup --rounds 3 --out bench/results/startup.json

Each round starts ``flexpage serve`` on the default model (SmolLM2-135M-Instruct) and a free
port, times process start to the first 200 from ``/health`` (the server binds only after
the model is loaded and warmed up), reads the banner's ``load`` and ``warm-up`` seconds, and
stops it with Ctrl-C. ``--cold`` gives the first round an empty compile cache (a fresh
``$TORCHINDUCTOR_CACHE_DIR``: Inductor's kernels and the saved step programs); the later
rounds then start from what it compiled. Medians of the warm rounds are printed; the
imports are the rest (ready - load - warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.serve import _cpu_name

BANNER = re.compile(r"load ([0-9.]+) s, warm-up ([0-9.]+) s")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_once(env: dict[str, str], timeout: float, serve_args: list[str] = ()) -> dict[str, float]:
    """One start: seconds to ready, and the banner's load and warm-up."""
    port = free_port()
    with tempfile.TemporaryFile("w+") as log:
        started = time.perf_counter()
        server = subprocess.Popen([sys.executable, "-m", "flexpage.cli", "serve", "--port", str(port), *serve_args],
                                  stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            while True:
                if server.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"flexpage serve exited with {server.returncode}:\n{log.read()[-2000:]}")
                if time.perf_counter() - started > timeout:
                    raise TimeoutError(f"flexpage serve not ready after {timeout} s")
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
            ready = time.perf_counter() - started
        finally:
            server.send_signal(signal.SIGINT)
            server.wait(60)
        log.seek(0)
        found = BANNER.search(log.read())
    if found is None:
        raise RuntimeError("no 'load ... s, warm-up ... s' line in the banner")
    return {"ready_s": ready, "load_s": float(found[1]), "warm_up_s": float(found[2])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="warm starts (after the cold one with --cold)")
    parser.add_argument("--cold", action="store_true", help="first start with an empty compile cache")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a start may take")
    parser.add_argument("--out", type=Path, help="write the rounds as JSON here")
    parser.add_argument("--serve-args", default="", help="more arguments for flexpage serve, e.g. '--kv-cache-memory 8GiB'")
    args = parser.parse_args()

    env = dict(os.environ)
    rounds: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as empty_cache:
        if args.cold:
            env["TORCHINDUCTOR_CACHE_DIR"] = empty_cache
            cold = start_once(env, args.timeout, args.serve_args.split())
            print(f"cold: ready {cold['ready_s']:.1f} s (load {cold['load_s']:.1f}, warm-up {cold['warm_up_s']:.1f})")
        for r in range(args.rounds):
            rounds.append(start_once(env, args.timeout, args.serve_args.split()))
            print(f"warm {r + 1}: ready {rounds[-1]['ready_s']:.1f} s "
                  f"(load {rounds[-1]['load_s']:.1f}, warm-up {rounds[-1]['warm_up_s']:.1f})")
    medians = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]} if rounds else {}
    if medians:
        medians["imports_and_server_s"] = medians["ready_s"] - medians["load_s"] - medians["warm_up_s"]
        print("median of warm starts: " + ", ".join(f"{key} {value:.1f}" for key, value in medians.items()))
    if args.out:
        result = {"machine": f"{_cpu_name()}, {os.cpu_count()} cores", "rounds": rounds, "median": medians,
                  "cold": cold if args.cold else None}
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
