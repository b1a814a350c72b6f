"""One HTTP request's engine requests, and how their deltas become an OpenAI response: the
submission (accepted or failed before any byte is sent), the collected body or the SSE
stream, logprob formatting, tool calls read out of a chat's text
(:mod:`flexpage.server.tool_calls`), and aborting when the client goes away."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from flexpage.outputs import SpeculationCounts
from flexpage.sampling_params import SamplingParams
from flexpage.server.engine_loop import Accepted, Delta, Failed, SampleDelta, Sink
from flexpage.server.protocol import APIError
from flexpage.server.state import ServerState
from flexpage.server.tool_calls import ToolCallReader, finish_reason
from flexpage.server.tools import ToolRequest

__all__ = ["run_request"]

log = logging.getLogger("flexpage.server")



class Submission:
    """The engine requests behind one HTTP request (one per prompt), merged into one stream."""

    def __init__(self, state: ServerState, prompts: list[tuple[str | None, list[int]]], params: SamplingParams,
                 arrival: float, options: dict[str, Any] | None = None) -> None:
        self.state = state
        self.prompts = prompts
        self.params = params
        self.arrival = arrival
        self.options = options or {}  # more add_request keywords, for every prompt
        self.sink = Sink(asyncio.get_running_loop())
        base = uuid.uuid4().hex
        self.request_ids = [f"{base}-{i}" for i in range(len(prompts))]
        self.finished: set[int] = set()
        self._buffer: list[Any] = []

    async def start(self) -> None:
        """Submit every prompt; raise :class:`APIError` if the engine refuses one."""
        for i, (text, ids) in enumerate(self.prompts):
            self.state.engine_loop.add(self.request_ids[i], {"prompt_token_ids": ids, "prompt": text}, self.params,
                                       self.sink, tag=i, arrival=self.arrival, options=self.options)
        pending = set(range(len(self.prompts)))
        failure: Failed | None = None
        while pending:
            item = await self.sink.queue.get()
            if isinstance(item, Accepted):
                pending.discard(item.tag)
            elif isinstance(item, Failed) and item.tag in pending:
                pending.discard(item.tag)
                self.finished.add(item.tag)
                failure = failure or item
            else:
                self._buffer.append(item)
        if failure is not None:
            self.abort()
            if failure.client_error:
                raise APIError(400, failure.message, param=failure.param, code="invalid_value")
            raise _failure_error(failure)

    async def items(self) -> AsyncIterator[Delta | Failed]:
        """Deltas until every prompt finished; a ``Failed`` ends the stream."""
        buffered, self._buffer = self._buffer, []
        pending = list(buffered)
        while len(self.finished) < len(self.prompts):
            item = pending.pop(0) if pending else await self.sink.queue.get()
            if item is None:  # woken by abort()
                continue
            if isinstance(item, Failed):
                self.finished.update(range(len(self.prompts)))
                yield item
                return
            if isinstance(item, Delta):
                if item.finished:
                    self.finished.add(item.tag)
                yield item

    def abort(self) -> None:
        """Abort every unfinished engine request (idempotent) and wake :meth:`items`."""
        aborted = False
        for i, request_id in enumerate(self.request_ids):
            if i not in self.finished:
                self.state.engine_loop.abort(request_id)
                self.finished.add(i)
                aborted = True
        if aborted:
            self.sink.queue.put_nowait(None)

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.prompts)


async def _wait_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    """Return when the client disconnects (or the connection fails)."""
    try:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - a broken connection counts as a disconnect
        return


@dataclass
class _Choice:
    """Accumulated state of one choice (non-streaming) or what was sent of it (streaming)."""

    text: str = ""
    sent_chars: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    text_offset: int = 0
    finish_reason: str | None = None
    started: bool = False
    tool_reader: ToolCallReader | None = None  # a chat with tools: its calls, read from the text


def _choices(count: int, tools: ToolRequest | None) -> list[_Choice]:
    read = tools is not None and tools.reads_calls
    return [_Choice(tool_reader=ToolCallReader(tools.leading_text) if read else None) for _ in range(count)]


class _Usage:
    def __init__(self, num_prompts: int) -> None:
        self.prompt = [0] * num_prompts
        self.cached = [0] * num_prompts
        self.completion = 0
        self.speculation: list[SpeculationCounts | None] = [None] * num_prompts

    def update(self, delta: Delta) -> None:
        self.prompt[delta.tag] = delta.num_prompt_tokens
        self.cached[delta.tag] = max(self.cached[delta.tag], delta.num_cached_tokens)
        self.completion += sum(len(s.token_ids) for s in delta.samples)
        self.speculation[delta.tag] = delta.speculation

    def body(self) -> dict[str, Any]:
        prompt = sum(self.prompt)
        body = {"prompt_tokens": prompt, "completion_tokens": self.completion,
                "total_tokens": prompt + self.completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached)}}
        counts = [c for c in self.speculation if c is not None]
        if counts:  # flexpage's extension: what speculative decoding proposed and got accepted
            total = SpeculationCounts(sum(c.draft_tokens for c in counts), sum(c.accepted_tokens for c in counts),
                                      sum(c.verifications for c in counts))
            body["speculative_decoding"] = {
                "draft_tokens": total.draft_tokens, "accepted_tokens": total.accepted_tokens,
                "acceptance_rate": round(total.acceptance_rate, 4),
                "mean_accepted_length": round(total.mean_accepted_length, 4)}
        return body


def _holdback(params: SamplingParams) -> int:
    """Characters to hold back while streaming, so a stop string is never partly sent."""
    return max((len(s) for s in params.stop), default=1) - 1


def _safe_float(value: float) -> float:
    if math.isnan(value):
        return -9999.0
    return max(value, -9999.0) if not math.isinf(value) or value < 0 else value


# -- logprob formatting -----------------------------------------------------------------------------
def _top(entry: dict, k: int) -> list[tuple[int, Any]]:
    ranked = sorted((lp.rank, tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= k)
    return [(tid, lp) for _, tid, lp in ranked[:k]]


def _completion_logprobs(choice: _Choice, token_ids: tuple[int, ...], entries: tuple[dict | None, ...], k: int,
                         decode: Callable[[int], str] | None = None) -> dict:
    """OpenAI's legacy ``logprobs`` object. An entry of None (an echoed prompt's first token,
    which follows nothing) has no logprob and no top ones; ``decode`` spells its token."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, entry in zip(token_ids, entries):
        if entry is None:
            token = decode(tid) if decode is not None else ""
            out["tokens"].append(token)
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            out["text_offset"].append(choice.text_offset)
            choice.text_offset += len(token)
            continue
        lp = entry.get(tid)
        token = lp.decoded_token if lp is not None and lp.decoded_token is not None else ""
        out["tokens"].append(token)
        out["token_logprobs"].append(_safe_float(lp.logprob) if lp is not None else None)
        out["top_logprobs"].append({t.decoded_token or "": _safe_float(t.logprob) for _, t in _top(entry, k)})
        out["text_offset"].append(choice.text_offset)
        choice.text_offset += len(token)
    return out


