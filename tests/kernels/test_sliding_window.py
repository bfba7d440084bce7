"""Sliding-window paged attention: the torch reference, the C++ CPU kernel (decode rows) and the
Triton kernel (the interpreter without CUDA) against dense masked attention over the same K/V."""

from __future__ import annotations

import pytest
import torch

from qserve.kernels import cpu_paged_attention as cpa
from qserve.kernels import ops
from qserve.kernels.attention_ref import paged_attention_ref
from qserve.model.attention import Attention, AttentionMetadata
from tests.kernels._helpers import require_built
from tests.kernels._window import first_visible, make_case, window_mask
from tests.kernels.conftest import DEVICE, HAS_TRITON


def _triton(*args, **kwargs) -> torch.Tensor:
    from qserve.kernels.paged_attention import paged_attention

    dev = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
    return paged_attention(*dev, **kwargs).cpu()


def _cpu(*args, **kwargs) -> torch.Tensor:
    require_built(cpa.load_library(), "CPU paged-attention")
    return cpa.paged_attention(*args, **kwargs)


PATHS = {"ref": paged_attention_ref, "cpu": _cpu, "triton": _triton}
ALL_PATHS = [
    "ref",
    "cpu",
    pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="no triton")),
]

# (seq_lens, query_lens): 1-token sequences, exact and partial last blocks, full prompts, chunks
# after cached context, an idle sequence; windows below, equal to (37, 64) and above them.
BATCHES = {
    "decode": ([1, 5, 16, 17, 37, 64, 100, 130], [1] * 8),
    "chunks": ([37, 64, 50, 130], [37, 5, 16, 40]),
    "mixed": ([40, 1, 23, 70, 9, 129, 37], [1, 1, 23, 30, 0, 1, 5]),
}
WINDOWS = [1, 5, 16, 37, 64, 1000]


def _check(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.dtype == expected.dtype and torch.isfinite(out).all()
    tol = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}[out.dtype]
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("path", ALL_PATHS)
def test_window_matches_dense_attention_fp32(path, batch, window) -> None:
    case = make_case(*BATCHES[batch])
    out = PATHS[path](*case.args, sliding_window=window)
    _check(out, case.expected(window))


@pytest.mark.parametrize("window", [3, 37])
@pytest.mark.parametrize(
    "heads,head_dim,block_size,dtype,cache_dtype,scales",
    [
        ((4, 4), 64, 16, torch.bfloat16, None, (1.0, 1.0)),
        ((9, 3), 128, 32, torch.bfloat16, None, (1.0, 1.0)),  # GQA group 3
        ((8, 1), 64, 8, torch.float16, None, (1.0, 1.0)),
        ((6, 2), 64, 16, torch.float32, torch.float8_e4m3fn, (0.02, 0.03)),
        ((8, 2), 128, 16, torch.bfloat16, torch.float8_e5m2, "head"),
    ],
)
@pytest.mark.parametrize("path", ALL_PATHS)
def test_window_dtypes_gqa_and_fp8_pages(
    path, heads, head_dim, block_size, dtype, cache_dtype, scales, window
) -> None:
    if scales == "head":
        scales = tuple(torch.rand(heads[1]) * 0.03 + 0.01 for _ in range(2))
    case = make_case(*BATCHES["mixed"], heads, head_dim, block_size, dtype, cache_dtype, scales)
    out = PATHS[path](*case.args, sliding_window=window)
    _check(out, case.expected(window).to(dtype))


@pytest.mark.parametrize(
    "path,batch,whole_blocks_only",
    [
        ("ref", "mixed", True),  # reads from the window's first page on
        ("cpu", "decode", False),  # from the window's first key on
        ("cpu", "mixed", True),  # its chunks take the reference
        pytest.param("triton", "mixed", False, marks=pytest.mark.skipif(not HAS_TRITON, reason="")),
    ],
)
@pytest.mark.parametrize("window", [5, 20])
def test_keys_before_the_window_are_never_read(path, batch, whole_blocks_only, window) -> None:
    """NaN K/V before each sequence's window (and table entries pointing at a NaN block): any
    read of them, even masked, would make the output NaN."""
    case = make_case(*BATCHES[batch])
    case.poison_before(first_visible(case, window), whole_blocks_only)
    out = PATHS[path](*case.args, sliding_window=window)
    _check(out, case.expected(window))


@pytest.mark.skipif(not HAS_TRITON, reason="no triton")
@pytest.mark.parametrize("num_kv_splits", [2, 5])
@pytest.mark.parametrize("window", [5, 37, 1000])
def test_triton_split_kv_decode_divides_the_window(num_kv_splits, window) -> None:
    from qserve.kernels.paged_attention import _kv_splits

    case = make_case(*BATCHES["decode"], dtype=torch.float32)
    case.poison_before(first_visible(case, window), whole_blocks_only=False)
    out = _triton(*case.args, num_kv_splits=num_kv_splits, sliding_window=window)
    _check(out, case.expected(window))
    max_seq_len = int(case.seq_lens.max())
    splits, per_split = _kv_splits(8, max_seq_len, torch.device("cpu"), 32, num_kv_splits, window)
    assert splits * per_split >= min(window, 130) and (splits - 1) * per_split < min(window, 130)


def test_cpu_kernel_checks_only_the_pages_it_reads() -> None:
    """Pages before a window may have been freed: their table entries are not looked at."""
    require_built(cpa.load_library(), "CPU paged-attention")
    case = make_case([70, 33], [1, 1])
    case.block_tables[0, :2] = -1  # positions 0..31, all before the window of 20 (50..69)
    out = torch.empty_like(case.query)
    cpa.paged_attention_decode(out, *case.args, sliding_window=20)
    _check(out, case.expected(20))
    with pytest.raises(ValueError, match="block id"):
        cpa.paged_attention_decode(out, *case.args, sliding_window=40)  # needs position 30


