"""Reading tool calls out of a choice's text, as it grows: OpenAI's ``tool_calls`` and the
content around them, the same way for a streamed response and a collected one.

The text follows :mod:`flexpage.server.tools`' syntax (``<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>``, calls one per line); the grammar made sure of it unless the output was cut
(``max_tokens``, a stop string). :class:`ToolCallReader` is fed the text seen so far and hands
back what may be sent now:

* content: text before the first ``<tool_call>`` (``"auto"`` only), held back while its end could
  still be the start of a tag, and whitespace held back until text follows it (the newline
  before a call is not content);
* each call once its ``</tool_call>`` arrived (one delta with id, name and all the arguments:
  valid OpenAI stream shape, which the client's stream helpers assemble by ``index``);
* at the end, text that never became a call (a call cut by ``max_tokens``) as content; calls
  completed before the cut stay calls (a stream has sent them already), and the finish reason
  stays ``"length"``.

A collected response feeds the whole text once, so its message is what the stream's deltas add
up to.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from flexpage.server.tools import CALL_CLOSE, CALL_OPEN

__all__ = ["ToolCallReader", "finish_reason", "new_call_id"]


def new_call_id() -> str:
    """An OpenAI-style call id: ``call_`` and 24 random hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


def _partial_tag(text: str) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of ``<tool_call>``."""
    for n in range(min(len(text), len(CALL_OPEN) - 1), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


def _parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of one call's JSON, or None if it is not a call."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(call.get("arguments"),
                                                                                             dict):
        return None
    return call["name"], json.dumps(call["arguments"], ensure_ascii=False)


@dataclass
class ToolCallReader:
    """The calls and content of one choice, read incrementally (see the module docstring).

    ``leading_text``: content may come before the calls (``"auto"``); otherwise the text is
    calls from its first character, and whatever is not becomes content at the end.
    """

    leading_text: bool
    calls: list[dict[str, Any]] = field(default_factory=list)  # every call read so far (a message's shape)
    _pos: int = 0  # characters of the text consumed
    _in_calls: bool = False
    _pending_space: str = ""  # whitespace of the content not yet sent

    def __post_init__(self) -> None:
        self._in_calls = not self.leading_text

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """New content and new calls (as a stream delta's ``tool_calls``: with their ``index``),
        given the choice's whole ``text`` so far; ``final``: the choice finished (everything
        still held back is let go)."""
        content: list[str] = []
        new_calls: list[dict[str, Any]] = []
        while True:
            if not self._in_calls:
                start = text.find(CALL_OPEN, self._pos)
                if start >= 0:
                    content.append(self._content(text[self._pos:start], drop_space=True))
                    self._pos, self._in_calls = start, True
                    continue
                end = len(text) if final else len(text) - _partial_tag(text)
                content.append(self._content(text[self._pos:end], drop_space=False, final=final))
                self._pos = max(self._pos, end)
                break
            rest = text[self._pos:]
            skipped = len(rest) - len(rest.lstrip("\n"))
            if rest[skipped:].startswith(CALL_OPEN):
                close = text.find(CALL_CLOSE, self._pos + skipped)
                parsed = None if close < 0 else _parse_call(text[self._pos + skipped + len(CALL_OPEN):close])
                if parsed is not None:
                    call = {"id": new_call_id(), "type": "function",
                            "function": {"name": parsed[0], "arguments": parsed[1]}}
                    new_calls.append({"index": len(self.calls), **call})
                    self.calls.append(call)
                    self._pos = close + len(CALL_CLOSE)
                    continue
            if final:  # not (or no longer) calls: the rest, past the newlines between calls, is content
                content.append(self._content(text[self._pos + skipped:], drop_space=False, final=True))
                self._pos = len(text)
            break
        return "".join(content), new_calls

    def _content(self, piece: str, *, drop_space: bool, final: bool = False) -> str:
        """``piece`` of content as it may be sent: whitespace waits for the text after it."""
        if drop_space:
            self._pending_space = ""
            head = piece.rstrip()
            return head and self._take(head)
        if final:
            return self._take(piece)
        head = piece.rstrip()
        out = self._take(head) if head else ""
        self._pending_space += piece[len(head):]
        return out

    def _take(self, text: str) -> str:
        out, self._pending_space = self._pending_space + text, ""
        return out


def finish_reason(reason: str | None, reader: ToolCallReader | None) -> str | None:
    """OpenAI's ``"tool_calls"`` for a choice that stopped after making calls."""
    if reader is not None and reader.calls and reason == "stop":
        return "tool_calls"
    return reason
