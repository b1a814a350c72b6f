"""Output processing: a request's engine-side state, and what each new token does to it
(detokenise, logprobs, stop tokens and strings, length limits).

:class:`OutputProcessor` never touches the scheduler: :meth:`OutputProcessor.append` says
whether the sample stopped, and the engine retires it.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from flexpage.beam_search import BeamGroup
from flexpage.core.sequence import Sequence, SequenceStatus
from flexpage.model.detokenizer import IncrementalDetokenizer
from flexpage.model.sampler import TokenLogprobs
from flexpage.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, SpeculationCounts
from flexpage.sampling_params import SamplingParams
from flexpage.structured.backend import GrammarMatcher

__all__ = ["OutputProcessor", "Request"]


@dataclass
class Request:
    """Engine-side state of one request: its samples' sequences, generators and outputs."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    seqs: list[Sequence] = field(default_factory=list)
    outputs: list[CompletionOutput] = field(default_factory=list)
    detokenizers: list[IncrementalDetokenizer] = field(default_factory=list)
    #: one per sample, made at arrival (a seeded request's sample ``i`` draws from ``seed + i``)
    generators: list[torch.Generator | None] = field(default_factory=list)
    #: one grammar matcher per sample under structured outputs (empty: free text)
    grammars: list[GrammarMatcher] = field(default_factory=list)
    num_cached_tokens: int = 0
    first_token_time: float | None = None
    kv_budget: int | None = None
    block_size: int = 0
    conversation: str | None = None
    #: speculative decoding, over all samples: proposed tokens verified, accepted, verifications
    #: (None: the engine does not speculate)
    speculation: SpeculationCounts | None = None
    #: set when the engine aborted the request because its own computation failed
    error: str | None = None
    #: beam search's state (None: sampling); ``seqs`` are then its live beams, and ``outputs``
    #: its finished beams once the search is done
    beam: BeamGroup | None = None
    #: per prompt position, its token's logprobs once computed (``params.prompt_logprobs``)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done
        return len(self.outputs) == self.params.n and all(o.finished for o in self.outputs)

    def to_output(self) -> RequestOutput:
        evicted = sum(seq.num_evicted_blocks for seq in self.seqs)
        metrics = RequestMetrics(self.arrival_time, self.first_token_time, self.kv_budget, evicted,
                                 evicted * self.block_size,
                                 dataclasses.replace(self.speculation) if self.speculation is not None else None)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, list(self.outputs),
                             self.finished, self.num_cached_tokens, metrics, error=self.error,
                             prompt_logprobs=list(self.prompt_logprobs) if self.prompt_logprobs is not None else None)


class OutputProcessor:
    """Turns sampled tokens into a request's outputs for one tokenizer and model."""

    def __init__(self, tokenizer: Any, eos_token_ids: list[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def attach_sample(self, request: Request, seq: Sequence) -> None:
        """Give ``request`` one more sample, computed by ``seq``."""
        index = len(request.outputs)
        request.seqs.append(seq)
        request.outputs.append(CompletionOutput(index, logprobs=[] if request.params.logprobs is not None else None))
        request.detokenizers.append(IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                                           request.params.skip_special_tokens))

    def append(self, request: Request, seq: Sequence, token: int,
               logprobs: TokenLogprobs | None) -> SequenceStatus | None:
        """Add one sampled token to ``seq`` and its output; returns the status it finished
        with (the caller retires it), or None while it goes on. Under a grammar the token
        advances the sample's matcher, and the output stops where the grammar is complete."""
        index = request.seqs.index(seq)
        out = request.outputs[index]
        grammar = request.grammars[index] if request.grammars else None
        if grammar is not None and not grammar.accept(token):
            raise ValueError(f"structured output: the grammar refused token {token}: {grammar.error}")
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
            request.num_cached_tokens = max(request.num_cached_tokens, seq.num_cached_tokens)
        seq.append_token(token)
        out.token_ids.append(token)
        if logprobs is not None and out.logprobs is not None:
            out.logprobs.append(self._logprob_entry(logprobs))
        params = request.params
        stop_token = self._stop_token(token, params, seq.num_output_tokens)
        if stop_token is None or not params.skip_special_tokens:
            out.text = request.detokenizers[index].append(token)
        else:
            request.detokenizers[index].append(token)
        stop_string = _find_stop(out.text, params.stop)
        if stop_token is not None:
            out.stop_reason = None if token in self.eos_token_ids else token
            return SequenceStatus.FINISHED_STOPPED
        if stop_string is not None:
            out.text = out.text[: out.text.index(stop_string)]
            out.stop_reason = stop_string
            return SequenceStatus.FINISHED_STOPPED
        if grammar is not None and grammar.is_finished:
            return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def record_prompt_logprobs(self, request: Request, positions: list[int], found: list[TokenLogprobs]) -> None:
        """The logprobs of the prompt tokens after ``positions`` (computed this step)."""
        for position, entry in zip(positions, found):
            request.prompt_logprobs[position + 1] = self._logprob_entry(entry)  # type: ignore[index]

    def _stop_token(self, token: int, params: SamplingParams, num_output: int) -> int | None:
        if num_output <= params.min_tokens and params.min_tokens:
            return None
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
            return token
        return None

    def _logprob_entry(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        entry = {tid: Logprob(value, rank + 1, self.tokenizer.decode([tid])) for rank, (tid, value) in enumerate(lp.top)}
        entry[lp.token_id] = Logprob(lp.logprob, lp.rank, self.tokenizer.decode([lp.token_id]))
        return entry


def _find_stop(text: str, stops: list[str]) -> str | None:
    hits = [(text.index(s), s) for s in stops if s in text]
    return min(hits)[1] if hits else None
