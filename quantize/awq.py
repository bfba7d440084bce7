"""AWQ (Lin et al., 2023): activation-aware scales and clipping, search apart from apply.

Search (pure functions):
    x_mean[j] = mean |x_j|                              per input channel j, over calibration tokens
    s(alpha)  = x_mean^alpha  (optionally / w_mean^(1-alpha)), normalised by sqrt(max(s) * min(s))
    alpha*    = argmin over alpha in {0, 1/20, ..., 19/20} of the output error of
                dW = W_all - Q(W_all diag(s)) diag(s)^-1,   mean over tokens of ||dW x||^2
where W_all stacks the linears fed by the same input (q/k/v, gate/up, o_proj, down_proj) and Q is
RTN asymmetric pseudo-quantization. Then a clip search per group: the max |w| of each group is
shrunk by 1/20 steps down to `max_shrink` while the group's output error drops.

The output error is a quadratic form in dW: the inputs enter through H = 2/n sum x x^T (the
GPTQ Hessian), accumulated over all calibration tokens, as in `output_error`. Experts of a
mixture-of-experts block share a scale (it folds into the norm before the block) but each reads
only its routed tokens: each expert's error goes through its own H.

Apply: fold 1/s into the previous op and s into the linears, clamp weights to the clip values.
The result (`qserve.quantize.fold.ScaleResult`: scales per mapping, clip per linear) saves to
safetensors and replays on the same model.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from qserve.quantize.fold import ScaleResult, clip_weight
from qserve.quantize.rtn import fake_quantize

__all__ = [
    "activation_mean",
    "search_scale",
    "search_clip",
    "output_error",
    "rescale_stats",
    "clip_weight",
    "AWQResult",
    "apply_awq",
]


def activation_mean(X: Tensor) -> Tensor:
    """mean |x| per input channel of X [..., K] -> [K]."""
    return X.reshape(-1, X.shape[-1]).abs().float().mean(dim=0)


def output_error(dW: Tensor, H: Tensor) -> Tensor:
    """Mean squared output error per output channel, [N], of a weight error dW [N, K].

    With H = 2/n sum x x^T (qserve.quantize.gptq.accumulate_hessian), mean over the n tokens of
    (dW x)^2 is (dW H dW^T)_nn / 2: the calibration inputs enter only through H, so every
    calibration token counts and each candidate costs N*K^2 instead of n*N*K.
    """
    return ((dW @ H) * dW).sum(dim=1) / 2


def _weight_mean(W: Tensor, group_size: int) -> Tensor:
    """mean over output channels of |w| / max|w of its group| -> [K] (AutoAWQ's duo scaling)."""
    N, K = W.shape
    gs = K if group_size == -1 or K % group_size else group_size
    Wg = W.abs().reshape(N, K // gs, gs)
    return (Wg / Wg.amax(dim=2, keepdim=True).clamp(min=1e-6)).reshape(N, K).mean(dim=0)


def search_scale(
    x_mean: Tensor,
    H: Tensor | list[Tensor],
    Ws: list[Tensor],
    bits: int = 4,
    group_size: int = 128,
    n_grid: int = 20,
    duo_scaling: bool = False,
) -> tuple[Tensor, float, list[float]]:
    """Best per-input-channel scale s [K] for the linears Ws ([N_i, K] each) that read inputs
    with mean |x| = x_mean [K] and H = 2/n sum x x^T [K, K]; or, for linears that read
    different tokens of that input (experts), one H per linear of Ws.

    Returns (s, alpha, the mean squared output error at each alpha of the grid).
    """
    W = torch.cat([w.float() for w in Ws], dim=0)
    Hs = [H.float()] if isinstance(H, Tensor) else [h.float() for h in H]
    sizes = [w.shape[0] for w in Ws]
    w_mean = _weight_mean(W, group_size)
    errors: list[float] = []
    best_s, best_alpha, best_err = torch.ones_like(x_mean), 0.0, float("inf")
    for i in range(n_grid):
        alpha = i / n_grid
        s = x_mean.float().pow(alpha).clamp(min=1e-4)
        if duo_scaling:
            s = (s / w_mean.pow(1 - alpha).clamp(min=1e-4)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        Wq = fake_quantize(W * s, bits, group_size, sym=False) / s
        err = _mean_error(W - Wq, Hs, sizes)
        errors.append(err)
        if err < best_err:
            best_s, best_alpha, best_err = s, alpha, err
    return best_s, best_alpha, errors


def _mean_error(dW: Tensor, Hs: list[Tensor], sizes: list[int]) -> float:
    """Mean squared output error over every output channel of the stacked linears: one H for
    all, or one per linear (of `sizes` output channels each)."""
    if len(Hs) == 1:
        return float(output_error(dW, Hs[0]).mean())
    parts = dW.split(sizes)
    return float(sum(output_error(d, h).sum() for d, h in zip(parts, Hs, strict=True))) / len(dW)


def search_clip(
    H: Tensor,
    W: Tensor,
    bits: int = 4,
    group_size: int = 128,
    n_grid: int = 20,
    max_shrink: float = 0.5,
) -> Tensor:
    """Clip value max_val [G, N] per group of W [N, K], for inputs with H = 2/n sum x x^T.

    Candidates max|w_group| * (1 - i/n_grid) for i < max_shrink * n_grid (the AutoAWQ grid);
    the error of group g is that of its partial product, through the diagonal block H_gg.
    """
    W, H = W.float(), H.float()
    N, K = W.shape
    gs = K if group_size == -1 else group_size
    max_vals = []
    for g0 in range(0, K, gs):
        Wg, Hg = W[:, g0 : g0 + gs], H[g0 : g0 + gs, g0 : g0 + gs]  # [N, gs], [gs, gs]
        org_max = Wg.abs().amax(dim=1)  # [N]
        best_max, best_err = org_max.clone(), torch.full((N,), float("inf"), device=org_max.device)
        for i in range(int(max_shrink * n_grid)):
            max_val = org_max * (1 - i / n_grid)
            Wc = torch.maximum(torch.minimum(Wg, max_val[:, None]), -max_val[:, None])
            err = output_error(fake_quantize(Wc, bits, -1, sym=False) - Wg, Hg)  # [N]
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_max = torch.where(better, max_val, best_max)
        max_vals.append(best_max)
    return torch.stack(max_vals)  # [G, N]


def rescale_stats(x_mean: Tensor, H: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """Input statistics after folding: x -> x / s, so x_mean / s and diag(1/s) H diag(1/s)."""
    return x_mean / s, H / s[:, None] / s[None, :]


# The search result of AWQ is a ScaleResult (scales per mapping + clips per linear).
AWQResult = ScaleResult


def apply_awq(model: nn.Module, result: ScaleResult, group_size: int) -> None:
    """Replay an AWQ search result on `model`: fold the scales, then clamp to the clips."""
    result.apply(model, group_size)
