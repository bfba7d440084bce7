"""Triton paged attention and KV cache write against the lead's torch references."""

import pytest
import torch

from qserve.engine.step_graph import HostReadGuard
from qserve.kernels.attention_ref import paged_attention_ref, reshape_and_cache_ref
from qserve.kernels.cache_write import reshape_and_cache
from qserve.kernels.paged_attention import paged_attention

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _batch(seq_lens, query_lens, block_size, num_blocks, max_blocks):
    """Random, shuffled block tables; slot mappings for every cached token of each sequence."""
    perm = torch.randperm(num_blocks)
    need = [-(-s // block_size) for s in seq_lens]
    assert sum(need) <= num_blocks
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        block_tables[i, :n] = perm[used : used + n]
        used += n
    slots = []
    for i, s in enumerate(seq_lens):
        pos = torch.arange(s)
        slots.append(block_tables[i, pos // block_size].long() * block_size + pos % block_size)
    qsl = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    return block_tables, torch.cat(slots), qsl


def _scales(kind, num_kv_heads):
    if kind == "tensor":
        return 0.05, 0.08
    if kind == "head":
        return torch.rand(num_kv_heads) * 0.1 + 0.02, torch.rand(num_kv_heads) * 0.1 + 0.02
    return 1.0, 1.0


# (seq_lens, query_lens): decodes, full prompts and prompt chunks after cached context, with
# partially filled last blocks; mixed in one flat batch.
BATCHES = {
    "decode": ([1, 17, 40, 64], [1, 1, 1, 1]),
    "prompt": ([5, 33], [5, 33]),
    "mixed": ([50, 1, 23, 70], [7, 1, 23, 40]),
    "with_idle": ([30, 9, 12], [4, 0, 1]),  # a sequence with no new token this step
}


@pytest.mark.parametrize(
    "batch,heads,kv_heads,head_dim,cache_dtype,scales",
    [
        ("decode", 8, 2, 64, torch.float16, None),
        ("prompt", 4, 4, 128, torch.bfloat16, None),
        ("mixed", 6, 2, 64, torch.float16, None),  # GQA group 3 (not a power of 2)
        ("mixed", 8, 2, 128, torch.bfloat16, None),
        ("mixed", 8, 2, 64, torch.float8_e4m3fn, "tensor"),
        ("decode", 4, 2, 64, torch.float8_e5m2, "head"),
        ("mixed", 4, 1, 64, torch.float8_e4m3fn, "head"),
        ("with_idle", 4, 2, 64, torch.float16, None),
    ],
)
def test_paged_attention(batch, heads, kv_heads, head_dim, cache_dtype, scales, device) -> None:
    seq_lens, query_lens = BATCHES[batch]
    block_size, num_blocks, max_blocks = 16, 24, 6
    dtype = torch.bfloat16 if cache_dtype == torch.bfloat16 else torch.float16
    block_tables, slots, qsl = _batch(seq_lens, query_lens, block_size, num_blocks, max_blocks)
    k_scale, v_scale = _scales(scales, kv_heads)
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim).to(cache_dtype)
    k = torch.randn(len(slots), kv_heads, head_dim, dtype=dtype)
    v = torch.randn(len(slots), kv_heads, head_dim, dtype=dtype)
    reshape_and_cache_ref(k, v, kv_cache, slots, k_scale, v_scale)  # torch fp8 cast
    query = torch.randn(int(qsl[-1]), heads, head_dim, dtype=dtype)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim**-0.5
    args = (query, kv_cache, block_tables, seq_lens_t, qsl)
    ref = paged_attention_ref(*args, scale, k_scale, v_scale)

    def dev(t):
        return t.to(device) if isinstance(t, torch.Tensor) else t

    out = paged_attention(*(dev(t) for t in args), scale, dev(k_scale), dev(v_scale))
    # a few roundings to the activation dtype (q, p, dequantized pages) on the CUDA path
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("num_kv_splits", [2, 5])
@pytest.mark.parametrize(
    "cache_dtype,scales", [(torch.float16, None), (torch.float8_e4m3fn, "head")]
)
def test_paged_attention_split_kv_decode(num_kv_splits, cache_dtype, scales, device) -> None:
    """Flash decoding: keys split over programs, partials merged; short sequences leave
    trailing splits empty."""
    seq_lens, heads, kv_heads, D = [1, 70, 33, 96], 8, 2, 64
    block_tables, slots, qsl = _batch(seq_lens, [1] * 4, 16, 20, 6)
    k_scale, v_scale = _scales(scales, kv_heads)
    kv_cache = torch.randn(2, 20, 16, kv_heads, D).to(cache_dtype)
    k = torch.randn(len(slots), kv_heads, D, dtype=torch.float16)
    reshape_and_cache_ref(k, torch.randn_like(k), kv_cache, slots, k_scale, v_scale)
    query = torch.randn(4, heads, D, dtype=torch.float16)
    args = (query, kv_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32), qsl)
    ref = paged_attention_ref(*args, D**-0.5, k_scale, v_scale)

    def dev(t):
        return t.to(device) if isinstance(t, torch.Tensor) else t

    out = paged_attention(
        *(dev(t) for t in args), D**-0.5, dev(k_scale), dev(v_scale), num_kv_splits=num_kv_splits
    )
    torch.testing.assert_close(out.cpu(), ref, rtol=5e-3, atol=5e-3)


@pytest.mark.parametrize("num_kv_splits", [None, 4])
def test_paged_attention_host_bounds_read_no_device_values(num_kv_splits, device) -> None:
    """A captured decode step passes max_query_len 1 and max_seq_len = max_model_len: the
    launcher sizes its splits by the bound (most of them then find no keys) without reading
    seq_lens or query_start_loc (HostReadGuard fails any op that reads values into Python),
    and the output is the same."""
    seq_lens, heads, kv_heads, D = [1, 70, 33, 96], 8, 2, 64
    block_tables, slots, qsl = _batch(seq_lens, [1] * 4, 16, 20, 6)
    kv_cache = torch.randn(2, 20, 16, kv_heads, D, dtype=torch.float16)
    query = torch.randn(4, heads, D, dtype=torch.float16)
    args = (query, kv_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32), qsl)
    ref = paged_attention_ref(*args, D**-0.5)
    dev_args = [t.to(device) for t in args]
    with HostReadGuard():
        out = paged_attention(
            *dev_args, D**-0.5, num_kv_splits=num_kv_splits, max_query_len=1, max_seq_len=2048
        )
    torch.testing.assert_close(out.cpu(), ref, rtol=5e-3, atol=5e-3)


@pytest.mark.parametrize("window", [1, 9, 40])
@pytest.mark.parametrize(
    "batch,heads,kv_heads,cache_dtype,scales",
    [
        ("decode", 8, 2, torch.float16, None),
        ("prompt", 4, 4, torch.bfloat16, None),
        ("mixed", 6, 2, torch.float16, None),
        ("mixed", 4, 1, torch.float8_e4m3fn, "head"),
        ("with_idle", 4, 2, torch.float16, None),
    ],
)
def test_paged_attention_sliding_window(
    batch, heads, kv_heads, cache_dtype, scales, window, device
) -> None:
    """The Triton kernel with a sliding window against the reference with the same window."""
    seq_lens, query_lens = BATCHES[batch]
    dtype = torch.bfloat16 if cache_dtype == torch.bfloat16 else torch.float16
    block_tables, slots, qsl = _batch(seq_lens, query_lens, 16, 24, 6)
    k_scale, v_scale = _scales(scales, kv_heads)
    kv_cache = torch.randn(2, 24, 16, kv_heads, 64).to(cache_dtype)
    k = torch.randn(len(slots), kv_heads, 64, dtype=dtype)
    reshape_and_cache_ref(k, torch.randn_like(k), kv_cache, slots, k_scale, v_scale)
    query = torch.randn(int(qsl[-1]), heads, 64, dtype=dtype)
    args = (query, kv_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32), qsl)
    ref = paged_attention_ref(*args, 0.125, k_scale, v_scale, sliding_window=window)

    def dev(t):
        return t.to(device) if isinstance(t, torch.Tensor) else t

    out = paged_attention(
        *(dev(t) for t in args), 0.125, dev(k_scale), dev(v_scale), sliding_window=window
    )
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=tol, atol=tol)


