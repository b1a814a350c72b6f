"""The FastAPI app: OpenAI-compatible endpoints on top of an :class:`EngineLoop`.

Request path: a pure-ASGI guard (API key for ``/v1/*``, 503 while draining, body size
cap checked on ``Content-Length`` and while the body streams in) -> a handler that
validates the JSON body (pydantic, strict), tokenises in a single tokenizer thread,
checks the context length, builds :class:`SamplingParams`, and submits one engine
request per prompt. The engine thread answers each submission with ``Accepted`` or
``Failed`` (so a bad request is a 400 before any byte of a stream is sent) and then
streams :class:`Delta` snapshots. A client that goes away gets its requests aborted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from flexpage.errors import InvalidParameter
from flexpage.sampling_params import MAX_LOGPROBS, SamplingParams
from flexpage.server.engine_loop import Accepted, Delta, EngineLoop, Failed, SampleDelta, Sink
from flexpage.server.metrics import CONTENT_TYPE, ServerMetrics
from flexpage.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    unsupported_fields,
    validation_error,
)

__all__ = ["ServerState", "build_app"]

log = logging.getLogger("flexpage.server")

MAX_N = 128
_KNOWN_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


RequestT = TypeVar("RequestT", bound=BaseModel)

@dataclass
class ServerState:
    """Everything the handlers share. Only the engine thread touches the engine."""

    engine_loop: EngineLoop
    tokenizer: Any  # the server's own tokenizer instance (the engine thread uses another)
    served_model_name: str
    max_model_len: int
    vocab_size: int
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    metrics: ServerMetrics | None = None
    recipes: str = ""  # the attention recipes the model runs (see flexpage.server.main.recipe_summary)
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    inflight: int = 0
    tokenizer_pool: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flexpage-tokenizer"))


# -- the ASGI guard ------------------------------------------------------------------------
class Guard:
    """Auth, draining and body-size checks before FastAPI parses anything."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        status = [500]

        async def counted_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if path.startswith("/v1"):
                await self._guarded(scope, receive, counted_send)
            else:
                await self.app(scope, receive, counted_send)
        finally:
            if self.state.metrics is not None:
                self.state.metrics.http.labels(path if path in _KNOWN_PATHS else "other", str(status[0])).inc()

    async def _guarded(self, scope: dict, receive: Callable, send: Callable) -> None:
        state = self.state
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if state.api_key is not None:
            scheme, _, credential = headers.get("authorization", "").strip().partition(" ")
            token = credential.strip() if scheme.lower() == "bearer" else ""
            if not hmac.compare_digest(token.encode(), state.api_key.encode()):
                if token:
                    message = "invalid API key"
                elif scheme and scheme.lower() != "bearer":
                    message = f"unsupported authorization scheme {scheme[:20]!r} (send 'Authorization: Bearer <key>')"
                else:
                    message = "missing API key (send 'Authorization: Bearer <key>')"
                await _send_error(send, APIError(401, message, type="authentication_error", code="invalid_api_key",
                                                 headers={"www-authenticate": "Bearer"}))
                return
        if state.draining:
            await _send_error(send, APIError(503, "the server is shutting down", type="service_unavailable",
                                             code="shutting_down"))
            return
        limit = state.max_body_bytes
        declared = headers.get("content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            await _send_error(send, _too_large(int(declared), limit), close=True)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _send_error(send, _too_large(size, limit, at_least=True), close=True)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        state.inflight += 1
        try:
            await self.app(scope, replay, send)
        finally:
            state.inflight -= 1


def _too_large(size: int, limit: int, at_least: bool = False) -> APIError:
    got = f"at least {size}" if at_least else str(size)
    return APIError(413, f"request body is {got} bytes; the limit is {limit} bytes (--max-request-body)",
                    code="request_too_large")


async def _send_error(send: Callable, error: APIError, close: bool = False) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in error.headers.items()]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


# -- helpers ---------------------------------------------------------------------------------
def _parse(model: type[RequestT], body: bytes) -> RequestT:
    if not body.strip():
        raise APIError(400, "request body is empty; expected a JSON object", code="invalid_json")
    try:
        return model.model_validate_json(body)
    except ValidationError as error:
        raise validation_error(error) from None


def _check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name != state.served_model_name:
        raise APIError(404, f"The model `{name}` does not exist. This server serves `{state.served_model_name}`.",
                       param="model", code="model_not_found")


