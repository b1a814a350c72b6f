"""End-to-end tests of ``flexpage serve``: a real subprocess on 127.0.0.1, driven by the
official ``openai`` client (sync and async) and raw ``httpx`` / sockets for bad inputs.

The server is started once per module (``--dtype float32``, 512 KV blocks, an API key from
``FLEXPAGE_API_KEY``). While it starts, the offline ``LLM`` computes reference outputs in
this process with the same dtype; greedy outputs over HTTP must equal them.

``--max-num-seqs 16``: 32 concurrent clients all run through the one engine loop, 16
sequences at a time, so admission under a full batch is exercised too.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from pydantic import BaseModel
from pydantic import Field as PydanticField
from server_fixtures import ServerProcess

from flexpage.config import EngineConfig

pytestmark = pytest.mark.slow

API_KEY = "test-key-123"
OTHER_KEY = "second-key-456"  # the server accepts both; each scopes its own conversations
MODEL = "SmolLM2-135M-Instruct"
BLOCK = EngineConfig().block_size  # the server runs with the engine's default block size
MAX_MODEL_LEN = 1024
MAX_TOKENS = 10

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Name a fruit that is yellow."}],
]
TURN1 = [{"role": "user", "content": "Write a short poem about the sea."}]
TURN1_TOKENS = 40
STOP_PROMPT = "List three animals:\n1."
STOP = ["\n", "3."]


# -- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def _started(default_model_path: Any) -> Any:
    server = ServerProcess("--dtype", "float32", "--num-blocks", "512", "--max-num-seqs", "16",
                           "--max-model-len", str(MAX_MODEL_LEN), "--drain-timeout", "60",
                           "--api-key", f"{API_KEY},{OTHER_KEY}", "--host-kv-bytes", "64MiB", api_key=API_KEY)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def offline(_started: Any) -> dict[str, Any]:
    """Reference outputs of the offline LLM (computed while the server starts up)."""
    from flexpage import LLM, SamplingParams

    llm = LLM(None, dtype="float32", num_blocks=512)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    completions = llm.generate(PROMPTS + [STOP_PROMPT],
                               [greedy] * len(PROMPTS) + [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                                         stop=STOP)])
    chats = llm.chat(CONVERSATIONS + [TURN1], [greedy] * len(CONVERSATIONS)
                     + [SamplingParams(temperature=0.0, max_tokens=TURN1_TOKENS)])
    return {
        "llm": llm,
        "completions": [o.outputs[0].text for o in completions[: len(PROMPTS)]],
        "stop": completions[-1].outputs[0],
        "chats": [o.outputs[0].text for o in chats[: len(CONVERSATIONS)]],
        "turn1": chats[-1],
    }


@pytest.fixture(scope="module")
def server(_started: ServerProcess, offline: Any) -> ServerProcess:
    return _started.wait_ready(timeout=300)


def _post(server: ServerProcess, path: str, body: Any = None, *, content: bytes | None = None,
          headers: dict[str, str] | None = None, timeout: float = 120.0) -> httpx.Response:
    hdrs = {**server.headers, **(headers or {})}
    if content is None:
        content = json.dumps(body).encode()
        hdrs.setdefault("content-type", "application/json")
    return httpx.post(server.base_url + path, content=content, headers=hdrs, timeout=timeout)


def _assert_error(response: httpx.Response, status: int, *, param: str | None = None,
                  code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]


# -- one batch of greedy requests, checked by several tests --------------------------------------
@pytest.fixture(scope="module")
def greedy(server: ServerProcess) -> dict[str, Any]:
    """Completions and chats, streamed and not, all in flight together."""
    client = server.async_openai()

    async def stream_completion(prompt: str, **kw: Any) -> tuple[str, Any, Any]:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}, **kw)
        text, finish, usage = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
        return text, finish, usage

    async def stream_chat(messages: list) -> tuple[str, Any, Any, list]:
        stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                                      temperature=0, stream=True,
                                                      stream_options={"include_usage": True})
        text, finish, usage, roles = "", None, None, []
        async for chunk in stream:
            assert chunk.object == "chat.completion.chunk"
            if chunk.choices:
                delta = chunk.choices[0].delta
                if delta.role:
                    roles.append(delta.role)
                text += delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
        return text, finish, usage, roles

    async def main() -> dict[str, Any]:
        start = time.monotonic()
        results = await asyncio.gather(
            client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0),
            *[stream_completion(p) for p in PROMPTS],
            *[client.chat.completions.create(model=MODEL, messages=c, max_completion_tokens=MAX_TOKENS,
                                             temperature=0) for c in CONVERSATIONS],
            *[stream_chat(c) for c in CONVERSATIONS],
            client.completions.create(model=MODEL, prompt=STOP_PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                      stop=STOP),
            stream_completion(STOP_PROMPT, stop=STOP),
        )
        await client.close()
        k, c = len(PROMPTS), len(CONVERSATIONS)
        return {
            "batch": results[0],
            "streamed": results[1: 1 + k],
            "chats": results[1 + k: 1 + k + c],
            "streamed_chats": results[1 + k + c: 1 + k + 2 * c],
            "stop": results[-2],
            "stop_streamed": results[-1],
            "seconds": time.monotonic() - start,
        }

    return asyncio.run(main())


# -- tests ------------------------------------------------------------------------------------------
def test_health_models_and_auth(server: ServerProcess) -> None:
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.base_url + "/metrics").status_code == 200  # open without a key
    models = httpx.get(server.base_url + "/v1/models", headers=server.headers).json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["attention_recipes"] == "causal (all 30 layers)"
    assert server.openai().models.list().data[0].id == MODEL
    _assert_error(httpx.get(server.base_url + "/v1/models"), 401, code="invalid_api_key")
    _assert_error(httpx.get(server.base_url + "/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    basic = httpx.get(server.base_url + "/v1/models", headers={"Authorization": "Basic dXNlcjpwYXNz"})
    _assert_error(basic, 401, code="invalid_api_key")
    assert "unsupported authorization scheme 'Basic'" in basic.json()["error"]["message"]
    assert "missing API key" in httpx.get(server.base_url + "/v1/models").json()["error"]["message"]
    _assert_error(_post(server, "/v1/completions", {"prompt": "x"}, headers={"Authorization": "Bearer nope"}), 401)
    import openai

    wrong = openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL, prompt="x", max_tokens=1)
    _assert_error(httpx.get(server.base_url + "/v1/nothing-here", headers=server.headers), 404)


def test_completions_match_offline(greedy: dict, offline: dict) -> None:
    batch = greedy["batch"]
    assert batch.object == "text_completion" and batch.model == MODEL and batch.id.startswith("cmpl-")
    assert [c.index for c in batch.choices] == list(range(len(PROMPTS)))
    assert [c.text for c in batch.choices] == offline["completions"]
    assert all(c.finish_reason in ("stop", "length") for c in batch.choices)
    usage = batch.usage
    assert usage.completion_tokens <= MAX_TOKENS * len(PROMPTS) and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens is not None


def test_beam_search_over_http_returns_the_offline_best_beams(server: ServerProcess, offline: dict) -> None:
    from flexpage import BeamSearchParams

    params = BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS, length_penalty=0.5)
    best = offline["llm"].beam_search([PROMPTS[1]], params)[0].sequences
    body = _post(server, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "n": 2, "beam_width": 3,
                                             "use_beam_search": True, "length_penalty": 0.5, "temperature": 0}).json()
    assert [c["text"] for c in body["choices"]] == [
        offline["llm"].get_tokenizer().decode(beam.output_token_ids, skip_special_tokens=True) for beam in best[:2]]
    assert body["usage"]["completion_tokens"] == sum(len(beam.output_token_ids) for beam in best[:2])


def test_echo_scores_the_prompt_as_lm_evaluation_harness_asks(server: ServerProcess, offline: dict) -> None:
    """``echo`` with ``max_tokens: 0`` and ``logprobs`` (lm-eval's local-completions
    loglikelihood request): the prompt back, its first token without a logprob, every other
    token's logprob the offline engine's ``prompt_logprobs``; with tokens generated, the
    completion's follow the prompt's."""
    from flexpage import SamplingParams

    llm = offline["llm"]
    ids = llm.get_tokenizer()(PROMPTS[2]).input_ids
    reference = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=4,
                                                                        prompt_logprobs=2, logprobs=2))[0]
    want = [None] + [entry[token].logprob for token, entry in zip(ids[1:], reference.prompt_logprobs[1:])]
    for max_tokens in (0, 4):
        body = _post(server, "/v1/completions", {"prompt": ids, "echo": True, "max_tokens": max_tokens,
                                                 "logprobs": 2, "temperature": 0}).json()
        (choice,) = body["choices"]
        logprobs = choice["logprobs"]
        assert choice["text"] == llm.get_tokenizer().decode(ids) + (reference.outputs[0].text if max_tokens else "")
        assert len(logprobs["tokens"]) == len(ids) + (0 if max_tokens == 0 else 4)
        assert logprobs["top_logprobs"][0] is None and all(len(top) <= 2 for top in logprobs["top_logprobs"][1:])
        assert logprobs["token_logprobs"][: len(ids)] == pytest.approx(want, abs=1e-4)
        assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
        assert body["usage"]["completion_tokens"] == (0 if max_tokens == 0 else 4)
        if max_tokens:
            assert logprobs["token_logprobs"][len(ids):] == pytest.approx(
                [entry[token].logprob for token, entry in zip(reference.outputs[0].token_ids,
                                                              reference.outputs[0].logprobs)], abs=1e-4)


def test_streamed_equals_non_streamed(greedy: dict, offline: dict) -> None:
    for (text, finish, usage), expected, choice in zip(greedy["streamed"], offline["completions"],
                                                       greedy["batch"].choices):
        assert text == expected == choice.text
        assert finish == choice.finish_reason
        assert usage is not None and usage.completion_tokens >= 1
    for (text, finish, usage, roles), chat, expected in zip(greedy["streamed_chats"], greedy["chats"],
                                                            offline["chats"]):
        assert roles == ["assistant"]
        assert text == chat.choices[0].message.content == expected
        assert finish == chat.choices[0].finish_reason
        assert usage.prompt_tokens == chat.usage.prompt_tokens
        assert usage.completion_tokens == chat.usage.completion_tokens


def test_chat_matches_offline(greedy: dict, offline: dict) -> None:
    for chat, expected in zip(greedy["chats"], offline["chats"]):
        assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
        assert chat.choices[0].message.role == "assistant"
        assert chat.choices[0].message.content == expected
        assert chat.usage.completion_tokens <= MAX_TOKENS


def test_stop_strings_streamed_and_not(greedy: dict, offline: dict) -> None:
    choice = greedy["stop"].choices[0]
    text, finish, _ = greedy["stop_streamed"]
    assert choice.text == text == offline["stop"].text
    assert choice.finish_reason == finish == offline["stop"].finish_reason
    for stop in STOP:
        assert stop not in choice.text


def test_parallel_sampling_n(server: ServerProcess) -> None:
    client = server.openai()
    kw = dict(model=MODEL, max_tokens=6, temperature=0.9, seed=1234, n=3)
    first = client.completions.create(prompt="My favourite food is", **kw)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert len({c.text for c in first.choices}) > 1  # three different samples
    # seeded sampling is batch-independent: streaming the same request gives the same texts
    texts = ["", "", ""]
    for chunk in client.completions.create(prompt="My favourite food is", stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in first.choices]
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **kw)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert chat.usage.prompt_tokens > 0 and chat.usage.completion_tokens <= 18


def test_logprobs(server: ServerProcess) -> None:
    client = server.openai()
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                    logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == out.choices[0].text
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and value <= 0
        assert abs(max(top.values()) - value) < 1e-4  # greedy picks the most likely token
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token for c in content)
    assert bytes(content[0].bytes).decode() == content[0].token


def _sse_events(response: httpx.Response) -> list[dict]:
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-3:]
    return [json.loads(line) for line in lines[:-1]]


def test_openapi_describes_what_the_server_sends(server: ServerProcess) -> None:
    """/openapi.json names each endpoint's request and response models, and real bodies --
    plain, streamed, with logprobs, errors -- validate against those models (they forbid
    unknown fields), so the schema clients and fuzzers read is the server's."""
    from flexpage.server.schema import RESPONSE_MODELS

    spec = httpx.get(server.base_url + "/openapi.json").json()
    schemas = spec["components"]["schemas"]
    for path, request, response in (("/v1/completions", "CompletionRequest", "CompletionResponse"),
                                    ("/v1/chat/completions", "ChatCompletionRequest", "ChatCompletionResponse")):
        operation = spec["paths"][path]["post"]
        assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + request)
        assert operation["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + response)
        assert operation["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
        assert request in schemas and response in schemas
    assert "messages" in schemas["ChatCompletionRequest"]["required"]

    def check(model: str, body: dict) -> None:
        RESPONSE_MODELS[model].model_validate(body)

    base = {"model": MODEL, "max_tokens": 3, "temperature": 0}
    check("CompletionResponse", _post(server, "/v1/completions", {**base, "prompt": ["Hi", "Yo"], "logprobs": 2}).json())
    chat = {**base, "messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 2}
    check("ChatCompletionResponse", _post(server, "/v1/chat/completions", chat).json())
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    for event in _sse_events(_post(server, "/v1/completions", {**base, "prompt": "Hi", **stream})):
        check("CompletionResponse", event)
    events = _sse_events(_post(server, "/v1/chat/completions", {**chat, **stream}))
    for event in events:
        check("ChatCompletionChunk", event)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
    check("ModelList", httpx.get(server.base_url + "/v1/models", headers=server.headers).json())
    check("ModelCard", httpx.get(server.base_url + f"/v1/models/{MODEL}", headers=server.headers).json())
    check("ErrorResponse", _post(server, "/v1/completions", {**base, "prompt": "Hi", "n": 0}).json())


def test_32_concurrent_streaming_clients(server: ServerProcess, offline: dict) -> None:
    client = server.async_openai()

    async def one(i: int) -> tuple[int, str, str | None, float]:
        start = time.monotonic()
        first = None
        stream = await client.completions.create(model=MODEL, prompt=PROMPTS[i % len(PROMPTS)],
                                                 max_tokens=MAX_TOKENS, temperature=0, stream=True)
        text, finish = "", None
        async for chunk in stream:
            if first is None and chunk.choices[0].text:
                first = time.monotonic() - start
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return i, text, finish, first or 0.0

    async def main() -> list:
        try:
            return await asyncio.wait_for(asyncio.gather(*[one(i) for i in range(32)]), timeout=600)
        finally:
            await client.close()

    results = asyncio.run(main())
    assert len(results) == 32
    for i, text, finish, _ in results:
        assert text == offline["completions"][i % len(PROMPTS)], i
        assert finish in ("stop", "length")
    server.wait_idle()


def test_multi_turn_reuses_history(server: ServerProcess, offline: dict) -> None:
    """Turn 2's prompt starts with turn 1's prompt + answer; the prefix cache serves it."""
    tokenizer = offline["llm"].get_tokenizer()
    client = server.openai()
    first = client.chat.completions.create(model=MODEL, messages=TURN1, max_tokens=TURN1_TOKENS, temperature=0)
    answer = first.choices[0].message.content
    reference = offline["turn1"]
    assert answer == reference.outputs[0].text
    turn2 = TURN1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Now make it rhyme."}]
    second = client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=4, temperature=0)

    # the token-exactness condition: the template re-renders the answer with the generated tokens
    ids1 = list(reference.prompt_token_ids)
    generated = list(reference.outputs[0].token_ids)
    ids2 = list(tokenizer.apply_chat_template(turn2, add_generation_prompt=True, tokenize=True, return_dict=False))
    history = ids1 + generated
    common = next((i for i, (a, b) in enumerate(zip(ids2, history)) if a != b), min(len(ids2), len(history)))
    computed = len(history) - 1  # the last sampled token never gets its KV computed
    expected = min(common, computed) // BLOCK * BLOCK
    assert common >= len(ids1) + len(generated) - 1, "the chat template re-tokenised the answer differently"
    assert second.usage.prompt_tokens == len(ids2)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == expected, (cached, expected, len(ids2))
    assert cached >= len(history) - 2 * BLOCK  # (most of) the whole first turn


BAD_REQUESTS = [
    # (path, raw body, status, param, code)
    ("/v1/completions", b'{"prompt": "x", ', 400, None, "invalid_json"),
    ("/v1/completions", b"", 400, None, "invalid_json"),
    ("/v1/completions", b"[1, 2]", 400, None, None),
    ("/v1/completions", b'{"max_tokens": 5}', 400, "prompt", "missing_field"),
    ("/v1/completions", b'{"prompt": 5}', 400, "prompt", None),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": "5"}', 400, "max_tokens", None),
    ("/v1/completions", b'{"prompt": "x", "stream": "yes"}', 400, "stream", None),
    ("/v1/completions", b'{"prompt": "x", "model": "gpt-4"}', 404, "model", "model_not_found"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 5000}', 400, "max_tokens", "context_length_exceeded"),
    ("/v1/completions", json.dumps({"prompt": "hello " * 1100}).encode(), 400, None, "context_length_exceeded"),
    ("/v1/completions", b'{"prompt": "x", "temperature": -1}', 400, "temperature", None),
    ("/v1/completions", b'{"prompt": "x", "top_p": 1.5}', 400, "top_p", None),
    ("/v1/completions", b'{"prompt": "x", "top_k": -5}', 400, "top_k", None),
    # found by the fuzzer: ints past 64 bits failed the engine step (500 for every request in it)
    ("/v1/completions", b'{"prompt": "x", "top_k": 18446744073709551617}', 400, "top_k", None),
    ("/v1/completions", b'{"prompt": "x", "stop_token_ids": [18446744073709551617]}', 400, "stop_token_ids", None),
    ("/v1/completions", b'{"prompt": "x", "min_p": 2}', 400, "min_p", None),
    ("/v1/completions", b'{"prompt": "x", "presence_penalty": 3}', 400, "presence_penalty", None),
    ("/v1/completions", b'{"prompt": "x", "frequency_penalty": -3}', 400, "frequency_penalty", None),
    ("/v1/completions", b'{"prompt": "x", "repetition_penalty": 0}', 400, "repetition_penalty", None),
    ("/v1/completions", b'{"prompt": "x", "n": 0}', 400, "n", None),
    ("/v1/completions", b'{"prompt": "x", "kv_budget": 20}', 400, "kv_budget", None),  # not whole blocks
    ("/v1/completions", b'{"prompt": "x", "kv_budget": 16}', 400, "kv_budget", None),  # under 3 blocks
    ("/v1/completions", b'{"prompt": "x", "num_speculative_tokens": -1}', 400, "num_speculative_tokens", None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "kv_budget": -8}', 400,
     "kv_budget", None),
    ("/v1/completions", b'{"prompt": "x", "logprobs": 50}', 400, "logprobs", None),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens", None),
    ("/v1/completions", b'{"prompt": "x", "min_tokens": 9, "max_tokens": 2}', 400, "min_tokens", None),
    ("/v1/completions", b'{"prompt": "x", "stop": [1, 2]}', 400, "stop", None),
    ("/v1/completions", b'{"prompt": "x", "stop": [""]}', 400, "stop", None),
    ("/v1/completions", b'{"prompt": ""}', 400, "prompt", None),
    ("/v1/completions", b'{"prompt": []}', 400, "prompt", None),
    ("/v1/completions", b'{"prompt": [1, 99999999]}', 400, "prompt", None),
    ("/v1/completions", b'{"prompt": "x", "echo": true, "stream": true}', 400, "echo", "unsupported"),
    ("/v1/completions", b'{"prompt": "x", "echo": true, "logprobs": 21}', 400, "logprobs", None),
    ("/v1/completions", b'{"prompt": "x", "use_beam_search": true, "stream": true}', 400, "stream", "unsupported"),
    ("/v1/completions", b'{"prompt": "x", "use_beam_search": true, "logprobs": 2}', 400, "logprobs", "unsupported"),
    ("/v1/completions", b'{"prompt": "x", "use_beam_search": true, "temperature": 0.7}', 400, "temperature", None),
    ("/v1/completions", b'{"prompt": "x", "use_beam_search": true, "n": 3, "beam_width": 2}', 400, "n", None),
    ("/v1/completions", b'{"prompt": "x", "beam_width": 2}', 400, "beam_width", None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "use_beam_search": true, '
     b'"response_format": {"type": "json_object"}}', 400, "use_beam_search", "unsupported"),
    ("/v1/chat/completions", b'{"messages": []}', 400, "messages", None),
    ("/v1/chat/completions", b'{"model": "SmolLM2-135M-Instruct"}', 400, "messages", "missing_field"),
    ("/v1/chat/completions", b'{"messages": [{"content": "hi"}]}', 400, "messages.0.role", "missing_field"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 7}]}', 400, "messages.0.content", None),
    ("/v1/chat/completions", b'{"messages": "hi"}', 400, "messages", None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}', 400,
     "top_logprobs", None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "logprobs": true, '
     b'"top_logprobs": 50}', 400, "top_logprobs", "invalid_value"),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "hi"}]}', 400, "messages.0.role", None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "model": "x"}', 404, "model",
     "model_not_found"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2000}',
     400, "max_tokens", "context_length_exceeded"),
]


