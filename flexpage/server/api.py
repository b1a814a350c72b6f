"""The FastAPI app: OpenAI-compatible endpoints on top of an :class:`EngineLoop`.

Request path: a pure-ASGI guard (:mod:`flexpage.server.guard`: API key for ``/v1/*``, 503
while draining, body size) -> a handler that
validates the JSON body (pydantic, strict), tokenises in a single tokenizer thread,
checks the context length, builds :class:`SamplingParams`, and submits one engine
request per prompt (:mod:`flexpage.server.responses`: the engine thread answers each
submission with ``Accepted`` or ``Failed``, so a bad request is a 400 before any byte of a
stream is sent, then streams :class:`Delta` snapshots; a client that goes away gets its
requests aborted).

Conversations: the OpenAI ``user`` field, or an ``X-Conversation-Id`` header (which wins),
names the chat a request continues (:mod:`flexpage.conversations`). With API keys the id is
scoped by the key the request used, and the request's prefix-cache blocks are salted with it:
one key's conversation never shares KV with another key's. ``GET /v1/kv`` shows the KV cache
(:mod:`flexpage.kv_view`), other keys' conversations anonymised.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from flexpage.beam_search import BeamSearchParams
from flexpage.errors import InvalidParameter
from flexpage.sampling_params import MAX_LOGPROBS, SamplingParams
from flexpage.server.guard import Guard, error_response
from flexpage.server.metrics import CONTENT_TYPE
from flexpage.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    unsupported_fields,
    validation_error,
)
from flexpage.server.responses import run_request
from flexpage.server.schema import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    ModelCard,
    ModelList,
    openapi_schema,
    route_docs,
)
from flexpage.server.state import ServerState
from flexpage.server.structured import Constraint, compile_constraint, requested_constraint
from flexpage.server.tools import TOOL_PROMPT, ToolRequest, chat_inputs, check_messages, compile_tools, \
    template_renders_tools, tool_constraint, tool_request

__all__ = ["ServerState", "build_app"]

log = logging.getLogger("flexpage.server")

MAX_N = 128
_KNOWN_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
MAX_CONVERSATION_ID = 200
_OTHER_KEY = "another key"


RequestT = TypeVar("RequestT", bound=BaseModel)

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


#: request fields that do not combine with ``use_beam_search``, as (field, its no-op value)
_NOT_WITH_BEAMS = (("stream", False), ("echo", False), ("stop", None), ("stop_token_ids", None), ("min_tokens", 0),
                   ("seed", None), ("top_p", None), ("top_k", None), ("min_p", None), ("presence_penalty", None),
                   ("frequency_penalty", None), ("repetition_penalty", None), ("kv_budget", None),
                   ("num_speculative_tokens", None))
_BEAM_ONLY = ("beam_width", "length_penalty", "early_stopping")


def _request_params(req: Any, max_tokens: int | None, logprobs: int | None,
                    constraint: Constraint | None = None) -> SamplingParams | BeamSearchParams:
    """The engine parameters of a completion or chat request: sampling, or with
    ``use_beam_search`` a beam search. What a beam search cannot honour is refused here, by
    name: it is deterministic and returns its ``n`` best beams once all are ranked (no
    stream: the best beam is known only at the end)."""
    if not req.use_beam_search:
        for name in _BEAM_ONLY:
            if getattr(req, name) is not None:
                raise APIError(400, f"{name} needs use_beam_search", param=name, code="invalid_value")
        return _sampling_params(req, max_tokens, logprobs, constraint)
    for name, no_op in _NOT_WITH_BEAMS:
        value = getattr(req, name, no_op)  # echo: completions only
        if value is not None and value != no_op:
            raise APIError(400, f"{name} cannot be combined with use_beam_search", param=name, code="unsupported")
    if logprobs is not None:
        raise APIError(400, "logprobs cannot be combined with use_beam_search", param="logprobs", code="unsupported")
    if constraint is not None:
        raise APIError(400, "structured outputs and tools cannot be combined with use_beam_search",
                       param="use_beam_search", code="unsupported")
    if not 1 <= req.n <= MAX_N:
        raise APIError(400, f"n must be in [1, {MAX_N}], got {req.n}", param="n", code="invalid_value")
    try:
        return BeamSearchParams(
            beam_width=req.beam_width if req.beam_width is not None else req.n, n=req.n,
            max_tokens=max_tokens if max_tokens is not None else 16, ignore_eos=req.ignore_eos,
            temperature=req.temperature or 0.0,
            length_penalty=req.length_penalty if req.length_penalty is not None else 1.0,
            early_stopping=req.early_stopping if req.early_stopping is not None else False)
    except InvalidParameter as error:
        raise APIError(400, str(error), param=error.param, code="invalid_value") from None


def _sampling_params(req: Any, max_tokens: int | None, logprobs: int | None,
                     constraint: Constraint | None = None) -> SamplingParams:
    if not 1 <= req.n <= MAX_N:
        raise APIError(400, f"n must be in [1, {MAX_N}], got {req.n}", param="n", code="invalid_value")
    echo = bool(getattr(req, "echo", False))
    kwargs: dict[str, Any] = dict(
        n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos, seed=req.seed,
        stop=req.stop, stop_token_ids=req.stop_token_ids, logprobs=logprobs,
        prompt_logprobs=logprobs if echo else None,
        skip_special_tokens=req.skip_special_tokens, kv_budget=req.kv_budget,
        num_speculative_tokens=req.num_speculative_tokens,
        structured_outputs=constraint.spec if constraint is not None else None,
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


def _conversation_options(request: Request, user: str | None) -> dict[str, Any]:
    """``add_request`` keywords naming the request's conversation, scoped by its API key."""
    conversation = request.headers.get("x-conversation-id") or user
    if conversation is None:
        return {}
    if not conversation.strip() or len(conversation) > MAX_CONVERSATION_ID:
        raise APIError(400, f"conversation id (X-Conversation-Id or user): got {conversation[:40]!r}, expected a "
                            f"non-empty string of at most {MAX_CONVERSATION_ID} characters", param="user",
                       code="invalid_value")
    scope = request.scope.get("flexpage.key_scope")
    if scope is None:
        return {"conversation_id": conversation}
    return {"conversation_id": f"{scope}:{conversation}", "cache_salt": scope}


