"""Tools <-> prompts and constraints: what a chat request's ``tools``, ``tool_choice`` and
``parallel_tool_calls`` do to its prompt and to the output the model may write.

flexpage has one syntax for a call, Hermes / Qwen 2.5's (what many open models were tuned on)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

* **Prompt.** A chat template that mentions ``tools`` renders them in the model's own format
  (``apply_chat_template(tools=...)``). Otherwise :data:`TOOL_PROMPT` lists them in the system
  message and asks for the syntax above (``flexpage serve --tool-prompt FILE`` replaces it, and
  then serves every model, whatever its template). Past turns render the same way: an assistant
  message's ``tool_calls`` as the ``<tool_call>`` blocks the model would have written, ``tool``
  messages as ``<tool_response>`` blocks in a user turn (plain ChatML templates know no tool role).
* **Output.** Every ``tool_choice`` but ``"none"`` constrains decoding with one llguidance Lark
  grammar (:func:`tool_call_grammar`) whose calls embed each tool's ``parameters`` schema
  (``%json``): a call the model makes always parses and its arguments validate. ``"auto"`` (the
  default with tools): free text, or text then calls; ``"required"``: one or more calls, only
  (exactly one with ``parallel_tool_calls: false``); a named function: exactly one call of it.
* ``"none"``: the tools are still shown to the model (vLLM's default), the output is neither
  constrained nor read for calls.

Reading calls back out of the text is :mod:`flexpage.server.tool_calls`.
"""

from __future__ import annotations

import json
import pathlib
import re
from dataclasses import dataclass
from typing import Any, Callable, Literal

from flexpage.errors import InvalidParameter
from flexpage.server.protocol import APIError, ChatCompletionRequest, ChatMessage, ToolDefinition
from flexpage.server.structured import Constraint
from flexpage.structured.llguidance_backend import JSON_DEFAULTS
from flexpage.structured.params import StructuredOutputsParams

__all__ = ["CALL_CLOSE", "CALL_OPEN", "TOOL_PROMPT", "ToolRequest", "chat_inputs", "check_messages",
           "compile_tools", "read_tool_prompt", "template_renders_tools", "tool_call_grammar", "tool_constraint",
           "tool_prompt", "tool_request"]

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
_OPEN_LINE = CALL_OPEN + "\n"
_CLOSE_LINE = "\n" + CALL_CLOSE

#: the system-message text that shows tools to a model whose chat template does not; ``{tools}``
#: becomes one JSON line per tool (``{"type": "function", "function": {...}}``). Replaced by
#: ``flexpage serve --tool-prompt FILE`` (the file's text, with the same ``{tools}`` slot).
TOOL_PROMPT = """# Tools

You can call functions to answer. Their signatures are listed inside <tools></tools>, one JSON object per line:
<tools>
{tools}
</tools>

To call a function, answer with its name and a JSON object of arguments inside <tool_call></tool_call> tags:
<tool_call>
{"name": "<function name>", "arguments": {<arguments>}}
</tool_call>
Write one <tool_call> block per call."""

TOOLS_SLOT = "{tools}"

#: OpenAI's rule for function names (letters, digits, "_" and "-", at most 64)
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: the arguments schema of a function declared without ``parameters``: the empty object only
_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}

Choice = Literal["none", "auto", "required", "function"]


def _error(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code=code)


@dataclass(frozen=True)
class ToolRequest:
    """A request's tools, checked: what it lets the model call, and how."""

    tools: tuple[ToolDefinition, ...]
    choice: Choice
    function: str | None = None  # the one function a named tool_choice forces
    parallel: bool = True  # parallel_tool_calls

    @property
    def reads_calls(self) -> bool:
        """Whether the output is read for calls (every choice but "none")."""
        return self.choice != "none"

    @property
    def leading_text(self) -> bool:
        """Whether free text may come before (or instead of) the calls ("auto")."""
        return self.choice == "auto"

    def constraint(self) -> StructuredOutputsParams | None:
        """The output constraint, or None for ``"none"``."""
        if self.choice == "none":
            return None
        callable_ = [t for t in self.tools if self.function in (None, t.function.name)]
        grammar = tool_call_grammar(callable_, leading_text=self.choice == "auto",
                                    one_call=self.choice == "function" or not self.parallel)
        return StructuredOutputsParams(grammar=grammar)