def test_bad_inputs_get_openai_errors(server: ServerProcess) -> None:
    for path, body, status, param, code in BAD_REQUESTS:
        response = _post(server, path, content=body, headers={"content-type": "application/json"})
        try:
            _assert_error(response, status, param=param, code=code)
        except AssertionError as error:
            raise AssertionError(f"{path} {body[:80]!r}: {error}") from None
    # wrong method and unknown route keep the OpenAI shape
    _assert_error(httpx.get(server.base_url + "/v1/completions", headers=server.headers), 405)
    _assert_error(_post(server, "/v1/embeddings", {"input": "x"}), 404)
    # still serving
    ok = server.openai().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, temperature=0)
    assert ok.choices[0].text


def test_oversized_bodies_get_413(server: ServerProcess) -> None:
    # Content-Length over the limit: refused before a single body byte is sent
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
                      "Content-Type: application/json\r\nContent-Length: 5000000\r\n\r\n").encode())
        received = b""
        while chunk := sock.recv(65536):  # the server closes the connection after its answer
            received += chunk
        head = received.decode(errors="replace")
    assert head.startswith("HTTP/1.1 413"), head
    assert '"request_too_large"' in head
    # a chunked body (no Content-Length) is capped while it streams in

    def chunks() -> Any:
        for _ in range(5):
            yield b" " * (1 << 20)

    response = httpx.post(server.base_url + "/v1/completions", content=chunks(),
                          headers={**server.headers, "content-type": "application/json"}, timeout=60)
    _assert_error(response, 413, code="request_too_large")
    assert server.openai().completions.create(model=MODEL, prompt="Hi", max_tokens=1).choices