def test_paged_attention_fp32_exact_semantics(device) -> None:
    """fp32 end to end: the kernel and the reference agree to fp32 round-off."""
    seq_lens, query_lens = [37, 20, 1], [5, 20, 1]
    block_tables, slots, qsl = _batch(seq_lens, query_lens, 16, 8, 3)
    kv_cache = torch.randn(2, 8, 16, 2, 64)
    query = torch.randn(int(qsl[-1]), 4, 64)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    ref = paged_attention_ref(query, kv_cache, block_tables, seq_lens_t, qsl, 0.125)
    out = paged_attention(
        *(t.to(device) for t in (query, kv_cache, block_tables, seq_lens_t, qsl)), 0.125
    )
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)


def _cache_write_case(cache_dtype, key_dtype, scales, device):
    num_tokens, kv_heads, head_dim, block_size, num_blocks = 21, 3, 64, 16, 4
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim).to(cache_dtype)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[[2, 9]] = -1  # padding tokens are skipped
    key = torch.randn(num_tokens, kv_heads, head_dim, dtype=key_dtype) * 4
    value = torch.randn(num_tokens, kv_heads, head_dim, dtype=key_dtype) * 4
    k_scale, v_scale = _scales(scales, kv_heads)
    expect = kv_cache.clone()
    reshape_and_cache_ref(key, value, expect, slots, k_scale, v_scale)
    got = kv_cache.to(device)

    def dev(t):
        return t.to(device) if isinstance(t, torch.Tensor) else t

    reshape_and_cache(dev(key), dev(value), got, dev(slots), dev(k_scale), dev(v_scale))
    return got.cpu(), expect