def tool_request(req: ChatCompletionRequest) -> ToolRequest | None:
    """The request's tools and tool choice, checked (400 naming the field), or None without tools."""
    named = req.tool_choice if req.tool_choice is not None and not isinstance(req.tool_choice, str) else None
    if req.tools is None:
        if req.tool_choice == "required" or named is not None:
            raise _error("tool_choice", f"{_choice_text(req.tool_choice)} needs tools; the request has none")
        return None
    if not req.tools:
        raise _error("tools", "expected at least one tool, got an empty list")
    seen: dict[str, int] = {}
    for i, tool in enumerate(req.tools):
        name = tool.function.name
        if not _NAME.fullmatch(name):
            raise _error(f"tools.{i}.function.name", f"got {name[:80]!r}, expected 1 to 64 letters, digits, "
                                                     "'_' or '-'")
        if name in seen:
            raise _error(f"tools.{i}.function.name", f"{name!r} is already the name of tools.{seen[name]}")
        seen[name] = i
        params = tool.function.parameters
        if params is not None and params.get("type", "object") != "object":
            raise _error(f"tools.{i}.function.parameters", f"expected a JSON schema of an object (the arguments), "
                                                           f"got type {params.get('type')!r}")
    parallel = req.parallel_tool_calls is not False
    if named is not None:
        if named.function.name not in seen:
            raise _error("tool_choice", f"function {named.function.name[:80]!r} is not among the tools "
                                        f"({', '.join(seen)})")
        return ToolRequest(tuple(req.tools), "function", named.function.name, parallel)
    return ToolRequest(tuple(req.tools), req.tool_choice or "auto", None, parallel)


def _choice_text(choice: Any) -> str:
    return f"tool_choice {choice!r}" if isinstance(choice, str) else f"tool_choice naming {choice.function.name!r}"


def tool_constraint(tools: ToolRequest | None, requested: Constraint | None) -> Constraint | None:
    """The request's one output constraint: its tools' calls (every tool_choice but "none"), or
    the one it asked for (``response_format``, ``structured_outputs``...); both is a 400."""
    if tools is None or not tools.reads_calls:
        return requested
    if requested is not None:
        choice = f"naming {tools.function!r}" if tools.function else repr(tools.choice)
        raise APIError(400, f"tools and {requested.param}: a request takes one output constraint, and tool_choice "
                            f"{choice} constrains the output to tool calls (with tool_choice 'none' it does not)",
                       param="tools", code="invalid_value")
    return Constraint(tools.constraint(), "tools")


def compile_tools(tools: ToolRequest, compile: Callable[[StructuredOutputsParams], Any]) -> None:
    """Compile each tool's parameters schema, then the request's constraint, with ``compile``
    (the engine's grammar compiler: cached, thread-safe); a schema the grammar library refuses is
    a 400 naming that tool."""
    for i, tool in enumerate(tools.tools):
        spec = StructuredOutputsParams(json=_arguments_schema(tool))
        try:
            compile(spec)
        except InvalidParameter as error:
            param = f"tools.{i}.function.parameters"
            raise _error(param, str(error).removeprefix(f"{spec.field}: ")) from None
    constraint = tools.constraint()
    if constraint is not None:
        try:
            compile(constraint)
        except InvalidParameter as error:  # each schema compiled alone: embedding them failed
            raise _error("tools", f"the tools' call grammar does not compile: "
                                  f"{str(error).removeprefix(constraint.field + ': ')}") from None


# -- the output grammar -------------------------------------------------------------------------
def _arguments_schema(tool: ToolDefinition) -> dict[str, Any]:
    """The tool's arguments schema with flexpage's JSON layout (compact, fixed separators; the
    schema's own ``x-guidance`` wins)."""
    params = tool.function.parameters if tool.function.parameters is not None else _NO_ARGUMENTS
    own = params.get("x-guidance")
    return {**params, "x-guidance": {**JSON_DEFAULTS, **own} if isinstance(own, dict) else JSON_DEFAULTS}