def _sampling_params(req: Any, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    if not 1 <= req.n <= MAX_N:
        raise APIError(400, f"n must be in [1, {MAX_N}], got {req.n}", param="n", code="invalid_value")
    kwargs: dict[str, Any] = dict(
        n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos, seed=req.seed,
        stop=req.stop, stop_token_ids=req.stop_token_ids, logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens,
    )
    defaults = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
                "frequency_penalty": 0.0, "repetition_penalty": 1.0}
    for name, default in defaults.items():
        value = getattr(req, name)
        kwargs[name] = default if value is None else value
    try:
        return SamplingParams(**kwargs)
    except InvalidParameter as error:
        raise APIError(400, str(error), param=error.param, code="invalid_value") from None


def _check_length(state: ServerState, num_prompt: int, params: SamplingParams, what: str) -> None:
    limit = state.max_model_len
    if num_prompt >= limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your {what} has "
                            f"{num_prompt} tokens (the {what} plus at least one generated token must fit).",
                       param=what, code="context_length_exceeded")
    if params.max_tokens is not None and num_prompt + params.max_tokens > limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                            f"{num_prompt + params.max_tokens} tokens ({num_prompt} in the {what}, "
                            f"{params.max_tokens} in the completion). Please reduce the length of the {what} "
                            "or the completion.", param="max_tokens", code="context_length_exceeded")


def _safe_float(value: float) -> float:
    if math.isnan(value):
        return -9999.0
    return max(value, -9999.0) if not math.isinf(value) or value < 0 else value


async def _in_tokenizer_thread(state: ServerState, fn: Callable[[], Any]) -> Any:
    return await asyncio.get_running_loop().run_in_executor(state.tokenizer_pool, fn)


# -- one HTTP request's engine requests ---------------------------------------------------------
class Submission:
    """The engine requests behind one HTTP request (one per prompt), merged into one stream."""

    def __init__(self, state: ServerState, prompts: list[tuple[str | None, list[int]]], params: SamplingParams,
                 arrival: float) -> None:
        self.state = state
        self.prompts = prompts
        self.params = params
        self.arrival = arrival
        self.sink = Sink(asyncio.get_running_loop())
        base = uuid.uuid4().hex
        self.request_ids = [f"{base}-{i}" for i in range(len(prompts))]
        self.finished: set[int] = set()
        self._buffer: list[Any] = []

    async def start(self) -> None:
        """Submit every prompt; raise :class:`APIError` if the engine refuses one."""
        for i, (text, ids) in enumerate(self.prompts):
            self.state.engine_loop.add(self.request_ids[i], {"prompt_token_ids": ids, "prompt": text}, self.params,
                                       self.sink, tag=i, arrival=self.arrival)
        pending = set(range(len(self.prompts)))
        failure: Failed | None = None
        while pending:
            item = await self.sink.queue.get()
            if isinstance(item, Accepted):
                pending.discard(item.tag)
            elif isinstance(item, Failed) and item.tag in pending:
                pending.discard(item.tag)
                self.finished.add(item.tag)
                failure = failure or item
            else:
                self._buffer.append(item)
        if failure is not None:
            self.abort()
            if failure.client_error:
                raise APIError(400, failure.message, param=failure.param, code="invalid_value")
            raise APIError(503 if "shutting down" in failure.message else 500, failure.message,
                           type="server_error", code="engine_error")

    async def items(self) -> AsyncIterator[Delta | Failed]:
        """Deltas until every prompt finished; a ``Failed`` ends the stream."""
        buffered, self._buffer = self._buffer, []
        pending = list(buffered)
        while len(self.finished) < len(self.prompts):
            item = pending.pop(0) if pending else await self.sink.queue.get()
            if item is None:  # woken by abort()
                continue
            if isinstance(item, Failed):
                self.finished.update(range(len(self.prompts)))
                yield item
                return
            if isinstance(item, Delta):
                if item.finished:
                    self.finished.add(item.tag)
                yield item

    def abort(self) -> None:
        """Abort every unfinished engine request (idempotent) and wake :meth:`items`."""
        aborted = False
        for i, request_id in enumerate(self.request_ids):
            if i not in self.finished:
                self.state.engine_loop.abort(request_id)
                self.finished.add(i)
                aborted = True
        if aborted:
            self.sink.queue.put_nowait(None)

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.prompts)


