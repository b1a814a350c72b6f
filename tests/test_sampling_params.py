import dataclasses

import pytest

from flexpage.errors import InvalidParameter
from flexpage.sampling_params import MAX_LOGPROBS, SamplingParams


def test_defaults():
    p = SamplingParams()
    assert p.n == 1
    assert p.temperature == 1.0
    assert p.top_p == 1.0
    assert p.top_k == 0
    assert p.min_p == 0.0
    assert p.presence_penalty == 0.0
    assert p.frequency_penalty == 0.0
    assert p.repetition_penalty == 1.0
    assert p.seed is None
    assert p.stop == []
    assert p.stop_token_ids == []
    assert p.max_tokens == 16
    assert p.min_tokens == 0
    assert p.ignore_eos is False
    assert p.logprobs is None
    assert p.skip_special_tokens is True
    assert not p.is_greedy


def test_greedy():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=1e-4).is_greedy
    g = SamplingParams.greedy(max_tokens=3)
    assert g.is_greedy and g.max_tokens == 3


def test_normalisation():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=["a"]).stop == ["a"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert isinstance(SamplingParams(temperature=1).temperature, float)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(top_k=-1),
        dict(top_k=0),
        dict(top_k=50),
        dict(top_p=1.0),
        dict(top_p=1e-6),
        dict(min_p=0.0),
        dict(min_p=1.0),
        dict(presence_penalty=-2.0, frequency_penalty=2.0),
        dict(repetition_penalty=1e-3),
        dict(seed=0),
        dict(seed=-5),
        dict(seed=2**70),
        dict(max_tokens=None),
        dict(max_tokens=1),
        dict(min_tokens=16, max_tokens=16),
        dict(min_tokens=100, max_tokens=None),
        dict(logprobs=0),
        dict(logprobs=MAX_LOGPROBS),
        dict(ignore_eos=True, skip_special_tokens=False),
        dict(n=4, temperature=0),
    ],
)
def test_valid(kwargs):
    p = SamplingParams(**kwargs)
    for k, v in kwargs.items():
        assert getattr(p, k) == v


@pytest.mark.parametrize(
    "field,value,extra",
    [
        ("n", 0, {}),
        ("n", -1, {}),
        ("n", 1.5, {}),
        ("temperature", -0.1, {}),
        ("temperature", float("nan"), {}),
        ("temperature", float("inf"), {}),
        ("temperature", "1", {}),
        ("top_p", 0.0, {}),
        ("top_p", -0.5, {}),
        ("top_p", 1.01, {}),
        ("top_k", -2, {}),
        ("top_k", 1.0, {}),
        ("top_k", 2**63, {}),  # ints reach int64 tensors: a larger one failed the whole engine step
        ("stop_token_ids", [2**63], {}),
        ("min_tokens", -(2**63) - 1, {}),
        ("min_p", -0.01, {}),
        ("min_p", 1.01, {}),
        ("presence_penalty", 2.01, {}),
        ("presence_penalty", -2.01, {}),
        ("frequency_penalty", 3.0, {}),
        ("frequency_penalty", -2.5, {}),
        ("repetition_penalty", 0.0, {}),
        ("repetition_penalty", -1.0, {}),
        ("seed", 1.5, {}),
        ("seed", "42", {}),
        ("seed", True, {}),
        ("stop", 5, {}),
        ("stop", ["ok", 5], {}),
        ("stop", [""], {}),
        ("stop", {"a"}, {}),
        ("stop_token_ids", [1, "2"], {}),
        ("stop_token_ids", [1.0], {}),
        ("stop_token_ids", 7, {}),
        ("stop_token_ids", [-1], {}),
        ("max_tokens", 0, {}),
        ("max_tokens", -3, {}),
        ("max_tokens", 2.0, {}),
        ("min_tokens", -1, {}),
        ("min_tokens", 17, {}),  # > default max_tokens=16
        ("min_tokens", 5, {"max_tokens": 4}),
        ("logprobs", -1, {}),
        ("logprobs", MAX_LOGPROBS + 1, {}),
        ("logprobs", 1.0, {}),
        ("ignore_eos", 1, {}),
        ("skip_special_tokens", None, {}),
    ],
)
def test_invalid_raises_naming_field(field, value, extra):
    """The error names the field twice: in its message, and as ``param`` (what the server
    reports as the OpenAI error's ``param``, taken from where the check is made)."""
    with pytest.raises(InvalidParameter) as exc:
        SamplingParams(**{field: value}, **extra)
    msg = str(exc.value)
    assert exc.value.param == field and field in msg
    assert repr(value) in msg or str(value) in msg


def test_replace_revalidates():
    p = SamplingParams(temperature=0.5)
    with pytest.raises(ValueError, match="temperature"):
        dataclasses.replace(p, temperature=-1.0)
