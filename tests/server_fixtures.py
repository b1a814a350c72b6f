"""Helpers to run ``flexpage serve`` as a real subprocess in tests and benchmarks.

Everything is bounded: start-up waits at most ``ready_timeout`` seconds, shutdown at most
``stop_timeout`` (then SIGKILL). Traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """``python -m flexpage.cli serve ...`` on 127.0.0.1 and a free port."""

    def __init__(self, *args: str, api_key: str | None = None, env: dict[str, str] | None = None,
                 port: int | None = None) -> None:
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.args = [sys.executable, "-m", "flexpage.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                     *args]
        self.env = {**os.environ, **(env or {})}
        if api_key is not None:
            self.env["FLEXPAGE_API_KEY"] = api_key
        self.log = tempfile.NamedTemporaryFile("w+", prefix="flexpage-serve-", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> "ServerProcess":
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                     stdin=subprocess.DEVNULL)
        return self

    def wait_ready(self, timeout: float = 300.0) -> "ServerProcess":
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"flexpage serve exited with {self.proc.returncode}:\n{self.output()[-4000:]}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"flexpage serve not ready after {timeout:.0f} s:\n{self.output()[-4000:]}")

    def stop(self, timeout: float = 40.0) -> int | None:
        """SIGINT (graceful), then SIGKILL after ``timeout``; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    # -- clients -------------------------------------------------------------------------
    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def openai(self, **kwargs: Any) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=self.base_url + "/v1", api_key=self.api_key or "none", max_retries=0,
                      timeout=kwargs.pop("timeout", 300.0), **kwargs)

    def async_openai(self, **kwargs: Any) -> Any:
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=self.base_url + "/v1", api_key=self.api_key or "none", max_retries=0,
                           timeout=kwargs.pop("timeout", 300.0), **kwargs)

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as ``{"name{label=value,...}": value}`` (labels sorted)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.base_url + "/metrics", timeout=10.0).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return out

    def wait_idle(self, timeout: float = 60.0) -> dict[str, float]:
        """Poll ``/metrics`` until no request runs or waits and no KV block is in use."""
        deadline = time.monotonic() + timeout
        metrics: dict[str, float] = {}
        while time.monotonic() < deadline:
            metrics = self.metrics()
            if (metrics["flexpage_num_requests_running"] == 0 and metrics["flexpage_num_requests_waiting"] == 0
                    and metrics["flexpage_kv_blocks_used"] == 0):
                return metrics
            time.sleep(0.2)
        raise AssertionError(f"server not idle after {timeout:.0f} s: "
                             f"{ {k: v for k, v in metrics.items() if 'requests' in k or 'kv_blocks' in k} }")