@pytest.mark.parametrize(
    "cache_dtype,key_dtype",
    [
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float32),
    ],
)
def test_reshape_and_cache(cache_dtype, key_dtype, device) -> None:
    got, expect = _cache_write_case(cache_dtype, key_dtype, None, device)
    assert torch.equal(got, expect)


@pytest.mark.cuda
@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("scales", ["tensor", "head"])
@pytest.mark.parametrize("key_dtype", [torch.float16, torch.bfloat16])
def test_reshape_and_cache_fp8_cuda(cache_dtype, scales, key_dtype) -> None:
    got, expect = _cache_write_case(cache_dtype, key_dtype, scales, "cuda")
    assert torch.equal(got.view(torch.uint8), expect.view(torch.uint8))


def test_strided_views(device) -> None:
    """q/k/v as column slices of one fused qkv projection (non-contiguous rows)."""
    heads, kv_heads, D, block_size = 4, 2, 64, 16
    seq_lens, query_lens = [20, 3], [20, 1]
    block_tables, slots, qsl = _batch(seq_lens, query_lens, block_size, 6, 3)
    T = int(qsl[-1])
    qkv = torch.randn(T, (heads + 2 * kv_heads) * D, dtype=torch.float16, device=device)
    q = qkv[:, : heads * D].view(T, heads, D)
    k = qkv[:, heads * D : (heads + kv_heads) * D].view(T, kv_heads, D)
    v = qkv[:, (heads + kv_heads) * D :].view(T, kv_heads, D)
    assert not q.is_contiguous() and not k.is_contiguous()
    # cache the whole prompt of seq 0 and the context + new token of seq 1
    new_slots = torch.cat([slots[:20], slots[-1:]]).to(device)
    ctx_slots = slots[20:-1]
    kv_cache = torch.randn(2, 6, block_size, kv_heads, D, dtype=torch.float16)
    reshape_and_cache_ref(
        torch.randn(len(ctx_slots), kv_heads, D).half(),
        torch.randn(len(ctx_slots), kv_heads, D).half(),
        kv_cache,
        ctx_slots,
    )
    expect = kv_cache.clone()
    reshape_and_cache_ref(k.cpu(), v.cpu(), expect, new_slots.cpu())
    kv_cache = kv_cache.to(device)
    reshape_and_cache(k, v, kv_cache, new_slots)
    assert torch.equal(kv_cache.cpu(), expect)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    args = (block_tables, seq_lens_t, qsl)
    out = paged_attention(q, kv_cache, *(t.to(device) for t in args), D**-0.5)
    ref = paged_attention_ref(q.cpu().contiguous(), expect, *args, D**-0.5)
    torch.testing.assert_close(out.cpu(), ref, rtol=5e-3, atol=5e-3)
