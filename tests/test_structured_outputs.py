"""Structured outputs in the engine: every output matches its constraint, greedy tokens equal
a second implementation's (HF's logits masked by llguidance directly), grammar state
survives preemption, a bad constraint is refused before anything is queued.

Tiny random-weight models share the default model's tokenizer, so their grammars are real
SmolLM2 grammars; their text is nonsense, which is the point: the constraint alone makes it
parse.
"""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch

from engine_models import hf_constrained_greedy, load_reference, random_prompts
from flexpage import SamplingParams, StructuredOutputsParams
from flexpage.errors import InvalidParameter
from flexpage.structured.bitmask import apply_bitmask
from flexpage.structured.compiler import GrammarCompiler
from flexpage.structured.llguidance_backend import LLGuidanceBackend

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "admin": {"type": "boolean"},
                   "role": {"enum": ["dev", "ops", "pm"]}, "tags": {"type": "array", "maxItems": 2,
                                                                    "items": {"type": "string", "maxLength": 4}}},
    "required": ["name", "admin", "role"],
    "additionalProperties": False,
}
REGEX = r"[A-Z]{2}-\d{3}"
CHOICES = ["alpha", "beta", "gamma delta"]
GRAMMAR = 'root ::= "(" item ("," item)? ")"\nitem ::= "x" | "y" | "zz"'
GRAMMAR_RE = r"\((x|y|zz)(,(x|y|zz))?\)"

CONSTRAINTS = {
    "json": StructuredOutputsParams(json=PERSON),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICES),
    "grammar": StructuredOutputsParams(grammar=GRAMMAR),
}
PROMPTS = random_prompts((5, 12, 7), seed=3)
MAX_TOKENS = 48


def matches(kind: str, text: str) -> bool:
    """The check of a second implementation: jsonschema, Python's re, membership."""
    if kind == "json":
        try:
            jsonschema.validate(json.loads(text), PERSON)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(GRAMMAR_RE, text) is not None


# -- the parameters -------------------------------------------------------------------------------
def test_exactly_one_constraint_is_given():
    with pytest.raises(InvalidParameter, match="exactly one of .* got none"):
        StructuredOutputsParams()
    with pytest.raises(InvalidParameter, match="got json, regex"):
        StructuredOutputsParams(json={}, regex="a")
    with pytest.raises(InvalidParameter) as error:
        StructuredOutputsParams(choice=["a", ""])
    assert error.value.param == "structured_outputs.choice"
    with pytest.raises(InvalidParameter, match="expected a JSON schema"):
        StructuredOutputsParams(json=[1])
    with pytest.raises(InvalidParameter, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})


def test_equal_schemas_written_differently_share_one_key():
    a = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    b = StructuredOutputsParams(json={"properties": {"a": {"type": "integer"}}, "type": "object"})
    assert a.key() == b.key() and a.key() != StructuredOutputsParams(json={"type": "object"}).key()
    assert StructuredOutputsParams(choice=["a", "b"]).key() != StructuredOutputsParams(choice=["b", "a"]).key()