@pytest.mark.parametrize("path", ALL_PATHS)
@pytest.mark.parametrize("batch", BATCHES)
def test_no_window_is_unchanged(path, batch) -> None:
    """sliding_window=None is the call without it, bit for bit; in the kernels, a window no
    shorter than any sequence is too (the same loop from key 0)."""
    case = make_case(*BATCHES[batch], dtype=torch.bfloat16)
    fn = PATHS[path]
    before = fn(*case.args)
    assert torch.equal(fn(*case.args, sliding_window=None), before)
    if path != "ref":  # the reference masks chunks explicitly (SDPA, not is_causal) then
        assert torch.equal(fn(*case.args, sliding_window=int(case.seq_lens.max())), before)
    _check(before, case.expected(None).to(torch.bfloat16))


@pytest.mark.parametrize("bad", [0, -3, True])
def test_bad_window_is_refused(bad) -> None:
    case = make_case([10], [1])
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention_ref(*case.args, sliding_window=bad)
    with pytest.raises(ValueError, match="sliding_window"):
        Attention(4, 2, 64, 0.125, sliding_window=bad)


@pytest.mark.parametrize("kernels", ["1", "0"])
def test_ops_and_attention_layer_pass_the_window(kernels, monkeypatch) -> None:
    """The Attention layer writes the new K/V and attends through ops.paged_attention with its
    window, on the C++ path and with the CPU kernels off."""
    monkeypatch.setenv(cpa.ENV_VAR, kernels)
    seq_lens, query_lens, window = [70, 33, 9], [1, 6, 9], 12
    case = make_case(seq_lens, query_lens, heads=(4, 2), head_dim=64)
    tables, bs = case.block_tables, case.kv_cache.shape[2]
    slots, ks, vs = [], [], []
    for i, (n, q) in enumerate(zip(seq_lens, query_lens)):
        pos = torch.arange(n - q, n)
        slots.append(tables[i, pos // bs].long() * bs + pos % bs)
        ks.append(case.keys[i][n - q :])
        vs.append(case.values[i][n - q :])
        case.kv_cache[:, tables[i, pos // bs].long(), pos % bs] = 0.0  # written by the layer
    md = AttentionMetadata(
        torch.cat(slots), tables, case.seq_lens, case.query_start_loc, seq_lens, query_lens
    )
    layer = Attention(4, 2, 64, case.scale, sliding_window=window)
    t = case.query.shape[0]
    k, v = torch.cat(ks).reshape(t, -1), torch.cat(vs).reshape(t, -1)
    out = layer(case.query.reshape(t, -1), k, v, case.kv_cache, md)
    _check(out.view(case.query.shape), case.expected(window))
    direct = ops.paged_attention(*case.args, sliding_window=window)
    assert torch.equal(out.view(case.query.shape), direct)


@pytest.mark.parametrize("window", [1, 4, 7, 31])
def test_window_convention_is_transformers(window) -> None:
    """The mask every path is tested against is transformers' sliding-window causal mask, as
    Mistral and Gemma 3's local layers build it."""
    masking = pytest.importorskip("transformers.masking_utils")
    q, kv = torch.arange(40), torch.arange(40)
    hf = masking.sliding_window_causal_mask_function(window)(0, 0, q[:, None], kv[None, :])
    assert torch.equal(window_mask(q, kv, window), hf)
    assert int(window_mask(q, kv, window)[-1].sum()) == window  # the last W, itself included
    from transformers import Gemma3TextConfig, MistralConfig

    for config_class in (MistralConfig, Gemma3TextConfig):
        config = config_class(sliding_window=window, hidden_size=64, num_attention_heads=4)
        config._attn_implementation = "eager"
        mask = masking.create_sliding_window_causal_mask(
            config=config,
            inputs_embeds=torch.zeros(1, 40, 64),
            attention_mask=None,
            cache=None,
            position_ids=torch.arange(40)[None],
        )
        assert torch.equal(mask[0, 0] == 0, window_mask(q, kv, window)), config_class.__name__


def test_matches_transformers_mistral_attention() -> None:
    """transformers' eager attention under its own Mistral sliding-window mask vs ops on the same
    q/k/v: the whole prompt as one chunk, and its last token as a decode row."""
    pytest.importorskip("transformers")
    from transformers import MistralConfig
    from transformers.masking_utils import create_sliding_window_causal_mask
    from transformers.models.mistral.modeling_mistral import eager_attention_forward

    seq_len, window, heads, kv_heads, head_dim = 45, 11, 8, 2, 64
    config = MistralConfig(sliding_window=window, hidden_size=64, num_attention_heads=heads)
    config._attn_implementation = "eager"
    mask = create_sliding_window_causal_mask(
        config=config,
        inputs_embeds=torch.zeros(1, seq_len, 64),
        attention_mask=None,
        cache=None,
        position_ids=torch.arange(seq_len)[None],
    )
    case = make_case([seq_len], [seq_len], (heads, kv_heads), head_dim)
    module = torch.nn.Module()
    module.num_key_value_groups = heads // kv_heads
    module.eval()
    q = case.query.transpose(0, 1)[None]  # [1, H, L, D]
    k, v = (x.transpose(0, 1)[None] for x in (case.keys[0], case.values[0]))
    hf, _ = eager_attention_forward(module, q, k, v, mask, scaling=case.scale)
    hf = hf[0]  # [L, H, D]
    _check(ops.paged_attention(*case.args, sliding_window=window), hf)
    decode = (case.query[-1:], *case.args[1:4], torch.tensor([0, 1], dtype=torch.int32))
    _check(ops.paged_attention(*decode, *case.args[5:], sliding_window=window), hf[-1:])
