"""The engine: requests in, tokens out, one scheduler step at a time.

``LLMEngine.add_request`` checks and queues (:mod:`flexpage.input_processor`); ``step`` runs
one iteration; ``abort`` frees a request's blocks at once. A step is::

    scheduler.schedule()                 -> SchedulerOutput (rows, KV operations, blocks to score)
    engine: + the rows to sample         -> StepPlan
    executor.execute(plan)               -> StepResult (tokens per sample row, logprobs, scores)
    engine: scores, mark_computed, forks, output processing (flexpage.output_processor)

The engine never touches tensors of the model or the pool: everything the executor does
travels in the plan, and everything it produced in the result.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from typing import TYPE_CHECKING, Any

from flexpage.attention.eviction import EvictionPolicy
from flexpage.attention.recipe import Recipe
from flexpage.beam_search import BeamGroup, BeamSearchParams, Candidate
from flexpage.config import EngineConfig, check_kv_budget
from flexpage.conversations import ConversationRegistry
from flexpage.core.block_manager import BlockManager
from flexpage.core.kv_ops import KVOp
from flexpage.core.kv_tiers import KVTiers
from flexpage.core.layer_groups import LayerGroup
from flexpage.core.scheduler import ScheduledSequence, Scheduler, SchedulerConfig, SchedulerOutput
from flexpage.core.scheduler_output import StepInputs, step_inputs
from flexpage.core.sequence import Sequence, SequenceStatus
from flexpage.errors import InvalidParameter
from flexpage.executor import Executor, ForwardFailed, PromptLogprobRows, SampleRow, StepPlan, StepResult
from flexpage.executor.factory import build_executor
from flexpage.features import check_request
from flexpage.input_processor import InputProcessor, PromptInput, check_optional_name
from flexpage.kv_view import kv_view
from flexpage.model.sampler import TokenHistory, make_generator
from flexpage.output_processor import OutputProcessor, Request
from flexpage.outputs import CompletionOutput, RequestOutput, SpeculationCounts
from flexpage.sampling_params import SamplingParams
from flexpage.speculative.draft_model import DraftModelProposer
from flexpage.speculative.speculator import Speculator
from flexpage.speculative.tree import count_proposals
from flexpage.structured.backend import GrammarMatcher
from flexpage.structured.compiler import GrammarCompiler
from flexpage.structured.llguidance_backend import LLGuidanceBackend

if TYPE_CHECKING:
    from flexpage.model.kv_tier_storage import TierStorage
    from flexpage.model.runner import ModelRunner

__all__ = ["LLMEngine", "PromptInput", "Request"]

log = logging.getLogger(__name__)


class LLMEngine:
    """One model, one KV pool, one scheduler. Not thread-safe: drive it from one loop."""

    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        self.config = config = config or EngineConfig(**kwargs)
        self.executor: Executor
        self.executor, info, kv = build_executor(config)
        self.model_path = info.path
        self.dtype = info.dtype
        self.tokenizer = info.tokenizer
        self.max_model_len: int = info.max_model_len
        self.vocab_size: int = info.vocab_size
        self.eos_token_ids: list[int] = info.eos_token_ids
        self.recipes: tuple[Recipe, ...] = info.recipes
        self.layer_groups: tuple[LayerGroup, ...] = info.layer_groups
        self.eviction_policy: EvictionPolicy = info.eviction_policy
        #: relative recompute cost per token of context before it: from FLOPs until warm_up measures it
        self.recompute_cost_slope = info.flop_cost_slope
        tiers = KVTiers(kv.host_slots, kv.disk_slots, policy=config.kv_tier_policy, cost=self._recompute_cost)
        self.block_manager = BlockManager(
            kv.num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching,
            num_host_blocks=kv.num_host_blocks, run_length=kv.run_length,
            group_windows=[group.window for group in self.layer_groups], tiers=tiers, virtual_rows=kv.virtual_rows,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=max(config.max_num_batched_tokens,
                                           0 if config.enable_chunked_prefill else self.max_model_len),
                enable_chunked_prefill=config.enable_chunked_prefill,
                preemption_mode=config.preemption_mode,
                max_model_len=self.max_model_len,
            ),
            self.block_manager,
        )
        self.inputs = InputProcessor(self.tokenizer, self.vocab_size, self.max_model_len)
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)
        #: compiled grammars of structured outputs, by constraint (thread-safe: a server compiles in its threads)
        self.grammars = GrammarCompiler(lambda: LLGuidanceBackend(self.tokenizer, self.vocab_size, self.eos_token_ids))
        #: speculative decoding's proposals (None: one token per step)
        self.speculator = self._speculator(kv.num_blocks) if config.speculative_config is not None else None
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "finished_requests": 0}
        #: per conversation id: turns and how much of their history the cache served
        self.conversations = ConversationRegistry()

    def _speculator(self, num_blocks: int) -> Speculator:
        spec = self.config.speculative_config
        if spec.method == "ngram":
            return Speculator(spec, self.max_model_len)
        # the draft's pool: as many tokens as the target's, plus a block per sequence for the
        # proposals; its block is the target's attention block (one allocation run)
        draft_block = self.config.block_size * self.config.blocks_per_attention_block(self.dtype)
        tokens = num_blocks * self.config.block_size
        proposer = DraftModelProposer(
            spec.model, dtype=self.dtype, vocab_size=self.vocab_size, block_size=draft_block,
            num_blocks=-(-tokens // draft_block) + self.config.max_num_seqs, compile=self.runner.compile,
            compile_step=self.config.compile_step)
        return Speculator(spec, self.max_model_len, proposer)

    @property
    def runner(self) -> ModelRunner:
        """The model runner of this process (rank 0's under tensor parallelism)."""
        return self.executor.runner

    @property
    def tier_storage(self) -> TierStorage | None:
        """The bytes of the tiers behind the prefix cache (None: no tiers)."""
        return self.executor.tier_storage

    # -- requests ------------------------------------------------------------------
    def prepare_prompt(self, prompt: PromptInput) -> dict[str, Any]:
        """Tokenise and check one prompt without queueing it: ``{"prompt", "prompt_token_ids"}``."""
        return self.inputs.prepare_prompt(prompt)

    def add_request(self, prompt: PromptInput, params: SamplingParams | BeamSearchParams | None = None,
                    request_id: str | None = None, *, conversation_id: str | None = None,
                    cache_salt: str | None = None) -> str:
        """Validate and queue one request; raises ValueError before anything is scheduled.

        ``params``: sampling, or a beam search (:mod:`flexpage.beam_search`: its outputs come
        when the search is done, every beam best first);
        ``conversation_id``: the chat this turn belongs to (see :mod:`flexpage.conversations`);
        ``cache_salt``: share prefix-cache blocks only with requests of the same salt.
        """
        check_optional_name("conversation_id", conversation_id)
        check_optional_name("cache_salt", cache_salt)
        params = params or SamplingParams()
        if not isinstance(params, (SamplingParams, BeamSearchParams)):
            raise InvalidParameter("sampling_params", f"sampling_params: got {type(params).__name__}, expected "
                                                      "SamplingParams or BeamSearchParams")
        prepared = self.prepare_prompt(prompt)
        text, token_ids = prepared["prompt"], prepared["prompt_token_ids"]
        request_id = request_id if request_id is not None else str(next(self._request_ids))
        if request_id in self.requests:
            raise InvalidParameter("request_id", f"request_id: {request_id!r} is already in flight")
        if isinstance(params, BeamSearchParams):
            return self._add_beam_search(text, token_ids, params, request_id, conversation_id, cache_salt)
        kv_budget = self._kv_budget(params)
        generators = [make_generator(params.seed + i) if params.seed is not None else None for i in range(params.n)]
        grammars = []
        if params.structured_outputs is not None:
            grammar = self.grammars.compile(params.structured_outputs)
            grammars = [grammar.matcher() for _ in range(params.n)]
        request = Request(request_id, text, token_ids, params, time.monotonic(), generators=generators,
                          grammars=grammars, kv_budget=kv_budget, block_size=self.config.block_size,
                          conversation=conversation_id,
                          speculation=SpeculationCounts() if self.speculator is not None else None)
        if params.prompt_logprobs is not None:  # every prompt position computed: no prefix-cache hit
            request.prompt_logprobs = [None] * len(token_ids)
            cache_salt = f"{cache_salt or ''}\0prompt_logprobs\0{request_id}"
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(token_ids)
        seq = Sequence(next(self._seq_ids), token_ids, max_tokens=max_tokens, request=request, num_samples=params.n,
                       kv_budget=kv_budget, cache_salt=cache_salt, conversation=conversation_id)
        self.scheduler.add(seq)
        self.outputs.attach_sample(request, seq)
        self.requests[request_id] = request
        self.counters["prompt_tokens"] += len(token_ids)
        return request_id

    def _add_beam_search(self, text: str | None, token_ids: list[int], params: BeamSearchParams, request_id: str,
                         conversation_id: str | None, cache_salt: str | None) -> str:
        """Queue a beam search: one sequence for the prompt, whose rows give each beam's
        ``beams_to_keep`` most likely tokens (raw log-probabilities, as HF ranks them)."""
        check_request(self.config, "beam_search")
        room = self.max_model_len - len(token_ids)
        if room < 1:
            raise InvalidParameter("max_tokens", f"beam search: the prompt ({len(token_ids)} tokens) leaves no room "
                                                 f"to generate under max_model_len={self.max_model_len}")
        group = BeamGroup(params, self.eos_token_ids, max_tokens=min(params.max_tokens, room))
        # one greedy row per beam: its top log-probabilities are what the search ranks (OpenAI's
        # cap of 20 logprobs is an API limit, not the sampler's: set past validation)
        rows = SamplingParams(temperature=0.0, max_tokens=group.max_tokens, ignore_eos=True, num_speculative_tokens=0)
        rows.logprobs = group.beams_to_keep
        request = Request(request_id, text, token_ids, rows, time.monotonic(), generators=[None],
                          block_size=self.config.block_size, conversation=conversation_id, beam=group)
        seq = Sequence(next(self._seq_ids), token_ids, max_tokens=group.max_tokens, request=request,
                       cache_salt=cache_salt, conversation=conversation_id)
        seq.beam_group = seq.seq_id
        group.beams = request.seqs = [seq]
        self.scheduler.add(seq)
        self.requests[request_id] = request
        self.counters["prompt_tokens"] += len(token_ids)
        return request_id

    def _kv_budget(self, params: SamplingParams) -> int | None:
        """The request's KV budget in tokens, checked against the block size; None: keep all."""
        if params.kv_budget is None:
            budget = self.config.kv_budget_tokens
        else:
            try:
                check_request(self.config, "kv_budget")
                budget = check_kv_budget("kv_budget", params.kv_budget, self.config.block_size)
            except ValueError as error:
                raise InvalidParameter("kv_budget", str(error)) from None
        return budget if self.eviction_policy.token_scores is not None else None

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free all its blocks; False if it is unknown or done."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        if request.beam is not None:
            for seq in request.seqs:
                self.scheduler.abort(seq.seq_id)
            request.beam.done = True
            return True
        for seq, out in zip(request.seqs, request.outputs):
            if not out.finished:
                self.scheduler.abort(seq.seq_id)
                out.finish_reason = "abort"
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def warm_up(self) -> float:
        """Compile and build every kernel a serving run meets (:func:`flexpage.warmup.warm_up`);
        returns the seconds it took."""
        from flexpage.warmup import warm_up

        return warm_up(self)

    def _recompute_cost(self, position: int) -> float:
        """The tiers' cost of recomputing the block at logical index ``position`` (1.0: a block
        with no context before it)."""
        return 1.0 + (position + 0.5) * self.config.block_size * self.recompute_cost_slope

    # -- the step --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration; returns the requests that produced tokens or finished.

        A request whose own computation fails (an exception in the forward pass, sampling or
        stop handling) is aborted alone, its blocks freed, and comes back finished with
        ``error`` set; the rest of the step completes: when the batched forward pass fails,
        each sequence is run again on its own, so the one that fails alone is found.
        """
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        touched: dict[str, Request] = {}
        for seq in sched.finished:  # the scheduler gave up on a sequence that outgrew the pool
            self._finish(seq, SequenceStatus.FINISHED_LENGTH, touched, already_retired=True)
        if not sched.scheduled:
            self._run_kv_ops(sched.kv_ops)
        else:
            try:
                self._run(sched, touched)
            except ForwardFailed as failure:
                if len(sched.scheduled) == 1:
                    self._fail(sched.scheduled[0].seq.request, failure.__cause__, touched)
                else:
                    for item in sched.scheduled:
                        self._run_alone(item, touched)
        self.scheduler.release_branches()
        self._advance_beams(touched)
        if not self.requests:  # idle: what the last steps freed goes back now, not at the next request
            self._run_kv_ops(self.block_manager.drain_ops())
        return [r.to_output() for r in touched.values()]

    def _run_kv_ops(self, ops: list[KVOp]) -> None:
        """A plan of KV operations alone (no rows to run)."""
        if ops:
            self.executor.execute(StepPlan(kv_ops=ops))

    def _run(self, sched: SchedulerOutput, touched: dict[str, Request]) -> None:
        """Plan, execute and apply one step (or one retried row of a failed one)."""
        sampled_items = [item for item in sched.scheduled if item.sample]
        sampled = [item.seq for item in sampled_items]
        rows, grammars = self._sample_rows(sampled_items)
        inputs = step_inputs(sched.scheduled, self.block_manager.block_tables)
        prompt_rows, prompt_positions = self._prompt_logprob_rows(sched.scheduled, inputs)
        plan = StepPlan(kv_ops=sched.kv_ops, inputs=inputs, samples=rows, scores=sched.scores,
                        prompt_logprobs=prompt_rows)
        if any(grammar is not None for grammar in grammars):
            plan.constrained = [i for i, grammar in enumerate(grammars) if grammar is not None]
            plan.token_bitmask = self.grammars.bitmask([grammars[i] for i in plan.constrained])
        result = self.executor.execute(plan)
        for request, scores in zip(sched.scores, result.block_scores):
            seq = self.scheduler.get(request.seq_id)
            if seq is not None:
                self.block_manager.record_block_scores(seq, dict(zip(request.blocks, scores)))
        for (request, positions), found in zip(prompt_positions, result.prompt_logprobs):
            self.outputs.record_prompt_logprobs(request, positions, found)
        self.scheduler.mark_computed(sched)  # sequences over their KV budget evict blocks here
        if sampled:
            self._apply_samples(sampled, plan.samples, result, touched)

    @staticmethod
    def _prompt_logprob_rows(scheduled: list[ScheduledSequence], inputs: StepInputs
                             ) -> tuple[list[PromptLogprobRows], list[tuple[Request, list[int]]]]:
        """Logits rows, added to ``inputs.sample_rows``, for the prompt positions this step
        computes whose next token's logprob a request asked for and does not have yet (a
        recomputed prompt is not scored twice); and which request and positions each serves."""
        rows: list[PromptLogprobRows] = []
        owners: list[tuple[Request, list[int]]] = []
        offset = 0  # the item's first row in the flat batch
        for item in scheduled:
            seq, request = item.seq, item.seq.request
            if request.prompt_logprobs is not None:
                end = min(item.start + item.num_new_tokens, seq.num_prompt_tokens - 1)
                positions = [p for p in range(item.start, end) if request.prompt_logprobs[p + 1] is None]
                if positions:
                    first = len(inputs.sample_rows)
                    inputs.sample_rows.extend(offset + p - item.start for p in positions)
                    rows.append(PromptLogprobRows(range(first, len(inputs.sample_rows)),
                                                  [seq.token_ids[p + 1] for p in positions],
                                                  request.params.prompt_logprobs))
                    owners.append((request, positions))
            offset += item.num_rows
        return rows, owners

    def _sample_rows(self, sampled: list[ScheduledSequence]) -> tuple[list[SampleRow], list[GrammarMatcher | None]]:
        """One row per sample to draw, and its grammar matcher (None: free text): a sequence
        whose prompt was just computed draws for all ``n`` samples of its request from its
        logits row (the siblings fork after the step); a sequence verifying proposals has
        one logits row more per proposal."""
        rows, grammars = [], []
        logits_row = 0
        for item in sampled:
            seq = item.seq
            request: Request = seq.request
            if request.beam is not None:  # one row per beam: the group ranks its top log-probabilities
                rows.append(SampleRow(logits_row, request.params, TokenHistory(seq.prompt_token_ids, []), None))
                grammars.append(None)
                logits_row += 1
                continue
            first = request.seqs.index(seq)
            forks = self.scheduler.forks_due(seq)
            history = TokenHistory(seq.prompt_token_ids, seq.output_token_ids)
            branches = tuple(branch.drafts for branch in item.branches)
            for sample in [first, *range(len(request.seqs), len(request.seqs) + forks)]:
                rows.append(SampleRow(logits_row, request.params, history, request.generators[sample], item.drafts,
                                      branches))
                grammars.append(request.grammars[sample] if request.grammars else None)
            logits_row += item.num_logits_rows
        return rows, grammars

    def _apply_samples(self, sampled: list[Sequence], rows: list[SampleRow], result: StepResult,
                       touched: dict[str, Request]) -> None:
        forked = self.scheduler.fork_parallel_samples(sampled, lambda: next(self._seq_ids))
        for i, (_, seq) in enumerate(forked):  # in the order of the plan's sample rows
            request: Request = seq.request
            if seq not in request.seqs:
                request.num_cached_tokens = seq.num_cached_tokens
                self.outputs.attach_sample(request, seq)
            if request.request_id not in self.requests:  # failed already (a sibling of n > 1)
                continue
            if i in result.errors:
                self._fail(request, result.errors[i], touched)
                continue
            if request.beam is not None:
                request.beam.rows[seq.seq_id] = result.logprobs[i][0].top
                continue
            try:
                for token, logprobs in zip(result.token_ids[i], result.logprobs[i]):
                    self.counters["generation_tokens"] += 1
                    touched[request.request_id] = request
                    status = self.outputs.append(request, seq, token, logprobs)
                    if status is not None:
                        self._finish(seq, status, touched)
                        break
                if rows[i].drafts:
                    self._accept_drafts(seq, rows[i], result.token_ids[i][:-1])
            except Exception as error:
                self._fail(request, error, touched)

    def _advance_beams(self, touched: dict[str, Request]) -> None:
        """Every beam group whose live beams all have a computed row takes its next step: a
        beam chosen more than once forks (sharing its blocks), one not chosen is freed, and
        each chosen beam appends its token. A group that is done returns its finished beams."""
        for request in [r for r in self.requests.values() if r.beam is not None]:
            group = request.beam
            if not all(seq.seq_id in group.rows and seq.status is SequenceStatus.RUNNING
                       and seq.num_uncomputed_tokens == 0 for seq in group.beams):
                continue
            self.counters["generation_tokens"] += len(group.beams)
            try:
                chosen = group.select([group.rows.pop(seq.seq_id) for seq in group.beams],
                                      [seq.output_token_ids for seq in group.beams])
                self._regroup_beams(request, chosen)
            except Exception as error:
                self._fail(request, error, touched)
                continue
            if group.done:
                request.outputs = [
                    CompletionOutput(i, self.tokenizer.decode(h.token_ids, skip_special_tokens=True), h.token_ids,
                                     h.finish_reason, cumulative_logprob=h.cum_logprob)
                    for i, h in enumerate(group.finished[:group.params.n])]
                touched[request.request_id] = request
                self.requests.pop(request.request_id)
                self.counters["finished_requests"] += 1

    def _regroup_beams(self, request: Request, chosen: list[Candidate]) -> None:
        group = request.beam
        uses = collections.Counter(c.parent for c in chosen)
        for i, seq in enumerate(group.beams):
            if not uses[i]:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
        beams: list[Sequence] = []
        for c in chosen:  # forks first: a child shares its parent's blocks as they are now
            parent = group.beams[c.parent]
            beams.append(parent if parent not in beams else self.scheduler.fork(parent, next(self._seq_ids)))
        for seq, c in zip(beams, chosen):
            seq.append_token(c.token)
        group.beams = request.seqs = beams

    def _accept_drafts(self, seq: Sequence, row: SampleRow, accepted: list[int]) -> None:
        """After a verification: the accepted proposals' KV counts as computed, the rest rolls back."""
        self.scheduler.accept_drafts(seq, len(accepted))
        if self.speculator is not None:
            branches = [row.drafts, *row.branches]
            self.speculator.verified(seq, count_proposals(branches), len(accepted),
                                     whole=any(list(branch) == accepted for branch in branches),
                                     tree=bool(row.branches))

    def _run_alone(self, item: ScheduledSequence, touched: dict[str, Request]) -> None:
        """Run one scheduled sequence of a step whose batched forward pass failed (its KV
        operations ran already)."""
        if item.seq.status is not SequenceStatus.RUNNING:  # its request failed already (n > 1)
            return
        try:
            scores = self.block_manager.score_requests(item.seq, item.num_new_tokens)
            self._run(SchedulerOutput(scheduled=[item], scores=scores), touched)
        except ForwardFailed as failure:
            self._fail(item.seq.request, failure.__cause__, touched)

    def _fail(self, request: Request, error: BaseException | None, touched: dict[str, Request]) -> None:
        """Abort one request whose own computation raised; the engine keeps serving the others."""
        log.error("request %s failed in the engine step", request.request_id, exc_info=error)
        self.abort(request.request_id)
        request.error = f"internal engine error: {type(error).__name__}: {error}"
        touched[request.request_id] = request

    def _finish(self, seq: Sequence, status: SequenceStatus, touched: dict[str, Request],
                already_retired: bool = False) -> None:
        request: Request = seq.request
        if request.beam is not None:  # the scheduler gave up on a beam: the pool cannot hold the group
            self.abort(request.request_id)
            request.error = (f"beam search: {len(request.seqs)} beams of {seq.num_tokens} tokens need more KV "
                             f"blocks than the pool has ({self.block_manager.num_usable_blocks} usable)")
            touched[request.request_id] = request
            return
        if not already_retired:
            self.scheduler.finish(seq, status)
        request.outputs[request.seqs.index(seq)].finish_reason = status.finish_reason
        touched[request.request_id] = request
        if request.finished:
            self.requests.pop(request.request_id, None)
            self.counters["finished_requests"] += 1
            if request.conversation is not None and status is not SequenceStatus.FINISHED_ABORTED:
                self.conversations.record_turn(request.conversation, len(request.prompt_token_ids),
                                               len(request.outputs[0].token_ids), request.num_cached_tokens,
                                               time.monotonic())

    def reset_prefix_cache(self) -> int:
        """Forget every cached block, in the pool and in the tiers; returns the pool blocks dropped."""
        dropped = self.block_manager.reset_prefix_cache()
        self._run_kv_ops(self.block_manager.drain_ops())
        return dropped

    def close(self) -> None:
        """Release what outlives the process otherwise (the disk tier's files and lock, the
        other tensor-parallel ranks)."""
        self.executor.close()

    def check_health(self) -> None:
        """Raise :class:`~flexpage.model.tensor_parallel.RankFailure` if a tensor-parallel rank has
        exited (a server calls it while idle, so a dead rank ends it without waiting for a request)."""
        self.executor.check_health()

    # -- observability -----------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Counters the CLI summary and the server's /metrics export."""
        from flexpage.engine_stats import engine_stats

        return engine_stats(self)

    def tier_stats(self) -> dict[str, float]:
        """The host and disk tiers behind the prefix cache (zeros without tiers)."""
        from flexpage.engine_stats import tier_stats

        return tier_stats(self)

    def kv_utilization(self) -> float:
        """Token states stored / token slots allocated, over the blocks live sequences hold."""
        from flexpage.engine_stats import kv_utilization

        return kv_utilization(self)

    def kv_view(self) -> dict[str, Any]:
        """The KV cache block by block, its tiers, conversations and requests (see flexpage.kv_view)."""
        return kv_view(self)
