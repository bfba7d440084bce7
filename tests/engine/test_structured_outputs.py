"""Grammar-constrained decoding (SamplingParams.structured_outputs) on a tiny random Llama: a
random model's output follows the grammar only because the mask makes it, so every sample must
match; constrained and free requests share batches; a preempted request keeps its grammar."""

from __future__ import annotations

import json
import re

import pytest

from qserve.engine.llm import LLM
from qserve.engine.sampling_params import SamplingParams
from qserve.engine.structured_outputs import StructuredOutputsParams
from qserve.errors import QServeError
from tests.tiny import save_tiny_llama

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["whale", "ship", "sailor"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "kind", "tags"],
    "additionalProperties": False,
}
PHONE = r"\d{3}-\d{4}"
CHOICES = ["yes", "no", "call me Ishmael"]


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    model = save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    return LLM(str(model), dtype="float32", kv_cache_memory="16MiB")


def sampled(constraint: StructuredOutputsParams, seeds: int, **kw) -> list[SamplingParams]:
    kw.setdefault("max_tokens", 120)
    return [SamplingParams(temperature=1.0, seed=s, structured_outputs=constraint, **kw)
            for s in range(seeds)]  # fmt: skip


def assert_valid(data: dict) -> None:
    assert set(data) == {"name", "age", "kind", "tags"}
    assert isinstance(data["name"], str) and len(data["name"]) <= 8
    assert isinstance(data["age"], int) and 0 <= data["age"] <= 120
    assert data["kind"] in ("whale", "ship", "sailor")
    assert all(isinstance(t, bool) for t in data["tags"]) and len(data["tags"]) <= 3


def test_json_schema_regex_and_choice_always_match(llm):
    params = sampled(StructuredOutputsParams(json=SCHEMA), 8)
    params += sampled(StructuredOutputsParams(regex=PHONE), 8)
    params += sampled(StructuredOutputsParams(choice=CHOICES), 8)
    params += [SamplingParams(temperature=1.0, seed=0, max_tokens=20)]  # unconstrained, same batch
    outputs = llm.generate(["Call me"] * len(params), params)
    texts = [o.outputs[0].text for o in outputs]
    for o in outputs[:24]:
        assert o.outputs[0].finish_reason == "stop"  # the grammar ended, not max_tokens
    for text in texts[:8]:
        assert_valid(json.loads(text))
    assert all(re.fullmatch(PHONE, t) for t in texts[8:16]), texts[8:16]
    assert all(t in CHOICES for t in texts[16:24]), texts[16:24]
    assert len(outputs[24].outputs[0].token_ids) == 20


def test_json_object(llm):
    """OpenAI's json_object: a JSON object (not any JSON value). A random model may fill one
    for long: those that end must parse, and most end within 200 tokens."""
    params = sampled(StructuredOutputsParams(json_object=True), 8, max_tokens=200)
    done = [o.outputs[0] for o in llm.generate(["{"] * 8, params)]
    done = [c for c in done if c.finish_reason == "stop"]
    assert len(done) >= 4
    for completion in done:
        assert isinstance(json.loads(completion.text), dict)


def test_a_preempted_request_keeps_its_grammar(tmp_path):
    model = save_tiny_llama(tmp_path / "tiny")
    # 2 layers x 2 KV heads x 16 dims x 4 bytes x 2 x 16 tokens = 8 KiB a block: 12 blocks
    llm = LLM(str(model), dtype="float32", kv_cache_memory=12 * 8192, max_model_len=190,
              max_num_batched_tokens=32)  # fmt: skip
    params = sampled(StructuredOutputsParams(json=SCHEMA), 6, max_tokens=100)
    outputs = llm.generate([list(range(3, 60))] * 6, params)
    assert llm.engine.scheduler.num_preemptions > 0
    for output in outputs:
        assert_valid(json.loads(output.outputs[0].text))


def test_equal_constraints_compile_once(llm):
    manager = llm.engine.structured_outputs
    a = manager.compile(StructuredOutputsParams(json=dict(SCHEMA)))
    assert manager.compile(StructuredOutputsParams(json=dict(SCHEMA))) is a


@pytest.mark.parametrize(
    "constraint, message",
    [
        (StructuredOutputsParams(regex="(a"), "invalid regex"),
        (StructuredOutputsParams(json={"type": "bogus"}), "invalid json"),
        (StructuredOutputsParams(json="{not json"), "invalid json"),
        (StructuredOutputsParams(grammar="root ::= missing_rule"), "invalid grammar"),
    ],
    ids=["regex", "schema-type", "schema-text", "grammar"],
)
def test_refused_constraints_are_one_line_errors(llm, constraint, message):
    with pytest.raises(QServeError, match=message) as info:
        llm.generate(["x"], SamplingParams(structured_outputs=constraint))
    assert info.value.param == "structured_outputs" and "\n" not in str(info.value)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"regex": "a", "choice": ["a"]}, {"choice": []}, {"choice": ["a", ""]}],
    ids=["none", "two", "empty-choice", "empty-string"],
)
def test_params_take_exactly_one_constraint(kwargs):
    with pytest.raises(QServeError) as info:
        StructuredOutputsParams(**kwargs)
    assert info.value.param == "structured_outputs"
