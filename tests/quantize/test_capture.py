"""capture_block_inputs: block 0's inputs and each block's own kwargs, from one cheap pass; and
collect_inputs folding several groups' inputs, with the block's outputs, into one forward."""

from __future__ import annotations

import pytest
import torch

from qserve.quantize.arch import arch_spec
from qserve.quantize.block_context import BlockContext
from qserve.quantize.capture import capture_block_inputs
from qserve.quantize.gptq import hessian_step
from qserve.quantize.moe import prepare_moe
from qserve.quantize.settings import QuantizeSettings
from tests.tiny_models import TINY_MODELS, build_tiny_model


def test_each_block_gets_the_kwargs_of_its_layer_kind() -> None:
    """Gemma 3's local layer (0) and global layer (1) differ in RoPE base and mask."""
    model = build_tiny_model("gemma3")
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(0))
    X, kwargs = capture_block_inputs(model, model.model.layers, ids)
    with torch.no_grad():
        hidden = model(input_ids=ids[:1], output_hidden_states=True).hidden_states[0]
    assert len(X) == 2 and torch.equal(X[0], hidden)  # block 0's input: the scaled embeddings
    local, glob = (kw["position_embeddings"] for kw in kwargs)
    assert not torch.equal(local[0], glob[0])
    assert all(kw["use_cache"] is False and "cache" not in kw for kw in kwargs)
    assert "forward" not in vars(model.model.layers[0])  # the blocks' own forwards are back


def test_blocks_never_run() -> None:
    model = build_tiny_model("llama")
    calls = []
    model.model.layers[1].mlp.register_forward_hook(lambda *a: calls.append(1))
    X, kwargs = capture_block_inputs(model, model.model.layers, torch.tensor([[1, 2, 3]]))
    assert calls == [] and len(kwargs) == 2 and X[0].shape == (1, 3, 64)


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
@torch.no_grad()
def test_one_forward_collects_every_group_and_the_next_inputs(name: str) -> None:
    """The measurement pass (`--method auto`) takes a float block's Hessians for all its groups
    and its outputs in one forward: the same as a forward per group and one more."""
    model = build_tiny_model(name)
    spec = arch_spec(model.config.model_type)
    prepare_moe(model, spec)
    blocks = model.get_submodule(spec.blocks)
    ids = torch.randint(0, 300, (3, 24), generator=torch.Generator().manual_seed(0))
    X, kwargs = capture_block_inputs(model, blocks, ids)
    for b, block in enumerate(blocks):
        ctx = BlockContext(block, f"{spec.blocks}.{b}.", spec.for_block(block),
                           QuantizeSettings(), X, kwargs[b])  # fmt: skip
        groups = [[n for n in g if n in ctx.names] for g in ctx.spec.sequential]
        outputs: list[torch.Tensor] = []
        merged = ctx.collect([n for g in groups for n in g], hessian_step, outputs)
        for group in filter(None, groups):
            for n, (H, count) in ctx.collect(group, hessian_step).items():
                torch.testing.assert_close(merged[n][0], H, rtol=1e-6, atol=1e-6)
                assert merged[n][1] == count
        X = [block(x, **kwargs[b]) for x in X]
        assert len(outputs) == 3 and all(torch.equal(o, x) for o, x in zip(outputs, X))
