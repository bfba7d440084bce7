"""16-bit dense linears on CPUs without native bf16/fp16 matmul (no AMX, no AVX-512 BF16).

There, torch's bf16 matmul costs about M separate matrix-vector products: at M = 64 rows,
SmolLM2's lm_head (49152 x 576) takes ~420 ms in bf16 against ~55 ms for the same product in
fp32 with the weight converted a chunk of rows at a time (each chunk stays in cache, so the
fp32 copy never goes to memory). For M >= `UPCAST_MIN_ROWS` this computes
y = dtype(fp32(x) @ fp32(W).T + b): one rounding of an fp32-accumulated product, as torch's
16-bit matmul. Smaller M (decode at batch 1) keeps torch's 16-bit matmul, which reads half the
bytes of fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qserve.kernels import cpu_build
from qserve.platform import native_half_matmul

HALF_DTYPES = (torch.bfloat16, torch.float16)
UPCAST_MIN_ROWS = 4  # measured crossover on an AVX2 EPYC: 2-4 rows (lm_head and MLP shapes)
CHUNK_BYTES = 2 << 20  # fp32 weight rows converted at a time (fits in L2/L3)


def use_upcast(x: torch.Tensor) -> bool:
    """A 16-bit CPU batch of at least UPCAST_MIN_ROWS rows on a CPU without native 16-bit
    matmul: `upcast_linear` is several times faster than F.linear."""
    return (
        x.is_cpu
        and x.dtype in HALF_DTYPES
        and x.dim() == 2
        and x.shape[0] >= UPCAST_MIN_ROWS
        and not _native_half()
    )


@cpu_build.constant_while_tracing
def _native_half() -> bool:
    """`native_half_matmul()` (this module's name, which tests patch), a constant while
    torch.compile traces (dynamo does not trace torch.cpu's CPU feature probes)."""
    return native_half_matmul()


def upcast_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias) accumulated in fp32, rounded once to x's dtype; the
    weight is converted to fp32 a chunk of rows at a time."""
    M, N = x.shape[0], weight.shape[0]
    rows = max(64, CHUNK_BYTES // (4 * weight.shape[1]))
    x32 = x.float()
    out = torch.empty(M, N, dtype=x.dtype)
    for n0 in range(0, N, rows):
        b = None if bias is None else bias[n0 : n0 + rows].float()
        out[:, n0 : n0 + rows] = F.linear(x32, weight[n0 : n0 + rows].float(), b)
    return out