async def _wait_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    """Return when the client disconnects (or the connection fails)."""
    try:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - a broken connection counts as a disconnect
        return


@dataclass
class _Choice:
    """Accumulated state of one choice (non-streaming) or what was sent of it (streaming)."""

    text: str = ""
    sent_chars: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    text_offset: int = 0
    finish_reason: str | None = None
    started: bool = False


class _Usage:
    def __init__(self, num_prompts: int) -> None:
        self.prompt = [0] * num_prompts
        self.cached = [0] * num_prompts
        self.completion = 0

    def update(self, delta: Delta) -> None:
        self.prompt[delta.tag] = delta.num_prompt_tokens
        self.cached[delta.tag] = max(self.cached[delta.tag], delta.num_cached_tokens)
        self.completion += sum(len(s.token_ids) for s in delta.samples)

    def body(self) -> dict[str, Any]:
        prompt = sum(self.prompt)
        return {"prompt_tokens": prompt, "completion_tokens": self.completion,
                "total_tokens": prompt + self.completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached)}}


def _holdback(params: SamplingParams) -> int:
    """Characters to hold back while streaming, so a stop string is never partly sent."""
    return max((len(s) for s in params.stop), default=1) - 1


# -- logprob formatting -----------------------------------------------------------------------------
def _top(entry: dict, k: int) -> list[tuple[int, Any]]:
    ranked = sorted((lp.rank, tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= k)
    return [(tid, lp) for _, tid, lp in ranked[:k]]


def _completion_logprobs(choice: _Choice, token_ids: tuple[int, ...], entries: tuple[dict, ...], k: int) -> dict:
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, entry in zip(token_ids, entries):
        lp = entry.get(tid)
        token = lp.decoded_token if lp is not None and lp.decoded_token is not None else ""
        out["tokens"].append(token)
        out["token_logprobs"].append(_safe_float(lp.logprob) if lp is not None else None)
        out["top_logprobs"].append({t.decoded_token or "": _safe_float(t.logprob) for _, t in _top(entry, k)})
        out["text_offset"].append(choice.text_offset)
        choice.text_offset += len(token)
    return out


def _chat_logprobs(token_ids: tuple[int, ...], entries: tuple[dict, ...], k: int) -> dict:
    content = []
    for tid, entry in zip(token_ids, entries):
        lp = entry.get(tid)
        token = lp.decoded_token if lp is not None and lp.decoded_token is not None else ""
        content.append({
            "token": token, "logprob": _safe_float(lp.logprob) if lp is not None else -9999.0,
            "bytes": list(token.encode("utf-8")),
            "top_logprobs": [{"token": t.decoded_token or "", "logprob": _safe_float(t.logprob),
                              "bytes": list((t.decoded_token or "").encode("utf-8"))} for _, t in _top(entry, k)],
        })
    return {"content": content}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


# -- the app -------------------------------------------------------------------------------------------
def build_app(state: ServerState) -> Any:
    """The ASGI app (FastAPI wrapped in :class:`Guard`)."""
    app = FastAPI(title="flexpage", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.flexpage = state

    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError) -> JSONResponse:
        return _error_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code, "http_error")
        return JSONResponse(error_body(str(error.detail), "invalid_request_error", None, kind),
                            status_code=error.status_code, headers=getattr(error, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {"loc": (), "msg": "invalid request"}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return _error_response(APIError(400, f"{loc}: {first['msg']}" if loc else first["msg"], param=loc or None,
                                        code="invalid_type"))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, error: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return _error_response(APIError(500, f"internal server error: {type(error).__name__}", type="server_error",
                                        code="internal_error"))

    @app.get("/health")
    async def health() -> Response:
        if not state.engine_loop.alive:
            return JSONResponse({"status": "error", "detail": "the engine thread is not running"}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.metrics is None:
            return Response(b"", media_type=CONTENT_TYPE)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    def model_card() -> dict[str, Any]:
        return {"id": state.served_model_name, "object": "model", "created": state.created, "owned_by": "flexpage",
                "max_model_len": state.max_model_len, "attention_recipes": state.recipes}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        _check_model(state, model_id)
        return model_card()

    async def read_request(request: Request, model: type[RequestT]) -> tuple[RequestT, float]:
        """What both generation endpoints do first: note the arrival, parse and check the body."""
        arrival = time.monotonic()
        req = _parse(model, await request.body())
        _check_model(state, req.model)
        unsupported_fields(req)
        return req, arrival

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req, arrival = await read_request(request, CompletionRequest)
        params = _sampling_params(req, req.max_tokens, req.logprobs)
        prompts = await _completion_prompts(state, req.prompt)
        for _, ids in prompts:
            _check_length(state, len(ids), params, "prompt")
        return await _run(request, state, prompts, params, arrival, chat=False, stream=bool(req.stream),
                          include_usage=bool(req.stream_options and req.stream_options.include_usage),
                          top_k=req.logprobs or 0)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req, arrival = await read_request(request, ChatCompletionRequest)
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}",
                           param="top_logprobs", code="invalid_value")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs",
                           code="invalid_value")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = _sampling_params(req, max_tokens, logprobs)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        ids = await _in_tokenizer_thread(state, lambda: _render_chat(state.tokenizer, messages,
                                                                      req.add_generation_prompt))
        _check_length(state, len(ids), params, "messages")
        return await _run(request, state, [(None, ids)], params, arrival, chat=True, stream=bool(req.stream),
                          include_usage=bool(req.stream_options and req.stream_options.include_usage),
                          top_k=req.top_logprobs or 0)

    return Guard(app, state)