def test_bad_requests_do_not_disturb_a_stream(server: ServerProcess, offline: dict) -> None:
    text: list[str] = []

    def consume() -> None:
        for chunk in server.openai().completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=MAX_TOKENS,
                                                        temperature=0, stream=True):
            text.append(chunk.choices[0].text)

    thread = threading.Thread(target=consume)
    thread.start()
    try:
        for path, body, status, param, code in BAD_REQUESTS[:12]:
            _assert_error(_post(server, path, content=body, headers={"content-type": "application/json"}), status)
    finally:
        thread.join(timeout=300)
    assert not thread.is_alive()
    assert "".join(text) == offline["completions"][2]


def test_disconnect_mid_stream_frees_blocks(server: ServerProcess) -> None:
    before = server.metrics()
    body = {"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, headers=server.headers,
                      timeout=120) as response:
        assert response.status_code == 200
        lines = 0
        for line in response.iter_lines():
            if line.startswith("data: "):
                lines += 1
            if lines == 2:
                break  # leaving the block closes the connection mid-stream
    assert server.metrics()["flexpage_kv_blocks_used"] >= 0
    after = server.wait_idle(timeout=60)
    assert after["flexpage_requests_finished_total{finish_reason=abort}"] == \
        before["flexpage_requests_finished_total{finish_reason=abort}"] + 1
    assert after["flexpage_generation_tokens_total"] - before["flexpage_generation_tokens_total"] < 400

    # a non-streaming request whose client times out is aborted too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", json={**body, "stream": False}, headers=server.headers,
                   timeout=httpx.Timeout(60, read=1.0))
    after2 = server.wait_idle(timeout=60)
    assert after2["flexpage_requests_finished_total{finish_reason=abort}"] == \
        after["flexpage_requests_finished_total{finish_reason=abort}"] + 1


