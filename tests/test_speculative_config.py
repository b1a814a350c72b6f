"""``SpeculativeConfig.from_dict`` reads vLLM's ``speculative_config`` dictionary: the same
defaults, and a ``ValueError`` that names the key for anything it cannot run."""

from __future__ import annotations

import pytest

from flexpage.speculative.config import SpeculativeConfig


def test_ngram_config_as_vllm_writes_it():
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 6,
                                       "prompt_lookup_min": 2})
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == ("ngram", 4, 2, 6)
    assert cfg.max_branches == 1 and cfg.model is None


@pytest.mark.parametrize("given, low, high", [
    ({}, 5, 5),  # vLLM's defaults when neither is given
    ({"prompt_lookup_max": 3}, 3, 3),  # one given alone sets the other
    ({"prompt_lookup_min": 7}, 7, 7),
])
def test_ngram_lookup_defaults_follow_vllm(given: dict, low: int, high: int):
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, **given})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (low, high)


def test_older_spellings_of_the_ngram_method():
    for spec in ({"method": "[ngram]", "num_speculative_tokens": 2}, {"model": "ngram", "num_speculative_tokens": 2}):
        assert SpeculativeConfig.from_dict(spec).method == "ngram"


def test_draft_model_config_and_implied_method():
    spelled = SpeculativeConfig.from_dict({"method": "draft_model", "model": "/m/tiny", "num_speculative_tokens": 5})
    implied = SpeculativeConfig.from_dict({"model": "/m/tiny", "num_speculative_tokens": 5})
    assert spelled == implied == SpeculativeConfig("draft_model", 5, model="/m/tiny")


def test_ngram_branches_extension():
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "max_branches": 3})
    assert cfg.max_branches == 3


def test_json_text_as_the_command_line_flag_gives_it():
    assert SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}') \
        == SpeculativeConfig("ngram", 4, prompt_lookup_min=3, prompt_lookup_max=3)
    with pytest.raises(ValueError, match=r"speculative_config: not valid JSON"):
        SpeculativeConfig.from_json("{method: ngram}")


@pytest.mark.parametrize("spec, message", [
    ({"method": "eagle", "num_speculative_tokens": 2},
     r"method: got 'eagle', expected one of \('ngram', 'draft_model'\)"),
    ({"num_speculative_tokens": 2}, r"method: missing"),
    ({"method": "ngram"}, r"num_speculative_tokens: missing"),
    ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens: got 0, expected an int >= 1"),
    ({"method": "ngram", "num_speculative_tokens": True}, r"num_speculative_tokens: got True"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, r"num_speculative_tokens: got 2.5"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     r"prompt_lookup_min: got 4, expected <= prompt_lookup_max=2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, r"prompt_lookup_min: got 0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "max_branches": 0}, r"max_branches: got 0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_mx": 3},
     r"prompt_lookup_mx: unknown key for method 'ngram'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "/m/tiny"}, r"model: unknown key for method 'ngram'"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, r"model: got None, expected the draft model's path"),
    ({"method": "draft_model", "model": "/m/tiny", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
     r"prompt_lookup_max: unknown key for method 'draft_model'"),
])
def test_bad_configs_name_the_key(spec: dict, message: str):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(spec)


def test_not_a_dict():
    with pytest.raises(ValueError, match=r"speculative_config: got list, expected a dict"):
        SpeculativeConfig.from_dict([("method", "ngram")])  # type: ignore[arg-type]


def test_direct_construction_checks_too():
    with pytest.raises(ValueError, match=r"prompt_lookup_min: applies to method 'ngram' only"):
        SpeculativeConfig("draft_model", 2, prompt_lookup_min=2, model="/m/tiny")
    with pytest.raises(ValueError, match=r"model: got '/m/tiny', but method 'ngram' uses no model"):
        SpeculativeConfig("ngram", 2, prompt_lookup_min=2, prompt_lookup_max=2, model="/m/tiny")
