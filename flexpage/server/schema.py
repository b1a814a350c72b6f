"""The API's shapes, served at ``/openapi.json``: request models from :mod:`protocol`, response
models here.

The handlers build response bodies as plain dicts (cheap, and streamed chunk by chunk); the
models below describe those dicts for clients and fuzzers. They forbid unknown fields, and the
server tests validate real responses against them, so the served schema cannot drift from
what the server sends.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict

from flexpage.server.protocol import ChatCompletionRequest, CompletionRequest

__all__ = ["RESPONSE_MODELS", "openapi_schema", "route_docs"]


class _Shape(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(_Shape):
    message: str
    type: str
    param: Optional[str]
    code: Optional[str]


class ErrorResponse(_Shape):
    """Every error, whatever the status: OpenAI's ``{"error": {...}}``."""

    error: ErrorDetail


class PromptTokensDetails(_Shape):
    cached_tokens: int


class Usage(_Shape):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(_Shape):
    tokens: list[str]
    token_logprobs: list[Optional[float]]
    top_logprobs: list[Optional[dict[str, float]]]  # None: an echoed prompt's first token
    text_offset: list[int]


class TopLogprob(_Shape):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Shape):
    content: list[ChatTokenLogprob]


FinishReason = Optional[Literal["stop", "length", "tool_calls", "abort"]]


class CompletionChoice(_Shape):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs]
    finish_reason: FinishReason


class CompletionResponse(_Shape):
    """``/v1/completions``; with ``stream`` each server-sent event is one of these (``usage``
    only with ``stream_options.include_usage``, then null until the last, choice-less event)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None
    system_fingerprint: None


class CalledFunction(_Shape):
    name: str
    arguments: str  # JSON text


class MessageToolCall(_Shape):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(_Shape):
    role: Literal["assistant"]
    content: Optional[str]  # null when the message is tool calls only
    tool_calls: Optional[list[MessageToolCall]] = None  # only with tools (flexpage.server.tools)


class ChatChoice(_Shape):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChatLogprobs]
    finish_reason: FinishReason


class ChatCompletionResponse(_Shape):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: None


class DeltaToolCall(MessageToolCall):
    """flexpage sends each call whole, in one delta, once it is complete."""

    index: int


class ChatDelta(_Shape):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None


class ChatChunkChoice(_Shape):
    index: int
    delta: ChatDelta
    logprobs: Optional[ChatLogprobs]
    finish_reason: FinishReason


class ChatCompletionChunk(_Shape):
    """One server-sent event of a streamed ``/v1/chat/completions``."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None
    system_fingerprint: None


class ModelCard(_Shape):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    attention_recipes: str


class ModelList(_Shape):
    object: Literal["list"]
    data: list[ModelCard]


#: the response models, by name (tests validate real bodies against them)
RESPONSE_MODELS: dict[str, type[BaseModel]] = {model.__name__: model for model in (
    ErrorResponse, CompletionResponse, ChatCompletionResponse, ChatCompletionChunk, ModelCard, ModelList)}

_ERRORS = {"400": "invalid request (the error names the field)", "401": "missing or invalid API key",
           "404": "unknown model", "413": "request body too large", "503": "shutting down"}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _json(model: type[BaseModel]) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(model)}}


def route_docs(request: type[BaseModel] | None, response: type[BaseModel],
               stream: type[BaseModel] | None = None) -> dict[str, Any]:
    """``openapi_extra`` for a route whose handler parses its own body: the request body, the
    200 response (and its event stream) and the error responses."""
    ok: dict[str, Any] = {"description": "OK", "content": _json(response)}
    if stream is not None:
        ok["content"]["text/event-stream"] = {"schema": {"type": "string", "description": (
            f"server-sent events: 'data: <{stream.__name__} JSON>' lines, then 'data: [DONE]'")}}
    extra: dict[str, Any] = {"responses": {"200": ok, **{status: {"description": text, "content": _json(ErrorResponse)}
                                                          for status, text in _ERRORS.items()}}}
    if request is not None:
        extra["requestBody"] = {"required": True, "content": _json(request)}
    return extra


def openapi_schema(base: dict[str, Any]) -> dict[str, Any]:
    """FastAPI's generated schema with the request and response models added to its components."""
    schemas = base.setdefault("components", {}).setdefault("schemas", {})
    for model in (CompletionRequest, ChatCompletionRequest, *RESPONSE_MODELS.values()):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    return base