def test_a_disconnect_storm_gives_every_block_back(server: ServerProcess) -> None:
    """40 streams closed after 1-5 chunks and 20 non-streamed requests given up by a client
    timeout, all at once: each is aborted and the pool is whole again."""
    before = server.metrics()
    body = {"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 300, "ignore_eos": True,
            "temperature": 0, "stream": True}

    def leave_stream_after(chunks: int) -> None:
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, headers=server.headers,
                          timeout=300) as response:
            assert response.status_code == 200
            seen = 0
            for line in response.iter_lines():
                seen += line.startswith("data: ")
                if seen == chunks:
                    return  # leaving the block closes the connection

    def give_up_waiting() -> None:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.base_url + "/v1/completions", json={**body, "stream": False}, headers=server.headers,
                       timeout=httpx.Timeout(60, read=1.0))

    with ThreadPoolExecutor(60) as pool:
        jobs = [pool.submit(leave_stream_after, 1 + i % 5) for i in range(40)]
        jobs += [pool.submit(give_up_waiting) for _ in range(20)]
        for job in jobs:
            job.result()
    after = server.wait_idle(timeout=60)
    aborted = "flexpage_requests_finished_total{finish_reason=abort}"
    assert after[aborted] == before[aborted] + 60
    assert after["flexpage_kv_blocks_used"] == 0


