"""The offline API in the shape vLLM users know: ``LLM(...).generate(prompts, params)``."""

from __future__ import annotations

from typing import Any, Callable, Sequence as Seq

from flexpage import background
from flexpage.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from flexpage.config import EngineConfig
from flexpage.engine import LLMEngine, PromptInput
from flexpage.frame_stack import reserved_frame_stack
from flexpage.outputs import RequestOutput
from flexpage.sampling_params import SamplingParams

Messages = list[dict[str, str]]


class LLM:
    """``LLM(model=None)`` loads SmolLM2-135M-Instruct; every EngineConfig field is a keyword."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        background.wait()  # ready when it returns: the KV pool resident, no helper thread still running

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    @reserved_frame_stack
    def generate(
        self,
        prompts: PromptInput | Seq[PromptInput],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        on_progress: Callable[[RequestOutput], None] | None = None,
        conversation_id: str | Seq[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in prompt order.

        Every prompt and parameter set is validated before any is queued, so a bad one
        raises ``ValueError`` and nothing runs. ``conversation_id`` (one, or one per prompt)
        names the chat each prompt continues (see :mod:`flexpage.conversations`).
        """
        prompt_list = _as_list(prompts)
        params = _params_list(sampling_params, len(prompt_list))
        conversations = _conversation_list(conversation_id, len(prompt_list))
        for p in params:
            if not isinstance(p, (SamplingParams, BeamSearchParams)):
                raise ValueError(f"sampling_params: got {type(p).__name__}, expected SamplingParams")
        prepared = [self.engine.prepare_prompt(prompt) for prompt in prompt_list]  # raises before queueing
        ids = [self.engine.add_request(prompt, p, conversation_id=conv)
               for prompt, p, conv in zip(prepared, params, conversations)]
        results: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            outputs = self.engine.step()
            failures = {out.request_id: out.error for out in outputs if out.error is not None}
            if failures:  # the engine aborted these alone; stop the rest of this call too
                for request_id in ids:
                    self.engine.abort(request_id)
                raise RuntimeError("; ".join(f"request {rid}: {message}" for rid, message in failures.items()))
            for out in outputs:
                if out.finished:
                    results[out.request_id] = out
                    if on_progress is not None:
                        on_progress(out)
        return [results[i] for i in ids]

    def beam_search(self, prompts: PromptInput | Seq[PromptInput], params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search over each prompt (vLLM's ``LLM.beam_search``), in the engine: a prompt's
        beams share its blocks and fork copy-on-write. Returns, per prompt, every beam best
        first (ranked as HF's ``generate(num_beams=...)``, see :mod:`flexpage.beam_search`)."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params: got {type(params).__name__}, expected BeamSearchParams")
        outputs = self.generate(prompts, [params] * len(_as_list(prompts)))  # type: ignore[list-item]
        tokenizer = self.engine.tokenizer
        return [BeamSearchOutput([
            BeamSearchSequence(out.prompt_token_ids + beam.token_ids,
                               tokenizer.decode(out.prompt_token_ids + beam.token_ids, skip_special_tokens=True),
                               beam.cumulative_logprob, params.score(beam.cumulative_logprob, len(beam.token_ids)),
                               len(out.prompt_token_ids), beam.finish_reason)
            for beam in out.outputs]) for out in outputs]

    def chat(
        self,
        messages: Messages | Seq[Messages],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        conversation_id: str | Seq[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate.

        ``conversation_id`` (one per conversation) names each chat: its turns' KV is kept and
        counted as one conversation's (see :mod:`flexpage.conversations`)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            {"prompt_token_ids": list(self.engine.tokenizer.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False))}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, conversation_id=conversation_id)


def _as_list(prompts: Any) -> list[PromptInput]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(
            f"prompts: got {type(prompts).__name__}, expected a str, a list of token ids, a dict or a list of those"
        )
    return list(prompts)


def _conversation_list(conversation_id: Any, count: int) -> list[str | None]:
    if conversation_id is None or isinstance(conversation_id, str):
        if isinstance(conversation_id, str) and count > 1:
            raise ValueError(f"conversation_id: one id for {count} prompts; pass one per prompt "
                             "(a conversation has one turn in flight at a time)")
        return [conversation_id] * count
    ids = list(conversation_id)
    if len(ids) != count:
        raise ValueError(f"conversation_id: got {len(ids)} entries for {count} prompts")
    return ids


def _params_list(params: Any, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"sampling_params: got {len(params)} entries for {count} prompts")
    return params
