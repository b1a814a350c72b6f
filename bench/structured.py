"""Structured outputs: what a grammar costs per token, per schema and on a batch-48 workload.

    python -m bench.structured [--rounds 6] [--compare-xgrammar] [--quick] [--out PATH]

On the default model (SmolLM2-135M-Instruct, 49,152-token vocabulary), one process:

1. ``compile``: for the corpus's first twelve schemas (bench/structured_corpus.py: nested
   objects, arrays, enums, anyOf/oneOf, $ref, formats, bounded numbers), on a fresh
   :class:`~flexpage.structured.compiler.GrammarCompiler` like the engine's: the backend's
   set-up once, each schema's first compile (a cache miss), the same schema again (a hit:
   the cache key's ``json.dumps`` and the lookup), a matcher (made per sample, never
   cached; beside it llguidance's ``deep_copy`` of one) and a fresh matcher's first mask.
2. ``mask``: realistic outputs (the twelve schemas, chat prompts, temperature 0.8, n = 4:
   48 outputs, recorded once) are replayed through matchers: each step fills the bitmask of
   every row the way the engine does (``engine.grammars.bitmask``), applies it with
   :func:`~flexpage.structured.bitmask.apply_bitmask` to float32 ``[B, 49152]`` logits and
   advances each matcher by its recorded token (``accept``, what the output processor
   does). Batch 1 walks every recorded token once; batch 48 keeps 48 rows busy, a row whose
   output ended taking the next one. Medians and means per step (a mask costs far more in
   a few states than in most, so the mean is what a token costs on average). At batch 48
   other ways to fill the same rows run on the same states in the same steps: llguidance's
   executor with 2 threads instead of its default, and a plain loop over the rows.
3. ``decode``: the anchors workload (bench/anchors.py: 48 random-token prompts, log-normal
   lengths 16-1024, 64 greedy tokens each, all at once) with every request under a JSON
   schema vs none, and a batch-1 request (128-token prompt, 64 tokens) both ways; rounds
   alternate which goes first, every run on fresh prompt tokens (same lengths) so the prefix
   cache helps neither. The schema of request ``i`` is an array of at least 64 records of
   twelve-schema ``i % 12`` (a list of orders, of tickets...), so no constrained output
   completes before 64 tokens and both sides generate exactly the same number of tokens.
   Reported: output tok/s and tokens per CPU-second of the process (medians over rounds,
   and their ratios), the median engine step of steps where every running sequence decodes
   (batch 48 and batch 1) -- the whole step: mask filling, the forward, applying, sampling,
   accepting -- and, timed inside those runs, the engine's own fill
   (``engine.grammars.bitmask``) and apply (the executor's ``_constrain``).

The mask's share of a decode step is (fill + apply + accept, means) from part 2 over part
3's free decode step at the same batch. ``--compare-xgrammar`` times xgrammar 0.2.8 on the
same schemas and the same recorded tokens (compile with ``any_whitespace=False`` and
flexpage's separators, its cache; ``fill_next_token_bitmask`` per row and
``BatchGrammarMatcher``; its CPU ``apply_token_bitmask_inplace`` beside flexpage's), and
compares the two libraries' masks position by position. Writes --out
(bench/results/structured.json). ``--quick``: a smoke run (one round, 4 schemas, 8 prompts
of 16 tokens).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.anchors import NUM_PROMPTS, fresh_prompt, workload
from bench.structured_corpus import SCHEMAS
import flexpage.executor.local as local_executor
from flexpage import LLM, SamplingParams, StructuredOutputsParams
from flexpage.structured.bitmask import apply_bitmask
from flexpage.structured.compiler import GrammarCompiler
from flexpage.structured.llguidance_backend import JSON_DEFAULTS, LLGuidanceBackend

DEFAULT_OUT = Path("bench/results/structured.json")
BENCH_SCHEMAS = SCHEMAS[:12]
RECORD_N, RECORD_TOKENS = 4, 256


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def us(seconds: float) -> float:
    return seconds * 1e6


# --------------------------------------------------------------------------- 1. compile


def compile_llguidance(engine: Any, schemas: list[tuple[str, str, dict]]) -> dict:
    """First use and reuse of each schema on a fresh compiler and backend (not the engine's)."""
    start = time.perf_counter()
    backend = LLGuidanceBackend(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    setup_s = time.perf_counter() - start
    compiler = GrammarCompiler(lambda: backend)
    rows = {}
    for name, _, schema in schemas:
        spec = StructuredOutputsParams(json=schema)
        first = _timed(compiler.compile, spec)
        again = median([_timed(compiler.compile, StructuredOutputsParams(json=json.loads(json.dumps(schema))))
                        for _ in range(5)])
        grammar = compiler.compile(spec)
        makes, first_masks = [], []
        for _ in range(5):
            start = time.perf_counter()
            matcher = grammar.matcher()
            makes.append(time.perf_counter() - start)
            first_masks.append(_timed(compiler.bitmask, [matcher]))
        copies = [_timed(matcher.inner.deep_copy) for _ in range(5)]  # an alternative to parsing per sample
        rows[name] = {"first_compile_ms": 1e3 * first, "cached_us": us(again), "matcher_us": us(median(makes)),
                      "matcher_deep_copy_us": us(median(copies)),
                      "first_mask_us_first": us(first_masks[0]), "first_mask_us": us(median(first_masks[1:]))}
    assert compiler.misses == len(schemas) and compiler.hits == 5 * len(schemas) + len(schemas)
    return {"backend_setup_s": setup_s, "schemas": rows, **_compile_summary(rows)}


def compile_xgrammar(engine: Any, schemas: list[tuple[str, str, dict]]) -> tuple[dict, Any, dict]:
    """The same for xgrammar; also returns its tokenizer info and each schema's compiled grammar.

    xgrammar's compiler also caches parts of grammars across schemas (a string of one
    ``maxLength`` costs 0.1-0.3 s the first time any schema uses it), so a schema's first
    compile depends on what was compiled before: ``first_compile_ms`` is in this order on one
    compiler (what a server that saw the previous ones pays), ``fresh_compile_ms`` on a
    compiler of its own (a server's first request with it)."""
    import xgrammar as xgr

    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(engine.tokenizer, vocab_size=engine.vocab_size,
                                              stop_token_ids=list(engine.eos_token_ids))
    compiler = xgr.GrammarCompiler(info, cache_enabled=True)
    setup_s = time.perf_counter() - start
    rows, compiled = {}, {}
    for name, _, schema in schemas:
        def build(schema: dict = schema, on: Any = compiler) -> Any:
            return on.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                          separators=(JSON_DEFAULTS["item_separator"], JSON_DEFAULTS["key_separator"]))
        first = _timed(build)
        again = median([_timed(build) for _ in range(5)])
        compiled[name] = build()
        fresh = _timed(build, schema, xgr.GrammarCompiler(info))
        bitmask = xgr.allocate_token_bitmask(1, engine.vocab_size)
        makes, first_masks = [], []
        for _ in range(5):
            start = time.perf_counter()
            matcher = xgr.GrammarMatcher(compiled[name])
            makes.append(time.perf_counter() - start)
            first_masks.append(_timed(matcher.fill_next_token_bitmask, bitmask, 0))
        rows[name] = {"first_compile_ms": 1e3 * first, "fresh_compile_ms": 1e3 * fresh, "cached_us": us(again),
                      "matcher_us": us(median(makes)),
                      "first_mask_us_first": us(first_masks[0]), "first_mask_us": us(median(first_masks[1:]))}
    summary = _compile_summary(rows) | {"median_fresh_compile_ms": median([r["fresh_compile_ms"] for r in rows.values()]),
                                        "max_fresh_compile_ms": max(r["fresh_compile_ms"] for r in rows.values())}
    return {"backend_setup_s": setup_s, "schemas": rows, **summary}, info, compiled


def _compile_summary(rows: dict) -> dict:
    """Medians over the schemas; the largest first compile; all first compiles one after another."""
    keys = ("first_compile_ms", "cached_us", "matcher_us", "matcher_deep_copy_us", "first_mask_us_first", "first_mask_us")
    first = [r["first_compile_ms"] for r in rows.values()]
    return {f"median_{key}": median([r[key] for r in rows.values()]) for key in keys if key in next(iter(rows.values()))} | {
        "max_first_compile_ms": max(first), "sum_first_compile_ms": sum(first)}


def _timed(fn: Callable, *args: Any) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


# --------------------------------------------------------------------------- 2. masks along recorded outputs


def record_outputs(llm: LLM, schemas: list[tuple[str, str, dict]], n: int) -> list[tuple[str, list[int]]]:
    """``n`` sampled outputs per schema (chat prompt, temperature 0.8): ``(schema name, token ids)``."""
    conversations = [[{"role": "user", "content": f"Reply with JSON only: {what}."}] for _, what, _ in schemas]
    params = [SamplingParams(temperature=0.8, n=n, seed=i, max_tokens=RECORD_TOKENS,
                             structured_outputs=StructuredOutputsParams(json=schema))
              for i, (_, _, schema) in enumerate(schemas)]
    outputs = llm.chat(conversations, params)
    return [(name, list(o.token_ids)) for (name, _, _), out in zip(schemas, outputs) for o in out.outputs]


class Replay:
    """``batch`` rows walking recorded outputs: each step fills every row's mask, applies it,
    then advances each row by its recorded token; a row whose output ended (or whose token
    the matcher refused) takes the next recorded output with a fresh matcher."""

    def __init__(self, outputs: list[tuple[str, list[int]]], batch: int, new_matcher: Callable[[str], Any],
                 accept: Callable[[Any, int], bool]) -> None:
        self.outputs, self.new_matcher, self.accept = outputs, new_matcher, accept
        self.next_output = 0
        self.rows = [self._take() for _ in range(batch)]
        self.refused = 0
        self.tokens = 0

    def _take(self) -> list:
        name, tokens = self.outputs[self.next_output % len(self.outputs)]
        self.next_output += 1
        return [self.new_matcher(name), tokens, 0, name]

    @property
    def matchers(self) -> list:
        return [row[0] for row in self.rows]

    def advance(self) -> float:
        """Accept every row's next token; returns the seconds spent in ``accept``."""
        spent = 0.0
        for i, (matcher, tokens, position, _) in enumerate(self.rows):
            start = time.perf_counter()
            ok = self.accept(matcher, tokens[position])
            spent += time.perf_counter() - start
            self.tokens += 1
            self.refused += not ok
            if not ok or position + 1 == len(tokens):
                self.rows[i] = self._take()
            else:
                self.rows[i][2] = position + 1
        return spent


def time_masks(outputs: list[tuple[str, list[int]]], batch: int, steps: int, vocab: int,
               new_matcher: Callable[[str], Any], accept: Callable[[Any, int], bool],
               fills: dict[str, Callable[[list], torch.Tensor]]) -> dict:
    """Per-step fill, apply and accept over ``steps`` steps of ``batch`` rows. ``fills`` are ways
    to fill the same masks; each step runs all of them on the same matcher states (in rotating
    order), the first one's mask is applied and reported as ``fill_us``, the others go under
    ``fill_variants``. Median and mean per step (masks cost a few times more in some states
    than in most, so at batch 1 the mean is what a token costs on average)."""
    replay = Replay(outputs, batch, new_matcher, accept)
    logits = torch.randn(batch, vocab, dtype=torch.float32)
    names = list(fills)
    times: dict[str, list[float]] = {name: [] for name in names}
    applies, accepts = [], []
    by_schema: dict[str, list[float]] = {}
    for step in range(steps):
        bitmasks = {}
        for name in names[step % len(names):] + names[: step % len(names)]:
            start = time.perf_counter()
            bitmasks[name] = fills[name](replay.matchers)
            times[name].append(time.perf_counter() - start)
        if batch == 1:
            by_schema.setdefault(replay.rows[0][3], []).append(times[names[0]][-1])
        start = time.perf_counter()
        apply_bitmask(logits, bitmasks[names[0]])
        applies.append(time.perf_counter() - start)
        accepts.append(replay.advance())
    fill = times[names[0]]
    row = {"batch": batch, "steps": steps, "fill_us": us(median(fill)), "fill_us_mean": us(statistics.mean(fill)),
           "apply_us": us(median(applies)), "apply_us_mean": us(statistics.mean(applies)),
           "accept_us": us(median(accepts)), "accept_us_mean": us(statistics.mean(accepts)),
           "fill_us_p90": us(float(np.percentile(fill, 90))), "refused_tokens": replay.refused,
           "outputs_used": replay.next_output,
           "fill_variants": {name: {"median_us": us(median(t)), "mean_us": us(statistics.mean(t))}
                             for name, t in times.items()}}
    row["total_us"] = row["fill_us"] + row["apply_us"] + row["accept_us"]
    row["total_us_mean"] = row["fill_us_mean"] + row["apply_us_mean"] + row["accept_us_mean"]
    if by_schema:
        row["fill_us_by_schema"] = {name: {"median": us(median(t)), "mean": us(statistics.mean(t))}
                                    for name, t in by_schema.items()}
    return row


def llguidance_masks(engine: Any, outputs: list[tuple[str, list[int]]], batch: int, steps: int) -> dict:
    """The engine's path (its compiler's grammars and ``bitmask``: one matcher alone, or
    llguidance's executor with its default threads) beside two other ways to fill the same rows:
    the executor with 2 threads, and a loop over the rows on the calling thread."""
    import llguidance

    specs = {name: StructuredOutputsParams(json=schema) for name, _, schema in BENCH_SCHEMAS}
    grammars = engine.grammars
    words = (engine.vocab_size + 31) // 32
    two_threads = llguidance.LLExecutor(num_threads=2)

    def executor_2(matchers: list) -> torch.Tensor:
        bitmask = torch.empty(len(matchers), words, dtype=torch.int32)
        two_threads.unsafe_compute_mask_ptr([(m.inner, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                            words * 4, len(matchers))
        return bitmask

    def loop(matchers: list) -> torch.Tensor:
        bitmask = torch.empty(len(matchers), words, dtype=torch.int32)
        for i, m in enumerate(matchers):
            m.inner.unsafe_compute_mask_ptr(bitmask.data_ptr() + 4 * words * i, words * 4)
        return bitmask

    variants = {"engine": grammars.bitmask}
    if batch > 1:
        variants |= {"executor_2_threads": executor_2, "loop": loop}
    return time_masks(outputs, batch, steps, engine.vocab_size,
                      new_matcher=lambda name: grammars.compile(specs[name]).matcher(),
                      accept=lambda m, t: m.accept(t), fills=variants)


def xgrammar_masks(compiled: dict, vocab: int, outputs: list[tuple[str, list[int]]], batch: int, steps: int) -> dict:
    """xgrammar's matchers on the same outputs: ``BatchGrammarMatcher`` (its default threads;
    and 2 threads) and a loop of ``fill_next_token_bitmask`` above one row; flexpage's apply
    (xgrammar's own CPU apply is timed beside it in :func:`xgrammar_apply`)."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(batch, vocab)
    batchers = {"batch_default_threads": xgr.BatchGrammarMatcher(), "batch_2_threads": xgr.BatchGrammarMatcher(2)}

    def loop(matchers: list) -> torch.Tensor:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)
        return bitmask

    def batched(name: str) -> Callable[[list], torch.Tensor]:
        def fill(matchers: list) -> torch.Tensor:
            batchers[name].batch_fill_next_token_bitmask(matchers, bitmask)
            return bitmask
        return fill

    variants = {"loop": loop} if batch == 1 else {name: batched(name) for name in batchers} | {"loop": loop}
    return time_masks(outputs, batch, steps, vocab, new_matcher=lambda name: xgr.GrammarMatcher(compiled[name]),
                      accept=lambda m, t: m.accept_token(t), fills=variants)


def xgrammar_apply(batch: int, vocab: int, repeats: int) -> dict:
    """xgrammar's ``apply_token_bitmask_inplace`` vs flexpage's ``apply_bitmask``, alternating, on one
    half-allowed random bitmask."""
    import xgrammar as xgr

    logits = torch.randn(batch, vocab, dtype=torch.float32)
    bitmask = torch.randint(-2**31, 2**31 - 1, (batch, (vocab + 31) // 32), dtype=torch.int32)
    ours, theirs = [], []
    for _ in range(repeats):
        ours.append(_timed(apply_bitmask, logits, bitmask))
        theirs.append(_timed(xgr.apply_token_bitmask_inplace, logits, bitmask))
    return {"batch": batch, "flexpage_apply_us": us(median(ours)), "xgrammar_apply_us": us(median(theirs))}


def mask_agreement(engine: Any, compiled: dict, outputs: list[tuple[str, list[int]]]) -> dict:
    """Walk each recorded output with both libraries and compare their masks position by
    position: equal, llguidance's a strict subset of xgrammar's, a strict superset, or neither;
    a few examples of each difference (the tokens only one side allows); and the recorded
    tokens xgrammar refuses (llguidance allowed every one of them)."""
    import xgrammar as xgr

    specs = {name: StructuredOutputsParams(json=schema) for name, _, schema in BENCH_SCHEMAS}
    theirs = xgr.allocate_token_bitmask(1, engine.vocab_size)
    counts = {"positions": 0, "equal": 0, "llguidance_subset": 0, "llguidance_superset": 0, "neither": 0}
    refused = []
    examples: dict[str, list] = {"llguidance_subset": [], "llguidance_superset": [], "neither": []}

    def tokens_of(words: torch.Tensor) -> list[str]:
        bits = np.unpackbits(words.contiguous().view(torch.uint8).numpy(), bitorder="little")[: engine.vocab_size]
        return [engine.tokenizer.decode([int(t)]) for t in bits.nonzero()[0][:4]]

    for name, tokens in outputs:
        ours_m = engine.grammars.compile(specs[name]).matcher()
        theirs_m = xgr.GrammarMatcher(compiled[name])
        for position, token in enumerate(tokens):
            ours = engine.grammars.bitmask([ours_m])
            theirs_m.fill_next_token_bitmask(theirs, 0)
            only_ours, only_theirs = ours & ~theirs, theirs & ~ours
            kind = ("equal" if not only_ours.any() and not only_theirs.any() else
                    "llguidance_subset" if not only_ours.any() else
                    "llguidance_superset" if not only_theirs.any() else "neither")
            counts["positions"] += 1
            counts[kind] += 1
            if kind != "equal" and len(examples[kind]) < 4:
                examples[kind].append({"schema": name, "after": engine.tokenizer.decode(tokens[:position])[-30:],
                                       "only_llguidance": tokens_of(only_ours), "only_xgrammar": tokens_of(only_theirs)})
            ours_m.accept(token)
            if not theirs_m.accept_token(token):
                refused.append({"schema": name, "after": engine.tokenizer.decode(tokens[:position])[-40:],
                                "token": engine.tokenizer.decode([token])})
                break
    return {**counts, "xgrammar_refused_outputs": len(refused), "xgrammar_refused": refused, "examples": examples}


# --------------------------------------------------------------------------- 3. decode, free vs constrained


def run_engine(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    """Run to completion, timing each engine step; a step counts as decode at batch B when every
    scheduled sequence computes one token and B of them are scheduled."""
    engine = llm.engine
    shapes: list[tuple[int, bool]] = []
    execute = engine.executor.execute

    def recorded(plan: Any) -> Any:  # noqa: ANN401
        if plan.inputs is not None:
            shapes.append((len(plan.inputs.query_lens), all(q == 1 for q in plan.inputs.query_lens)))
        return execute(plan)

    engine.executor.execute = recorded
    fills, applies = CallTimer(engine.grammars, "bitmask", 0), CallTimer(local_executor, "_constrain", 1)
    steps: list[tuple[float, tuple[int, bool] | None]] = []
    lengths = []
    completed = 0  # outputs that ended before max_tokens (none expected: see records_schema)
    try:
        start, cpu_start = time.perf_counter(), time.process_time()
        for prompt, p in zip(prompts, params):
            engine.add_request({"prompt_token_ids": prompt}, p)
        while engine.has_unfinished_requests():
            before = len(shapes)
            t0 = time.perf_counter()
            outs = engine.step()
            steps.append((time.perf_counter() - t0, shapes[-1] if len(shapes) > before else None))
            for out in outs:
                if out.error is not None:
                    raise RuntimeError(out.error)
                if out.finished:
                    lengths.append(len(out.outputs[0].token_ids))
                    completed += out.outputs[0].finish_reason != "length"
        seconds, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    finally:
        del engine.executor.execute
        fills.restore()
        applies.restore()
    batch = len(prompts)
    decode = [s for s, shape in steps if shape == (batch, True)]
    return {"seconds": seconds, "tokens": sum(lengths), "tok_s": sum(lengths) / seconds,
            "tok_per_cpu_s": sum(lengths) / cpu_s,
            "decode_step_ms": 1e3 * median(decode), "decode_steps": len(decode),
            "completed_early": completed,
            "in_engine_fill_ms": _ms_or_none([t for n, t in fills.calls if n == batch]),
            "in_engine_apply_ms": _ms_or_none([t for n, t in applies.calls if n == batch])}


def _ms_or_none(seconds: list[float]) -> float | None:
    return 1e3 * median(seconds) if seconds else None


class CallTimer:
    """Times every call of ``owner.name`` while installed (an instance's method, shadowed by an
    instance attribute; or a module's function, replaced): ``calls`` holds (rows, seconds),
    rows being the length of the call's row list (``bitmask(matchers)``,
    ``_constrain(logits, rows, bitmask)``)."""

    def __init__(self, owner: Any, name: str, rows_arg: int) -> None:
        self.owner, self.name, self.calls = owner, name, []
        self.module_function = isinstance(owner, type(local_executor))
        self.original = getattr(owner, name)

        def timed(*args: Any) -> Any:
            start = time.perf_counter()
            out = self.original(*args)
            self.calls.append((len(args[rows_arg]), time.perf_counter() - start))
            return out

        setattr(owner, name, timed)

    def restore(self) -> None:
        if self.module_function:
            setattr(self.owner, self.name, self.original)
        else:
            delattr(self.owner, self.name)


def records_schema(schema: dict) -> dict:
    """An array of at least 64 records of ``schema``: no output of it completes within 64 tokens.
    (``$defs`` move to the root, where the records' ``#/$defs/...`` references point.)"""
    items = {key: value for key, value in schema.items() if key != "$defs"}
    return {"type": "array", "items": items, "minItems": 64, **({"$defs": schema["$defs"]} if "$defs" in schema else {})}


def decode_rounds(llm: LLM, rounds: int, num_prompts: int, tokens: int, schemas: list[tuple[str, str, dict]]) -> dict:
    listed = [StructuredOutputsParams(json=records_schema(schema)) for _, _, schema in schemas]

    def params(i: int, constrained: bool) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True,
                              structured_outputs=listed[i % len(listed)] if constrained else None)

    grammars = llm.engine.grammars
    before = (grammars.misses, grammars.hits, grammars.compile_seconds)
    runs: dict[str, list[dict]] = {f"{variant}_b{b}": [] for variant in ("free", "schema") for b in (1, num_prompts)}
    for r in range(rounds):
        lengths = [len(p) for p in workload(r)[:num_prompts]]
        rng = np.random.default_rng(10_000 + r)
        order = ("free", "schema") if r % 2 == 0 else ("schema", "free")
        for variant in order:
            constrained = variant == "schema"
            batch = [fresh_prompt(rng, n) for n in lengths]
            runs[f"{variant}_b{num_prompts}"].append(
                run_engine(llm, batch, [params(i, constrained) for i in range(len(batch))]))
            runs[f"{variant}_b1"].append(run_engine(llm, [fresh_prompt(rng, 128)], [params(r, constrained)]))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]['tok_s']:.1f} tok/s, step {v[-1]['decode_step_ms']:.1f} ms"
                                         for k, v in runs.items()), flush=True)
    summary = {}
    for key, values in runs.items():
        summary[key] = {"tok_s": median([v["tok_s"] for v in values]),
                        "tok_per_cpu_s": median([v["tok_per_cpu_s"] for v in values]),
                        "in_engine_fill_ms": median([v["in_engine_fill_ms"] for v in values])
                        if values[0]["in_engine_fill_ms"] is not None else None,
                        "in_engine_apply_ms": median([v["in_engine_apply_ms"] for v in values])
                        if values[0]["in_engine_apply_ms"] is not None else None,
                        "decode_step_ms": median([v["decode_step_ms"] for v in values]),
                        "per_round_tok_s": [round(v["tok_s"], 1) for v in values],
                        "per_round_decode_step_ms": [round(v["decode_step_ms"], 2) for v in values],
                        "tokens": [v["tokens"] for v in values],
                        "completed_early": sum(v["completed_early"] for v in values)}
    b = num_prompts
    summary["schema_over_free"] = {
        f"tok_s_b{b}": summary[f"schema_b{b}"]["tok_s"] / summary[f"free_b{b}"]["tok_s"],
        f"decode_step_b{b}": summary[f"schema_b{b}"]["decode_step_ms"] / summary[f"free_b{b}"]["decode_step_ms"],
        "decode_step_b1": summary["schema_b1"]["decode_step_ms"] / summary["free_b1"]["decode_step_ms"],
        f"tok_per_cpu_s_b{b}": summary[f"schema_b{b}"]["tok_per_cpu_s"] / summary[f"free_b{b}"]["tok_per_cpu_s"],
        "per_round_tok_s_b{}".format(b): [round(s["tok_s"] / f["tok_s"], 3)
                                          for s, f in zip(runs[f"schema_b{b}"], runs[f"free_b{b}"])],
    }
    summary["grammar_cache_during_rounds"] = {"misses": grammars.misses - before[0], "hits": grammars.hits - before[1],
                                              "compile_ms": 1e3 * (grammars.compile_seconds - before[2])}
    return summary


