"""capture_block_inputs: block 0's inputs and each block's own kwargs, from one cheap pass."""

from __future__ import annotations

import torch

from qserve.quantize.capture import capture_block_inputs
from tests.tiny_models import build_tiny_model


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