def _lark(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def tool_call_grammar(tools: list[ToolDefinition], *, leading_text: bool, one_call: bool) -> str:
    """A llguidance Lark grammar of calls to ``tools``.

    Each call is ``<tool_call>\\n{"name": "<name>", "arguments": <schema>}\\n</tool_call>``, calls
    separated by one newline. The name is a literal per tool and the arguments that tool's own
    ``%json`` (its ``$ref``s resolve against its own root). ``leading_text``: the output may be
    text only, or text then calls; the text's lexeme is lazy, so the first ``<tool_call>`` ends
    it and commits to a call."""
    lines = ["%llguidance {}"]
    more = "" if one_call else ' ("\\n" call)*'
    if leading_text:
        lines += [f'start: TEXT | head "\\n" body {_lark(_CLOSE_LINE)}{more}',
                  f"head[lazy]: TEXT {_lark(CALL_OPEN)}", r"TEXT: /(.|\n)*/"]
    else:
        lines.append(f"start: call{more}")
    lines.append(f"call: {_lark(_OPEN_LINE)} body {_lark(_CLOSE_LINE)}")
    lines.append("body: " + " | ".join(f"fn_{i}" for i in range(len(tools))))
    for i, tool in enumerate(tools):
        prefix = '{"name": ' + json.dumps(tool.function.name) + ', "arguments": '
        lines.append(f'fn_{i}: {_lark(prefix)} args_{i} "}}"')
        lines.append(f"args_{i}: %json {json.dumps(_arguments_schema(tool), ensure_ascii=False)}")
    return "\n".join(lines) + "\n"


# -- messages and the prompt --------------------------------------------------------------------
def check_messages(messages: list[ChatMessage]) -> None:
    """400 naming the field for tool turns that do not fit together: ``tool_calls`` on a message
    that is not the assistant's, arguments that are not a JSON object, a ``tool`` message without
    ``tool_call_id`` or answering no earlier call."""
    calls: set[str] = set()
    for i, message in enumerate(messages):
        if message.tool_calls and message.role != "assistant":
            raise _error(f"messages.{i}.tool_calls", f"only assistant messages carry tool calls, got role "
                                                     f"{message.role!r}")
        for j, call in enumerate(message.tool_calls or ()):
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                raise _error(f"messages.{i}.tool_calls.{j}.function.arguments",
                             f"expected a JSON object as text, got {call.function.arguments[:80]!r}")
            calls.add(call.id)
        if message.role == "tool":
            if message.tool_call_id is None:
                raise _error(f"messages.{i}.tool_call_id", "field required for role 'tool'", "missing_field")
            if message.tool_call_id not in calls:
                raise _error(f"messages.{i}.tool_call_id", f"{message.tool_call_id[:80]!r} answers no tool call of "
                                                           "an earlier assistant message")


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template mentions ``tools`` (then it shows them itself)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = " ".join(template.values())
    return isinstance(template, str) and "tools" in template


def read_tool_prompt(path: str) -> str:
    """``--tool-prompt``'s file, checked: it must have the ``{tools}`` slot."""
    try:
        text = pathlib.Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise ValueError(f"tool_prompt: cannot read {path!r}: {error.strerror or error}") from None
    if TOOLS_SLOT not in text:
        raise ValueError(f"tool_prompt: {path!r} has no {TOOLS_SLOT} slot for the tools")
    return text


def tool_prompt(tools: ToolRequest, template: str = TOOL_PROMPT) -> str:
    """``template`` with the tools listed in its ``{tools}`` slot (name, description, parameters:
    ``strict`` is the server's business, not the model's)."""
    listed = "\n".join(json.dumps({"type": "function", "function": t.function.model_dump(exclude_none=True,
                                                                                         exclude={"strict"})},
                                  ensure_ascii=False) for t in tools.tools)
    return template.replace(TOOLS_SLOT, listed)


def _call_text(call: Any) -> str:
    body = {"name": call.function.name, "arguments": json.loads(call.function.arguments)}
    return f"{_OPEN_LINE}{json.dumps(body, ensure_ascii=False)}{_CLOSE_LINE}"


def chat_inputs(messages: list[ChatMessage], tools: ToolRequest | None, *, native: bool,
                prompt_template: str = TOOL_PROMPT) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``apply_chat_template``'s messages and extra keywords for a (checked) conversation.

    ``native``: the template renders tools and tool turns itself (OpenAI's message shape, with
    arguments as objects, as Hugging Face templates expect). Otherwise the tools go into the
    system message through ``prompt_template`` and tool turns become the text the model reads
    and writes."""
    if native:
        names = {c.id: c.function.name for m in messages for c in m.tool_calls or ()}
        out: list[dict[str, Any]] = []
        for m in messages:
            item: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.tool_calls:
                item["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": json.loads(c.function.arguments)}} for c in m.tool_calls]
            if m.role == "tool":
                item.update(tool_call_id=m.tool_call_id, name=names.get(m.tool_call_id or ""))
            out.append(item)
        extra = {"tools": [t.model_dump(exclude_none=True) for t in tools.tools]} if tools else {}
        return out, extra
    out = []
    for m in messages:
        text = m.text()
        if m.role == "tool":
            response = f"<tool_response>\n{text}\n</tool_response>"
            if out and out[-1].get("tool_responses"):  # one user turn answers all of a turn's calls
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "tool_responses": True})
            continue
        if m.tool_calls:
            text = "\n".join(([text] if text else []) + [_call_text(c) for c in m.tool_calls])
        out.append({"role": m.role, "content": text})
    for item in out:
        item.pop("tool_responses", None)
    if tools is not None:
        shown = tool_prompt(tools, prompt_template)
        if out and out[0]["role"] in ("system", "developer"):
            out[0]["content"] = f"{out[0]['content']}\n\n{shown}" if out[0]["content"] else shown
        else:
            out.insert(0, {"role": "system", "content": shown})
    return out, {}