def test_a_request_with_a_kv_budget_evicts_and_says_so_in_metrics(server: ServerProcess) -> None:
    before = server.wait_idle(timeout=60)["flexpage_kv_evicted_blocks_total"]
    out = server.openai().completions.create(model=MODEL, prompt="hello " * 100, max_tokens=8, temperature=0,
                                             extra_body={"kv_budget": 24})
    assert out.choices[0].finish_reason == "length"
    after = server.wait_idle(timeout=60)
    assert after["flexpage_kv_evicted_blocks_total"] > before
    assert after["flexpage_kv_evicted_tokens_total"] == 8 * after["flexpage_kv_evicted_blocks_total"]
    assert after["flexpage_kv_blocks_used"] == 0


def test_a_conversation_id_is_scoped_by_api_key(server: ServerProcess) -> None:
    """The same conversation id and prompt under two keys: only the key that computed the KV reuses it."""
    prompt = "Tell me everything about the history of lighthouses. " * 6
    other = {"Authorization": f"Bearer {OTHER_KEY}"}

    def turn(headers: dict, **extra: Any) -> int:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}
        response = _post(server, "/v1/completions", body, headers=headers)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    conversation = {**server.headers, "X-Conversation-Id": "lighthouses"}
    assert turn(conversation) == 0
    assert turn(conversation) > 0  # the same key and conversation: its KV is back
    assert turn({**other, "X-Conversation-Id": "lighthouses"}) == 0  # another key, the same id: nothing shared
    assert turn(other, user="lighthouses") > 0  # `user` names the conversation too; now the other key's KV
    mine = httpx.get(server.base_url + "/v1/kv", headers=server.headers, timeout=30).json()
    theirs = httpx.get(server.base_url + "/v1/kv", headers=other, timeout=30).json()
    assert [(c["id"], c["turns"]) for c in mine["conversations"] if c["id"] == "lighthouses"] == [("lighthouses", 2)]
    assert [(c["id"], c["turns"]) for c in theirs["conversations"] if c["id"] == "lighthouses"] == [("lighthouses", 2)]
    assert "another key" in mine["owners"] and "lighthouses" in mine["owners"]
    assert not any(OTHER_KEY in str(o) or API_KEY in str(o) for o in mine["owners"] + theirs["owners"])
    _assert_error(httpx.get(server.base_url + "/v1/kv"), 401, code="invalid_api_key")
    too_long = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1},
                     headers={**server.headers, "X-Conversation-Id": "c" * 300})
    _assert_error(too_long, 400, param="user")


