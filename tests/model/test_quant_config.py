"""Quantization schemes from config.json: what each format means, and one-line errors."""

from __future__ import annotations

import pytest

from qserve.errors import QServeError
from qserve.model.quant_config import LinearScheme, parse_quant_scheme

Q = "model.layers.0.self_attn.q_proj"
DOWN = "model.layers.1.mlp.down_proj"


def ct_config(kind: str = "int", weights: dict | None = None, acts: dict | None = None, **extra):
    group = {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": kind, "symmetric": True, "strategy": "channel"}
        | (weights or {}),
        "input_activations": {"num_bits": 8, "type": kind, "strategy": "token", "dynamic": True}
        | (acts or {}),
    }
    return {
        "quant_method": "compressed-tensors",
        "format": f"{kind}-quantized",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
    } | extra


def packed_config(weights: dict | None = None, **extra) -> dict:
    """llm-compressor's W4A16 (pack-quantized, group 128, symmetric)."""
    w = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}
    group = {"targets": ["Linear"], "weights": w | (weights or {}), "input_activations": None}
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
    } | extra


def test_compressed_tensors_pack_quantized_reads_as_gptq() -> None:
    scheme = parse_quant_scheme(packed_config())
    assert scheme.for_module(Q) == LinearScheme("gptq", bits=4, group_size=128)
    assert scheme.for_module("lm_head") is None
    channel = parse_quant_scheme(packed_config({"num_bits": 8, "strategy": "channel"}))
    assert channel.for_module(Q) == LinearScheme("gptq", bits=8, group_size=-1)
    old = parse_quant_scheme(packed_config({"actorder": "group"}))  # before compressed-tensors 0.20
    assert old.for_module(Q).desc_act


def test_gptq():
    raw = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True}
    scheme = parse_quant_scheme(raw)
    assert scheme.for_module(Q) == LinearScheme("gptq", bits=4, group_size=128, desc_act=True)
    assert scheme.for_module("lm_head") is None
    assert scheme.describe() == "gptq: gptq w4a16 g128 act-order"


def test_gptq_with_a_quantized_lm_head():
    raw = {"quant_method": "gptq", "bits": 4, "group_size": 64, "lm_head": True}
    scheme = parse_quant_scheme(raw)
    assert scheme.for_module("lm_head") == scheme.for_module("model.layers.0.mlp.up_proj")
    raw["modules_in_block_to_quantize"] = [["self_attn.q_proj"]]
    assert parse_quant_scheme(raw).for_module("lm_head") is not None


def test_gptq_modules_in_block_to_quantize_leaves_the_others_dense():
    raw = {
        "quant_method": "gptq",
        "bits": 8,
        "group_size": -1,
        "modules_in_block_to_quantize": [["self_attn.q_proj"], ["mlp.up_proj"]],
    }
    scheme = parse_quant_scheme(raw)
    assert scheme.for_module(Q) == LinearScheme("gptq", bits=8, group_size=-1)
    assert scheme.for_module(DOWN) is None


def test_awq_modules_to_not_convert_match_substrings():
    raw = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 64,
        "zero_point": True,
        "version": "GEMM",
        "modules_to_not_convert": ["down_proj"],
    }
    scheme = parse_quant_scheme(raw)
    assert scheme.for_module(Q) == LinearScheme("awq", bits=4, group_size=64)
    assert scheme.for_module(DOWN) is None


@pytest.mark.parametrize(
    ("acts", "expected"),
    [
        ({}, "token"),
        ({"strategy": "tensor", "dynamic": False}, "static"),
        ({"strategy": "tensor", "dynamic": True}, "tensor"),
    ],
)
def test_compressed_tensors_activations(acts, expected):
    scheme = parse_quant_scheme(ct_config("float", acts=acts))
    assert scheme.for_module(Q) == LinearScheme("fp8", activations=expected)


def test_compressed_tensors_weight_only_and_ignore_patterns():
    raw = ct_config("int", ignore=["lm_head", "re:.*down_proj$", "layers.0.self_attn.q_proj"])
    raw["config_groups"]["group_0"]["input_activations"] = None
    scheme = parse_quant_scheme(raw)
    assert scheme.for_module("model.layers.1.self_attn.q_proj") == LinearScheme("int8")
    assert scheme.for_module(Q) is None
    assert scheme.for_module(DOWN) is None
    assert scheme.describe() == "compressed-tensors: int8 w8a16"


def test_compressed_tensors_groups_by_target():
    raw = ct_config("int")
    raw["config_groups"]["group_0"]["targets"] = ["re:.*self_attn.*"]
    fp8 = ct_config("float")["config_groups"]["group_0"] | {"targets": ["re:.*mlp.*"]}
    raw["config_groups"]["group_1"] = fp8
    scheme = parse_quant_scheme(raw)
    assert scheme.for_module(Q).format == "int8"
    assert scheme.for_module(DOWN).format == "fp8"


def test_kv_cache_scheme_and_vllm_fp8():
    kv = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    assert parse_quant_scheme(ct_config(kv_cache_scheme=kv)).kv_cache_scheme
    scheme = parse_quant_scheme({"quant_method": "fp8", "activation_scheme": "dynamic"})
    assert scheme.for_module(Q) == LinearScheme("fp8", activations="tensor")
    assert parse_quant_scheme(None) is None


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"quant_method": "gptq", "bits": 2}, "GPTQ 2-bit is not supported"),
        (
            {"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"},
            "GPTQ checkpoint_format 'marlin' is not supported",
        ),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ version 'gemv'"),
        ({"quant_method": "awq", "bits": 4, "zero_point": False}, "AWQ without zero points"),
        ({"quant_method": "bitsandbytes"}, "quantization method 'bitsandbytes'"),
        (ct_config(format="marlin-24"), "format 'marlin-24'"),
        (ct_config(format="pack-quantized"), "quantized activations"),  # W8A8 is not packed
        (packed_config({"num_bits": 3}), "3-bit int packed weights"),
        (packed_config({"strategy": "tensor"}), "weight strategy 'tensor'"),
        (packed_config({"actorder": "dynamic"}), "actorder 'dynamic'"),
        (ct_config(weights={"num_bits": 4}), "4-bit int weights"),
        (ct_config(weights={"strategy": "group"}), "weight strategy 'group'"),
        (ct_config(acts={"type": "float"}), "8-bit float activations"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise fp8"),
    ],
)
def test_unsupported_schemes_fail_in_one_line(raw, message):
    with pytest.raises(QServeError, match=message) as info:
        parse_quant_scheme(raw, "ckpt/config.json")
    assert str(info.value).startswith("ckpt/config.json: ")
    assert "\n" not in str(info.value)
