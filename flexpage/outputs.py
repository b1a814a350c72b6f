"""Results in the shape vLLM users know: ``RequestOutput`` with ``CompletionOutput`` items."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sample (of ``n``) of a request; text and token ids are cumulative."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None  # set by beam search (the sum a beam is ranked by)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SpeculationCounts:
    """Speculative decoding's work for one request, over its samples."""

    draft_tokens: int = 0  # proposed tokens verified
    accepted_tokens: int = 0  # of those, accepted
    verifications: int = 0  # a sample's steps that checked proposals

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Proposed tokens accepted per verification."""
        return self.accepted_tokens / self.verifications if self.verifications else 0.0


@dataclass
class RequestMetrics:
    """What a request cost beyond its tokens (vLLM's ``RequestOutput.metrics``)."""

    arrival_time: float
    first_token_time: float | None = None
    kv_budget: int | None = None  # KV tokens per layer each sample keeps (None: all)
    evicted_blocks: int = 0  # logical blocks its samples gave up to the budget, summed over samples
    evicted_tokens: int = 0  # the tokens in them
    speculation: SpeculationCounts | None = None  # None: the engine does not speculate


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None
    #: the engine aborted this request because its own computation failed (the others go on)
    error: str | None = None
    #: with ``SamplingParams.prompt_logprobs``: per prompt position, its token's logprob and the
    #: top ones (None at the first, which follows nothing); filled as the prompt is computed
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
