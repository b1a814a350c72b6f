"""The seam to a grammar library: compile a constraint once, match one output per sample.

A :class:`GrammarBackend` turns :class:`~flexpage.structured.params.StructuredOutputsParams`
into a :class:`Grammar` (immutable, shared by every request with the same constraint); a
grammar makes one :class:`GrammarMatcher` per sample, which says which tokens may come next
(a bitmask, one bit per vocabulary entry) and follows the tokens the sample accepts.

The one backend is llguidance (:mod:`flexpage.structured.llguidance_backend`); docs/structured-outputs.md
says why it was picked over xgrammar, with the measurements. Another library plugs in by
implementing these three protocols.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from flexpage.structured.params import StructuredOutputsParams

__all__ = ["Grammar", "GrammarBackend", "GrammarMatcher", "bitmask_words"]


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row: one bit per token id."""
    return (vocab_size + 31) // 32


class GrammarMatcher(Protocol):
    """The grammar's state for one sample's output so far."""

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and the matcher in error) if the grammar forbids it."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected speculative tokens)."""
        ...

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and allows no further token (the output ends here)."""
        ...

    @property
    def error(self) -> str:
        """Why the matcher failed ('' while it has not)."""
        ...


class Grammar(Protocol):
    """A compiled constraint; shared, never mutated."""

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of an output."""
        ...


class GrammarBackend(Protocol):
    """One grammar library, bound to one tokenizer and vocabulary size."""

    name: str
    vocab_size: int

    def compile(self, spec: StructuredOutputsParams) -> Grammar:
        """Compile ``spec``; raises :class:`~flexpage.errors.InvalidParameter` naming the field
        and quoting the library's message for a malformed or unsupported constraint."""
        ...

    def fill_bitmasks(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor) -> None:
        """Write each matcher's allowed next tokens into row ``i`` of ``bitmask`` (int32,
        ``[len(matchers), bitmask_words(vocab_size)]``, contiguous, on the CPU)."""
        ...
