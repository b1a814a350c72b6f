"""What a user asks speculative decoding to do, in vLLM's dictionary form.

``LLM(speculative_config={...})`` and ``flexpage serve --speculative-config '{...}'`` take the
same dictionary as vLLM's, so a command line moves between the two engines unchanged::

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "draft_model", "model": "/path/to/small-llama", "num_speculative_tokens": 4}

Defaults follow vLLM's ``SpeculativeConfig.__post_init__``: an n-gram config without
``prompt_lookup_min``/``max`` uses 5 for both, and one given alone sets the other; a config
with ``model`` and no ``method`` is a draft model (or the n-gram method for ``model="ngram"``,
vLLM's older spelling). Unlike vLLM, a key that does not apply to the method is refused
rather than ignored, so a typo never silently changes what runs.

One extension: ``max_branches`` (n-gram only, default 1) -- several earlier occurrences of
the matched n-gram become several branches of a draft tree, verified in one step
(:mod:`flexpage.speculative.tree`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["METHODS", "SpeculativeConfig"]

METHODS = ("ngram", "draft_model")
_NGRAM_ALIASES = ("ngram", "[ngram]")
_KEYS = {
    "ngram": ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "max_branches",
              "disable_by_batch_size"),
    "draft_model": ("method", "model", "num_speculative_tokens", "disable_by_batch_size"),
}
_DEFAULT_LOOKUP = 5  # vLLM's default for both prompt_lookup_min and prompt_lookup_max
#: decoding sequences above which nothing is proposed (vLLM's key, which has no default there):
#: ``python -m bench.speculative --crossover`` measured prompt lookup still 1.31x faster at
#: batch 16 on text worth copying (1.67x at 1, 1.49x at 4, 1.41x at 8), and batch 16 is the
#: largest it measures
DEFAULT_DISABLE_BY_BATCH_SIZE = 16


def _positive_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: got {value!r}, expected an int >= 1")
    return value


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """A checked speculative-decoding configuration (build it with :meth:`from_dict`).

    Attributes:
        method: ``"ngram"`` (prompt lookup over the sequence's own tokens) or ``"draft_model"``.
        num_speculative_tokens: k, the most tokens proposed per sequence and step (per branch).
        prompt_lookup_min / prompt_lookup_max: n-gram only; the shortest and longest suffix
            n-gram that is looked up (the longest that occurs earlier wins).
        max_branches: n-gram only; how many distinct continuations to propose as a tree.
        model: draft_model only; the draft checkpoint (same tokenizer as the target).
        disable_by_batch_size: with more sequences decoding than this, nothing is proposed.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    max_branches: int = 1
    model: str | None = None
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method: got {self.method!r}, expected one of {METHODS}")
        _positive_int("num_speculative_tokens", self.num_speculative_tokens)
        _positive_int("disable_by_batch_size", self.disable_by_batch_size)
        if self.method == "ngram":
            _positive_int("prompt_lookup_min", self.prompt_lookup_min)
            _positive_int("prompt_lookup_max", self.prompt_lookup_max)
            _positive_int("max_branches", self.max_branches)
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ValueError(f"prompt_lookup_min: got {self.prompt_lookup_min}, expected <= "
                                 f"prompt_lookup_max={self.prompt_lookup_max}")
            if self.model is not None:
                raise ValueError(f"model: got {self.model!r}, but method 'ngram' uses no model")
        else:
            if not isinstance(self.model, str) or not self.model.strip():
                raise ValueError(f"model: got {self.model!r}, expected the draft model's path or name "
                                 f"(method 'draft_model')")
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}: applies to method 'ngram' only, got method 'draft_model'")
            if self.max_branches != 1:
                raise ValueError(f"max_branches: got {self.max_branches!r}; draft models propose one chain")

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any]) -> SpeculativeConfig:
        """Parse vLLM's ``speculative_config`` dictionary; a ``ValueError`` names the bad key."""
        if not isinstance(spec, Mapping):
            raise ValueError(f"speculative_config: got {type(spec).__name__}, expected a dict such as "
                             f'{{"method": "ngram", "num_speculative_tokens": 4}}')
        method = spec.get("method")
        if method is None and "model" in spec:
            method = "ngram" if spec["model"] in _NGRAM_ALIASES else "draft_model"
        if method is None:
            raise ValueError(f"method: missing, expected one of {METHODS}")
        if method in _NGRAM_ALIASES:
            method = "ngram"
        if method not in METHODS:
            raise ValueError(f"method: got {method!r}, expected one of {METHODS}")
        known = _KEYS[method]
        for key in spec:
            if key not in known and not (key == "model" and method == "ngram" and spec[key] in _NGRAM_ALIASES):
                raise ValueError(f"{key}: unknown key for method {method!r}, expected some of {known}")
        if "num_speculative_tokens" not in spec:
            raise ValueError("num_speculative_tokens: missing, expected an int >= 1")
        k = spec["num_speculative_tokens"]
        batch = spec.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)
        if method == "draft_model":
            return cls(method, k, model=spec.get("model"), disable_by_batch_size=batch)
        low, high = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
        if low is None and high is None:
            low = high = _DEFAULT_LOOKUP
        low = high if low is None else low
        high = low if high is None else high
        return cls(method, k, prompt_lookup_min=low, prompt_lookup_max=high,
                   max_branches=spec.get("max_branches", 1), disable_by_batch_size=batch)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parse the JSON text of ``--speculative-config`` (vLLM's flag takes the same)."""
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config: not valid JSON ({exc.msg} at character {exc.pos}): {text!r}") \
                from None
        return cls.from_dict(spec)
