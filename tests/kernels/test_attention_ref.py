"""The torch paged-attention reference against plain dense attention over the same K/V."""

from __future__ import annotations

import math

import pytest
import torch

from qserve.kernels.attention_ref import paged_attention_ref, reshape_and_cache_ref

BLOCK_SIZE = 4


def dense_attention(q, k, v, seq_len):
    """q [Q, H, D] at the last Q positions of k/v [L, KVH, D]; causal."""
    num_q, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    k, v = k.repeat_interleave(group, 1).float(), v.repeat_interleave(group, 1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) / math.sqrt(head_dim)
    q_pos = torch.arange(seq_len - num_q, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_case(seq_lens, query_lens, cache_dtype, k_scale=1.0, v_scale=1.0, heads=(4, 2)):
    torch.manual_seed(sum(seq_lens))
    num_heads, num_kv_heads, head_dim = *heads, 16
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in seq_lens]
    perm = torch.randperm(sum(blocks_per_seq) + 3)  # scattered, unsorted block ids
    kv_cache = torch.zeros(2, len(perm), BLOCK_SIZE, num_kv_heads, head_dim).to(cache_dtype)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    qs, expected = [], []
    offset = 0
    for i, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        block_tables[i, :nb] = perm[offset : offset + nb]
        offset += nb
        k, v = torch.randn(n, num_kv_heads, head_dim), torch.randn(n, num_kv_heads, head_dim)
        pos = torch.arange(n)
        slots = block_tables[i, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
        reshape_and_cache_ref(k, v, kv_cache, slots, k_scale, v_scale)
        # what the pages hold, read back: the reference must attend over exactly this
        kq = kv_cache[0].flatten(0, 1)[slots].float() * _bcast(k_scale)
        vq = kv_cache[1].flatten(0, 1)[slots].float() * _bcast(v_scale)
        q = torch.randn(query_lens[i], num_heads, head_dim)
        qs.append(q)
        expected.append(dense_attention(q, kq, vq, n))
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    out = paged_attention_ref(
        torch.cat(qs), kv_cache, block_tables, seq_lens_t, qsl, head_dim**-0.5, k_scale, v_scale
    )
    return out, torch.cat(expected)


def _bcast(scale):
    return scale.view(-1, 1) if isinstance(scale, torch.Tensor) else scale


def test_decode_and_chunks_in_one_batch_fp32():
    out, expected = run_case([9, 1, 30, 17, 5], [1, 1, 7, 17, 1], torch.float32)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_many_decodes_of_mixed_lengths_fp32():
    lens = [3 + (i * 37) % 90 for i in range(70)]  # more rows than one decode bucket
    out, expected = run_case(lens, [1] * len(lens), torch.float32, heads=(6, 2))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_pages_with_scales(cache_dtype, per_head):
    k_scale = torch.tensor([0.5, 2.0]) if per_head else 0.25
    v_scale = torch.tensor([1.5, 0.75]) if per_head else 0.5
    out, expected = run_case([13, 6], [4, 1], cache_dtype, k_scale, v_scale)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_cache_write_saturates_fp8():
    kv_cache = torch.zeros(2, 1, BLOCK_SIZE, 1, 2).to(torch.float8_e4m3fn)
    big = torch.tensor([[[1000.0, -1000.0]]])
    reshape_and_cache_ref(big, big, kv_cache, torch.tensor([2]))
    assert kv_cache[0, 0, 2].float().tolist() == [[448.0, -448.0]]
    assert kv_cache[0, 0, 0].float().abs().sum() == 0  # untouched slots stay as they were
