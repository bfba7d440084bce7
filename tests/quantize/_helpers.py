"""Test helpers: tiny random models, and float models rebuilt from exported checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from qserve.kernels.packing import dequantize_awq, dequantize_gptq


def dequantized_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    config = json.loads((folder / "config.json").read_text())
    qc = config["quantization_config"]
    sd = load_file(str(folder / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for key, t in sd.items():
        name, _, kind = key.rpartition(".")
        if kind == "qweight" and qc["quant_method"] == "gptq":
            out[f"{name}.weight"] = dequantize_gptq(
                t, sd[f"{name}.qzeros"], sd[f"{name}.scales"], sd[f"{name}.g_idx"], qc["bits"]
            ).float()
        elif kind == "qweight":
            out[f"{name}.weight"] = dequantize_awq(
                t, sd[f"{name}.qzeros"], sd[f"{name}.scales"], qc["group_size"]
            ).float()
        elif kind == "weight" and f"{name}.weight_scale" in sd:
            out[key] = t.float() * sd[f"{name}.weight_scale"].float()
        elif kind in ("qzeros", "scales", "g_idx", "weight_scale", "input_scale"):
            continue
        else:
            out[key] = t.float()
    return out


def load_dequantized(folder: Path) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    config.quantization_config = None
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(dequantized_state_dict(folder), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model.eval()


def make_tiny_model(
    folder: Path, model_type: str = "llama", kv_heads: int = 4, tie: bool = False, seed: int = 0
) -> Path:
    """Save a 2-layer, hidden-128 random causal LM and a 320-token BPE tokenizer to `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    from qserve.quantize.calibration import load_calibration_text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<s>", "</s>"],
    )
    tok.train_from_iterator([load_calibration_text()[:20000]], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    torch.manual_seed(seed)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
    )
    if model_type == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif model_type == "mistral":  # head_dim 64 != hidden / heads: q/k/v/o are 128 <-> 256
        model = MistralForCausalLM(MistralConfig(head_dim=64, sliding_window=None, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def grouped(method: str, group_size: int = 32) -> dict[str, int]:
    """{"group_size": group_size} for the grouped methods (rtn, gptq, awq); int8 / fp8 are per
    channel or per tensor and refuse a group size."""
    return {"group_size": group_size} if method in ("rtn", "gptq", "awq") else {}