# --------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=400, help="replayed steps per mask measurement")
    p.add_argument("--compare-xgrammar", action="store_true", help="also time xgrammar on the same schemas and tokens")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 round, 4 schemas, 8 prompts, 16 tokens")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    schemas = BENCH_SCHEMAS[:4] if args.quick else BENCH_SCHEMAS
    rounds, num_prompts, tokens, steps = (1, 8, 16, 40) if args.quick else (args.rounds, NUM_PROMPTS, 64, args.steps)

    started = time.perf_counter()
    llm = LLM()
    warm_s = llm.engine.warm_up()
    engine = llm.engine
    result: dict[str, Any] = {"model": "SmolLM2-135M-Instruct (default)", "vocab": engine.vocab_size,
                              "torch_threads": torch.get_num_threads(), "quick": args.quick,
                              "ready_s": time.perf_counter() - started, "warm_up_s": warm_s}
    print(f"ready in {result['ready_s']:.0f} s", flush=True)

    result["compile"] = {"llguidance": compile_llguidance(engine, schemas)}
    xgr_compiled = None
    if args.compare_xgrammar:
        from importlib.metadata import version

        result["compile"]["xgrammar"], _, xgr_compiled = compile_xgrammar(engine, schemas)
        result["xgrammar_version"] = version("xgrammar")
    for lib, row in result["compile"].items():
        fresh = (f"; on a fresh compiler each: median {row['median_fresh_compile_ms']:.1f} ms, max "
                 f"{row['max_fresh_compile_ms']:.1f}" if "median_fresh_compile_ms" in row else "")
        print(f"compile {lib}: set-up {row['backend_setup_s']:.2f} s, first compile median "
              f"{row['median_first_compile_ms']:.2f} ms (max {row['max_first_compile_ms']:.1f}, all twelve "
              f"{row['sum_first_compile_ms']:.0f}{fresh}), cached "
              f"{row['median_cached_us']:.1f} us, matcher {row['median_matcher_us']:.0f} us, first mask "
              f"{row['median_first_mask_us_first']:.0f} us (then {row['median_first_mask_us']:.0f})", flush=True)

    outputs = record_outputs(llm, schemas, RECORD_N)
    result["recorded"] = {"outputs": len(outputs), "tokens": sum(len(t) for _, t in outputs),
                          "median_tokens": median([len(t) for _, t in outputs])}
    print(f"recorded {len(outputs)} outputs, {result['recorded']['tokens']} tokens", flush=True)

    batches = {1: result["recorded"]["tokens"], num_prompts: steps}  # batch 1 walks every recorded token once
    result["mask"] = {"llguidance": {f"b{b}": llguidance_masks(engine, outputs, b, n) for b, n in batches.items()}}
    if xgr_compiled is not None:
        result["mask"]["xgrammar"] = {f"b{b}": xgrammar_masks(xgr_compiled, engine.vocab_size, outputs, b, n)
                                      for b, n in batches.items()}
        result["apply_compare"] = {f"b{b}": xgrammar_apply(b, engine.vocab_size, 200) for b in batches}
        result["agreement"] = mask_agreement(engine, xgr_compiled, outputs)
    for lib, row in result["mask"].items():
        for key, m in row.items():
            variants = ", ".join(f"{name} {v['median_us']:.0f}/{v['mean_us']:.0f}" for name, v in m["fill_variants"].items())
            print(f"mask {lib} {key}: fill {m['fill_us']:.0f} us (mean {m['fill_us_mean']:.0f}), apply {m['apply_us']:.0f} "
                  f"us, accept {m['accept_us']:.0f} us; refused {m['refused_tokens']}; fill median/mean us: {variants}",
                  flush=True)

    result["decode"] = decode_rounds(llm, rounds, num_prompts, tokens, schemas)
    d, b = result["decode"], num_prompts
    share = {f"b{n}": result["mask"]["llguidance"][f"b{n}"]["total_us_mean"] / (1e3 * d[f"free_b{n}"]["decode_step_ms"])
             for n in (1, b)}
    result["mask_share_of_free_decode_step"] = share
    result["targets"] = {
        "b1_mask_share_le_10pct": share["b1"] <= 0.10,
        "b1_decode_step_ratio_le_1.10": d["schema_over_free"]["decode_step_b1"] <= 1.10,
        f"b{b}_tok_s_ratio_ge_0.9": d["schema_over_free"][f"tok_s_b{b}"] >= 0.9,
        "cached_compile_under_100us": result["compile"]["llguidance"]["median_cached_us"] < 100,
    }
    for key in ("free_b1", "schema_b1", f"free_b{b}", f"schema_b{b}"):
        in_engine = (f"; in the engine: fill {d[key]['in_engine_fill_ms']:.2f} ms, apply {d[key]['in_engine_apply_ms']:.2f} ms"
                     if d[key]["in_engine_fill_ms"] is not None else "")
        print(f"{key:>10}: {d[key]['tok_s']:.1f} tok/s {d[key]['per_round_tok_s']}, decode step "
              f"{d[key]['decode_step_ms']:.2f} ms {d[key]['per_round_decode_step_ms']}{in_engine}")
    print("schema / free: " + ", ".join(f"{k} {v if isinstance(v, list) else round(v, 3)}"
                                        for k, v in d["schema_over_free"].items()))
    print("mask (fill + apply + accept, means) / free decode step: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in share.items()))
    print(f"grammar cache during the rounds: {d['grammar_cache_during_rounds']}")
    print("targets: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in result["targets"].items()))
    if "agreement" in result:
        a = result["agreement"]
        print(f"llguidance vs xgrammar masks over {a['positions']} positions: {a['equal']} equal, "
              f"{a['llguidance_subset']} llguidance's narrower, {a['llguidance_superset']} wider, {a['neither']} "
              f"neither; {a['xgrammar_refused_outputs']} recorded outputs refused by xgrammar")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
