"""What the HTTP handlers share: the engine loop, the tokenizer and the server's settings."""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field
from typing import Any

from flexpage.server.engine_loop import EngineLoop
from flexpage.server.metrics import ServerMetrics

__all__ = ["ServerState"]


@dataclass
class ServerState:
    """Everything the handlers share. Only the engine thread touches the engine."""

    engine_loop: EngineLoop
    tokenizer: Any  # the server's own tokenizer instance (the engine thread uses another)
    served_model_name: str
    max_model_len: int
    vocab_size: int
    api_key: str | None = None  # one key, or several separated by commas
    max_body_bytes: int = 4 << 20
    metrics: ServerMetrics | None = None
    recipes: str = ""  # the attention recipes the model runs (see flexpage.server.main.recipe_summary)
    #: the engine's grammar compiler (thread-safe): requests' constraints compile in the
    #: tokenizer thread, before they are queued (None: the engine compiles them when they arrive)
    grammars: Any = None
    tool_prompt: str | None = None  # --tool-prompt's text; None: the template's own, else tools.TOOL_PROMPT
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    inflight: int = 0
    tokenizer_pool: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flexpage-tokenizer"))

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The keys ``/v1/*`` accepts (empty: open)."""
        return tuple(key.strip() for key in (self.api_key or "").split(",") if key.strip())
