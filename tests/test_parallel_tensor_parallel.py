"""Tensor-parallel model ranks (issue 24, `qserve.parallel.tensor_parallel`): two processes over
gloo, each loading its share of a tiny model (`load_model(..., tp=...)`), run a prefill of two
prompts of different lengths and a decode step over their own KV caches; every rank's logits
equal the one-process model's (up to fp32 summation order: the all-reduce adds two partial sums).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qserve.errors import QServeError
from qserve.model.attention import AttentionMetadata, make_kv_cache
from qserve.model.config import ModelConfig
from qserve.model.loader import load_model
from qserve.parallel.tensor_parallel import TPRank, rank_config, shard_state
from tests.tiny import save_tiny_llama
from tests.tiny_models import build_tiny_model

BLOCK = 16
PROMPTS = [[3, 4, 5, 6, 7], [20, 21, 22, 23, 24, 25, 26, 27, 28]]
WORLD = 2


def _metadata(
    query_lens: list[int], seq_lens: list[int], positions: torch.Tensor
) -> AttentionMetadata:
    """Sequence i in block i; the flat batch's slots and offsets."""
    tables = torch.arange(len(seq_lens), dtype=torch.int32).reshape(-1, 1)
    seq = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(query_lens))
    starts = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    return AttentionMetadata(
        slot_mapping=tables[seq, 0].long() * BLOCK + positions,
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=starts,
        seq_lens_cpu=seq_lens,
        query_lens_cpu=query_lens,
        prompt_lens_cpu=[len(p) for p in PROMPTS],
    )


def prefill_and_decode_logits(folder: Path, tp: TPRank | None) -> torch.Tensor:
    """fp32 logits of every prompt token, then of one decode token per sequence."""
    model, config = load_model(folder, torch.float32, tp=tp)
    kv = [
        make_kv_cache(4, BLOCK, config.num_key_value_heads, config.head_dim, torch.float32)
        for _ in range(config.num_hidden_layers)
    ]
    lens = [len(p) for p in PROMPTS]
    with torch.inference_mode():
        pos = torch.cat([torch.arange(n) for n in lens])
        hidden = model(torch.tensor(sum(PROMPTS, [])), pos, kv, _metadata(lens, lens, pos))
        prefill = model.compute_logits(hidden)
        pos = torch.tensor(lens)
        md = _metadata([1, 1], [n + 1 for n in lens], pos)
        decode = model.compute_logits(model(torch.tensor([40, 41]), pos, kv, md))
    return torch.cat([prefill, decode])


