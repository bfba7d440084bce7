"""Our paged Llama-family model against transformers' logits, on tiny random checkpoints."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from paged_batcher import PagedBatcher
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from qserve.model.llama import LlamaForCausalLM
from qserve.model.loader import load_model

ATOL = 1e-4
ARCHS = ["llama", "qwen2", "mistral", "qwen3", "phi3", "phi3-longrope", "gemma3", "mistral-window"]
ARCHS += ["mixtral", "qwen3-moe"]  # mixture of experts (qserve.model.moe)


@functools.cache
def hf_model(folder: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_logits(folder: Path, tokens: list[int]) -> torch.Tensor:
    """transformers' fp32 logits for every position of one sequence: [len(tokens), vocab]."""
    model = hf_model(folder)
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def tokens_for(vocab_size: int, n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n,), generator=gen).tolist()


def run_steps(
    model: LlamaForCausalLM, batcher: PagedBatcher, chunks: list[tuple[int, list[int]]]
) -> torch.Tensor:
    """One engine step; logits of every token in the flat batch: [num_tokens, vocab]."""
    step = batcher.step(chunks)
    with torch.no_grad():
        hidden = model(step.input_ids, step.positions, batcher.kv_caches, step.attn_metadata)
        return model.compute_logits(hidden)


@pytest.fixture(scope="module", params=ARCHS)
def loaded(request, tiny_checkpoints):
    folder = tiny_checkpoints[request.param]
    model, config = load_model(folder, torch.float32)
    return folder, model, config


def test_full_prompt_in_one_step(loaded):
    folder, model, config = loaded
    prompt = tokens_for(config.vocab_size, 11, seed=1)
    logits = run_steps(model, PagedBatcher(config), [(0, prompt)])
    assert logits.dtype == torch.float32
    assert logits.shape == (11, config.vocab_size)
    torch.testing.assert_close(logits, hf_logits(folder, prompt), atol=ATOL, rtol=0)


def test_decode_steps_read_the_paged_cache(loaded):
    folder, model, config = loaded
    tokens = tokens_for(config.vocab_size, 14, seed=2)
    expected = hf_logits(folder, tokens)
    batcher = PagedBatcher(config)
    got = [run_steps(model, batcher, [(0, tokens[:7])])[-1]]
    for i in range(7, 14):  # one token per step, crossing block boundaries (block size 4)
        got.append(run_steps(model, batcher, [(0, [tokens[i]])])[-1])
    torch.testing.assert_close(torch.stack(got), expected[6:], atol=ATOL, rtol=0)


def test_chunked_prefill(loaded):
    folder, model, config = loaded
    tokens = tokens_for(config.vocab_size, 17, seed=3)
    batcher = PagedBatcher(config)
    chunks = [tokens[:5], tokens[5:8], tokens[8:9], tokens[9:17]]
    got = torch.cat([run_steps(model, batcher, [(0, chunk)]) for chunk in chunks])
    torch.testing.assert_close(got, hf_logits(folder, tokens), atol=ATOL, rtol=0)


def test_two_sequences_in_one_flat_batch(loaded):
    folder, model, config = loaded
    a = tokens_for(config.vocab_size, 13, seed=4)
    b = tokens_for(config.vocab_size, 6, seed=5)
    batcher = PagedBatcher(config)
    first = run_steps(model, batcher, [(0, a[:9]), (1, b[:5])])  # two prompts of different lengths
    second = run_steps(model, batcher, [(1, b[5:]), (0, a[9:])])  # a decode and a prompt chunk
    ref_a, ref_b = hf_logits(folder, a), hf_logits(folder, b)
    torch.testing.assert_close(first[:9], ref_a[:9], atol=ATOL, rtol=0)
    torch.testing.assert_close(first[9:], ref_b[:5], atol=ATOL, rtol=0)
    torch.testing.assert_close(second[:1], ref_b[5:], atol=ATOL, rtol=0)
    torch.testing.assert_close(second[1:], ref_a[9:], atol=ATOL, rtol=0)


def test_module_names_match_hf_state_dict(loaded):
    folder, model, config = loaded
    if config.num_experts:  # transformers 5 fuses the experts in memory: compare with the file
        assert set(model.state_dict()) == moe_checkpoint_names(folder)
    else:
        assert set(model.state_dict()) == set(hf_model(folder).state_dict())


def moe_checkpoint_names(folder: Path) -> set[str]:
    """The per-expert tensor names of a saved MoE checkpoint, Mixtral's `block_sparse_moe.`
    read as `mlp.` (as transformers 5 renames it)."""
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = {name.replace(".block_sparse_moe.", ".mlp.") for name in f.keys()}
    assert any(".mlp.experts.3." in name for name in names)  # per expert, not fused
    return names


def test_tied_embeddings_share_storage(tiny_checkpoints):
    model, config = load_model(tiny_checkpoints["llama"], torch.float32)
    assert config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_sharded_checkpoint_loads(tmp_path, tiny_checkpoints):
    folder = tiny_checkpoints["qwen2"]
    hf_model(folder).save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    sharded, _ = load_model(tmp_path, torch.float32)
    single, _ = load_model(folder, torch.float32)
    for name, tensor in single.state_dict().items():
        assert torch.equal(sharded.state_dict()[name], tensor), name


def test_load_in_bfloat16(tiny_checkpoints):
    model, _ = load_model(tiny_checkpoints["qwen2"], torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.float32