def test_the_kv_view_accounts_for_every_block(server: ServerProcess) -> None:
    server.wait_idle(timeout=60)
    view = httpx.get(server.base_url + "/v1/kv", headers=server.headers, timeout=30).json()
    assert len(view["blocks"]) == len(view["owner_of"]) == 511 and set(view["blocks"]) <= set(".cus")
    assert sum(view["pool"].values()) == 511 and view["pool"]["used"] == view["pool"]["shared"] == 0
    assert view["pool"]["cached"] == view["blocks"].count("c") > 0
    assert all(view["owners"][i] is not None for i, state in zip(view["owner_of"], view["blocks"]) if state == "c")
    host = view["tiers"]["host"]
    assert view["tiers"]["policy"] == "retention" and host["bytes_total"] <= 64 << 20 < host["bytes_total"] + (1 << 20)
    metrics = server.metrics()
    assert metrics["flexpage_kv_host_tier_bytes"] == host["bytes_used"]
    for name in ("kv_spilled_tokens", "kv_restored_host_tokens", "kv_restored_disk_tokens", "kv_dropped_tokens",
                 "kv_released_tokens", "conversation_turns", "conversation_reused_tokens", "conversation_recomputed_tokens"):
        assert f"flexpage_{name}_total" in metrics
    assert metrics["flexpage_conversation_turns_total"] >= 4
    top = subprocess.run([sys.executable, "-m", "flexpage.cli", "top", "--url", server.base_url, "--api-key", API_KEY,
                          "--once"], capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "100"})
    assert top.returncode == 0, top.stderr
    assert "KV pool: 511 blocks of 8 tokens" in top.stdout and "lighthouses" in top.stdout
    wrong = subprocess.run([sys.executable, "-m", "flexpage.cli", "top", "--url", server.base_url, "--api-key", "nope",
                            "--once"], capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 1 and "HTTP 401" in wrong.stderr


# -- structured outputs ----------------------------------------------------------------------------
class Person(BaseModel):
    model_config = {"extra": "forbid"}
    name: str = PydanticField(max_length=12)
    age: int = PydanticField(ge=0, le=120)


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"], "additionalProperties": False}


def test_the_openai_clients_parse_gets_an_object_of_the_pydantic_model(server: ServerProcess) -> None:
    client = server.openai()
    completion = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Invent a person."}], response_format=Person,
        max_tokens=64, temperature=0.7, seed=3, n=2)
    assert len(completion.choices) == 2
    for choice in completion.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Person)


def test_streamed_json_schema_chunks_join_into_valid_json(server: ServerProcess) -> None:
    import jsonschema

    stream = server.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in a city?"}], stream=True, n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": CITY, "strict": True}},
        max_tokens=64, temperature=0.9, seed=5)
    texts, finishes = ["", ""], [None, None]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert finishes == ["stop", "stop"]
    for text in texts:
        jsonschema.validate(json.loads(text), CITY)


@pytest.mark.parametrize(("field", "value", "check"), [
    ("structured_outputs", {"regex": r"\d{3}-[a-z]{2}"}, lambda t: __import__("re").fullmatch(r"\d{3}-[a-z]{2}", t)),
    ("structured_outputs", {"choice": ["red", "green"]}, lambda t: t in ("red", "green")),
    ("guided_choice", ["left", "right"], lambda t: t in ("left", "right")),
    ("guided_json", CITY, lambda t: json.loads(t)["city"] is not None),
])
def test_completions_follow_each_spelling_of_a_constraint(server: ServerProcess, field: str, value: Any,
                                                          check: Any) -> None:
    response = _post(server, "/v1/completions", {"model": MODEL, "prompt": "Answer:", "max_tokens": 64,
                                                 "temperature": 0.8, "seed": 1, "n": 2, field: value})
    assert response.status_code == 200, response.text
    for choice in response.json()["choices"]:
        assert choice["finish_reason"] == "stop" and check(choice["text"]), choice


