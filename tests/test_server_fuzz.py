"""The server under schema fuzzing: requests generated from its own ``/openapi.json``.

schemathesis draws valid and invalid requests for every operation the schema describes (the
two generation endpoints get most of them) and sends them to a real ``flexpage serve`` on a
tiny random-weight model (eager attention: no compile wait). The server must answer every
one without a 5xx or a hang, every error in OpenAI's ``{"error": {...}}`` shape, give every
KV block back, and still answer an ordinary request afterwards.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from server_fixtures import ServerProcess

pytestmark = pytest.mark.fuzz

#: generated requests per operation and generation mode (valid data, then invalid data)
EXAMPLES = {"POST /v1/completions": 300, "POST /v1/chat/completions": 300}
OTHER_EXAMPLES = 25
#: the same requests every run (a suite must not fail by chance); FLEXPAGE_FUZZ_RANDOM=1 explores new ones
DERANDOMIZE = os.environ.get("FLEXPAGE_FUZZ_RANDOM") != "1"


def _check_error_shape(response: Any) -> None:
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body


def test_fuzzed_requests_never_break_the_server(tiny_model: Any) -> None:
    server = ServerProcess("--model", str(tiny_model("llama")), "--dtype", "float32", "--eager", "--num-blocks", "256",
                           "--max-model-len", "32", "--max-num-seqs", "64", "--no-warmup")
    server.start().wait_ready()
    statuses: Counter[int] = Counter()
    try:
        schema = schemathesis.openapi.from_url(server.base_url + "/openapi.json")
        for result in schema.get_all_operations():
            operation = result.ok()
            for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
                examples = EXAMPLES.get(operation.label, OTHER_EXAMPLES)

                @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
                          suppress_health_check=list(HealthCheck), derandomize=DERANDOMIZE)
                @given(case=operation.as_strategy(generation_mode=mode))
                def send(case: Any) -> None:
                    response = case.call(base_url=server.base_url, timeout=120)
                    statuses[response.status_code] += 1
                    assert response.status_code < 500, (case.as_curl_command(), response.text[:500])
                    if response.status_code >= 400:
                        _check_error_shape(response)

                try:
                    send()
                except Unsatisfiable:  # an operation without parameters or body has no invalid form
                    assert mode is schemathesis.GenerationMode.NEGATIVE and not operation.label.startswith("POST")
        print(f"fuzzed {sum(statuses.values())} requests; statuses {dict(sorted(statuses.items()))}")
        assert sum(statuses.values()) >= 1000, statuses
        assert statuses[200] > 0 and any(400 <= status < 500 for status in statuses), statuses
        server.wait_idle(timeout=60)  # every KV block back in the pool
        done = httpx.post(server.base_url + "/v1/completions", timeout=60,
                          json={"prompt": "Hello", "max_tokens": 3, "temperature": 0}).json()
        assert done["usage"]["completion_tokens"] == 3, done
    finally:
        server.stop()
