"""Which engine options combine: one table, one check, one error.

Every option of :class:`~flexpage.config.EngineConfig` that changes *how* the engine runs is
named here as one or more :class:`Feature` s: one per value worth naming (``kv_layout='virtual'``,
``compile=False`` ...), at most one active per option. For every pair of features of different
options exactly one of these holds:

* the pair is in :data:`INCOMPATIBLE`: :func:`check_combination` (called by
  ``EngineConfig.__post_init__``) raises :class:`UnsupportedCombination`, naming both and why;
* the pair is in :data:`FALLBACKS`: it works, but the first feature steps aside (the engine
  runs as if it were off) for the reason given;
* otherwise it works: greedy tokens equal HF transformers' on a tiny fp32 model.

``tests/test_feature_pairs.py`` generates configurations from this table and checks all three,
for every pair. How each state was established:

* refused pairs: the exclusions that were hand-written in ``EngineConfig``, ``ModelRunner``
  (``check_parallel_supported``, the virtual-layout check of deterministic mode), the
  attention kernel options (deterministic needs the tuned template that ``compile`` installs)
  and ``LLMEngine._kv_budget``, moved here with their reasons; plus
  ``tensor_parallel``/``transformers_impl``, which ``ModelRunner`` refused only once the
  ranks had started;
* fallbacks: ``ModelRunner._block_kernel_missing`` (a GGUF's blocks need the compact forward
  in one process, not deterministic), confirmed by the test (no projection keeps blocks);
* working pairs: by the test's engines (greedy tokens equal HF's, each feature's own counter
  showing it acted: preemptions, swaps, prefix hits, tier spills, evicted blocks).

Options are the engine's, not a request's, except where a request adds one: a request's
``SamplingParams.kv_budget`` is the ``kv_budget`` feature; :func:`check_request` checks it
against the engine's, and a beam search request is the ``beam_search`` feature
(:data:`REQUEST_FEATURES`: no engine option turns it on). Model- and machine-dependent limits (a model without a compact
forward, a CPU without the block kernel, head counts a rank count does not divide) are not
pairs of options; they stay where the model is known (``ModelRunner``, ``shard_llama``).

To add an option (speculative decoding, grammars, beams ...): add its :class:`Feature` (s) to
:data:`FEATURES`, its refused pairs to :data:`INCOMPATIBLE`, and its engine settings to the
test's ``SETTINGS``; the test then covers it with every other feature.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Iterable

__all__ = ["FEATURES", "FALLBACKS", "INCOMPATIBLE", "REQUEST_FEATURES", "Feature", "UnsupportedCombination",
           "active_features", "check_combination", "check_features", "check_request", "refusal"]


@dataclass(frozen=True)
class Feature:
    """One value of one engine option. ``option``: the option it is a value of (two features
    of one option are never active together); ``setting``: how a user asks for it, as the
    error message names it; ``active``: whether an ``EngineConfig`` asks for it."""

    name: str
    option: str
    setting: str
    active: Callable[[Any], bool]


def _size(value: Any) -> int:
    from flexpage.config import parse_size

    return parse_size(value)


def _gguf_model(config: Any) -> bool:
    """Computing projections from a GGUF's blocks is asked for: ``quantization='auto'`` on a
    ``.gguf`` file or the default model (converted from its packaged GGUF). A folder converted
    from a GGUF is found only at load time; the same fallbacks apply there."""
    return config.quantization == "auto" and (config.model is None or str(config.model).lower().endswith(".gguf"))


def _max_branches(config: Any) -> int:
    """Continuations speculative decoding verifies per sequence (0: no speculative decoding);
    the config may still hold the dict a user gave."""
    spec = config.speculative_config
    if spec is None:
        return 0
    return spec.get("max_branches", 1) if isinstance(spec, dict) else spec.max_branches


FEATURES: tuple[Feature, ...] = (
    Feature("virtual", "kv_layout", "kv_layout='virtual'", lambda c: c.kv_layout == "virtual"),
    Feature("kv_budget", "kv_budget", "kv_budget_tokens (or a request's kv_budget)",
            lambda c: c.kv_budget_tokens is not None),
    Feature("host_tier", "kv_tiers", "host_kv_bytes > 0",
            lambda c: _size(c.host_kv_bytes) > 0 and c.disk_kv_dir is None),
    Feature("disk_tier", "kv_tiers", "disk_kv_dir (behind host_kv_bytes)", lambda c: c.disk_kv_dir is not None),
    Feature("tensor_parallel", "tensor_parallel_size", "tensor_parallel_size > 1",
            lambda c: c.tensor_parallel_size > 1),
    Feature("deterministic", "deterministic", "deterministic=True", lambda c: c.deterministic is True),
    Feature("gguf", "quantization", "quantization='auto' on a GGUF model", _gguf_model),
    Feature("int8", "quantization", "quantization='int8'", lambda c: c.quantization == "int8"),
    Feature("int8_kv", "kv_cache_dtype", "kv_cache_dtype='int8'", lambda c: c.kv_cache_dtype == "int8"),
    Feature("compiled", "compile", "compile=True", lambda c: c.compile is True),
    Feature("eager", "compile", "compile=False", lambda c: c.compile is False),
    Feature("no_chunked_prefill", "enable_chunked_prefill", "enable_chunked_prefill=False",
            lambda c: c.enable_chunked_prefill is False),
    Feature("no_prefix_caching", "enable_prefix_caching", "enable_prefix_caching=False",
            lambda c: c.enable_prefix_caching is False),
    Feature("swap_preemption", "preemption_mode", "preemption_mode='swap'", lambda c: c.preemption_mode == "swap"),
    Feature("transformers_impl", "model_impl", "model_impl='transformers'",
            lambda c: c.model_impl == "transformers"),
    Feature("speculative", "speculative_config", "speculative_config", lambda c: _max_branches(c) == 1),
    Feature("speculative_tree", "speculative_config", "speculative_config with max_branches > 1",
            lambda c: _max_branches(c) > 1),
    # a request's only (no engine option turns it on): check_request names it
    Feature("beam_search", "beam_search", "beam search (LLM.beam_search, use_beam_search)", lambda c: False),
    # Structured outputs (a request's grammar) are no feature here: they refuse no option,
    # and tests/test_feature_pairs.py runs them in every engine
)
#: features a request asks for, never an engine's configuration
REQUEST_FEATURES = frozenset({"beam_search"})
_BY_NAME = {feature.name: feature for feature in FEATURES}
_ORDER = {feature.name: i for i, feature in enumerate(FEATURES)}


def _pairs(reasons: dict[tuple[str, ...], str]) -> dict[frozenset[str], str]:
    """``{(a, b, c): why}`` -> ``{frozenset({a, b}): why, frozenset({a, c}): why}``: the first
    feature against each of the others."""
    return {frozenset((first, other)): why for (first, *others), why in reasons.items() for other in others}


_TIERS_HOLD_PREFIX_BLOCKS = ("the tiers hold blocks the prefix cache gave up, and the virtual layout shares none "
                             "(its rows are one sequence's)")
_SPECULATIVE_BUDGET = ("a budget scores and evicts blocks as they fill, and a verification step fills blocks with "
                       "proposed tokens that may be rolled back")
_INT8 = "int8 projections run on the compact forward in one process, without deterministic row tiles"

#: refused pairs -> why (one reason per pair, written from the first feature's side)
INCOMPATIBLE: dict[frozenset[str], str] = _pairs({
    ("virtual", "deterministic"): "deterministic decode reads keys gathered through block tables; a virtual row "
                                  "is read in place",
    ("virtual", "kv_budget"): "evicted blocks are holes in a paged block table; a virtual row is consecutive",
    ("virtual", "host_tier", "disk_tier"): _TIERS_HOLD_PREFIX_BLOCKS,
    ("no_prefix_caching", "host_tier", "disk_tier"): "the tiers hold prefix-cache blocks",
    ("deterministic", "kv_budget"): "deterministic decode rows read gathered keys, which cannot skip evicted blocks",
    ("deterministic", "eager"): "deterministic attention needs flexpage's tuned CPU template, which compiling "
                                "installs",
    ("tensor_parallel", "deterministic"): "the all-reduce sums each projection in another order than one "
                                          "process does",
    ("tensor_parallel", "host_tier", "disk_tier"): "tier copies would need every rank's share of a block",
    ("tensor_parallel", "transformers_impl"): "ranks shard the compact forward (Llama, Mistral, Qwen2, Qwen3), "
                                              "not HF's modules",
    ("int8", "tensor_parallel", "deterministic", "transformers_impl"): _INT8,
    ("int8_kv", "tensor_parallel", "transformers_impl"): "the 8-bit cache's scales are calibrated by the compact "
                                                         "forward in one process",
    ("int8_kv", "deterministic"): "deterministic rows must compute alike over the pool and over a gathered copy; "
                                  "8-bit decode rows widen their keys in another kernel than prefill rows",
    ("int8_kv", "virtual"): "a virtual row is read in place by prefill rows too, and the 8-bit prefill kernel "
                            "over the pool is untested",
    ("speculative", "kv_budget"): _SPECULATIVE_BUDGET,
    ("speculative_tree", "kv_budget"): _SPECULATIVE_BUDGET,
    ("speculative_tree", "virtual"): "each branch shares the sequence's blocks and copies the last one; a virtual "
                                     "row shares none",
    ("beam_search", "virtual"): "beams fork at every step, and a virtual-layout fork copies its parent's blocks "
                                "into a row reserved at admission (it shares none)",
    ("beam_search", "kv_budget"): "beams are ranked by log-probabilities over their whole context, and a budget "
                                  "evicts each beam's blocks by its own scores",
})

#: pairs that work with the first feature stepping aside -> why
FALLBACKS: dict[tuple[str, str], str] = {
    ("gguf", other): "projections are computed from float32 weights expanded from the GGUF's blocks: the block "
                     "kernel needs the compact forward in one process, not deterministic"
    for other in ("deterministic", "tensor_parallel", "transformers_impl")
}


class UnsupportedCombination(ValueError):
    """Two options that do not work together. ``features``: both :class:`Feature` names, in
    table order; the message names both settings and why."""

    def __init__(self, first: str, second: str, reason: str) -> None:
        a, b = sorted((first, second), key=_ORDER.__getitem__)
        self.features = (a, b)
        self.reason = reason
        super().__init__(f"{_BY_NAME[a].setting} cannot be combined with {_BY_NAME[b].setting}: {reason}")


def refusal(first: str, second: str) -> str | None:
    """Why ``first`` and ``second`` (feature names) are refused together; None: they combine."""
    for name in (first, second):
        if name not in _BY_NAME:
            raise KeyError(f"feature: got {name!r}, expected one of {sorted(_BY_NAME)}")
    return INCOMPATIBLE.get(frozenset((first, second)))


def check_features(names: Iterable[str]) -> None:
    """Raise :class:`UnsupportedCombination` for the first refused pair among ``names`` (in
    table order)."""
    ordered = sorted(set(names), key=lambda n: _ORDER[n] if n in _ORDER else -1)
    for first, second in itertools.combinations(ordered, 2):
        reason = refusal(first, second)
        if reason is not None:
            raise UnsupportedCombination(first, second, reason)


def active_features(config: Any) -> frozenset[str]:
    """The names of the features an ``EngineConfig`` asks for."""
    return frozenset(feature.name for feature in FEATURES if feature.active(config))


def check_combination(config: Any) -> None:
    """Raise :class:`UnsupportedCombination` if two options of ``config`` are refused together."""
    check_features(active_features(config))


def check_request(config: Any, *request_features: str) -> None:
    """Raise :class:`UnsupportedCombination` if a request's own options (e.g. ``"kv_budget"``
    for ``SamplingParams.kv_budget``) cannot run on an engine built with ``config``."""
    check_features(active_features(config) | set(request_features))