def test_a_json_object_response_format_gives_an_object(server: ServerProcess) -> None:
    response = _post(server, "/v1/chat/completions", {
        "model": MODEL, "max_tokens": 200, "temperature": 0, "response_format": {"type": "json_object"},
        "messages": [{"role": "user", "content": 'Reply with the JSON object {"answer": 42} and nothing else.'}]})
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert isinstance(json.loads(choice["message"]["content"]), dict)


@pytest.mark.parametrize(("extra", "param", "fragment"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format.json_schema.schema", "objectx"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex", "unclosed group"),
    ({"guided_grammar": "root ::= nothing"}, "guided_grammar", "nothing"),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"jsonn": {}}}, "structured_outputs.jsonn", None),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "one output constraint"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
    ({"functions": [{"name": "f"}]}, "functions", "use tools"),
    ({"structural_tag": "{}"}, "structural_tag", "not supported"),
])
def test_a_bad_or_conflicting_constraint_is_a_400_naming_the_field(server: ServerProcess, extra: dict, param: str,
                                                                    fragment: str | None) -> None:
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        error = _assert_error(_post(server, path, {"model": MODEL, "max_tokens": 4, **body, **extra}), 400,
                              param=param)
        assert fragment is None or fragment in error["message"], error


def test_a_schema_seen_before_is_not_compiled_again(server: ServerProcess) -> None:
    schema = {"type": "object", "properties": {"seen_before": {"type": "boolean"}}, "required": ["seen_before"]}
    body = {"model": MODEL, "prompt": "Flag:", "max_tokens": 32, "temperature": 0, "guided_json": schema}
    counts = []
    for _ in range(3):
        assert _post(server, "/v1/completions", body).status_code == 200
        metrics = server.wait_idle(timeout=60)
        counts.append(metrics["flexpage_grammar_compiles_total"])
    assert counts[0] >= 1 and counts[0] == counts[1] == counts[2]  # compiled once, by the first request


def test_an_unknown_field_is_accepted_and_an_ignorable_one_changes_nothing(server: ServerProcess) -> None:
    base = {"model": MODEL, "prompt": "The sky is", "max_tokens": 6, "temperature": 0}
    plain = _post(server, "/v1/completions", base).json()["choices"][0]["text"]
    for extra in ({"store": True, "metadata": {"a": "b"}}, {"some_future_field": 1}):
        response = _post(server, "/v1/completions", {**base, **extra})
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == plain


def test_a_constraint_cut_by_max_tokens_ends_with_length_and_the_partial_text(server: ServerProcess) -> None:
    response = _post(server, "/v1/completions", {"model": MODEL, "prompt": "Count:", "max_tokens": 3,
                                                 "temperature": 0, "structured_outputs": {"regex": "(ab){30}"}})
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["text"]
    assert __import__("re").fullmatch("(ab)*a?", choice["text"]), choice


def test_metrics_after_everything(server: ServerProcess) -> None:
    metrics = server.wait_idle(timeout=60)
    total = metrics["flexpage_kv_blocks_total"]
    assert total == 511
    assert metrics["flexpage_kv_blocks_used"] == 0
    assert metrics["flexpage_kv_blocks_free"] + metrics["flexpage_kv_blocks_cached"] == total
    assert metrics["flexpage_kv_blocks_cached"] > 0  # finished requests' KV stays reusable
    assert metrics["flexpage_prompt_tokens_total"] > 0 and metrics["flexpage_generation_tokens_total"] > 0
    assert metrics["flexpage_prefix_cache_hits_total"] > 0
    assert 0 < metrics["flexpage_prefix_cache_hit_rate"] <= 1
    assert metrics["flexpage_requests_finished_total{finish_reason=length}"] > 0
    for name in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        assert metrics[f"flexpage_{name}_seconds_count"] > 0
    for name in ("flexpage_num_requests_running", "flexpage_num_requests_waiting", "flexpage_kv_utilization",
                 "flexpage_kv_cache_usage", "flexpage_preemptions_total"):
        assert name in metrics


def test_graceful_shutdown_drains(server: ServerProcess) -> None:
    """Last: SIGINT with a stream in flight -> new requests 503, the stream completes, exit 0."""
    lines: list[str] = []
    # Long enough to still be in flight when the signal lands: at ~20 ms per token a 30-token stream
    # ended within the old fixed 0.5 s wait, the server exited, and the 503 probe met a closed port.
    body = {"model": MODEL, "prompt": "Count to fifty:", "max_tokens": 200, "ignore_eos": True, "temperature": 0,
            "stream": True}

    def consume() -> None:
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, headers=server.headers,
                          timeout=300) as response:
            lines.extend(line for line in response.iter_lines() if line)

    thread = threading.Thread(target=consume)
    thread.start()
    deadline = time.monotonic() + 60
    while not lines and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lines, "the stream did not start"
    server.proc.send_signal(2)  # SIGINT
    deadline = time.monotonic() + 10
    while httpx.get(server.base_url + "/health").status_code != 503 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert thread.is_alive(), "the stream ended before the signal was handled: nothing left to drain"
    _assert_error(_post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1}), 503, code="shutting_down")
    assert httpx.get(server.base_url + "/health").status_code == 503
    thread.join(timeout=300)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(timeout=60) == 0
    assert "draining 1 in-flight" in server.output()


