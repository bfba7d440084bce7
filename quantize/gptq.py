"""GPTQ (Frantar et al., 2022) as pure tensor functions, in the paper's notation.

    H     = 2/n * sum_x x x^T                    Hessian of the layer-wise squared error, [K, K]
    Hinv  = upper Cholesky factor of (H + damp I)^-1
    err   = (w - q(w)) / Hinv[i, i]              scaled error of column i, fed back into the
                                                 columns not yet quantized

Columns are visited in blocks of `block_size`: the error is spread inside the block at once and to
the rest of the matrix lazily, once per block (the "lazy batch update"). With `desc_act` the
columns are visited in order of descending diag(H); `g_idx` then records the group of each
ORIGINAL input channel, as the GPTQ checkpoint format expects. Weights are W [N, K] (nn.Linear).

GPTAQ (Li et al., 2025, "asymmetric calibration"): the target is the full-precision model's
output W X, not W X~ on the inputs X~ that the already-quantized layers produce. With
dXXT = 2/n * sum (x - x~) x~^T it adds, to the update of the columns not yet quantized,

    P     = alpha * triu(dXXT Hinv^T, 1) Hinv   (alpha = 0.25, as GPTQModel)
    W[:, j>i] += w_i P[i, j>i]                  w_i: column i as it stands when quantized

so the remaining columns also make up for the drift of the inputs. dXXT = 0 is plain GPTQ.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor

from qserve.quantize.fp8 import FP8_MAX, quantize_fp8
from qserve.quantize.rtn import (
    QuantizedWeight,
    compute_qparams,
    num_groups,
    quantize_codes,
    search_qparams,
)
from qserve.quantize.smoothquant import quantize_int8

__all__ = [
    "accumulate_dxxt",
    "accumulate_hessian",
    "gptaq_correction",
    "gptq_w8_quantize",
    "gptq_quantize",
    "group_aware_order",
    "hessian_step",
]


def accumulate_hessian(H: Tensor | None, n: int, X: Tensor) -> tuple[Tensor, int]:
    """Streaming update of H = 2/n * sum x x^T with a batch of inputs X [..., K].

    `n` counts the tokens seen so far. Returns the new (H, n); H is fp32 [K, K].
    """
    X = X.reshape(-1, X.shape[-1]).float()
    return _running_mean_update(H, n, X.t(), X)


def hessian_step(acc: tuple[Tensor, int] | None, x: Tensor) -> tuple[Tensor, int]:
    """`accumulate_hessian` as a `BlockContext.collect` step: acc is (H, tokens) or None."""
    H, n = acc if acc is not None else (None, 0)
    return accumulate_hessian(H, n, x)


def accumulate_dxxt(dXXT: Tensor | None, n: int, X: Tensor, X_fp: Tensor) -> tuple[Tensor, int]:
    """Streaming update of dXXT = 2/n * sum (x_fp - x) x^T (GPTAQ) with a batch of inputs X
    [..., K] and the full-precision model's inputs X_fp at the same tokens; `n` as in
    `accumulate_hessian`. Returns the new (dXXT, n); dXXT is fp32 [K, K]."""
    X = X.reshape(-1, X.shape[-1]).float()
    X_fp = X_fp.reshape(-1, X_fp.shape[-1]).float()
    return _running_mean_update(dXXT, n, (X_fp - X).t(), X)


def _running_mean_update(acc: Tensor | None, n: int, A: Tensor, B: Tensor) -> tuple[Tensor, int]:
    """(acc * n / (n + m) + 2 / (n + m) * A @ B, n + m) for the m tokens of A [K, m] @ B [m, K],
    in one GEMM (acc None: zeros)."""
    m = B.shape[0]
    if acc is None:
        return A @ B * (2.0 / m), m
    return torch.addmm(acc, A, B, beta=n / (n + m), alpha=2.0 / (n + m)), n + m


def gptaq_correction(dXXT: Tensor, Hinv: Tensor, alpha: float) -> Tensor:
    """P = alpha * triu(dXXT Hinv^T, 1) Hinv: strictly upper triangular [K, K] (visiting order)."""
    return alpha * torch.triu(dXXT @ Hinv.t(), diagonal=1) @ Hinv


def _inverse_cholesky_upper(H: Tensor, damp_percent: float, retries: int = 10) -> Tensor:
    """Hinv: upper Cholesky factor of (H + damp * mean(diag H) * I)^-1.

    If H is not positive definite at this damping (too few calibration tokens for K), the
    damping grows by 1% of mean(diag H) per retry, as GPTQModel does.
    """
    K = H.shape[0]
    for attempt in range(retries + 1):
        damp = (damp_percent + 0.01 * attempt) * torch.mean(torch.diag(H))
        L, info = torch.linalg.cholesky_ex(H + damp * torch.eye(K, device=H.device))
        if info == 0:
            Hinv = torch.cholesky_inverse(L)
            Hinv, info = torch.linalg.cholesky_ex(Hinv, upper=True)
            if info == 0:
                return Hinv
    raise torch.linalg.LinAlgError(f"H is not positive definite even with damp {damp_percent}+")


ColumnQuantizer = Callable[[int, Tensor, Callable[[int], Tensor]], Tensor]
"""(position i, column w [N], ahead(n) -> the n columns from i on as updated so far)
-> the quantized-dequantized column [N]; records its codes on the side."""


def _error_feedback(
    W: Tensor, Hinv: Tensor, block_size: int, quantize: ColumnQuantizer, P: Tensor | None = None
) -> None:
    """The GPTQ column loop over W [N, K] (in visiting order); W's columns after each block
    are updated in place (its own columns are left as they were: nothing reads them again).

    Inside a block of `block_size` columns each column's scaled error is spread at once over
    the block's later columns; the columns after the block get the block's errors lazily, in
    one matmul (the "lazy batch update"). `P` (GPTAQ's correction, strictly upper triangular)
    adds w_i P[i, :] to the same columns, by the same schedule. The block is held transposed
    (one contiguous row per column), so each step is a few in-place rank-1 updates."""
    K = W.shape[1]
    diag = Hinv.diagonal().tolist()
    for i1 in range(0, K, block_size):
        i2 = min(i1 + block_size, K)
        Wt = W[:, i1:i2].t().contiguous()  # [n, N]: row i is column i1 + i
        Errt = torch.empty_like(Wt)
        Wqt = torch.empty_like(Wt) if P is not None else None  # columns as quantized
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            w, err = Wt[i], Errt[i]
            ahead = partial(_columns_from, Wt, W, i1, i)
            torch.sub(w, quantize(i1 + i, w, ahead), out=err)
            err.div_(diag[i1 + i])
            if Wqt is not None:
                Wqt[i] = w
                Wt[i + 1 :].addr_(P[i1 + i, i1 + i + 1 : i2], w)
            Wt[i:].addr_(Hinv1[i, i:], err, alpha=-1)
        W[:, i2:].addmm_(Errt.t(), Hinv[i1:i2, i2:], alpha=-1)
        if Wqt is not None:
            W[:, i2:].addmm_(Wqt.t(), P[i1:i2, i2:])


def _columns_from(Wt: Tensor, W: Tensor, i1: int, i: int, n: int) -> Tensor:
    """W[:, i1 + i : i1 + i + n] as it stands mid-block: the block's columns from Wt (its
    transposed copy, errors applied), the later ones from W (lazy updates pending)."""
    i2 = i1 + Wt.shape[0]
    return torch.cat([Wt[i:].t(), W[:, i2 : i1 + i + n]], dim=1)[:, :n]


def _prepare(W: Tensor, H: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 copies of W and H with dead input channels (never active) zeroed out of both."""
    W = W.clone().float()
    H = H.clone().float()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    return W, H


