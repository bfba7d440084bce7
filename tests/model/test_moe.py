"""Mixture of experts: routing, grouped-by-expert execution against a per-token loop, the
config fields and refusals, and the checkpoint layouts that load."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from qserve.errors import QServeError
from qserve.model.config import ModelConfig
from qserve.model.llama import Linear, LlamaForCausalLM
from qserve.model.loader import load_model
from qserve.model.moe import (
    ExpertMLP,
    SparseMoeBlock,
    checkpoint_namer,
    checkpoint_renames,
    fused_moe,
    fused_moe_per_token,
    is_router,
    moe_checkpoint_tensors,
    select_experts,
)
from tests.tiny_models import TINY_MODELS, build_tiny_model


def raw_config(name: str) -> dict:
    """The config.json of tiny model `name`."""
    cls, config = TINY_MODELS[name]
    return {**config.to_diff_dict(), "architectures": [cls.__name__]}


MOE_CONFIG = ModelConfig.from_dict(raw_config("qwen3-moe"))


def random_experts(num: int, hidden: int, inter: int, dtype: torch.dtype) -> list[ExpertMLP]:
    torch.manual_seed(0)
    experts = [ExpertMLP(hidden, inter, ("w1", "w3", "w2"), Linear) for _ in range(num)]
    return [e.to(dtype).requires_grad_(False) for e in experts]


def random_routing(tokens: int, num: int, top_k: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, num, generator=gen)
    logits[:, -1] = -1e9  # one expert nobody picks: skipped, not run on zero rows
    return select_experts(logits, top_k, renormalize=seed % 2 == 0)


@pytest.mark.parametrize("tokens", [0, 1, 7, 33])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_grouped_by_expert_equals_the_per_token_loop(tokens, top_k):
    experts = random_experts(6, 32, 48, torch.float32)
    x = torch.randn(tokens, 32)
    topk_weights, topk_ids = random_routing(tokens, 6, top_k, seed=tokens + top_k)
    got = fused_moe(x, topk_weights, topk_ids, experts)
    want = fused_moe_per_token(x, topk_weights, topk_ids, experts)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_each_chosen_expert_runs_once_over_all_its_tokens():
    experts = random_experts(6, 32, 48, torch.float32)
    calls: list[tuple[int, int]] = []
    spies = [lambda z, e=e, m=m: calls.append((e, len(z))) or m(z) for e, m in enumerate(experts)]
    topk_weights, topk_ids = random_routing(40, 6, 2, seed=1)
    fused_moe(torch.randn(40, 32), topk_weights, topk_ids, spies)
    counts = torch.bincount(topk_ids.flatten(), minlength=6).tolist()
    assert calls == [(e, n) for e, n in enumerate(counts) if n]
    assert counts[-1] == 0  # the expert nobody picked never ran


def test_grouped_by_expert_in_bfloat16():
    experts = random_experts(4, 32, 48, torch.bfloat16)
    x = torch.randn(20, 32, dtype=torch.bfloat16)
    topk_weights, topk_ids = random_routing(20, 4, 2, seed=3)
    got = fused_moe(x, topk_weights, topk_ids, experts)
    assert got.dtype == torch.bfloat16
    want = fused_moe_per_token(x, topk_weights, topk_ids, experts)
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_select_experts_matches_the_transformers_routers(norm_topk_prob):
    torch.manual_seed(0)
    qwen = copy.deepcopy(TINY_MODELS["qwen3-moe"][1])
    qwen.norm_topk_prob = norm_topk_prob
    routers = [(Qwen3MoeTopKRouter(qwen), norm_topk_prob)]
    routers.append((MixtralTopKRouter(TINY_MODELS["mixtral"][1]), True))  # always renormalizes
    x = torch.randn(9, qwen.hidden_size)
    for router, renormalize in routers:
        torch.nn.init.normal_(router.weight)
        logits, want_weights, want_ids = router(x)
        weights, ids = select_experts(logits, router.top_k, renormalize)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights, want_weights.float())


def test_merged_gate_up_computes_what_the_modules_compute():
    torch.manual_seed(0)
    block = SparseMoeBlock(MOE_CONFIG, Linear).requires_grad_(False)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(13, MOE_CONFIG.hidden_size)
    before = block(x)
    assert block.merge()
    torch.testing.assert_close(block(x), before)


def test_config_fields():
    assert MOE_CONFIG.num_experts == 4 and MOE_CONFIG.num_experts_per_tok == 2
    assert MOE_CONFIG.moe_layers == (0,)  # layer 1 is in mlp_only_layers
    assert MOE_CONFIG.moe_intermediate_size == 96 and MOE_CONFIG.intermediate_size == 160
    assert MOE_CONFIG.expert_names == ("gate_proj", "up_proj", "down_proj")
    assert MOE_CONFIG.qk_norm and not MOE_CONFIG.norm_topk_prob
    mixtral = ModelConfig.from_dict(raw_config("mixtral"))
    assert mixtral.moe_layers == (0, 1) and mixtral.norm_topk_prob
    assert mixtral.moe_intermediate_size == mixtral.intermediate_size
    assert mixtral.expert_names == ("w1", "w3", "w2")


def qwen3_moe_raw(**changes) -> dict:
    raw = raw_config("qwen3-moe")
    raw.pop("num_local_experts", None)
    raw.update({"num_hidden_layers": 6, "num_experts": 4, "mlp_only_layers": [], **changes})
    return raw


def test_decoder_sparse_step_and_mlp_only_layers():
    config = ModelConfig.from_dict(qwen3_moe_raw(decoder_sparse_step=2, mlp_only_layers=[3]))
    assert config.moe_layers == (1, 5)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok 5 is more than the 4 experts"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step is 0"),
        ({"num_experts": 0}, "num_experts is 0"),
        ({"architectures": ["Qwen2MoeForCausalLM"]}, "Qwen2MoeForCausalLM is not supported"),
    ],
)
def test_unsupported_settings_are_refused_in_one_line(changes, message):
    with pytest.raises(QServeError, match=message) as err:
        ModelConfig.from_dict(qwen3_moe_raw(**changes))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["mixtral", "qwen3-moe"])
def test_fused_expert_tensors_load_like_per_expert_ones(name, tmp_path, tiny_checkpoints):
    """transformers 5's in-memory layout (experts.gate_up_proj [E, 2I, H], .down_proj) saved
    as it is: split per expert at load."""
    hf = build_tiny_model(name)
    folder = tmp_path / name
    shutil.copytree(tiny_checkpoints[name], folder)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    fused, _ = load_model(folder, torch.float32)
    per_expert, _ = load_model(tiny_checkpoints[name], torch.float32)
    want = per_expert.state_dict()
    for key, tensor in fused.state_dict().items():
        assert torch.equal(tensor, want[key]), key


def test_a_missing_expert_is_named(tmp_path, tiny_checkpoints):
    folder = tmp_path / "m"
    shutil.copytree(tiny_checkpoints["mixtral"], folder)
    state = load_file(folder / "model.safetensors")
    state.pop("model.layers.1.block_sparse_moe.experts.2.w3.weight")
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(QServeError, match="e.g. model.layers.1.mlp.experts.2.w3.weight"):
        load_model(folder, torch.float32)


def test_quantized_configs_are_read():
    raw = qwen3_moe_raw(quantization_config={"quant_method": "gptq", "bits": 4, "group_size": 32})
    config = ModelConfig.from_dict(raw)
    assert config.quantization is not None and config.num_experts == 4


def test_checkpoint_names_follow_the_checkpoint():
    """The scheme of a quantized linear is asked under the checkpoint's name for it: Mixtral as
    the Hub writes it, as GPTQModel 7.6 does (experts unfused by transformers 5 + defuser), and
    Qwen3-MoE as it is."""
    mixtral = ModelConfig.from_dict(raw_config("mixtral"))
    qwen = ModelConfig.from_dict(raw_config("qwen3-moe"))
    expert = "model.layers.0.mlp.experts.0"
    cases = [
        (mixtral, "block_sparse_moe.experts.0.w1", "w1", "block_sparse_moe.experts.0.w1"),
        (mixtral, "mlp.experts.0.gate_proj", "w1", "mlp.experts.0.gate_proj"),
        (mixtral, "mlp.experts.0.down_proj", "w2", "mlp.experts.0.down_proj"),
        (qwen, "mlp.experts.0.gate_proj", "gate_proj", "mlp.experts.0.gate_proj"),
    ]
    for config, stored, ours, theirs in cases:
        stored = f"model.layers.0.{stored}.qweight"
        renames = checkpoint_renames([stored], config)
        assert checkpoint_namer(renames)(f"{expert}.{ours}") == f"model.layers.0.{theirs}"
        state = moe_checkpoint_tensors({stored: torch.zeros(1)}, config, renames)
        assert list(state) == [f"{expert}.{ours}.qweight"]
    assert checkpoint_renames(["model.layers.0.mlp.gate_proj.weight"], qwen) == []


def test_routers_are_found():
    model = LlamaForCausalLM(ModelConfig.from_dict(raw_config("qwen3-moe")))
    routers = [n for n, _ in model.named_modules() if is_router(model, n)]
    assert routers == ["model.layers.0.mlp.gate"]  # layer 1 is dense: its gate_proj is no router


def test_qwen3_moe_expert_count_under_either_name(tiny_checkpoints):
    """The Hub's Qwen3-MoE configs say num_experts; transformers 5 writes num_local_experts."""
    raw = json.loads(Path(tiny_checkpoints["qwen3-moe"], "config.json").read_text())
    assert "num_experts" not in raw and raw["num_local_experts"] == 4
    assert ModelConfig.from_dict(raw).num_experts == 4
    assert ModelConfig.from_dict(qwen3_moe_raw(num_experts=3)).num_experts == 3


@pytest.mark.parametrize("merged", [False, True])
def test_bfloat16_block_follows_float32(merged):
    """16-bit activations: the router's softmax in fp32, the experts and their sum in bf16."""
    torch.manual_seed(0)
    block = SparseMoeBlock(MOE_CONFIG, Linear).requires_grad_(False)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(17, MOE_CONFIG.hidden_size)
    want = block(x)
    block = block.to(torch.bfloat16)
    if merged:
        assert block.merge()
    got = block(x.to(torch.bfloat16))
    assert got.dtype == torch.bfloat16
    err = float((got.float() - want).abs().max() / want.abs().max())
    assert err < 0.03, err
