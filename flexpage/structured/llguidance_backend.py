"""The llguidance backend (https://github.com/guidance-ai/llguidance, used by vLLM and llama.cpp).

Compiling is cheap (about 1-3 ms for the nested schemas of bench/structured.py on SmolLM2's
49,152-token vocabulary: validating the grammar, then parsing it into a matcher at its start);
llguidance builds its lexer lazily while it matches. Each sample's matcher is a copy of that
start (~1 us). Masks cost 20-130 us per row; a batch fills on llguidance's own thread pool.

JSON is generated with fixed separators (``", "``, ``": "``) and no free whitespace: a small
model given free whitespace can emit newlines until ``max_tokens``, and the output never
parses. Schemas may still ask for other separators with llguidance's ``x-guidance`` key.
Dates, times and date-times are matched by flexpage's stricter patterns
(:mod:`flexpage.structured.json_formats`).
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import llguidance
import llguidance.hf
import torch

from flexpage.errors import InvalidParameter
from flexpage.structured.backend import bitmask_words
from flexpage.structured.json_formats import calendar_formats
from flexpage.structured.params import StructuredOutputsParams

__all__ = ["LLGuidanceBackend"]

#: llguidance's JSON options for every schema (a schema's own ``x-guidance`` overrides them)
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _strict_formats(schema: dict | str) -> str:
    """The schema's text with :func:`calendar_formats` applied (malformed JSON text as it is:
    llguidance's message then names what is wrong)."""
    if not isinstance(schema, str):
        return json.dumps(calendar_formats(schema))
    try:
        return json.dumps(calendar_formats(json.loads(schema)))
    except ValueError:
        return schema


class _Matcher:
    """One sample's llguidance matcher."""

    __slots__ = ("inner",)

    def __init__(self, inner: llguidance.LLMatcher) -> None:
        self.inner = inner

    def accept(self, token_id: int) -> bool:
        return self.inner.consume_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        self.inner.rollback(num_tokens)

    @property
    def is_finished(self) -> bool:
        return self.inner.is_stopped()

    @property
    def error(self) -> str:
        return self.inner.get_error()


class _Grammar:
    """A validated grammar and a matcher at its start, copied for each sample: parsing the
    grammar into a matcher costs 0.5-1.7 ms for the schemas of bench/structured.py, a copy ~1 us."""

    __slots__ = ("text", "_start")

    def __init__(self, tokenizer: llguidance.LLTokenizer, text: str) -> None:
        self.text = text
        self._start = llguidance.LLMatcher(tokenizer, text)

    def matcher(self) -> _Matcher:
        return _Matcher(self._start.deep_copy())


class LLGuidanceBackend:
    """llguidance bound to one Hugging Face tokenizer and the model's vocabulary size."""

    name = "llguidance"

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        """``vocab_size``: the model's logits width (may exceed the tokenizer's); ``eos_token_ids``:
        the tokens that end an output, allowed wherever the grammar is complete."""
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                                      eos_token=list(eos_token_ids) or None)
        self._executor = llguidance.LLExecutor()

    def compile(self, spec: StructuredOutputsParams) -> _Grammar:
        text = self._grammar_text(spec)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, self.tokenizer)
        if failed:
            raise InvalidParameter(spec.field, f"{spec.field}: {'; '.join(messages).strip()}")
        return _Grammar(self.tokenizer, text)

    def _grammar_text(self, spec: StructuredOutputsParams) -> str:
        try:
            if spec.kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_DEFAULTS)
            if spec.kind == "json":
                return llguidance.LLMatcher.grammar_from_json_schema(_strict_formats(spec.json), defaults=JSON_DEFAULTS)
            if spec.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(spec.regex)
            if spec.kind == "choice":
                return llguidance.grammar_from("choice", json.dumps(list(spec.choice)))
            return llguidance.grammar_from("grammar", spec.grammar)
        except (ValueError, TypeError) as error:  # malformed JSON text, mostly
            raise InvalidParameter(spec.field, f"{spec.field}: {error}") from None

    def fill_bitmasks(self, matchers: Sequence[_Matcher], bitmask: torch.Tensor) -> None:
        words = bitmask_words(self.vocab_size)
        if bitmask.dtype != torch.int32 or not bitmask.is_contiguous() or tuple(bitmask.shape) != (len(matchers), words):
            raise ValueError(f"bitmask: expected a contiguous int32 [{len(matchers)}, {words}] tensor, got "
                             f"{bitmask.dtype} {tuple(bitmask.shape)}")
        if len(matchers) == 1:
            matchers[0].inner.unsafe_compute_mask_ptr(bitmask.data_ptr(), words * 4)
        else:
            self._executor.unsafe_compute_mask_ptr([(m.inner, i) for i, m in enumerate(matchers)],
                                                   bitmask.data_ptr(), words * 4, len(matchers))
