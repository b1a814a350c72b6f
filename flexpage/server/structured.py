"""A request's output constraint, from whichever field the client used to ask for one.

Three spellings reach the same :class:`~flexpage.structured.StructuredOutputsParams`:

* OpenAI's ``response_format``: ``{"type": "json_object"}`` or
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` (``"text"``: none);
* vLLM's ``structured_outputs``: ``{"json" | "json_object" | "regex" | "choice" | "grammar": ...}``;
* vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``,
  accepted as aliases of ``structured_outputs``.

A request gives at most one; two are a 400 naming both. The constraint compiles in the
server's tokenizer thread before the request is queued (:func:`compile_constraint`), so a
malformed schema is a 400 quoting the grammar library before any token is generated, and the
engine's step loop never waits on a new schema.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from flexpage.errors import InvalidParameter
from flexpage.server.protocol import APIError
from flexpage.structured import StructuredOutputsParams

__all__ = ["GUIDED_ALIASES", "Constraint", "compile_constraint", "requested_constraint"]

#: vLLM's pre-0.10 fields and the ``structured_outputs`` key each one means
GUIDED_ALIASES = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


@dataclass(frozen=True)
class Constraint:
    """A request's constraint and the field it came in (what a 400 about it names)."""

    spec: StructuredOutputsParams
    param: str


def requested_constraint(req: Any) -> Constraint | None:
    """The one constraint ``req`` asks for (None: free text); 400 naming the fields when it
    asks in two ways or a value has the wrong shape."""
    found: list[tuple[str, dict[str, Any]]] = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise APIError(400, "response_format.json_schema: required when type is 'json_schema'",
                           param="response_format.json_schema", code="missing_field")
        schema = fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else {}
        found.append(("response_format.json_schema.schema", {"json": schema}))
    if req.structured_outputs is not None:
        fields = req.structured_outputs.model_dump(exclude_none=True, by_alias=True)
        if not fields.get("json_object"):
            fields.pop("json_object", None)
        kinds = list(fields) or ["structured_outputs"]
        found.append((f"structured_outputs.{kinds[0]}" if len(kinds) == 1 else "structured_outputs", fields))
    found += [(alias, {key: getattr(req, alias)}) for alias, key in GUIDED_ALIASES.items()
              if getattr(req, alias) is not None]
    if not found:
        return None
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise APIError(400, f"{names}: a request takes one output constraint; got {len(found)}",
                       param=found[1][0], code="invalid_value")
    param, fields = found[0]
    try:
        return Constraint(StructuredOutputsParams(**fields), param)
    except InvalidParameter as error:
        raise APIError(400, f"{param}: {str(error).split(': ', 1)[-1]}", param=param, code="invalid_value") from None


async def compile_constraint(state: Any, constraint: Constraint | None) -> None:
    """Compile ``constraint`` in the tokenizer thread (the engine then finds it cached); 400
    quoting the grammar library for a constraint it refuses."""
    if constraint is None or state.grammars is None:
        return
    try:
        await asyncio.get_running_loop().run_in_executor(state.tokenizer_pool, state.grammars.compile,
                                                         constraint.spec)
    except InvalidParameter as error:
        message = str(error).split(": ", 1)[-1]
        raise APIError(400, f"{constraint.param}: {message}", param=constraint.param, code="invalid_value") from None
