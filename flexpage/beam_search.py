"""Beam search: vLLM's ``LLM.beam_search`` interface, HF transformers' algorithm.

A beam group is one request. Its prompt is computed once (one sequence); every step, each
live beam has one logits row, and the group keeps the ``beam_width`` best of the top
``beams_to_keep`` continuations over all beams (:meth:`BeamGroup.select`). The engine
applies the choice on the block manager: a beam chosen twice forks (its blocks shared,
copy-on-write copies at most its last partial block), a beam not chosen is freed
(:meth:`flexpage.engine.LLMEngine._advance_beams`).

Scores follow ``transformers`` 5's ``GenerationMixin._beam_search`` step for step, so the
beams equal ``generate(num_beams=k, num_return_sequences=k, do_sample=False)``:

* the candidates are the top ``max(2, 1 + len(eos_token_ids)) * beam_width`` of
  ``cum_logprob + log_softmax(logits)`` over all beams;
* a candidate that ends (an EOS token, or the last allowed token) is a finished hypothesis
  only if it ranks among the first ``beam_width`` candidates; its score is
  ``cum_logprob / generated_tokens ** length_penalty``, counting the EOS and not the prompt;
* the next beams are the best ``beam_width`` candidates that did not end;
* ``early_stopping``: ``True`` stops once ``beam_width`` hypotheses are finished;
  ``False`` (HF's default) also stops when the best live beam, scored at its current
  length, cannot beat the worst finished one; ``"never"`` scores it at ``max_tokens``
  when ``length_penalty > 0`` (the canonical search).

vLLM's ``LLM.beam_search`` differs, and we follow HF where they do: it divides by the whole
sequence's length (prompt included, the EOS not), keeps every EOS candidate (not only the
top ``beam_width``), has no ``early_stopping`` and runs every beam to ``max_tokens``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from flexpage.errors import InvalidParameter

__all__ = ["BeamGroup", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "Candidate"]

EarlyStopping = bool | Literal["never"]


@dataclass
class BeamSearchParams:
    """One beam search request (vLLM's ``BeamSearchParams``, plus HF's ``early_stopping``).

    Attributes:
        beam_width: beams kept per step, and sequences returned (>= 1).
        max_tokens: tokens generated at most (>= 1).
        ignore_eos: keep beams going past EOS (no hypothesis finishes before ``max_tokens``).
        temperature: 0 only: the search is deterministic (HF's beam *sampling* is not offered).
        length_penalty: a finished hypothesis scores ``cum_logprob / length ** length_penalty``.
        early_stopping: ``True``, ``False`` or ``"never"``, as HF's ``generate``.
        n: the best beams returned (an OpenAI request's ``n``); None: all ``beam_width``.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = False
    n: int | None = None

    def score(self, cum_logprob: float, length: int) -> float:
        """What a hypothesis of ``length`` generated tokens (its EOS included) is ranked by."""
        return cum_logprob / length ** self.length_penalty

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidParameter(name, f"{name} must be an int >= 1, got {value!r}")
        if self.n is None:
            self.n = self.beam_width
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= self.beam_width:
            raise InvalidParameter("n", f"n must be an int in [1, beam_width={self.beam_width}], got {self.n!r}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidParameter("ignore_eos", f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.temperature != 0.0:
            raise InvalidParameter("temperature", f"beam search is deterministic: temperature must be 0.0, got "
                                                  f"{self.temperature!r} (beam sampling is not supported)")
        if isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, (int, float)) \
                or not math.isfinite(self.length_penalty):
            raise InvalidParameter("length_penalty", f"length_penalty must be a finite number, got "
                                                     f"{self.length_penalty!r}")
        if self.early_stopping is not True and self.early_stopping is not False and self.early_stopping != "never":
            raise InvalidParameter("early_stopping", f"early_stopping must be True, False or 'never', got "
                                                     f"{self.early_stopping!r}")


@dataclass
class BeamSearchSequence:
    """One returned beam, vLLM's shape: ``tokens`` and ``text`` cover the prompt and the
    output; ``cum_logprob`` sums the output tokens' log-probabilities; ``score`` is what the
    beams are ranked by (HF's ``sequences_scores``)."""

    tokens: list[int]
    text: str
    cum_logprob: float
    score: float
    num_prompt_tokens: int
    finish_reason: str  # "stop" (EOS) or "length"

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    """All ``beam_width`` beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


@dataclass
class Candidate:
    """One continuation of live beam ``parent`` by ``token``."""

    parent: int
    token: int
    cum_logprob: float


@dataclass
class Hypothesis:
    """A finished beam: its output tokens (the EOS included) and scores."""

    token_ids: list[int]
    cum_logprob: float
    score: float
    finish_reason: str


@dataclass
class BeamGroup:
    """The search state of one request: live beams' cumulative log-probabilities, finished
    hypotheses, and whether it is done. Pure bookkeeping: the engine owns the sequences
    (``beams[i]`` is the engine's object for live beam ``i``)."""

    params: BeamSearchParams
    eos_token_ids: list[int]
    max_tokens: int  # params.max_tokens, cut to what the context allows
    beams: list[Any] = field(default_factory=list)
    cum_logprobs: list[float] = field(default_factory=lambda: [0.0])
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most beam_width
    generated: int = 0  # tokens each live beam has generated
    done: bool = False
    #: each live beam's top ``(token, logprob)`` from its latest computed row, by the engine's
    #: sequence id, kept until every live beam has one (a beam may be computed a step later)
    rows: dict[int, list[tuple[int, float]]] = field(default_factory=dict)

    @property
    def beams_to_keep(self) -> int:
        """Candidates ranked per step (HF's ``beams_to_keep``): enough that ``beam_width``
        beams go on even if every EOS token is among the best."""
        return max(2, 1 + len(self.eos_token_ids)) * self.params.beam_width

    def select(self, top_logprobs: list[list[tuple[int, float]]],
               output_token_ids: list[list[int]]) -> list[Candidate]:
        """One step: ``top_logprobs[i]`` are live beam ``i``'s ``beams_to_keep`` most likely
        ``(token, logprob)``, ``output_token_ids[i]`` its output so far. Records the finished
        hypotheses and returns the next live beams, best first (empty when the search is done)."""
        width = self.params.beam_width
        ranked = sorted((Candidate(i, token, self.cum_logprobs[i] + logprob)
                         for i, row in enumerate(top_logprobs) for token, logprob in row),
                        key=lambda c: -c.cum_logprob)[: self.beams_to_keep]
        self.generated += 1
        last = self.generated >= self.max_tokens

        def ends(c: Candidate) -> bool:
            return last or (not self.params.ignore_eos and c.token in self.eos_token_ids)

        for c in ranked[:width]:
            if ends(c):
                self.finished.append(Hypothesis(output_token_ids[c.parent] + [c.token], c.cum_logprob,
                                                self.params.score(c.cum_logprob, self.generated),
                                                "length" if last and c.token not in self.eos_token_ids
                                                or self.params.ignore_eos else "stop"))
        self.finished.sort(key=lambda h: -h.score)
        del self.finished[width:]
        going = [c for c in ranked if not ends(c)][:width]
        self.cum_logprobs = [c.cum_logprob for c in going]
        self.done = not going or (len(self.finished) == width and (
            self.params.early_stopping is True or not self._improvable(going[0].cum_logprob)))
        return [] if self.done else going

    def _improvable(self, best_cum_logprob: float) -> bool:
        """Whether the best live beam may still beat the worst finished hypothesis (HF's
        early-stop heuristic, with every slot finished)."""
        never = self.params.early_stopping == "never" and self.params.length_penalty > 0
        return self.params.score(best_cum_logprob, self.max_tokens if never else self.generated) \
            > self.finished[-1].score
