"""Incremental detokenisation: text grows token by token without re-decoding everything.

Decodes a short window (``prefix_offset:read_offset`` vs ``prefix_offset:``) so that
multi-token characters and SentencePiece spacing come out right, holding back output
while the tail is an incomplete UTF-8 sequence (decoded as U+FFFD). The same scheme vLLM
uses.
"""

from __future__ import annotations

from typing import Any

INITIAL_WINDOW = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-INITIAL_WINDOW:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def append(self, token_id: int) -> str:
        """Add one token; returns the whole output text so far."""
        self.ids.append(token_id)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)  # noqa: E731
        prefix = decode(self.ids[self.prefix_offset : self.read_offset])
        full = decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
        return self.text
