"""Request bodies of the OpenAI-compatible API (pydantic, strict JSON) and the error shape.

Bodies are validated with ``model_validate_json`` in strict mode: ``"5"`` is not an int,
``1`` is not a bool, a float field accepts ints. Fields this server does not implement are
handled by :func:`unsupported_fields`, one table for all of them: those that would change the
output are refused with a 400 naming the field (:data:`REFUSED_FIELDS`), those that do not are
accepted and ignored (:data:`IGNORED_FIELDS`), and a field nobody here knows is accepted with
a warning in the server log (clients such as the ``openai`` SDK send extras).
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

import logging

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = [
    "APIError",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "FunctionDefinition",
    "IGNORED_FIELDS",
    "NamedToolChoice",
    "REFUSED_FIELDS",
    "ResponseFormat",
    "StreamOptions",
    "StructuredOutputsField",
    "ToolCall",
    "ToolDefinition",
    "error_body",
    "validation_error",
]


class APIError(Exception):
    """An error that becomes ``{"error": {message, type, param, code}}`` with ``status``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before",
              "function-wrap", "lax-or-strict", "json-or-python"}


def validation_error(error: ValidationError) -> APIError:
    """The first pydantic error as a 400 ``invalid_request_error`` naming the field."""
    first = error.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"malformed JSON body: {first['msg']}", code="invalid_json")
    raw_loc = [str(p) for p in first.get("loc", ())]
    # union members and validator wrappers show up in loc ("prompt.str"): keep field names and indices
    loc = ".".join(p for p in raw_loc if p.lower() not in _TYPE_TAGS and "[" not in p)
    if first["type"] == "model_type" and not loc:
        return APIError(400, "request body must be a JSON object", code="invalid_type")
    missing = first["type"] == "missing"
    if missing:
        message = f"{loc}: field required"
    elif len(raw_loc) > len(loc.split(".")) and loc:  # a union: no single member's message fits
        message = f"{loc}: invalid type or value {_short(first.get('input'))}"
    else:
        message = f"{loc}: {first['msg']}" if loc else first["msg"]
        if "input" in first and not isinstance(first["input"], dict):
            message += f" (got {_short(first['input'])})"
    return APIError(400, message, param=loc or None, code="missing_field" if missing else "invalid_type")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class _Base(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Base):
    include_usage: bool = False


class JsonSchemaFormat(_Base):
    """OpenAI's ``response_format.json_schema``. ``strict`` is accepted either way: the schema
    is always enforced (decoding is constrained to it)."""

    name: str
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Base):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputsField(_Base):
    """vLLM's ``structured_outputs`` (see :class:`flexpage.structured.StructuredOutputsParams`)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    json_: Optional[Union[dict[str, Any], str]] = Field(default=None, alias="json")  # BaseModel has .json()
    json_object: Optional[bool] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None


class _SamplingFields(_Base):
    """Fields shared by both endpoints (OpenAI names plus vLLM's extras)."""

    model_config = ConfigDict(strict=True, extra="allow")  # unknown fields: see unsupported_fields

    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    kv_budget: Optional[int] = None  # KV tokens kept per layer (flexpage's extra; see SamplingParams.kv_budget)
    num_speculative_tokens: Optional[int] = None  # flexpage's extra; see SamplingParams.num_speculative_tokens
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsField] = None
    guided_json: Optional[Union[dict[str, Any], str]] = None  # vLLM's older spellings of structured_outputs
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    # beam search (vLLM's extras, plus HF's early_stopping): see flexpage.server.api._beam_search_params
    use_beam_search: bool = False
    beam_width: Optional[int] = None  # None: n
    length_penalty: Optional[float] = None  # None: 1.0
    early_stopping: Optional[Union[bool, Literal["never"]]] = None  # None: False
    # accepted only in their no-op form (see unsupported_fields)
    logit_bias: Optional[dict[str, float]] = None
    best_of: Optional[int] = None


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: Optional[bool] = False
    suffix: Optional[str] = None


class _TextPart(_Base):
    type: Literal["text"]
    text: str


class FunctionCall(_Base):
    name: str
    arguments: str  # JSON text (OpenAI's shape); flexpage.server.tools checks it parses


class ToolCall(_Base):
    """A call an earlier assistant turn made (``messages[i].tool_calls[j]``)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Base):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]  # OpenAI's roles
    content: Optional[Union[str, list[_TextPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None  # role "assistant" only
    tool_call_id: Optional[str] = None  # role "tool": the call this message answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(_Base):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema of the arguments object; None: no arguments
    strict: Optional[bool] = None  # accepted: calls are always schema-constrained (see flexpage.server.tools)


class ToolDefinition(_Base):
    type: Literal["function"]
    function: FunctionDefinition


class _FunctionName(_Base):
    name: str


class NamedToolChoice(_Base):
    type: Literal["function"]
    function: _FunctionName


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[ToolDefinition]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None  # None: "auto" with tools
    parallel_tool_calls: Optional[bool] = None  # None: true (OpenAI's default)
    add_generation_prompt: bool = True


#: fields of OpenAI's or vLLM's API that would change the output, and what to use instead
REFUSED_FIELDS = {
    "functions": "use tools", "function_call": "use tool_choice",
    "structural_tag": "use structured_outputs.grammar", "guided_decoding_backend": "the backend is llguidance",
    "guided_whitespace_pattern": "JSON is generated with fixed separators",
    "prompt_logprobs": "use echo with logprobs", "allowed_token_ids": "use structured_outputs.choice or regex",
    "bad_words": "not supported", "logits_processors": "not supported", "prediction": "not supported",
    "audio": "text only", "modalities": "text only", "include_stop_str_in_output": "not supported",
    "truncate_prompt_tokens": "not supported", "continue_final_message": "not supported",
    "chat_template": "the model's own template is used", "chat_template_kwargs": "not supported",
    "documents": "not supported",
    "return_tokens_as_token_ids": "not supported",
    "tools": "tools are for /v1/chat/completions", "tool_choice": "tools are for /v1/chat/completions",
}
#: fields that do not change the output: accepted and ignored
IGNORED_FIELDS = frozenset({"store", "metadata", "service_tier", "reasoning_effort", "priority", "request_id", "spaces_between_special_tokens",
                            "web_search_options", "safety_identifier", "prompt_cache_key", "verbosity"})

log = logging.getLogger(__name__)
_warned: set[str] = set()
_MAX_WARNED = 256


def unsupported_fields(req: _SamplingFields) -> None:
    """Refuse options this server would otherwise silently ignore; warn (once per name) of
    fields it does not know."""
    for name, value in (req.model_extra or {}).items():
        if name in REFUSED_FIELDS and value is not None:
            raise APIError(400, f"{name} is not supported ({REFUSED_FIELDS[name]})", param=name, code="unsupported")
        if name not in IGNORED_FIELDS and name not in REFUSED_FIELDS and name not in _warned \
                and len(_warned) < _MAX_WARNED:  # bounded: clients choose the names
            _warned.add(name)
            log.warning("request field %r is not known to this server and was ignored", name)
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias", code="unsupported")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of is not supported (use n)", param="best_of", code="unsupported")
    if isinstance(req, CompletionRequest):
        if req.echo and req.stream:
            raise APIError(400, "echo is supported without stream only", param="echo", code="unsupported")
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix", code="unsupported")
