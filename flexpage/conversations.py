"""Chats the engine has seen, by conversation id: how much of each turn's history was reused.

A request may name its conversation (``LLM.chat(..., conversation_id=...)``; on the server
the OpenAI ``user`` field or an ``X-Conversation-Id`` header, scoped by API key). The KV
itself is found by content (the prefix cache and its tiers, :mod:`flexpage.core.kv_tiers`):
the id names the owner of the blocks a turn publishes, salts them when the server scopes it
to a key, and lets the engine count, per turn after the first, how many tokens of the
previous turn's history (prompt + reply) came back from the cache and how many were
computed again -- the number Pensieve's retention policy is there to lower.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["Conversation", "ConversationRegistry"]


@dataclass(slots=True)
class Conversation:
    turns: int = 0
    history_tokens: int = 0  # the last finished turn's prompt + reply
    last_active: float = 0.0
    reused_tokens: int = 0  # of later turns' history, served from the cache (pool or tiers)
    recomputed_tokens: int = 0  # of later turns' history, computed again


class ConversationRegistry:
    """The most recently active conversations (at most ``capacity``), least recent dropped."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._conversations: OrderedDict[str, Conversation] = OrderedDict()
        self.totals = {"turns": 0, "history_tokens": 0, "reused_tokens": 0, "recomputed_tokens": 0}

    def __len__(self) -> int:
        return len(self._conversations)

    def get(self, conversation_id: str) -> Conversation | None:
        return self._conversations.get(conversation_id)

    def items(self) -> list[tuple[str, Conversation]]:
        """Most recently active first."""
        return list(reversed(self._conversations.items()))

    def record_turn(self, conversation_id: str, num_prompt: int, num_output: int, num_cached: int,
                    now: float) -> None:
        """A finished turn: ``num_cached`` of its ``num_prompt`` prompt tokens came from the cache."""
        conv = self._conversations.pop(conversation_id, None) or Conversation()
        if conv.turns:  # the prompt carries the previous turn's history (chat templates may re-render its tail)
            history = min(conv.history_tokens, num_prompt)
            reused = min(num_cached, history)
            conv.reused_tokens += reused
            conv.recomputed_tokens += history - reused
            self.totals["history_tokens"] += history
            self.totals["reused_tokens"] += reused
            self.totals["recomputed_tokens"] += history - reused
        conv.turns += 1
        conv.history_tokens = num_prompt + num_output
        conv.last_active = now
        self.totals["turns"] += 1
        self._conversations[conversation_id] = conv
        while len(self._conversations) > self.capacity:
            self._conversations.popitem(last=False)
