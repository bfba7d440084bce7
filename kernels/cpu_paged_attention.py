"""C++ paged attention on CPU for decode rows (csrc/paged_attention_cpu.cpp), compiled on first use.

Same contract as `attention_ref.paged_attention_ref`. Decode rows (one query token per sequence)
read K/V where they sit in the pages, with an online softmax in fp32, parallel over
(sequence, KV head); prompt chunks stay on the torch reference. With a sliding window W a decode
row reads only its last W keys (pages before the window are skipped: O(W), not O(context)).

The source is compiled once per machine with `torch.utils.cpp_extension.load` (-O3 -march=native,
cached in the torch extensions dir, keyed by the CPU capability so a shared cache never hands
one CPU another's build). Nothing compiles at import. If compiling fails (no compiler, no ninja)
one warning is logged and every call takes the torch reference. `QSERVE_CPU_KERNELS=0` turns the
C++ path off.

A change to the source (the C signature included) needs no cache-key bump: the extensions dir is
rebuilt by ninja whenever the .cpp or a header it includes is newer than the library, and within
one process torch's versioner rebuilds when the source's hash changes.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from qserve.kernels import cpu_build
from qserve.kernels.attention_ref import (
    Scale,
    check_window,
    chunk_attention_ref,
    paged_attention_ref,
)

ENV_VAR = cpu_build.ENV_VAR
enabled = cpu_build.enabled
SOURCE = cpu_build.CSRC / "paged_attention_cpu.cpp"
HEAD_DIMS = (64, 96, 128, 256)
# dtype codes of the C++ source
QUERY_DTYPES = cpu_build.DTYPE_CODES
PAGE_DTYPES = cpu_build.PAGE_DTYPE_CODES
STATUS = {
    1: "unsupported dtype",
    2: "head_dim not 64, 96, 128 or 256",
    3: "a seq_len outside its block table",
    4: "a block id outside the cache",
    5: "query_start_loc does not rise from 0 to the number of query rows",
}

_i32, _i64, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
# (name, type) of qserve_paged_attention_decode's arguments, in order
_ARGS = (
    ("query", _ptr),
    ("out", _ptr),
    ("q_dtype", _i32),
    ("q_stride_t", _i64),
    ("q_stride_h", _i64),
    ("o_stride_t", _i64),
    ("o_stride_h", _i64),
    ("kv_cache", _ptr),
    ("kv_dtype", _i32),
    ("num_blocks", _i64),
    ("block_size", _i32),
    ("num_kv_heads", _i32),
    ("head_dim", _i32),
    ("num_heads", _i32),
    ("block_tables", _ptr),
    ("bt_stride", _i64),
    ("max_blocks", _i64),
    ("seq_lens", _ptr),
    ("query_start_loc", _ptr),
    ("num_seqs", _i32),
    ("num_tokens", _i64),
    ("k_scale", _ptr),
    ("v_scale", _ptr),
    ("scale", ctypes.c_float),
    ("sliding_window", _i32),  # 0 = full causal attention
    ("num_threads", _i32),
    ("num_chunks", ctypes.POINTER(_i32)),  # out: sequences with > 1 query row (not computed)
)


@functools.cache
def load_library() -> cpu_build.KernelLibrary | None:
    """Compile (first call on this machine, a few seconds) and load the kernel; None, with one
    warning, if that fails."""
    argtypes = [t for _, t in _ARGS]
    symbols = {"qserve_paged_attention_decode": (argtypes, ctypes.c_int32)}
    return cpu_build.build_library("cpu_paged_attention", SOURCE, symbols, "CPU paged-attention")


def supports(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Shapes and dtypes the C++ kernel handles (others take the torch reference)."""
    return (
        query.is_cpu
        and kv_cache.is_cpu
        and query.dim() == 3
        and kv_cache.dim() == 5
        and query.shape[-1] in HEAD_DIMS
        and query.stride(-1) == 1
        and query.dtype in QUERY_DTYPES
        and kv_cache.dtype in PAGE_DTYPES
        and kv_cache.is_contiguous()
    )


@cpu_build.constant_while_tracing
def ready() -> bool:
    """Enabled and compiled (compiles on the first call). torch.compile calls this once while
    tracing and bakes the answer into the graph (no os / ctypes calls in the traced code)."""
    return enabled() and load_library() is not None