def test_the_bitmask_masks_exactly_the_tokens_whose_bits_are_clear():
    generator = torch.Generator().manual_seed(0)
    for vocab in (64, 1003, 49152):
        words = (vocab + 31) // 32
        bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=generator)
        logits = torch.randn(3, vocab, generator=generator)
        expected = logits.clone()
        for row in range(3):
            for token in range(vocab):
                if not (int(bitmask[row, token // 32]) >> (token % 32)) & 1:
                    expected[row, token] = float("-inf")
        apply_bitmask(logits, bitmask)
        assert torch.equal(logits, expected)


# -- the compiler ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    from flexpage.model.loader import load_tokenizer

    return load_tokenizer(default_model_path)


@pytest.fixture(scope="module")
def backend(tokenizer):
    return LLGuidanceBackend(tokenizer, 49152, [2])


def test_a_schema_seen_before_costs_no_compile(backend):
    compiler = GrammarCompiler(lambda: backend)
    first = compiler.compile(StructuredOutputsParams(json=PERSON))
    again = compiler.compile(StructuredOutputsParams(json=json.loads(json.dumps(PERSON))))
    assert again is first and (compiler.hits, compiler.misses) == (1, 1)


def test_one_new_constraint_asked_by_many_threads_compiles_once(backend):
    calls = []

    class Counting:
        vocab_size = backend.vocab_size

        def compile(self, spec):
            calls.append(spec)
            return backend.compile(spec)

    compiler = GrammarCompiler(Counting)
    grammars = []
    threads = [threading.Thread(target=lambda: grammars.append(compiler.compile(CONSTRAINTS["grammar"])))
               for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len(grammars) == 8 and all(g is grammars[0] for g in grammars)


@pytest.mark.parametrize(("spec", "param", "message"), [
    (StructuredOutputsParams(json={"type": "objectx"}), "structured_outputs.json", "objectx"),
    (StructuredOutputsParams(json='{"type": '), "structured_outputs.json", "EOF while parsing"),
    (StructuredOutputsParams(regex="(ab"), "structured_outputs.regex", "unclosed group"),
    (StructuredOutputsParams(grammar="root ::= missing"), "structured_outputs.grammar", "missing"),
])
def test_a_bad_constraint_is_refused_with_the_libraries_message_and_not_cached(backend, spec, param, message):
    compiler = GrammarCompiler(lambda: backend)
    for _ in range(2):  # the second request gets the same error, not a cached failure
        with pytest.raises(InvalidParameter, match=message) as error:
            compiler.compile(spec)
        assert error.value.param == param
    assert compiler.misses == 2


# -- the engine -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_every_sample_of_a_random_model_matches_its_constraint(kind, llama, llm_factory, kv_blocks_returned):
    params = [SamplingParams(n=3, temperature=1.0, seed=10 + i, max_tokens=MAX_TOKENS,
                             structured_outputs=CONSTRAINTS[kind]) for i in range(len(PROMPTS))]
    outputs = llm_factory(llama).generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    samples = [sample for out in outputs for sample in out.outputs]
    assert len(samples) == 3 * len(PROMPTS)
    for sample in samples:
        assert sample.finish_reason == "stop", sample
        assert matches(kind, sample.text), sample.text


def test_greedy_constrained_tokens_equal_a_second_implementation(llama, llm_factory, default_model_path):
    from flexpage.model.loader import load_tokenizer

    spec = CONSTRAINTS["json"]
    model, tokenizer = load_reference(llama), load_tokenizer(default_model_path)
    expected = [hf_constrained_greedy(model, tokenizer, p, spec.json, MAX_TOKENS) for p in PROMPTS]
    outputs = llm_factory(llama).generate([{"prompt_token_ids": p} for p in PROMPTS],
                                          SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                         structured_outputs=spec))
    assert [out.outputs[0].token_ids for out in outputs] == expected


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_grammar_state_survives_preemption(mode, llama, llm_factory):
    """A pool too small for all prompts: preempted samples resume their grammars where they were."""
    prompts = random_prompts((5, 17, 33, 60, 9, 24), seed=7)
    params = [SamplingParams(n=1 + i % 2, temperature=1.0, seed=40 + i, max_tokens=MAX_TOKENS,
                             structured_outputs=CONSTRAINTS["json"]) for i in range(len(prompts))]
    roomy = llm_factory(llama, num_blocks=128)
    tight = llm_factory(llama, num_blocks=1 + 12 - 2, block_size=16, preemption_mode=mode, swap_space="1MiB",
                        enable_chunked_prefill=True, max_num_batched_tokens=16)

    def samples(llm):
        return [[s.text for s in out.outputs] for out in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                                       params)]

    expected = samples(roomy)
    before = tight.engine.stats()["preemptions"]
    assert samples(tight) == expected
    assert tight.engine.stats()["preemptions"] > before
    assert all(matches("json", text) for texts in expected for text in texts)


def test_a_bad_constraint_is_refused_before_queueing_and_others_go_on(llama, llm_factory, kv_blocks_returned):
    engine = llm_factory(llama).engine
    engine.add_request({"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0.0, max_tokens=4), "good")
    with pytest.raises(InvalidParameter) as error:
        engine.add_request({"prompt_token_ids": PROMPTS[1]},
                           SamplingParams(structured_outputs=StructuredOutputsParams(regex="[z-a]")), "bad")
    assert error.value.param == "structured_outputs.regex"
    assert set(engine.requests) == {"good"}
    finished = []
    while engine.has_unfinished_requests():
        finished += [out for out in engine.step() if out.finished]
    assert [out.request_id for out in finished] == ["good"] and finished[0].error is None


def test_a_grammar_that_cannot_finish_in_max_tokens_ends_with_length(llama, llm_factory, kv_blocks_returned):
    spec = StructuredOutputsParams(regex=r"a{20}")
    [out] = llm_factory(llama).generate({"prompt_token_ids": PROMPTS[0]},
                                        SamplingParams(temperature=0.0, max_tokens=3, structured_outputs=spec))
    sample = out.outputs[0]
    assert sample.finish_reason == "length" and len(sample.token_ids) == 3
    assert re.fullmatch(r"a+", sample.text) and len(sample.text) < 20


# -- date and time formats ------------------------------------------------------------------------
def test_the_date_pattern_allows_exactly_the_days_of_the_gregorian_calendar():
    """Every day string of leap, common, century and 400-year years, against ``date.fromisoformat``."""
    import datetime

    from flexpage.structured.json_formats import FORMAT_PATTERNS

    date = FORMAT_PATTERNS["date"]
    for year in (0, 1, 4, 100, 400, 1900, 2000, 2023, 2024, 2100, 9999):
        for month in range(0, 14):
            for day in range(0, 33):
                text = f"{year:04d}-{month:02d}-{day:02d}"
                try:
                    valid = datetime.date.fromisoformat(text) is not None
                except ValueError:
                    valid = False
                assert bool(re.fullmatch(date[1:-1], text)) == valid, text


@pytest.mark.parametrize(("fmt", "value", "allowed"), [
    ("date", "2024-02-29", True), ("date", "2023-02-29", False), ("date", "1900-02-29", False),
    ("date", "2000-02-29", True), ("date", "0000-01-01", False),  # llguidance alone allows all five
    ("date-time", "2023-02-29T10:00:00Z", False), ("date-time", "2024-02-29t10:00:00.5+02:00", True),
    ("time", "23:59:59.123456789Z", True), ("time", "10:00:00.1234567890Z", False),  # at most 9 fraction digits
])
def test_dates_and_times_under_a_schema_are_valid_ones(backend, tokenizer, fmt, value, allowed):
    schema = {"type": "object", "properties": {"at": {"type": "string", "format": fmt}}, "required": ["at"]}
    matcher = backend.compile(StructuredOutputsParams(json=schema)).matcher()
    ids = tokenizer.encode(json.dumps({"at": value}), add_special_tokens=False)
    assert (all(matcher.accept(t) for t in ids) and matcher.is_finished) == allowed


def test_only_string_schemas_with_those_formats_and_no_pattern_are_rewritten():
    from flexpage.structured.json_formats import FORMAT_PATTERNS, calendar_formats

    schema = {"type": "object", "properties": {
        "format": {"type": "string", "format": "date"},  # a property named "format"
        "own": {"type": "string", "format": "date", "pattern": "^2024-"},  # its own pattern wins
        "email": {"type": "string", "format": "email"},
        "data": {"const": {"format": "date"}, "enum": [{"format": "time"}]},  # data, not schemas
    }}
    out = calendar_formats(schema)
    assert out["properties"]["format"] == {"type": "string", "pattern": FORMAT_PATTERNS["date"]}
    assert out["properties"]["own"] == schema["properties"]["own"]
    assert out["properties"]["email"] == schema["properties"]["email"]
    assert out["properties"]["data"] == schema["properties"]["data"]