def gptq_quantize(
    W: Tensor,
    H: Tensor,
    bits: int = 4,
    group_size: int = 128,
    sym: bool = True,
    damp_percent: float = 0.01,
    block_size: int = 128,
    desc_act: bool = False,
    static_groups: bool = False,
    min_zero: int = 0,
    mse: bool = False,
    act_group_aware: bool = False,
    dXXT: Tensor | None = None,
    gptaq_alpha: float = 0.25,
) -> QuantizedWeight:
    """Quantize W [N, K] given the Hessian H [K, K] of its inputs; Q in original column order.

    `mse`: each group's range comes from the MSE grid search (rtn.search_qparams) instead of
    its min / max. `act_group_aware` (ignored with desc_act or per-channel): visit whole groups
    in group-aware order (see the module docstring). `dXXT` (from `accumulate_dxxt`): GPTAQ's
    asymmetric target, weighted by `gptaq_alpha`."""
    qparams = partial(search_qparams if mse else compute_qparams, bits=bits, sym=sym)
    if dXXT is not None:
        dXXT = dXXT.clone().float()
        dXXT[:, torch.diag(H) == 0] = 0
    W, H = _prepare(W, H)
    N, K = W.shape
    gs = K if group_size == -1 else group_size
    G = num_groups(K, group_size)
    fixed_groups = static_groups or group_size == -1

    scales = torch.empty(G, N, device=W.device)
    zeros = torch.empty(G, N, device=W.device)
    if fixed_groups:
        # Group parameters fixed up front from the (unpermuted) weights.
        for g in range(G):
            scales[g], zeros[g] = qparams(W[:, g * gs : (g + 1) * gs], min_zero=min_zero)

    group_aware = act_group_aware and not desc_act and group_size != -1
    perm = torch.arange(K, device=W.device)
    if desc_act:
        perm = torch.argsort(torch.diag(H), descending=True)
    elif group_aware:
        perm = group_aware_order(torch.diag(H), gs)
    if desc_act or group_aware:
        W = W[:, perm]
        H = H[perm][:, perm]
        dXXT = dXXT[perm][:, perm] if dXXT is not None else None
    invperm = torch.argsort(perm)
    # Group of the column visited at position i: its own group when groups are the format's
    # consecutive channels (fixed up front, or visited whole: group-aware), else the visiting
    # order's (act-order).
    keeps_groups = fixed_groups or group_aware
    group_of_pos = perm // gs if keeps_groups else torch.arange(K, device=W.device) // gs
    groups = group_of_pos.tolist()
    Qt = torch.zeros(K, N, device=W.device)  # codes, one row per visited column

    def quantize(col: int, w: Tensor, ahead: Callable[[int], Tensor]) -> Tensor:
        g = groups[col]
        if not fixed_groups and col % gs == 0:
            # Parameters from the group's weights as error feedback has left them so far.
            scales[g], zeros[g] = qparams(ahead(gs), min_zero=min_zero)
        q = Qt[col] = quantize_codes(w, scales[g], zeros[g], bits)
        return scales[g] * (q - zeros[g])

    Hinv = _inverse_cholesky_upper(H, damp_percent)
    P = gptaq_correction(dXXT, Hinv, gptaq_alpha) if dXXT is not None else None
    _error_feedback(W, Hinv, block_size, quantize, P)
    g_idx = group_of_pos[invperm].to(torch.int32)  # group of each original input channel
    Q = Qt[invperm].t().to(torch.int32).contiguous()
    return QuantizedWeight(Q, scales, zeros.to(torch.int32), g_idx, bits, group_size, sym)


