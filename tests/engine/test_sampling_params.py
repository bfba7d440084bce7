import dataclasses

import pytest

from qserve.engine.sampling_params import SamplingParams, SamplingType
from qserve.errors import QServeError


def test_defaults_match_vllm():
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.min_p) == (
        1,
        1.0,
        1.0,
        0,
        0.0,
    )
    assert params.seed is None
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (
        0.0,
        0.0,
        1.0,
    )
    assert params.stop == [] and params.stop_token_ids == []
    assert (params.max_tokens, params.min_tokens, params.logprobs) == (16, 0, None)
    assert params.ignore_eos is False
    assert params.skip_special_tokens is True
    assert params.include_stop_str_in_output is False


def test_stop_is_normalised_to_a_list():
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop=["a", "bc"]).stop == ["a", "bc"]
    assert SamplingParams(stop=("x",)).stop == ["x"]


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("n", 1.5),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", -2),
        ("top_k", 2.0),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", True),
        ("seed", 1.5),
        ("stop", ["ok", ""]),
        ("stop", [3]),
        ("stop_token_ids", [-1]),
    ],
)
def test_invalid_values_raise_with_param(field, value):
    with pytest.raises(QServeError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", 0.0),
        ("temperature", 5.0),
        ("top_p", 1.0),
        ("top_p", 1e-9),
        ("top_k", -1),
        ("top_k", 1),
        ("min_p", 1.0),
        ("presence_penalty", -2.0),
        ("frequency_penalty", 2.0),
        ("repetition_penalty", 0.01),
        ("max_tokens", None),
        ("max_tokens", 1),
        ("logprobs", 0),
        ("logprobs", 20),
        ("seed", 0),
        ("seed", -5),
        ("temperature", 1),  # an int where a float is expected is fine
    ],
)
def test_edge_values_are_accepted(field, value):
    assert getattr(SamplingParams(**{field: value}), field) == value


def test_min_tokens_above_max_tokens_raises():
    with pytest.raises(QServeError) as info:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert info.value.param == "min_tokens"
    assert SamplingParams(max_tokens=None, min_tokens=500).min_tokens == 500


def test_sampling_type():
    assert SamplingParams(temperature=0.0).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=1e-6, seed=3).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=1e-5).sampling_type == SamplingType.RANDOM
    assert SamplingParams(temperature=0.7, seed=3).sampling_type == SamplingType.RANDOM_SEED


def test_all_stop_token_ids_and_stop_buffer_length():
    params = SamplingParams(stop=["\n\n", "END"], stop_token_ids=[7, 9, 7])
    assert params.all_stop_token_ids == {7, 9}
    assert params.stop_buffer_length == 2
    assert SamplingParams(stop=["END"], include_stop_str_in_output=True).stop_buffer_length == 0
    assert SamplingParams().stop_buffer_length == 0


def test_child_params_offset_the_seed():
    params = SamplingParams(n=3, seed=100, temperature=0.8, stop="x")
    children = [params.child_params(i) for i in range(3)]
    assert [c.seed for c in children] == [100, 101, 102]
    assert all(c.n == 1 and c.temperature == 0.8 and c.stop == ["x"] for c in children)
    unseeded = SamplingParams(n=2)
    assert unseeded.child_params(1).seed is None
    with pytest.raises(ValueError):
        params.child_params(3)


def test_params_are_frozen_and_replace_checks_again():
    params = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.5
    assert dataclasses.replace(params, top_k=5).top_k == 5
    with pytest.raises(QServeError) as info:
        dataclasses.replace(params, top_p=2.0)
    assert info.value.param == "top_p"