def _scoped_view(view: dict[str, Any], scope: str | None) -> dict[str, Any]:
    """``view`` as the holder of key ``scope`` may see it: its own conversations without the
    scope prefix, other keys' as "another key"."""
    if scope is None:
        return view

    def label(name: str | None) -> str | None:
        if name is None or ":" not in name:
            return name
        owner, _, conversation = name.partition(":")
        return conversation if owner == scope else _OTHER_KEY

    view["owners"] = [label(name) for name in view["owners"]]
    view["conversations"] = [{**c, "id": label(c["id"])} for c in view["conversations"] if label(c["id"]) != _OTHER_KEY]
    for r in view["requests"]:
        r["conversation"] = label(r["conversation"])
    return view


def _check_length(state: ServerState, num_prompt: int, params: SamplingParams | BeamSearchParams, what: str) -> None:
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


async def _in_tokenizer_thread(state: ServerState, fn: Callable[[], Any]) -> Any:
    return await asyncio.get_running_loop().run_in_executor(state.tokenizer_pool, fn)



# -- the app -------------------------------------------------------------------------------------------
def build_app(state: ServerState) -> Any:
    """The ASGI app (FastAPI wrapped in :class:`Guard`)."""
    from flexpage import __version__

    app = FastAPI(title="flexpage", version=__version__, docs_url=None, redoc_url=None)
    app.state.flexpage = state

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_schema(get_openapi(title=app.title, version=app.version, routes=app.routes))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code, "http_error")
        return JSONResponse(error_body(str(error.detail), "invalid_request_error", None, kind),
                            status_code=error.status_code, headers=getattr(error, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {"loc": (), "msg": "invalid request"}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error_response(APIError(400, f"{loc}: {first['msg']}" if loc else first["msg"], param=loc or None,
                                        code="invalid_type"))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, error: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(APIError(500, f"internal server error: {type(error).__name__}", type="server_error",
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

    @app.get("/v1/models", openapi_extra=route_docs(None, ModelList))
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", openapi_extra=route_docs(None, ModelCard))
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

    @app.post("/v1/completions", openapi_extra=route_docs(CompletionRequest, CompletionResponse, CompletionResponse))
    async def completions(request: Request) -> Response:
        req, arrival = await read_request(request, CompletionRequest)
        constraint = requested_constraint(req)
        # echo with max_tokens 0 scores the prompt alone (lm-evaluation-harness's loglikelihood):
        # one token is generated and left out of the response
        prompt_only = bool(req.echo) and req.max_tokens == 0
        params = _request_params(req, 1 if prompt_only else req.max_tokens, req.logprobs, constraint)
        prompts = await _completion_prompts(state, req.prompt)
        for _, ids in prompts:
            _check_length(state, len(ids), params, "prompt")
        options = _conversation_options(request, req.user)
        if options and len(prompts) > 1:
            raise APIError(400, "a conversation continues one prompt at a time; got a conversation id with "
                                f"{len(prompts)} prompts", param="prompt", code="invalid_value")
        await compile_constraint(state, constraint)
        return await run_request(request, state, prompts, params, arrival, chat=False, stream=bool(req.stream),
                          include_usage=bool(req.stream_options and req.stream_options.include_usage),
                          top_k=req.logprobs or 0, options=options, echo=bool(req.echo), drop_output=prompt_only)

    @app.post("/v1/chat/completions",
              openapi_extra=route_docs(ChatCompletionRequest, ChatCompletionResponse, ChatCompletionChunk))
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
        tools = tool_request(req)
        check_messages(req.messages)
        constraint = tool_constraint(tools, requested_constraint(req))
        params = _request_params(req, max_tokens, logprobs, constraint)
        ids = await _in_tokenizer_thread(state, lambda: _chat_prompt(state, req, tools))
        _check_length(state, len(ids), params, "messages")
        await compile_constraint(state, constraint)
        return await run_request(request, state, [(None, ids)], params, arrival, chat=True, stream=bool(req.stream),
                          include_usage=bool(req.stream_options and req.stream_options.include_usage),
                          top_k=req.top_logprobs or 0, options=_conversation_options(request, req.user), tools=tools)

    @app.get("/v1/kv")
    async def kv_cache(request: Request) -> dict[str, Any]:
        """The KV cache block by block, its tiers, conversations and requests (flexpage.kv_view)."""
        view = await asyncio.wrap_future(state.engine_loop.call(lambda engine: engine.kv_view()))
        return _scoped_view(view, request.scope.get("flexpage.key_scope"))

    return Guard(app, state)


def _chat_prompt(state: ServerState, req: ChatCompletionRequest, tools: ToolRequest | None) -> list[int]:
    """In the tokenizer thread: the chat's prompt ids, and its tools' schemas compiled (one the
    grammar library refuses is a 400 naming that tool, before the request is queued)."""
    if tools is not None and state.grammars is not None:
        compile_tools(tools, state.grammars.compile)
    native = state.tool_prompt is None and template_renders_tools(state.tokenizer)
    messages, extra = chat_inputs(req.messages, tools, native=native, prompt_template=state.tool_prompt or TOOL_PROMPT)
    return _render_chat(state.tokenizer, messages, req.add_generation_prompt, **extra)


def _render_chat(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool,
                 **template_kwargs: Any) -> list[int]:
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                            return_dict=False, **template_kwargs)
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