def test_prefill_group_over_16_rows(offline: dict) -> None:
    """Regression: a prefill step with > 16 rows of >= 16 new tokens crashed the compiled CPU kernel
    (``index out of bounds ... cur_kvSplitSize``, a size-symbol clash fixed in inductor_fix)."""
    from flexpage import LLM, SamplingParams

    llm = LLM(None, dtype="float32", num_blocks=512)  # same shapes as `offline`: reuses its compiled kernels
    prompts = [{"prompt_token_ids": [100 + i + j for j in range(20)]} for i in range(17)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 2 for o in outputs)


def test_many_prompt_shapes_stay_within_the_compile_budget(offline: dict) -> None:
    """Regression: prefill groups once specialised on a query block of 1, 2, 4, ..., 32, so ordinary
    traffic needed more compiled variants than Dynamo's default limit of 8 and the 9th step failed.
    Runs in a fresh thread, like a server's engine thread."""
    from flexpage import LLM, SamplingParams

    llm = LLM(None, dtype="float32", num_blocks=512)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    errors: list[BaseException] = []

    def shapes() -> None:
        try:
            for length in (2, 3, 5, 9, 17, 33):  # q_block 2, 4, 8, 16, 32, 32
                for rows in (1, 2):
                    llm.generate([{"prompt_token_ids": [200 + r + j for j in range(length)]} for r in range(rows)],
                                 params)
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    thread = threading.Thread(target=shapes)
    thread.start()
    thread.join(timeout=600)
    assert not errors, f"{type(errors[0]).__name__}: {errors[0]}"


def test_serve_with_a_recipe_from_a_file(tiny_model: Any, tmp_path: Any) -> None:
    """The two commands of recipes/README.md: a copied recipe file, then ``flexpage serve --recipe``."""
    recipe_file = tmp_path / "my_local.py"
    recipe_file.write_text("from flexpage.recipes import chunked_local\nmine = chunked_local(16)\n")
    server = ServerProcess("--model", str(tiny_model("llama")), "--dtype", "float32", "--eager", "--num-blocks", "64",
                           "--recipe", f"{recipe_file}:mine")
    server.start().wait_ready()
    try:
        card = httpx.get(server.base_url + "/v1/models").json()["data"][0]
        assert card["attention_recipes"] == "chunked_local(16) (all 2 layers)"
        done = server.openai().completions.create(model=card["id"], prompt="Hello there", max_tokens=4)
        assert done.usage.completion_tokens == 4
        assert "chunked_local(16) (all 2 layers)  (--recipe)" in server.output()
    finally:
        server.stop()


def test_serve_with_speculative_decoding_reports_it_in_usage_and_metrics(tiny_model: Any) -> None:
    """``--speculative-config`` (vLLM's JSON): the same greedy text as a request that opts out,
    with what was proposed and accepted in ``usage.speculative_decoding`` and /metrics."""
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}'
    server = ServerProcess("--model", str(tiny_model("llama")), "--dtype", "float32", "--eager", "--num-blocks", "64",
                           "--no-warmup", "--speculative-config", spec)
    server.start().wait_ready()
    try:
        body = {"prompt": "one two three one two three one two", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        done = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120).json()
        plain = httpx.post(server.base_url + "/v1/completions", json={**body, "num_speculative_tokens": 0},
                           timeout=120).json()
        assert done["choices"][0]["text"] == plain["choices"][0]["text"]
        usage = done["usage"]["speculative_decoding"]
        assert 0 < usage["accepted_tokens"] <= usage["draft_tokens"]
        assert usage["acceptance_rate"] == round(usage["accepted_tokens"] / usage["draft_tokens"], 4)
        assert plain["usage"]["speculative_decoding"]["draft_tokens"] == 0
        metrics = server.metrics()
        assert metrics["flexpage_spec_decode_num_draft_tokens_total"] == usage["draft_tokens"]
        assert metrics["flexpage_spec_decode_num_accepted_tokens_total"] == usage["accepted_tokens"]
    finally:
        server.stop()


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_a_stream_cut_by_the_drain_timeout_ends_as_aborted(tiny_model: Any, chat: bool) -> None:
    """SIGTERM with a stream that outlives ``--drain-timeout``: the stream ends with an ``abort``
    finish chunk, a 503-style ``shutting_down`` error event and ``[DONE]``; the process exits 0."""
    server = ServerProcess("--model", str(tiny_model("llama")), "--dtype", "float32", "--eager", "--num-blocks", "512",
                           "--max-model-len", "2048", "--drain-timeout", "1", "--no-warmup")
    server.start().wait_ready()
    lines: list[str] = []
    body: dict[str, Any] = {"max_tokens": 2000, "ignore_eos": True, "temperature": 0, "stream": True}
    body.update({"messages": [{"role": "user", "content": "Go"}]} if chat else {"prompt": "Go"})

    def consume() -> None:
        path = "/v1/chat/completions" if chat else "/v1/completions"
        with httpx.stream("POST", server.base_url + path, json=body, timeout=120) as response:
            lines.extend(line for line in response.iter_lines() if line)

    thread = threading.Thread(target=consume)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while len(lines) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(lines) >= 3, "the stream did not start"
        server.proc.send_signal(15)  # SIGTERM
        thread.join(timeout=60)
        assert server.proc.wait(timeout=30) == 0
    finally:
        server.stop()
    assert lines[-1] == "data: [DONE]"
    *chunks, error = [json.loads(line[6:]) for line in lines[:-1]]
    assert error["error"]["code"] == "shutting_down" and error["error"]["type"] == "service_unavailable", error
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