def group_aware_order(diag_h: Tensor, group_size: int) -> Tensor:
    """Visiting order [K] of Group Aware Reordering: groups of `group_size` consecutive channels
    by descending max diag(H), the channels inside each by descending diag(H) (ties stable)."""
    G = diag_h.numel() // group_size
    per_group = diag_h.reshape(G, group_size)
    local = torch.argsort(per_group, dim=1, descending=True, stable=True)
    order = torch.argsort(per_group.amax(dim=1), descending=True, stable=True)
    base = torch.arange(G, device=diag_h.device)[:, None] * group_size
    return (local + base)[order].reshape(-1)


def gptq_w8_quantize(
    W: Tensor,
    H: Tensor,
    fmt: str = "fp8",
    strategy: str = "channel",
    damp_percent: float = 0.01,
    block_size: int = 128,
) -> tuple[Tensor, Tensor]:
    """int8 or FP8 E4M3 weights rounded with GPTQ's error feedback: (Q [N, K] int8 |
    float8_e4m3fn, scale fp32 [N, 1] | [1]).

    The scales are those of plain rounding (max|w| / 127 or / 448 per channel or tensor), fixed
    before the loop; only the rounding of each column takes the Hessian into account, so the
    checkpoint format is exactly that of `quantize_int8` / `quantize_fp8`."""
    if fmt not in ("int8", "fp8"):
        raise ValueError(f"fmt must be 'int8' or 'fp8', got {fmt!r}")
    W, H = _prepare(W, H)
    _, scale = (quantize_int8 if fmt == "int8" else quantize_fp8)(W, strategy)
    dtype = torch.int8 if fmt == "int8" else torch.float8_e4m3fn
    Qt = torch.empty(W.shape[::-1], dtype=dtype, device=W.device)  # one row per column
    col_scale = scale.reshape(-1)  # [N] or [1]

    def quantize(col: int, w: Tensor, ahead: Callable[[int], Tensor]) -> Tensor:
        Qt[col] = _round_w8(w / col_scale, Qt.dtype)
        return Qt[col].float() * col_scale

    _error_feedback(W, _inverse_cholesky_upper(H, damp_percent), block_size, quantize)
    return Qt.t().contiguous(), scale


def _round_w8(x: Tensor, dtype: torch.dtype) -> Tensor:
    """Nearest int8 code, or nearest FP8 E4M3 value (saturated), of x."""
    if dtype == torch.int8:
        return torch.clamp(torch.round(x), -128, 127).to(torch.int8)
    return torch.clamp(x, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
