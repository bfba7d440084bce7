"""GPTQ (Frantar et al., 2022) as pure tensor functions, in the paper's notation.

    H     = 2/n * sum_x x x^T                    Hessian of the layer-wise squared error, [K, K]
    Hinv  = upper Cholesky factor of (H + damp I)^-1
    err   = (w - q(w)) / Hinv[i, i]              scaled error of column i, fed back into the
                                                 columns not yet quantized

Columns are visited in blocks of `block_size`: the error is spread inside the block at once and to
the rest of the matrix lazily, once per block (the "lazy batch update"). With `desc_act` the
columns are visited in order of descending diag(H); `g_idx` then records the group of each
ORIGINAL input channel, as the GPTQ checkpoint format expects. Weights are W [N, K] (nn.Linear).
"""

from __future__ import annotations

import torch
from torch import Tensor

from qserve.quantize.rtn import QuantizedWeight, compute_qparams, num_groups, quantize_codes

__all__ = ["accumulate_hessian", "gptq_quantize"]


def accumulate_hessian(H: Tensor | None, n: int, X: Tensor) -> tuple[Tensor, int]:
    """Streaming update of H = 2/n * sum x x^T with a batch of inputs X [..., K].

    `n` counts the tokens seen so far. Returns the new (H, n); H is fp32 [K, K].
    """
    X = X.reshape(-1, X.shape[-1]).float()
    m = X.shape[0]
    if H is None:
        H = torch.zeros(X.shape[1], X.shape[1])
    H = H * (n / (n + m))
    n += m
    X = X * (2.0 / n) ** 0.5
    return H + X.t() @ X, n


def _inverse_cholesky_upper(H: Tensor, damp_percent: float, retries: int = 10) -> Tensor:
    """Hinv: upper Cholesky factor of (H + damp * mean(diag H) * I)^-1.

    If H is not positive definite at this damping (too few calibration tokens for K), the
    damping grows by 1% of mean(diag H) per retry, as GPTQModel does.
    """
    K = H.shape[0]
    for attempt in range(retries + 1):
        damp = (damp_percent + 0.01 * attempt) * torch.mean(torch.diag(H))
        L, info = torch.linalg.cholesky_ex(H + damp * torch.eye(K))
        if info == 0:
            Hinv = torch.cholesky_inverse(L)
            Hinv, info = torch.linalg.cholesky_ex(Hinv, upper=True)
            if info == 0:
                return Hinv
    raise torch.linalg.LinAlgError(f"H is not positive definite even with damp {damp_percent}+")


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
) -> QuantizedWeight:
    """Quantize W [N, K] given the Hessian H [K, K] of its inputs; Q in original column order."""
    W = W.clone().float()
    H = H.clone().float()
    N, K = W.shape
    maxq_bits = bits
    gs = K if group_size == -1 else group_size
    G = num_groups(K, group_size)

    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0

    scales = torch.empty(G, N)
    zeros = torch.empty(G, N)
    if static_groups or group_size == -1:
        # Group parameters fixed up front from the (unpermuted) weights.
        for g in range(G):
            scales[g], zeros[g] = compute_qparams(W[:, g * gs : (g + 1) * gs], bits, sym, min_zero)

    perm = torch.arange(K)
    if desc_act:
        perm = torch.argsort(torch.diag(H), descending=True)
        W = W[:, perm]
        H = H[perm][:, perm]
    invperm = torch.argsort(perm)
    # Group of the column visited at position i.
    if static_groups or group_size == -1:
        group_of_pos = perm // gs
    else:
        group_of_pos = torch.arange(K) // gs

    Hinv = _inverse_cholesky_upper(H, damp_percent)
    Q = torch.zeros(N, K, dtype=torch.int32)

    for i1 in range(0, K, block_size):
        i2 = min(i1 + block_size, K)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if not (static_groups or group_size == -1) and col % gs == 0:
                # Parameters from the error-updated weights of the group (inside this block)
                # and the lazily-updated ones after it.
                group_w = torch.cat([W1[:, i:], W[:, i2 : col + gs]], dim=1)[:, :gs]
                g = col // gs
                scales[g], zeros[g] = compute_qparams(group_w, bits, sym, min_zero)
            g = int(group_of_pos[col])
            w = W1[:, i]
            q = quantize_codes(w, scales[g], zeros[g], maxq_bits)
            Q[:, col] = q.to(torch.int32)
            err = (w - scales[g] * (q - zeros[g])) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] @ Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]

    g_idx = group_of_pos[invperm].to(torch.int32)  # group of each original input channel
    return QuantizedWeight(
        Q[:, invperm].contiguous(), scales, zeros.to(torch.int32), g_idx, bits, group_size, sym
    )
