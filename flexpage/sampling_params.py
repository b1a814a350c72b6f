"""Per-request sampling parameters, in the shape vLLM users know.

``SamplingParams`` is a plain dataclass whose ``__post_init__`` validates every
field (raising ``ValueError`` naming the field and the offending value) and
normalises the convenience forms:

* ``stop``: ``None`` -> ``[]``, ``"x"`` -> ``["x"]``, tuples -> lists;
* ``stop_token_ids``: ``None`` -> ``[]``;
* ``top_k``: ``0`` and ``-1`` both mean "disabled" (kept as given).

``temperature == 0`` means greedy decoding (see :attr:`SamplingParams.is_greedy`).
Validation happens at construction only; build a new object (e.g. with
``dataclasses.replace``) rather than mutating fields afterwards.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

from flexpage.errors import InvalidParameter
from flexpage.structured.params import StructuredOutputsParams

__all__ = ["SamplingParams", "MAX_LOGPROBS"]

#: Largest ``logprobs`` value accepted (same cap as the OpenAI API).
MAX_LOGPROBS = 20


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


#: integer parameters end up in int64 tensors: larger values are refused here, not deep in a step
_INT64 = range(-(2**63), 2**63)


def _require_int(name: str, value: Any, *, int64: bool = True) -> int:
    if not _is_int(value):
        raise InvalidParameter(name, f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if int64 and int(value) not in _INT64:
        raise InvalidParameter(name, f"{name} must fit in a signed 64-bit integer, got {value!r}")
    return int(value)


def _require_float(name: str, value: Any) -> float:
    if not _is_real(value):
        raise InvalidParameter(name, f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise InvalidParameter(name, f"{name} must be finite, got {value!r}")
    return value


def _require_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidParameter(name, f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return value


@dataclass
class SamplingParams:
    """Sampling parameters for one request (vLLM-compatible names and defaults).

    Attributes:
        n: number of completions to generate for the prompt (>= 1).
        temperature: softmax temperature (>= 0); 0 means greedy.
        top_p: nucleus sampling mass, in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 or -1 disables it.
        min_p: drop tokens whose probability is below ``min_p * max_prob``; in [0, 1].
        presence_penalty: OpenAI presence penalty on generated tokens, in [-2, 2].
        frequency_penalty: OpenAI frequency penalty on generated tokens, in [-2, 2].
        repetition_penalty: HF/CTRL repetition penalty on prompt + generated tokens (> 0).
        seed: per-request RNG seed; same seed => same tokens regardless of batching.
        stop: stop strings (normalised to ``list[str]``).
        stop_token_ids: extra token ids that stop generation (normalised to ``list[int]``).
        max_tokens: maximum number of generated tokens (>= 1), or ``None`` for no limit.
        min_tokens: EOS / stop_token_ids are masked until this many tokens are generated.
        ignore_eos: keep generating after EOS (EOS is then not masked by ``min_tokens``).
        logprobs: number of top logprobs to return per generated token, in [0, 20];
            0 returns only the sampled token's logprob; ``None`` returns nothing.
        prompt_logprobs: the log-probability of every prompt token after the ones before it
            (vLLM's ``RequestOutput.prompt_logprobs``; the first is None) with the top
            ``prompt_logprobs`` at each position, in [0, 20]; ``None`` returns nothing. The
            prompt is then computed in full (never served from the prefix cache).
        skip_special_tokens: drop special tokens when detokenising.
        kv_budget: KV tokens this request keeps per layer (the engine's eviction policy drops
            whole blocks past it); ``None`` takes the engine's ``kv_budget_tokens``. The engine
            checks it against its block size (a multiple, at least 3 blocks).
        structured_outputs: the output must match this JSON schema, regex, choice or grammar
            (:class:`~flexpage.structured.StructuredOutputsParams`); ``None``: free text.
        num_speculative_tokens: with an engine that speculates (``speculative_config``), the
            most tokens proposed per step for this request (0: none, decode one token a step);
            ``None``: the engine's. The tokens are the same either way.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    kv_budget: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    num_speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        self.n = _require_int("n", self.n)
        if self.n < 1:
            raise InvalidParameter("n", f"n must be >= 1, got {self.n!r}")

        self.temperature = _require_float("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidParameter("temperature", f"temperature must be >= 0, got {self.temperature!r}")

        self.top_p = _require_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidParameter("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")

        self.top_k = _require_int("top_k", self.top_k)
        if self.top_k < -1:
            raise InvalidParameter("top_k", f"top_k must be -1, 0 (disabled) or >= 1, got {self.top_k!r}")

        self.min_p = _require_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidParameter("min_p", f"min_p must be in [0, 1], got {self.min_p!r}")

        for name in ("presence_penalty", "frequency_penalty"):
            value = _require_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise InvalidParameter(name, f"{name} must be in [-2, 2], got {value!r}")
            setattr(self, name, value)

        self.repetition_penalty = _require_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise InvalidParameter("repetition_penalty",
                                   f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")

        if self.seed is not None:
            self.seed = _require_int("seed", self.seed, int64=False)  # any int: make_generator folds it

        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)

        if self.max_tokens is not None:
            self.max_tokens = _require_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise InvalidParameter("max_tokens", f"max_tokens must be >= 1 or None, got {self.max_tokens!r}")

        self.min_tokens = _require_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise InvalidParameter("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParameter("min_tokens",
                f"min_tokens must be <= max_tokens ({self.max_tokens!r}), got {self.min_tokens!r}"
            )

        self.ignore_eos = _require_bool("ignore_eos", self.ignore_eos)
        self.skip_special_tokens = _require_bool("skip_special_tokens", self.skip_special_tokens)

        if self.kv_budget is not None:
            self.kv_budget = _require_int("kv_budget", self.kv_budget)
            if self.kv_budget < 1:
                raise InvalidParameter("kv_budget", f"kv_budget must be >= 1 or None, got {self.kv_budget!r}")

        if self.num_speculative_tokens is not None:
            self.num_speculative_tokens = _require_int("num_speculative_tokens", self.num_speculative_tokens)
            if self.num_speculative_tokens < 0:
                raise InvalidParameter("num_speculative_tokens", "num_speculative_tokens must be >= 0 or None, "
                                       f"got {self.num_speculative_tokens!r}")

        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise InvalidParameter("structured_outputs", "structured_outputs must be a StructuredOutputsParams or "
                                   f"None, got {type(self.structured_outputs).__name__}")

        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                value = _require_int(name, value)
                if not 0 <= value <= MAX_LOGPROBS:
                    raise InvalidParameter(name, f"{name} must be in [0, {MAX_LOGPROBS}] or None, got {value!r}")
                setattr(self, name, value)

    @staticmethod
    def _normalise_stop(stop: Any) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            items = [stop]
        elif isinstance(stop, (list, tuple)):
            items = list(stop)
        else:
            raise InvalidParameter("stop",
                f"stop must be a str, a list of str or None, got {stop!r} ({type(stop).__name__})"
            )
        for s in items:
            if not isinstance(s, str):
                raise InvalidParameter("stop",
                    f"stop must contain only str, got {s!r} ({type(s).__name__}) in {stop!r}"
                )
            if s == "":
                raise InvalidParameter("stop", f"stop must not contain empty strings, got {stop!r}")
        return items

    @staticmethod
    def _normalise_stop_token_ids(ids: Any) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)):
            raise InvalidParameter("stop_token_ids",
                f"stop_token_ids must be a list of int or None, got {ids!r} ({type(ids).__name__})"
            )
        out: list[int] = []
        for t in ids:
            if not _is_int(t):
                raise InvalidParameter("stop_token_ids",
                    f"stop_token_ids must contain only int, got {t!r} ({type(t).__name__}) in {ids!r}"
                )
            if not 0 <= t < 2**63:
                raise InvalidParameter("stop_token_ids", f"stop_token_ids must be in [0, 2**63), got {t!r} in {ids!r}")
            out.append(int(t))
        return out

    @property
    def is_greedy(self) -> bool:
        """True when decoding is greedy (``temperature == 0``)."""
        return self.temperature == 0.0

    @classmethod
    def greedy(cls, **kwargs: Any) -> SamplingParams:
        """``SamplingParams(temperature=0, **kwargs)``."""
        return cls(temperature=0.0, **kwargs)