def _chat_logprobs(token_ids: tuple[int, ...], entries: tuple[dict, ...], k: int) -> dict:
    content = []
    for tid, entry in zip(token_ids, entries):
        lp = entry.get(tid)
        token = lp.decoded_token if lp is not None and lp.decoded_token is not None else ""
        content.append({
            "token": token, "logprob": _safe_float(lp.logprob) if lp is not None else -9999.0,
            "bytes": list(token.encode("utf-8")),
            "top_logprobs": [{"token": t.decoded_token or "", "logprob": _safe_float(t.logprob),
                              "bytes": list((t.decoded_token or "").encode("utf-8"))} for _, t in _top(entry, k)],
        })
    return {"content": content}


def _failure_error(failure: Failed) -> APIError:
    """The error of a request the engine ended: 503 ``shutting_down`` (retry elsewhere) or 500."""
    if failure.shutdown:
        return APIError(503, failure.message, type="service_unavailable", code="shutting_down")
    return APIError(500, failure.message, type="server_error", code="engine_error")


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"



async def run_request(request: Request, state: ServerState, prompts: list[tuple[str | None, list[int]]],
               params: SamplingParams, arrival: float, *, chat: bool, stream: bool, include_usage: bool,
               top_k: int, options: dict[str, Any] | None = None, tools: ToolRequest | None = None,
               echo: bool = False, drop_output: bool = False) -> Response:
    """Submit, then stream or collect the response. ``echo`` (completions, not streamed): each
    choice's text (and logprobs) starts with its prompt's; ``drop_output``: only the prompt's
    (the engine generated one token, which is left out)."""
    submission = Submission(state, prompts, params, arrival, options)
    await submission.start()  # APIError if the engine refuses
    prefix = "chatcmpl-" if chat else "cmpl-"
    response_id = prefix + submission.request_ids[0].split("-")[0]
    created = int(time.time())
    if stream:
        return StreamingResponse(
            _stream(request, state, submission, response_id, created, chat=chat, include_usage=include_usage,
                    top_k=top_k, tools=tools),
            media_type="text/event-stream", headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
    return await _collect(request, state, submission, response_id, created, chat=chat, top_k=top_k, tools=tools,
                          echo=echo, drop_output=drop_output)


def _message(choice: _Choice) -> tuple[dict[str, Any], str | None]:
    """A collected chat choice's message and finish reason (with its tool calls, if read)."""
    reader = choice.tool_reader
    if reader is None:
        return {"role": "assistant", "content": choice.text}, choice.finish_reason
    content, _ = reader.feed(choice.text, final=True)
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not reader.calls else None}
    if reader.calls:
        message["tool_calls"] = reader.calls
    return message, finish_reason(choice.finish_reason, reader)


