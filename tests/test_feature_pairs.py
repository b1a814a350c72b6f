"""Every pair of engine features, generated from :mod:`flexpage.features`' table.

* Refused pairs (``INCOMPATIBLE``): ``EngineConfig`` with both raises ``UnsupportedCombination``
  naming both settings (no engine is built); where one side is a request's ``kv_budget``,
  ``check_request`` refuses it the same way.
* Working pairs (every other pair of features of different options, fallbacks included): each
  runs in a tiny engine (fp32, 2-layer Llama with 4 KV heads, or the tiny Q4_1 GGUF) on a
  workload that preempts (10 usable blocks of 16 tokens for 6 prompts of 16 new tokens), chunks
  prompts (16 tokens a step) and comes back to cached prefixes; greedy tokens must equal HF
  transformers' (``generate``-equivalent argmax, fp32) on the same weights (int8: the
  quantised weights; an int8 KV cache: HF's attention over K/V rounded with the engine's
  calibrated scales, ``round_kv_as_int8``). Each feature's own effect is asserted too (preemptions, spilled
  blocks, evicted blocks, blocks computed from, the compiled step run ...), so a pair
  cannot pass with one side silently off; a fallback pair asserts the fallback.
* Structured outputs (a request option with no refused pair) run in every engine: a third
  round of requests under a JSON schema must give the tokens of a second implementation (HF's
  argmax under llguidance's mask, ``hf_constrained_greedy``).
* Prompt logprobs (a request option with no refused pair) run in every engine: one prompt's
  must equal HF's log-softmax of the same forward (1e-4).
* Beam search is a request's feature (``REQUEST_FEATURES``: no engine option turns it on): it
  takes part in the covers like the others, and an engine whose cover holds it runs two beam
  searches at once after the rounds, which must give HF ``generate(num_beams=2)``'s beams;
  its refused pairs are refused by ``check_request``.
* Under a KV budget that evicts (the 60-token prompt against 64 tokens), HF's full-context
  tokens are not the answer: that request must equal the same model's budget-only engine,
  which ``test_kv_budget.py`` checks against HF's forward over the kept tokens.

Pairs are covered by few engines: a greedy cover puts as many mutually working features in one
engine as fit (every pair it holds is covered; see ``cover``), so about a dozen engines
check ~70 pairs. ``FLEXPAGE_FEATURE_PAIRS=each`` runs one engine per pair instead (to find
which pair of a failing cover is at fault). Engines default to eager: ``compiled`` is a
feature of its own, and compiled covers share the step programs Inductor compiled for the
same shapes.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import pathlib

import pytest
import torch

from engine_models import hf_constrained_greedy, hf_greedy, load_reference, random_prompts
from engine_models import hf_beams, round_kv_as_int8
from flexpage import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams
from flexpage.config import EngineConfig
from flexpage.features import (FALLBACKS, FEATURES, INCOMPATIBLE, REQUEST_FEATURES, UnsupportedCombination,
                               active_features, check_request, refusal)

NAMES = [feature.name for feature in FEATURES]
OPTION = {feature.name: feature.option for feature in FEATURES}
SETTING = {feature.name: feature.setting for feature in FEATURES}
BLOCK = 16
BUDGET = 4 * BLOCK

#: engine settings that turn each feature on (``None``: a fresh disk-tier directory; ``gguf``:
#: the model is the tiny GGUF)
SETTINGS: dict[str, dict] = {
    "virtual": dict(kv_layout="virtual"),
    "kv_budget": dict(kv_budget_tokens=BUDGET),
    "host_tier": dict(host_kv_bytes="1MiB"),
    "disk_tier": dict(host_kv_bytes=f"{2 * 16}KiB", disk_kv_dir=None, disk_kv_bytes="1MiB"),
    "tensor_parallel": dict(tensor_parallel_size=2),
    "deterministic": dict(deterministic=True),
    "gguf": dict(),  # the model: the tiny Q4_1 GGUF
    "int8": dict(quantization="int8"),
    "int8_kv": dict(kv_cache_dtype="int8"),
    "compiled": dict(compile=True),
    "eager": dict(compile=False),
    "no_chunked_prefill": dict(enable_chunked_prefill=False),
    "no_prefix_caching": dict(enable_prefix_caching=False),
    "swap_preemption": dict(preemption_mode="swap", swap_space="1MiB"),
    "transformers_impl": dict(model_impl="transformers"),
    # prompt lookup from 1-grams, at any batch size: proposals in every step where blocks allow them
    "speculative": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
                                            "prompt_lookup_max": 2, "disable_by_batch_size": 64}),
    "speculative_tree": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                 "prompt_lookup_min": 1, "prompt_lookup_max": 2, "max_branches": 3,
                                                 "disable_by_batch_size": 64}),
    "beam_search": dict(),  # a request's: see BEAMS
}
BASE = dict(dtype="float32", compile=False, num_blocks=11, block_size=BLOCK, max_num_batched_tokens=16,
            max_model_len=128, max_num_seqs=8)

ROUND_1 = random_prompts((5, 17, 33, 60, 9, 24), seed=7)
# cached prefixes (or tiers'); the second ends with a token that occurred twice before, followed
# differently each time: prompt lookup proposes two branches whatever the model writes
ROUND_2 = [ROUND_1[2] + [11, 12, 13], ROUND_1[5][:16] + [5, 6, 7, 5, 8, 5]]
NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
EVICTING = [3]  # ROUND_1 indices whose context outgrows BUDGET
ROUND_3 = [ROUND_1[0] + [21, 22], ROUND_1[4]]  # under a JSON schema
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["a", "bc"]}},
          "required": ["ok", "kind"], "additionalProperties": False}
CONSTRAINED = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                             structured_outputs=StructuredOutputsParams(json=SCHEMA))
BEAM_PROMPTS = [ROUND_1[1], ROUND_1[4]]  # two groups at once, in the pool that preempts
BEAMS = BeamSearchParams(beam_width=2, max_tokens=NEW_TOKENS)
SCORED = ROUND_1[3]  # its prompt's logprobs (60 tokens: four chunks, evicted from under a budget after)


def test_the_table_names_only_features_and_pairs_of_different_options():
    assert set(SETTINGS) == set(NAMES)
    for pair in INCOMPATIBLE:
        a, b = sorted(pair)
        assert a in OPTION and b in OPTION and OPTION[a] != OPTION[b], pair
    for a, b in FALLBACKS:
        assert OPTION[a] != OPTION[b] and refusal(a, b) is None, (a, b)
    with pytest.raises(KeyError, match="feature: got 'beams'"):
        refusal("beams", "virtual")
    assert REQUEST_FEATURES <= set(NAMES)


def _compatible(a: str, b: str) -> bool:
    return OPTION[a] != OPTION[b] and refusal(a, b) is None


def _config(names, model: str = "/unused", disk_dir: str = "/unused-disk", compile: bool = False) -> dict:
    config = {**BASE, "model": model, "compile": compile}
    for name in names:
        config.update(SETTINGS[name])
    if config.get("disk_kv_dir", 0) is None:
        config["disk_kv_dir"] = disk_dir
    if "gguf" in names and not str(model).endswith(".gguf"):
        config["model"] = "/unused/tiny.gguf"  # never loaded: EngineConfig only reads the name
    return config


class _Unchecked:
    """A config's settings as attributes, without ``EngineConfig``'s checks (which refuse)."""

    def __init__(self, config: dict) -> None:
        self.__dict__.update({f.name: f.default for f in dataclasses.fields(EngineConfig)}, **config)


# ---- refused pairs ---------------------------------------------------------------------

REFUSED = sorted(tuple(sorted(pair, key=NAMES.index)) for pair in INCOMPATIBLE)


@pytest.mark.parametrize("pair", REFUSED, ids="+".join)
def test_a_refused_pair_raises_one_error_naming_both(pair):
    requested = REQUEST_FEATURES.intersection(pair)
    if requested:  # a request's feature on an engine built with the other
        other = pair[1 - pair.index(min(requested))]
        engine = EngineConfig(**_config([other], compile=other != "eager" or None))
        with pytest.raises(UnsupportedCombination) as raised:
            check_request(engine, *requested)
        assert raised.value.features == pair and raised.value.reason == INCOMPATIBLE[frozenset(pair)]
        assert str(raised.value).startswith(f"{SETTING[pair[0]]} cannot be combined with {SETTING[pair[1]]}: ")
        return
    config = _config(pair, compile="eager" not in pair)  # not eager unless asked: deterministic refuses it
    assert active_features(_Unchecked(config)) == set(pair) | (
        set() if "eager" in pair else {"compiled"})
    with pytest.raises(UnsupportedCombination) as raised:
        EngineConfig(**config)
    assert raised.value.features == pair
    assert str(raised.value).startswith(f"{SETTING[pair[0]]} cannot be combined with {SETTING[pair[1]]}: ")
    assert raised.value.reason == INCOMPATIBLE[frozenset(pair)]
    if "kv_budget" in pair:  # a request's kv_budget on an engine with the other
        other = pair[1 - pair.index("kv_budget")]
        engine = EngineConfig(**_config([other], compile=other != "eager" or None))
        with pytest.raises(UnsupportedCombination, match="cannot be combined") as raised:
            check_request(engine, "kv_budget")
        assert set(raised.value.features) == set(pair)


def test_a_request_budget_on_a_plain_engine_passes():
    check_request(EngineConfig(**_config([])), "kv_budget")


# ---- working pairs ---------------------------------------------------------------------

WORKING = [(a, b) for a, b in itertools.combinations(NAMES, 2) if _compatible(a, b)]


def _fits(a: str, b: str) -> bool:
    """``a`` and ``b`` may share a cover: they work together, and neither makes the other step
    aside (a fallback pair runs alone: beside it, the fallen-back feature's pairs would pass
    without it acting)."""
    return _compatible(a, b) and (a, b) not in FALLBACKS and (b, a) not in FALLBACKS


def cover(pairs: list[tuple[str, str]]) -> list[tuple[str, ...]]:
    """Feature sets, each mutually working (one value per option), that hold every pair of
    ``pairs``: greedily, from the first uncovered pair, add the feature fitting all chosen
    (:func:`_fits`) that covers most uncovered pairs. Every set runs eager unless it holds
    ``compiled`` (or needs it: deterministic)."""
    uncovered = set(pairs)
    sets = []
    while uncovered:
        chosen = list(min(uncovered, key=lambda p: (NAMES.index(p[0]), NAMES.index(p[1]))))
        while True:
            gains = {}
            for name in NAMES:
                if name not in chosen and all(_fits(name, c) for c in chosen):
                    gains[name] = sum(tuple(sorted((name, c), key=NAMES.index)) in uncovered for c in chosen)
            best = max(gains.items(), key=lambda item: item[1], default=(None, 0))
            if best[1] == 0:
                break
            chosen.append(best[0])
        if "compiled" not in chosen and "eager" not in chosen:
            chosen.append("eager" if all(_compatible("eager", c) for c in chosen) else "compiled")
        chosen.sort(key=NAMES.index)
        uncovered -= {tuple(sorted(p, key=NAMES.index)) for p in itertools.combinations(chosen, 2)}
        sets.append(tuple(chosen))
    return sets


COVERS = [pair for pair in WORKING] if os.environ.get("FLEXPAGE_FEATURE_PAIRS") == "each" else cover(WORKING)


def test_the_covers_hold_every_working_pair():
    held = {tuple(sorted(p, key=NAMES.index)) for names in COVERS for p in itertools.combinations(names, 2)}
    assert set(WORKING) <= held
    for names in COVERS:
        assert all(_compatible(a, b) for a, b in itertools.combinations(names, 2)), names


@pytest.fixture(scope="module")
def models(tiny_model, tmp_path_factory):
    """``{"llama": folder, "gguf": file, "gguf_folder": its HF conversion}``."""
    from gguf_models import write_tiny_gguf

    from flexpage.model.loader import _default_gguf_path, resolve_model_path

    gguf = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-q4_1.gguf", _default_gguf_path())
    return {"llama": tiny_model("llama", num_key_value_heads=4), "gguf": gguf, "gguf_folder": resolve_model_path(gguf)}


@pytest.fixture(scope="module")
def reference(models):
    """``reference(weights, kv_scales)``: HF's model of those weights (``"llama"``, ``"int8"``,
    ``"gguf"``); with ``kv_scales`` (an int8 KV cache's), its K/V rounded as the cache rounds them."""
    from flexpage.model.int8_weights import int8_blocks

    def get(weights: str, kv_scales: torch.Tensor | None = None):
        model = load_reference(models["gguf_folder" if weights == "gguf" else "llama"])
        if weights == "int8":
            int8_blocks(model)
        return model if kv_scales is None else round_kv_as_int8(model, kv_scales)

    return get


class _ByReference:
    """Reference results cached by (weights, int8 KV cache or not); the scales of every engine
    with an int8 cache over the same weights must be the same (calibration is deterministic)."""

    def __init__(self, compute) -> None:
        self.compute = compute
        self.cache: dict[tuple[str, bool], object] = {}
        self.scales: dict[str, torch.Tensor] = {}

    def __call__(self, weights: str, kv_scales: torch.Tensor | None = None):
        if kv_scales is not None:
            assert torch.equal(self.scales.setdefault(weights, kv_scales.clone()), kv_scales)
        key = (weights, kv_scales is not None)
        if key not in self.cache:
            self.cache[key] = self.compute(weights, kv_scales)
        return self.cache[key]


@pytest.fixture(scope="module")
def expected(reference, default_model_path):
    """HF's greedy tokens for ROUND_1 + ROUND_2 (then ROUND_3's under SCHEMA)."""
    from flexpage.model.loader import load_tokenizer

    tokenizer = load_tokenizer(default_model_path)

    def compute(weights: str, kv_scales: torch.Tensor | None) -> list[list[int]]:
        model = reference(weights, kv_scales)
        return [hf_greedy(model, p, NEW_TOKENS, stop_at_eos=False) for p in ROUND_1 + ROUND_2] + [
            hf_constrained_greedy(model, tokenizer, p, SCHEMA, NEW_TOKENS) for p in ROUND_3]

    return _ByReference(compute)


@pytest.fixture(scope="module")
def expected_prompt_logprobs(reference):
    """HF's log-probability of each token of SCORED after the ones before it."""

    def compute(weights: str, kv_scales: torch.Tensor | None) -> list[float]:
        with torch.no_grad():
            logprobs = reference(weights, kv_scales)(torch.tensor([SCORED])).logits[0].float().log_softmax(-1)
        return [logprobs[i, token].item() for i, token in enumerate(SCORED[1:])]

    return _ByReference(compute)


@pytest.fixture(scope="module")
def expected_beams(reference):
    """HF's beams (best first, ``(tokens, score)``) for BEAM_PROMPTS under BEAMS."""

    def compute(weights: str, kv_scales: torch.Tensor | None) -> list[list[tuple[list[int], float]]]:
        model = reference(weights, kv_scales)
        return [hf_beams(model, p, BEAMS.beam_width, BEAMS.max_tokens) for p in BEAM_PROMPTS]

    return _ByReference(compute)


def _run(llm: LLM) -> tuple[list[list[int]], list]:
    first = llm.generate([{"prompt_token_ids": p} for p in ROUND_1], GREEDY)
    second = llm.generate([{"prompt_token_ids": p} for p in ROUND_2], GREEDY)
    third = llm.generate([{"prompt_token_ids": p} for p in ROUND_3], CONSTRAINED)
    return [o.outputs[0].token_ids for o in first + second + third], first + second + third


@pytest.fixture(scope="module")
def budget_only(models):
    """The tokens of a budget-only engine (per weights) for the requests the budget evicts from."""
    cache: dict[tuple[str, bool], list[list[int]]] = {}

    def get(weights: str, int8_kv: bool) -> list[list[int]]:
        if (weights, int8_kv) not in cache:
            names = ["kv_budget"] + ([weights] if weights != "llama" else []) + (["int8_kv"] if int8_kv else [])
            config = _config(names, str(models["gguf" if weights == "gguf" else "llama"]))
            cache[weights, int8_kv] = _run(LLM(**config))[0]
        return cache[weights, int8_kv]

    return get


def _close(llm: LLM) -> None:
    llm.engine.close()
    group = getattr(llm.engine.executor, "group", None)  # tensor parallel
    if group is not None:
        assert [w.returncode for w in group.workers] == [0] * len(group.workers)


@pytest.mark.usefixtures("single_torch_thread", "compile_budget")
@pytest.mark.parametrize("names", COVERS, ids="+".join)
def test_working_features_together_give_hf_greedy_tokens(names, models, expected, expected_beams,
                                                         expected_prompt_logprobs, budget_only, tmp_path):
    weights = "gguf" if "gguf" in names else "int8" if "int8" in names else "llama"
    config = _config(names, str(models["gguf" if weights == "gguf" else "llama"]), str(tmp_path / "disk"))
    assert active_features(EngineConfig(**config)) == set(names) - REQUEST_FEATURES
    llm = LLM(**config)
    try:
        engine = llm.engine
        # an int8 KV cache: the references round K/V with the engine's calibrated scales
        kv_scales = engine.runner.pool.scales if "int8_kv" in names else None
        tokens, outputs = _run(llm)
        want = list(expected(weights, kv_scales))
        if "kv_budget" in names:
            for i in EVICTING:
                assert outputs[i].metrics.evicted_blocks > 0
                want[i] = budget_only(weights, kv_scales is not None)[i]
        assert tokens == want
        scored = llm.generate([{"prompt_token_ids": SCORED}], SamplingParams(temperature=0.0, max_tokens=2,
                                                                             prompt_logprobs=0))[0]
        assert [entry[token].logprob for token, entry in zip(SCORED[1:], scored.prompt_logprobs[1:])] == \
            pytest.approx(expected_prompt_logprobs(weights, kv_scales), abs=1e-4)
        if "beam_search" in names:
            beams = llm.beam_search([{"prompt_token_ids": p} for p in BEAM_PROMPTS], BEAMS)
            for out, hf in zip(beams, expected_beams(weights, kv_scales)):
                assert [beam.output_token_ids for beam in out.sequences] == [tokens for tokens, _ in hf]
                assert [beam.score for beam in out.sequences] == pytest.approx([score for _, score in hf], abs=1e-4)
        stats, runner = engine.stats(), engine.runner
        assert engine.block_manager.stats().used == 0 and not engine.requests
        print(names, {k: stats[k] for k in ("preemptions", "prefix_cache_hits", "kv_spilled_tokens")})
        assert stats["preemptions"] > 0  # 10 usable blocks for 6 prompts: swap or recompute acted
        if "virtual" not in names and "no_prefix_caching" not in names:
            assert stats["prefix_cache_hits"] > 0  # ROUND_2 comes back to ROUND_1's prefixes
        if "virtual" in names:
            assert runner.pool.layout == "virtual" and stats["prefix_cache_hits"] == 0
        if "host_tier" in names or "disk_tier" in names:
            assert stats["kv_spilled_tokens"] > 0
        if "tensor_parallel" in names:
            assert len(engine.executor.group.workers) == 1
        else:
            compact = runner.compact
            from_blocks = compact is not None and compact.lm_head.blocks is not None
            fallback = any((weights, other) in FALLBACKS for other in names)
            assert from_blocks == (weights != "llama" and not fallback)
            if "compiled" in names and compact is not None:
                assert runner.compiled_step is not None and runner.compiled_step.steps_run > 0
        if "deterministic" in names:
            assert runner.deterministic
        if "int8_kv" in names:
            assert runner.pool.dtype == torch.int8 and runner.host.dtype == torch.int8
        if "speculative" in names or "speculative_tree" in names:
            assert stats["spec_decode_num_accepted_tokens"] > 0  # proposals were verified and accepted
        if "speculative_tree" in names:
            assert stats["spec_decode_num_tree_drafts"] > 0  # several branches were verified at once
    finally:
        _close(llm)
