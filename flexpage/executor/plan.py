"""The contract between the engine and an executor: one :class:`StepPlan` in, one
:class:`StepResult` out, per step.

The plan carries everything the step does to the KV cache and the model, in order:

1. ``kv_ops`` -- swaps, tier copies, copy-on-write copies, relocations and released rows,
   as the core decided them (:mod:`flexpage.core.kv_ops`);
2. ``inputs`` -- the rows of the forward pass (None: a plan of KV operations only);
3. ``samples`` -- which logits rows to sample, with each row's parameters, history and
   generator (a row may be sampled more than once: the ``n`` samples of a prompt), and the
   allowed-token bitmasks of the samples under a grammar (structured outputs);
4. ``scores`` -- blocks whose eviction-policy scores the forward pass must produce.

The result carries what came back: the tokens each sample row accepted (a list per row, so
that a step verifying proposed tokens can accept several), their logprobs, a sampling
error per row that failed alone, and one list of block scores per score request. Nothing
else passes between the engine and an executor during a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flexpage.core.kv_ops import KVOp
from flexpage.core.scheduler_output import ScoreRequest, StepInputs
from flexpage.model.sampler import TokenHistory, TokenLogprobs
from flexpage.sampling_params import SamplingParams

__all__ = ["ForwardFailed", "PromptLogprobRows", "SampleRow", "StepPlan", "StepResult"]


class ForwardFailed(Exception):
    """The batched forward pass raised (the cause is chained); sampling never started. The
    plan's KV operations ran: a retry of some of its rows needs a plan without them."""


@dataclass(slots=True)
class SampleRow:
    """One token to sample from logits row ``logits_row`` (an index into ``inputs.sample_rows``)
    -- or, with ``drafts``, proposed tokens to verify: rows ``logits_row .. + len(drafts)`` score
    the token after the last one and after each proposal, and the row accepts a prefix of the
    proposals plus one token (:mod:`flexpage.speculative.verify`). With ``branches``, each
    further proposal's rows follow in the same way (``1 + len(branch)`` each) and the row
    accepts a path of the tree they make together."""

    logits_row: int
    params: SamplingParams
    history: TokenHistory
    generator: torch.Generator | None  # the sample's own (seeded requests); None: the executor's
    drafts: tuple[int, ...] = ()
    branches: tuple[tuple[int, ...], ...] = ()

    @property
    def num_rows(self) -> int:
        """Logits rows this sample reads."""
        return 1 + len(self.drafts) + sum(1 + len(branch) for branch in self.branches)


@dataclass(slots=True)
class PromptLogprobRows:
    """Prompt positions of one request whose next token's log-probability it asked for
    (``SamplingParams.prompt_logprobs``): logits rows ``logits_rows`` (indices into
    ``inputs.sample_rows``, after every sample's) score ``targets``, the prompt token after
    each position, with the ``top`` most likely beside."""

    logits_rows: range
    targets: list[int]
    top: int


@dataclass(slots=True)
class StepPlan:
    """Everything one step does, in the order it happens (see the module docstring)."""

    kv_ops: list[KVOp] = field(default_factory=list)
    inputs: StepInputs | None = None
    samples: list[SampleRow] = field(default_factory=list)
    #: indices into ``samples`` whose tokens a grammar constrains, and their bitmasks (int32
    #: ``[len(constrained), words]``, bit ``t`` set where token ``t`` is allowed)
    constrained: list[int] = field(default_factory=list)
    token_bitmask: torch.Tensor | None = None
    scores: list[ScoreRequest] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobRows] = field(default_factory=list)


@dataclass(slots=True)
class StepResult:
    """What one step produced; lists are parallel to the plan's ``samples`` and ``scores``."""

    #: per sample row, the tokens it accepted (one, or the accepted proposals and one more)
    token_ids: list[list[int]] = field(default_factory=list)
    #: per sample row, each accepted token's logprobs (None: the row asked for none)
    logprobs: list[list[TokenLogprobs | None]] = field(default_factory=list)
    #: sample rows whose own sampling raised, by index into ``samples`` (they got no tokens)
    errors: dict[int, BaseException] = field(default_factory=dict)
    #: per score request, one score per block
    block_scores: list[list[float]] = field(default_factory=list)
    #: per ``plan.prompt_logprobs`` entry, each target's logprobs
    prompt_logprobs: list[list[TokenLogprobs]] = field(default_factory=list)