async def _collect(request: Request, state: ServerState, submission: Submission, response_id: str, created: int,
                   *, chat: bool, top_k: int, tools: ToolRequest | None, echo: bool = False,
                   drop_output: bool = False) -> Response:
    n = submission.params.n
    choices = _choices(len(submission.prompts) * n, tools)
    usage = _Usage(len(submission.prompts))
    want_logprobs = getattr(submission.params, "logprobs", None) is not None
    prompt_logprobs: dict[int, tuple] = {}
    failure: Failed | None = None

    async def consume() -> None:
        nonlocal failure
        async for item in submission.items():
            if isinstance(item, Failed):
                failure = item
                return
            usage.update(item)
            if item.prompt_logprobs is not None:
                prompt_logprobs[item.tag] = item.prompt_logprobs
            for sample in item.samples:
                choice = choices[item.tag * n + sample.index]
                choice.text = sample.text
                choice.token_ids.extend(sample.token_ids)
                if want_logprobs and sample.logprobs is not None:
                    choice.logprobs.extend(sample.logprobs)
                choice.finish_reason = sample.finish_reason or choice.finish_reason

    consumer = asyncio.create_task(consume())
    watcher = asyncio.create_task(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not consumer.done():  # the client went away: stop generating for it
            submission.abort()
            consumer.cancel()
            return Response(status_code=499)
        consumer.result()
    finally:
        watcher.cancel()
        if not consumer.done():
            consumer.cancel()
        submission.abort()
    if failure is not None:
        raise _failure_error(failure)
    if drop_output:
        usage.completion = 0
        for choice in choices:
            choice.text, choice.token_ids, choice.logprobs = "", [], []
    body_choices = []
    for i, choice in enumerate(choices):
        logprobs = None
        ids, entries = tuple(choice.token_ids), tuple(choice.logprobs)
        if echo:  # the prompt first: its text, and its tokens' logprobs before the completion's
            text, prompt_ids = submission.prompts[i // n]
            choice.text = (text if text is not None else state.tokenizer.decode(prompt_ids)) + choice.text
            if want_logprobs:
                ids, entries = tuple(prompt_ids) + ids, prompt_logprobs[i // n] + entries
        if want_logprobs:
            logprobs = _chat_logprobs(ids, entries, top_k) if chat else _completion_logprobs(
                choice, ids, entries, top_k, decode=lambda tid: state.tokenizer.decode([tid]))
        if chat:
            message, reason = _message(choice)
            body_choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": reason})
        else:
            body_choices.append({"index": i, "text": choice.text, "logprobs": logprobs,
                                 "finish_reason": choice.finish_reason})
    return JSONResponse({
        "id": response_id, "object": "chat.completion" if chat else "text_completion", "created": created,
        "model": state.served_model_name, "choices": body_choices, "usage": usage.body(), "system_fingerprint": None,
    })


async def _stream(request: Request, state: ServerState, submission: Submission, response_id: str, created: int, *,
                  chat: bool, include_usage: bool, top_k: int, tools: ToolRequest | None) -> AsyncIterator[str]:
    n = submission.params.n
    choices = _choices(len(submission.prompts) * n, tools)
    usage = _Usage(len(submission.prompts))
    holdback = _holdback(submission.params)
    want_logprobs = getattr(submission.params, "logprobs", None) is not None
    obj = "chat.completion.chunk" if chat else "text_completion"
    extra = {"usage": None} if include_usage else {}

    def chunk(choice_body: dict) -> str:
        return _sse({"id": response_id, "object": obj, "created": created, "model": state.served_model_name,
                     "system_fingerprint": None, "choices": [choice_body], **extra})

    def sample_chunk(index: int, choice: _Choice, sample: SampleDelta) -> str | None:
        finished = sample.finish_reason is not None
        limit = len(sample.text) if finished else max(choice.sent_chars, len(sample.text) - holdback)
        text = sample.text[choice.sent_chars:limit]
        choice.sent_chars = max(choice.sent_chars, limit)
        logprobs = None
        if want_logprobs and sample.logprobs and sample.token_ids:
            logprobs = (_chat_logprobs(sample.token_ids, sample.logprobs, top_k) if chat
                        else _completion_logprobs(choice, sample.token_ids, sample.logprobs, top_k))
        reader = choice.tool_reader
        if reader is not None:  # content and calls, read from the text sent so far
            content, calls = reader.feed(sample.text[:choice.sent_chars], final=finished)
            delta: dict[str, Any] = {"content": content} if content else {}
            if calls:
                delta["tool_calls"] = calls
            if not delta and logprobs is None and not finished:
                return None
            return chunk({"index": index, "delta": delta, "logprobs": logprobs,
                          "finish_reason": finish_reason(sample.finish_reason, reader)})
        if not text and logprobs is None and not finished:
            return None
        if chat:
            delta = {"content": text} if text or not finished else {}
            return chunk({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": sample.finish_reason})
        return chunk({"index": index, "text": text, "logprobs": logprobs, "finish_reason": sample.finish_reason})

    watcher = asyncio.create_task(_wait_disconnect(request.receive))
    watcher.add_done_callback(lambda task: task.cancelled() or submission.abort())
    try:
        if chat:
            for i, choice in enumerate(choices):
                choice.started = True
                # with tools, content stays null unless text comes (the collected message's content)
                content = None if choice.tool_reader is not None else ""
                yield chunk({"index": i, "delta": {"role": "assistant", "content": content}, "logprobs": None,
                             "finish_reason": None})
        async for item in submission.items():
            if isinstance(item, Failed):
                if item.shutdown:  # every unfinished choice ends as aborted, then the reason
                    for index, choice in enumerate(choices):
                        if choice.finish_reason is None:
                            yield chunk({"index": index, **({"delta": {}} if chat else {"text": ""}),
                                         "logprobs": None, "finish_reason": "abort"})
                yield _sse(_failure_error(item).body())
                break
            usage.update(item)
            for sample in item.samples:
                index = item.tag * n + sample.index
                choices[index].finish_reason = sample.finish_reason or choices[index].finish_reason
                data = sample_chunk(index, choices[index], sample)
                if data is not None:
                    yield data
        else:
            if include_usage:
                yield _sse({"id": response_id, "object": obj, "created": created, "model": state.served_model_name,
                            "system_fingerprint": None, "choices": [], "usage": usage.body()})
        yield "data: [DONE]\n\n"
    finally:
        watcher.cancel()
        submission.abort()