def _rank(rank: int, folder: Path, rendezvous: Path, out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=WORLD)  # fmt: skip
    try:
        logits = prefill_and_decode_logits(folder, TPRank(rank, WORLD))
        torch.save(logits, out / f"logits{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=["llama", "qwen3", "llama-1-kv-head", "gemma3-1-kv-head"])
def model_folder(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The BPE Llama (untied head); Qwen3 (q/k norms, biases on q/k/v and o_proj); a Llama of
    one KV head, which both ranks hold (replicated, as vLLM's num_kv_head_replicas); Gemma 3
    of one KV head as Gemma-3-270M (scaled tied embedding, sliding layers, soft-capped logits)."""
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        return save_tiny_llama(folder)
    name, _, kv1 = request.param.partition("-")
    overrides = dict(num_key_value_heads=1) if kv1 else {}
    build_tiny_model(name, **overrides).save_pretrained(folder)
    return folder


def test_two_ranks_give_the_one_process_logits(model_folder: Path, tmp_path: Path) -> None:
    want = prefill_and_decode_logits(model_folder, None)
    mp.spawn(_rank, args=(model_folder, tmp_path / "rendezvous", tmp_path), nprocs=WORLD)
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"logits{rank}.pt")
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_rank_holds_its_share(model_folder: Path) -> None:
    config = ModelConfig.from_pretrained(model_folder)
    tp = TPRank(1, WORLD)
    model, rank_cfg = load_model(model_folder, torch.float32, tp=tp)
    assert rank_cfg.num_attention_heads == config.num_attention_heads // WORLD
    assert rank_cfg.num_key_value_heads == max(config.num_key_value_heads // WORLD, 1)
    k_proj = model.model.layers[0].self_attn.k_proj.weight
    assert k_proj.shape == (rank_cfg.num_key_value_heads * config.head_dim, config.hidden_size)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.q_proj.weight.shape == (config.q_size // WORLD, config.hidden_size)
    assert mlp.down_proj.weight.shape == (config.hidden_size, config.intermediate_size // WORLD)
    if mlp.down_proj.bias is not None:  # added once, by rank 0
        assert not mlp.down_proj.bias.any()


def test_what_does_not_split_is_refused() -> None:
    config = _config()
    assert rank_config(config, TPRank(3, 4)).num_key_value_heads == 1  # 2 ranks a KV head
    three_kv = dataclasses.replace(config, num_attention_heads=6, num_key_value_heads=3)
    with pytest.raises(QServeError, match=r"KV heads \(3\) do not split over"):
        rank_config(three_kv, TPRank(0, 2))
    with pytest.raises(QServeError, match=r"attention heads \(4\) do not split over"):
        rank_config(config, TPRank(0, 3))
    with pytest.raises(QServeError, match="rank 2 outside a world of 2"):
        TPRank(2, 2)


def test_shard_state_cuts_columns_and_rows() -> None:
    W = torch.arange(32.0).reshape(4, 8)
    state = {"model.layers.0.self_attn.q_proj.weight": W,
             "model.layers.0.self_attn.o_proj.weight": W,
             "model.norm.weight": torch.ones(8)}  # fmt: skip
    rank1 = shard_state(state, TPRank(1, 2))
    assert torch.equal(rank1["model.layers.0.self_attn.q_proj.weight"], W[2:])
    assert torch.equal(rank1["model.layers.0.self_attn.o_proj.weight"], W[:, 4:])
    assert torch.equal(rank1["model.norm.weight"], torch.ones(8))


def test_replicated_kv_heads_take_the_kv_head_of_their_query_heads() -> None:
    """4 ranks, 2 KV heads of 2 rows: ranks 0 and 1 hold KV head 0, ranks 2 and 3 KV head 1."""
    W = torch.arange(32.0).reshape(4, 8)
    state = {"model.layers.0.self_attn.k_proj.weight": W,
             "model.layers.0.self_attn.q_proj.weight": W}  # fmt: skip
    for rank in range(4):
        part = shard_state(state, TPRank(rank, 4), kv_replicas=2)
        k, q = (part[f"model.layers.0.self_attn.{m}_proj.weight"] for m in "kq")
        assert torch.equal(k, W[rank // 2 * 2 : rank // 2 * 2 + 2])
        assert torch.equal(q, W[rank : rank + 1])


def _config() -> ModelConfig:
    """A Llama config of 4 heads, 2 KV heads and an MLP of 160 (no folder needed)."""
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=16, hidden_size=64, intermediate_size=160,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None, max_position_embeddings=64,
        tie_word_embeddings=False, attention_bias=False, o_proj_bias=False, mlp_bias=False,
        eos_token_ids=[0], torch_dtype=torch.float32,
    )  # fmt: skip


def test_pipeline_stages_split_the_layers_and_rename_them() -> None:
    from qserve.parallel.pipeline_parallel import PPRank, stage_layers

    assert [stage_layers(7, r, 3) for r in range(3)] == [(0, 3), (3, 5), (5, 7)]
    assert [stage_layers(4, r, 2) for r in range(2)] == [(0, 2), (2, 4)]
    state = {f"model.layers.{i}.mlp.up_proj.weight": torch.full((1,), float(i)) for i in range(4)}
    state["model.norm.weight"] = torch.ones(1)
    stage = PPRank(1, 2, 4).shard_state(state)
    assert sorted(stage) == [
        "model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight",
        "model.norm.weight",
    ]  # fmt: skip
    assert stage["model.layers.0.mlp.up_proj.weight"].item() == 2.0
    four_layers = dataclasses.replace(_config(), num_hidden_layers=4)
    assert PPRank(1, 2, 4).rank_config(four_layers).num_hidden_layers == 2
    with pytest.raises(QServeError, match="more stages than"):
        PPRank(0, 5, 4)


def test_micro_batches_cut_whole_sequences_into_equal_token_shares() -> None:
    from qserve.parallel.pipeline_parallel import micro_batches

    def cut(lens: list[int], parts: int) -> list:
        return micro_batches(lens, parts, min_tokens=1)

    assert cut([1] * 8, 2) == [((0, 4), (0, 4)), ((4, 8), (4, 8))]
    assert cut([5, 40, 25, 70, 1, 33], 2) == [((0, 3), (0, 70)), ((3, 6), (70, 174))]
    assert cut([100], 4) == [((0, 1), (0, 100))]  # a sequence is never cut
    assert cut([1, 1], 4) == [((0, 1), (0, 1)), ((1, 2), (1, 2))]
    assert cut([3, 4, 5], 1) == [((0, 3), (0, 12))]
    for lens in ([7, 1, 9, 2, 2, 30], [1] * 5, [64, 64, 1]):
        for parts in (1, 2, 3, 4):
            got = cut(lens, parts)
            assert 1 <= len(got) <= parts and got[0][0][0] == 0 and got[-1][0][1] == len(lens)
            for (seqs, tokens), (nxt, nxt_tokens) in zip(got, got[1:]):
                assert seqs[1] == nxt[0] and tokens[1] == nxt_tokens[0]
            assert all(t1 - t0 == sum(lens[a:b]) for (a, b), (t0, t1) in got)
    # the default keeps decode steps of a few sequences whole (each part reads every weight)
    assert len(micro_batches([1] * 8, 2)) == 1
    assert len(micro_batches([1] * 64, 4)) == 2 and len(micro_batches([128] * 8, 4)) == 4


def test_attention_metadata_of_some_sequences() -> None:
    pos = torch.tensor([0, 1, 2, 3, 4, 5])
    md = _metadata([1, 3, 2], [5, 3, 9], pos)
    part = md.seqs(1, 3)
    assert part.query_start_loc.tolist() == [0, 3, 5]
    assert torch.equal(part.slot_mapping, md.slot_mapping[1:])
    assert part.block_tables.tolist() == [[1], [2]]
    assert part.seq_lens.tolist() == [3, 9] == part.seq_lens_cpu
    assert part.query_lens_cpu == [3, 2] and part.num_seqs == 2