def usable(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Enabled, supported, and compiled (compiles on the first call that gets this far)."""
    return supports(query, kv_cache) and ready()


@functools.lru_cache(maxsize=64)
def _constant_scale(value: float, num_kv_heads: int) -> torch.Tensor:
    return torch.full((num_kv_heads,), value, dtype=torch.float32)


def head_scales(scale: Scale, num_kv_heads: int) -> torch.Tensor:
    """A per-tensor or per-KV-head scale as a contiguous fp32 [num_kv_heads]."""
    if not isinstance(scale, torch.Tensor):
        return _constant_scale(float(scale), num_kv_heads)
    if scale.numel() == num_kv_heads:  # first: with one KV head, reading it would be a sync
        return scale.reshape(num_kv_heads).to("cpu", torch.float32).contiguous()
    if scale.numel() == 1:
        return _constant_scale(float(scale), num_kv_heads)
    raise ValueError(f"scale has {scale.numel()} values, expected 1 or {num_kv_heads}")


def _check(query, kv_cache, block_tables, seq_lens, query_start_loc) -> None:
    if not supports(query, kv_cache):
        raise ValueError(
            f"unsupported query {query.dtype} {tuple(query.shape)} / kv_cache {kv_cache.dtype} "
            f"{tuple(kv_cache.shape)}: head_dim in {HEAD_DIMS}, contiguous CPU pages"
        )
    two, _, _, num_kv_heads, head_dim = kv_cache.shape
    num_seqs = seq_lens.shape[0]
    if two != 2 or head_dim != query.shape[2] or query.shape[1] % num_kv_heads:
        raise ValueError(
            f"kv_cache {tuple(kv_cache.shape)} does not fit query {tuple(query.shape)}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables {tuple(block_tables.shape)}: expected [{num_seqs}, *]")
    if query_start_loc.shape != (num_seqs + 1,):  # its values are checked in C++
        raise ValueError(
            f"query_start_loc {tuple(query_start_loc.shape)}: expected [{num_seqs + 1}]"
        )


def _int32(t: torch.Tensor) -> torch.Tensor:
    """An int32 CPU tensor whose rows are contiguous (row stride read by the kernel)."""
    if not (t.is_cpu and t.dtype == torch.int32):
        t = t.to("cpu", torch.int32)
    return t if t.stride(-1) == 1 else t.contiguous()


def paged_attention_decode(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    k_scale: Scale = 1.0,
    v_scale: Scale = 1.0,
    sliding_window: int | None = None,
) -> int:
    """Fill the rows of `out` [num_tokens, num_heads, head_dim] that belong to decode sequences
    (one query token each); other rows are left untouched. Returns the number of sequences with
    more than one query token (prompt chunks) that it left to the caller."""
    _check(query, kv_cache, block_tables, seq_lens, query_start_loc)
    window = check_window(sliding_window) or 0
    if out.shape != query.shape or out.dtype != query.dtype or out.stride(-1) != 1:
        raise ValueError("out must have query's shape and dtype and a contiguous last dim")
    lib = load_library()
    if lib is None:
        raise RuntimeError("the CPU paged-attention kernel failed to compile")
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    tables, lens, qsl = _int32(block_tables), _int32(seq_lens), _int32(query_start_loc)
    k_s, v_s = head_scales(k_scale, num_kv_heads), head_scales(v_scale, num_kv_heads)
    num_chunks = ctypes.c_int32(0)
    status = lib.qserve_paged_attention_decode(
        query.data_ptr(), out.data_ptr(), QUERY_DTYPES[query.dtype],
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.data_ptr(), PAGE_DTYPES[kv_cache.dtype], num_blocks, block_size,
        num_kv_heads, head_dim, query.shape[1],
        tables.data_ptr(), tables.stride(0), tables.shape[1], lens.data_ptr(), qsl.data_ptr(),
        lens.shape[0], query.shape[0], k_s.data_ptr(), v_s.data_ptr(), scale, window,
        torch.get_num_threads(), ctypes.byref(num_chunks),
    )  # fmt: skip
    if status:
        raise ValueError(f"paged_attention_decode: {STATUS.get(status, status)}")
    return num_chunks.value


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    k_scale: Scale = 1.0,
    v_scale: Scale = 1.0,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim] -> out: decode rows through the C++ kernel,
    prompt chunks through the torch reference. The whole batch takes the reference when the
    kernel is off, unsupported here or failed to compile."""
    args = (kv_cache, block_tables, seq_lens, query_start_loc, scale, k_scale, v_scale)
    if not usable(query, kv_cache):
        return paged_attention_ref(query, *args, sliding_window)
    out = torch.empty_like(query)
    args = (*args, sliding_window)
    if paged_attention_decode(out, query, *args):
        chunk_attention_ref(out, query, *args)
    return out
