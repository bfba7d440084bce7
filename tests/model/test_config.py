from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qserve.errors import QServeError
from qserve.model.config import ARCHITECTURES, ModelConfig, RopeScaling

# The config.json of the converted SmolLM2-135M-Instruct, trimmed.
SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"],
    "dtype": "float32",
    "eos_token_id": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "max_position_embeddings": 8192,
    "model_type": "llama",
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "rms_norm_eps": 1e-05,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    "tie_word_embeddings": True,
    "vocab_size": 49152,
}


def write_folder(folder: Path, config: dict, generation: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def test_smollm2_config(tmp_path):
    folder = write_folder(tmp_path, SMOLLM2, generation={"eos_token_id": [2, 0]})
    config = ModelConfig.from_pretrained(folder)
    assert config == ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        rms_norm_eps=1e-05,
        rope_theta=100000.0,
        rope_scaling=None,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        attention_bias=False,
        o_proj_bias=False,
        mlp_bias=False,
        eos_token_ids=[2, 0],
        torch_dtype=torch.float32,
        sliding_window=None,
    )
    assert (config.q_size, config.kv_size) == (576, 192)


def test_transformers4_style_llama3_rope_and_derived_head_dim():
    raw = {**SMOLLM2, "torch_dtype": "bfloat16", "rope_theta": 500000.0}
    del raw["rope_parameters"], raw["head_dim"], raw["dtype"]
    raw["rope_scaling"] = {
        "type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = ModelConfig.from_dict(raw)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert config.head_dim == 576 // 9
    assert config.torch_dtype == torch.bfloat16


def test_qwen2_has_qkv_bias_but_no_o_proj_bias():
    raw = {
        **SMOLLM2,
        "architectures": ["Qwen2ForCausalLM"],
        "sliding_window": 4096,
        "use_sliding_window": False,
        "eos_token_id": [151645, 151643],
    }
    config = ModelConfig.from_dict(raw)
    assert (config.attention_bias, config.o_proj_bias) == (True, False)
    assert config.sliding_window is None
    assert config.eos_token_ids == [151645, 151643]


@pytest.mark.parametrize(("window", "expected"), [(None, None), (8192, None), (4096, 4096)])
def test_mistral_sliding_window_kept_only_when_shorter_than_context(window, expected):
    raw = {**SMOLLM2, "architectures": ["MistralForCausalLM"], "sliding_window": window}
    config = ModelConfig.from_dict(raw)
    assert config.sliding_window == expected
    assert config.max_context_len == 8192  # the window is honoured, not a context limit
    sliding = ("sliding_attention",) * config.num_hidden_layers
    assert config.layer_types == (sliding if expected else ())


def test_unsupported_architecture_names_it_and_the_supported_list(tmp_path):
    folder = write_folder(tmp_path, {**SMOLLM2, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(QServeError) as err:
        ModelConfig.from_pretrained(folder)
    supported = ", ".join(ARCHITECTURES)  # every architecture qserve runs, in table order
    assert str(err.value) == (
        f"{folder}/config.json: architecture GPT2LMHeadModel is not supported; expected one of: "
        + supported
    )
    assert supported.startswith("LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM")


def test_unsupported_rope_type():
    raw = {**SMOLLM2, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}
    with pytest.raises(QServeError, match="rope type 'yarn' is not supported; expected default, "):
        ModelConfig.from_dict(raw)


def test_missing_field_is_named():
    raw = {k: v for k, v in SMOLLM2.items() if k != "hidden_size"}
    with pytest.raises(QServeError, match="hidden_size is None; expected a positive integer"):
        ModelConfig.from_dict(raw)


def test_malformed_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(QServeError, match="config.json is not valid JSON"):
        ModelConfig.from_pretrained(tmp_path)
