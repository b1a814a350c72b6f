"""What a request asks its output to match: one JSON schema, regex, choice or grammar.

:class:`StructuredOutputsParams` has vLLM's name and fields
(``SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))``). It is plain
data, checked for shape at construction; whether the schema, regex or grammar itself is
valid is the grammar library's call, made when the engine compiles it
(:mod:`flexpage.structured.compiler`), before the request is queued.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from flexpage.errors import InvalidParameter

__all__ = ["StructuredOutputsParams", "KINDS"]

#: the forms an output constraint takes, one per request
KINDS = ("json", "json_object", "regex", "choice", "grammar")

_PARAM = "structured_outputs"


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of:

    Attributes:
        json: a JSON schema (a dict, or its JSON text) the output must validate against.
        json_object: True: any JSON object (OpenAI's ``response_format: json_object``).
        regex: a regular expression the whole output must match (Rust ``regex`` syntax).
        choice: the output is exactly one of these strings.
        grammar: a context-free grammar, in GBNF (llama.cpp's) or Lark syntax.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise InvalidParameter(_PARAM, f"{_PARAM}: give exactly one of {', '.join(KINDS)}; got "
                                           f"{', '.join(given) if given else 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise InvalidParameter(f"{_PARAM}.json", f"{_PARAM}.json: expected a JSON schema (an object or its "
                                                     f"JSON text), got {type(self.json).__name__}")
        if not isinstance(self.json_object, bool):
            raise InvalidParameter(f"{_PARAM}.json_object", f"{_PARAM}.json_object: expected a bool")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise InvalidParameter(f"{_PARAM}.{name}", f"{_PARAM}.{name}: expected a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise InvalidParameter(f"{_PARAM}.choice",
                                       f"{_PARAM}.choice: expected a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        """Which of :data:`KINDS` this is."""
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def field(self) -> str:
        """The field an error about this constraint names (``structured_outputs.json`` ...)."""
        return f"{_PARAM}.{self.kind}"

    def key(self) -> tuple[str, str]:
        """What identifies the compiled grammar: equal keys compile to the same grammar."""
        value = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, dict):
            value = json.dumps(value, sort_keys=True, separators=(",", ":"))
        elif self.kind == "choice":
            value = json.dumps(list(value))
        return self.kind, str(value)