def _render_chat(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                            return_dict=False)
    except Exception as error:  # jinja errors (e.g. the template's raise_exception) are the client's
        raise APIError(400, f"messages: the chat template failed: {error}", param="messages",
                       code="invalid_value") from None
    ids = list(ids)
    if not ids:
        raise APIError(400, "messages: the chat template rendered an empty prompt", param="messages",
                       code="invalid_value")
    return ids


async def _completion_prompts(state: ServerState, prompt: Any) -> list[tuple[str | None, list[int]]]:
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and isinstance(prompt[0], int):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise APIError(400, "prompt: got an empty list", param="prompt", code="invalid_value")
    if len(items) > MAX_N:
        raise APIError(400, f"prompt: at most {MAX_N} prompts per request, got {len(items)}", param="prompt",
                       code="invalid_value")
    texts = [p for p in items if isinstance(p, str)]
    for text in texts:
        if not text:
            raise APIError(400, "prompt: got an empty string", param="prompt", code="invalid_value")
    encoded = iter(await _in_tokenizer_thread(
        state, lambda: [state.tokenizer(t, add_special_tokens=True).input_ids for t in texts]) if texts else [])
    out: list[tuple[str | None, list[int]]] = []
    for p in items:
        if isinstance(p, str):
            out.append((p, list(next(encoded))))
            continue
        if not p:
            raise APIError(400, "prompt: got an empty list of token ids", param="prompt", code="invalid_value")
        bad = next((t for t in p if not 0 <= t < state.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"prompt: token id {bad} is outside the vocabulary [0, {state.vocab_size})",
                           param="prompt", code="invalid_value")
        out.append((None, list(p)))
    return out


async def _run(request: Request, state: ServerState, prompts: list[tuple[str | None, list[int]]],
               params: SamplingParams, arrival: float, *, chat: bool, stream: bool, include_usage: bool,
               top_k: int) -> Response:
    submission = Submission(state, prompts, params, arrival)
    await submission.start()  # APIError if the engine refuses
    prefix = "chatcmpl-" if chat else "cmpl-"
    response_id = prefix + submission.request_ids[0].split("-")[0]
    created = int(time.time())
    if stream:
        return StreamingResponse(
            _stream(request, state, submission, response_id, created, chat=chat, include_usage=include_usage,
                    top_k=top_k),
            media_type="text/event-stream", headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
    return await _collect(request, state, submission, response_id, created, chat=chat, top_k=top_k)


async def _collect(request: Request, state: ServerState, submission: Submission, response_id: str, created: int,
                   *, chat: bool, top_k: int) -> Response:
    n = submission.params.n
    choices = [_Choice() for _ in range(len(submission.prompts) * n)]
    usage = _Usage(len(submission.prompts))
    want_logprobs = submission.params.logprobs is not None
    failure: Failed | None = None

    async def consume() -> None:
        nonlocal failure
        async for item in submission.items():
            if isinstance(item, Failed):
                failure = item
                return
            usage.update(item)
            for sample in item.samples:
                choice = choices[item.tag * n + sample.index]
                choice.text = sample.text
                choice.token_ids.extend(sample.token_ids)
                if want_logprobs and sample.logprobs is not None:
                    choice.logprobs.extend(sample.logprobs)
                choice.finish_reason = sample.finish_reason or choice.finish_reason

    consumer = asyncio.create_task(consume())
    watcher = asyncio.create_task(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not consumer.done():  # the client went away: stop generating for it
            submission.abort()
            consumer.cancel()
            return Response(status_code=499)
        consumer.result()
    finally:
        watcher.cancel()
        if not consumer.done():
            consumer.cancel()
        submission.abort()
    if failure is not None:
        status = 503 if "shutting down" in failure.message else 500
        raise APIError(status, failure.message, type="server_error", code="engine_error")
    body_choices = []
    for i, choice in enumerate(choices):
        logprobs = None
        if want_logprobs:
            entries = tuple(choice.logprobs)
            ids = tuple(choice.token_ids)
            logprobs = _chat_logprobs(ids, entries, top_k) if chat else _completion_logprobs(choice, ids, entries,
                                                                                            top_k)
        if chat:
            body_choices.append({"index": i, "message": {"role": "assistant", "content": choice.text},
                                 "logprobs": logprobs, "finish_reason": choice.finish_reason})
        else:
            body_choices.append({"index": i, "text": choice.text, "logprobs": logprobs,
                                 "finish_reason": choice.finish_reason})
    return JSONResponse({
        "id": response_id, "object": "chat.completion" if chat else "text_completion", "created": created,
        "model": state.served_model_name, "choices": body_choices, "usage": usage.body(), "system_fingerprint": None,
    })


async def _stream(request: Request, state: ServerState, submission: Submission, response_id: str, created: int, *,
                  chat: bool, include_usage: bool, top_k: int) -> AsyncIterator[str]:
    n = submission.params.n
    choices = [_Choice() for _ in range(len(submission.prompts) * n)]
    usage = _Usage(len(submission.prompts))
    holdback = _holdback(submission.params)
    want_logprobs = submission.params.logprobs is not None
    obj = "chat.completion.chunk" if chat else "text_completion"
    extra = {"usage": None} if include_usage else {}

    def chunk(choice_body: dict) -> str:
        return _sse({"id": response_id, "object": obj, "created": created, "model": state.served_model_name,
                     "system_fingerprint": None, "choices": [choice_body], **extra})

    def sample_chunk(index: int, choice: _Choice, sample: SampleDelta) -> str | None:
        finished = sample.finish_reason is not None
        limit = len(sample.text) if finished else max(choice.sent_chars, len(sample.text) - holdback)
        text = sample.text[choice.sent_chars:limit]
        choice.sent_chars = max(choice.sent_chars, limit)
        logprobs = None
        if want_logprobs and sample.logprobs and sample.token_ids:
            logprobs = (_chat_logprobs(sample.token_ids, sample.logprobs, top_k) if chat
                        else _completion_logprobs(choice, sample.token_ids, sample.logprobs, top_k))
        if not text and logprobs is None and not finished:
            return None
        if chat:
            delta: dict[str, Any] = {"content": text} if text or not finished else {}
            return chunk({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": sample.finish_reason})
        return chunk({"index": index, "text": text, "logprobs": logprobs, "finish_reason": sample.finish_reason})

    watcher = asyncio.create_task(_wait_disconnect(request.receive))
    watcher.add_done_callback(lambda task: task.cancelled() or submission.abort())
    try:
        if chat:
            for i, choice in enumerate(choices):
                choice.started = True
                yield chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})
        async for item in submission.items():
            if isinstance(item, Failed):
                yield _sse(error_body(item.message, "server_error", None, "engine_error"))
                break
            usage.update(item)
            for sample in item.samples:
                index = item.tag * n + sample.index
                data = sample_chunk(index, choices[index], sample)
                if data is not None:
                    yield data
        else:
            if include_usage:
                yield _sse({"id": response_id, "object": obj, "created": created, "model": state.served_model_name,
                            "system_fingerprint": None, "choices": [], "usage": usage.body()})
        yield "data: [DONE]\n\n"
    finally:
        watcher.cancel()
        submission.abort()
