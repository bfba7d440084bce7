"""Quality-budgeted allocation, as pure functions: exact checkpoint bytes per scheme, the
prediction of the whole model's perplexity increase, and the allocators.

A unit is a set of linears that must share a scheme because vLLM (and qserve) fuse them: q/k/v,
gate/up, one linear otherwise (the `sequential` groups of `qserve.quantize.arch`).

Bytes are those of the GPTQ format, counted exactly (`linear_bytes`): for a linear [N, K] at b
bits with G groups (G = 1 per channel): qweight K*N*b/8, qzeros G*N*b/8 (int32 words), scales
2*G*N (fp16), g_idx 4*K (int32); a 16-bit linear is 2*N*K. Biases are the same either way and
left out.

Prediction (additive): the per-unit errors e_u(s) are the mean KL(p_float || p_quantized) of
the final logits on calibration tokens with only unit u quantized at scheme s
(`qserve.quantize.auto.measure`). The whole model's log-perplexity increase is predicted as

    log(ppl_q / ppl) = c * sum_u e_u(s_u)

with c fitted to start to one measured mix, every unit at its reference scheme, scored on the
held-out text (`start_c`; the measurement pass does it), and re-fitted to the measured increase
after each verification. A KL budget (`--max-kl`) predicts the held-out KL itself as
c_kl * sum_u e_u(s_u), c_kl fitted the same way. `Goal` holds either budget; the constants of
both metrics travel together as `C = {"ppl": c, "kl": c_kl}`.

Allocators: a multiple-choice knapsack by dynamic programming over the budget, discretized in
`bins` steps, each option's budget use rounded up (so the result never exceeds the budget):
`min_bytes` (a quality budget: the fewest bytes whose predicted error fits) and `min_error` (a
size budget: the least predicted error whose bytes fit).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from qserve.quantize.dynamic import Scheme

if TYPE_CHECKING:
    from qserve.quantize.settings import QuantizeSettings

__all__ = [
    "Allocation",
    "Unit",
    "candidate_schemes",
    "reference_scheme",
    "directly_measured",
    "anchor",
    "linear_bytes",
    "min_bytes",
    "min_error",
    "predicted_increase",
    "Goal",
    "predicted",
    "SAFETY",
    "C",
    "start_c",
    "CONFIDENCE",
    "upper_bound",
    "t_quantile",
]

DENSE = Scheme(16)
SAFETY = 1.1  # a re-fitted c is raised by this much, so a retry does not land just over again
CONFIDENCE = 0.95  # a budget is met when the one-sided upper bound at this confidence is in it
W4_GROUPS = (128, 64, 32)
W3_GROUPS = (128, 64, 32)  # GPTQ format only: compressed-tensors' loaders take 4 and 8 bits


@dataclasses.dataclass(frozen=True)
class Unit:
    """Linears quantized with one scheme: their checkpoint names and [N, K] shapes."""

    name: str
    linears: tuple[str, ...]
    shapes: tuple[tuple[int, int], ...]

    def bytes(self, scheme: Scheme) -> int:
        return sum(linear_bytes(n, k, scheme) for n, k in self.shapes)

    @property
    def weights(self) -> int:
        return sum(n * k for n, k in self.shapes)


def linear_bytes(N: int, K: int, scheme: Scheme) -> int:
    """Checkpoint bytes of one [N, K] linear's weight tensors in `scheme` (GPTQ format)."""
    if scheme.dense:
        return 2 * N * K
    G = 1 if scheme.group_size == -1 else K // scheme.group_size
    return K * N * scheme.bits // 8 + G * N * scheme.bits // 8 + 2 * G * N + 4 * K


def candidate_schemes(unit: Unit) -> list[Scheme]:
    """16-bit, W8 per channel, W4 with every group size dividing each linear's K, W4 per
    channel where 128 does not divide some K (the only candidate under W4 there when no group
    size does), and W3 with every group size dividing each K where 3-bit packing fits (N and K
    multiples of 32). Where the coarsest W4 groups are finer than 128 (SmolLM2's K = 576: 64),
    nothing but W3 is smaller than them, and an allocation at their size can pay for an
    upgrade only with W3 elsewhere. Where g128 fits, per channel was tried beside it on
    Gemma-3-270M: the allocator at W4 g64's size put one unit of 72 there, and the checkpoint
    scored no better (README)."""
    fits = [g for g in W4_GROUPS if all(k % g == 0 for _, k in unit.shapes)]
    groups = [Scheme(4, g) for g in fits]
    coarse = [Scheme(4, -1)] if not groups or groups[0].group_size < max(W4_GROUPS) else []
    packs3 = all(n % 32 == 0 and k % 32 == 0 for n, k in unit.shapes)
    three = [Scheme(3, g) for g in W3_GROUPS if g in fits] if packs3 else []
    return [DENSE, Scheme(8, -1), *groups, *coarse, *three]


def directly_measured(schemes: Sequence[Scheme]) -> list[Scheme]:
    """The schemes whose KL is measured, not carried from the reference's by the ratio of
    proxy errors: the reference; W4 per channel beside groups (one range for a whole row is
    unlike the groups' in kind, which the ratio's assumption of alike noise may not carry: on
    SmolLM2-135M (18 units of 6 blocks) the plain proxies' ratio was 0.06x to 1.26x its
    measured KL ratio to g64, that of the proxies of both schemes' MSE-searched weights 0.41x to
    1.63x, biased by unit kind (q/k/v 0.69x to 0.72x in the last blocks); two sets of 4 KL
    windows agreed on the measured ratio within 10%); and the coarsest W3 groups, the anchor
    the other W3 groups are carried from (`anchor`): 8 levels rather than 16 is a larger
    error, further from the reference's than any other candidate. Measured on
    measure.RATIO_WINDOWS."""
    ref = reference_scheme(schemes)
    three = [s for s in schemes if s.bits == 3]
    return [ref, *(s for s in schemes if s == Scheme(4, -1) and s != ref), *three[:1]]


def anchor(scheme: Scheme, measured: Sequence[Scheme]) -> Scheme:
    """The directly measured scheme `scheme`'s KL is carried from by the ratio of proxy errors
    (itself when measured): the measured scheme of its bits when it is W3, else the reference
    (`measured[0]`)."""
    if scheme in measured:
        return scheme
    return next((s for s in measured[1:] if s.bits == 3 == scheme.bits), measured[0])


def reference_scheme(schemes: Sequence[Scheme]) -> Scheme:
    """The scheme a unit's KL is measured at: its coarsest W4 groups (W4 per channel when no
    group size divides it), the middle of the candidates, which the others are carried to."""
    grouped = [s for s in schemes if s.bits == 4 and s.group_size > 0]
    if grouped:
        return max(grouped, key=lambda s: s.group_size)
    return Scheme(4, -1)


@dataclasses.dataclass(frozen=True)
class Allocation:
    schemes: dict[str, Scheme]  # unit name -> scheme
    bytes: int
    error: float  # predicted: sum of the units' errors

    def bits_per_weight(self, units: Sequence[Unit]) -> float:
        return 8 * self.bytes / sum(u.weights for u in units)


C = dict[str, float]  # the prediction's constants: {"ppl": c, "kl": c_kl}


def start_c(heldout: Mapping[str, float], error: float) -> C:
    """The constants fitted to one measured mix of summed unit error `error` and held-out
    {"increase", "kl"}; 1 where there is nothing to fit (a mix with no measurable effect)."""
    scaled = {"ppl": math.log1p(max(heldout["increase"], 0.0)), "kl": max(heldout["kl"], 0.0)}
    return {k: v / error if error > 0 and v > 0 else 1.0 for k, v in scaled.items()}


def predicted_increase(error: float, c: float = 1.0) -> float:
    """Predicted relative perplexity increase (0.01: +1%) of a summed error."""
    return math.expm1(c * error)


def min_bytes(
    units: Sequence[Unit],
    errors: Sequence[dict[Scheme, float]],
    max_error: float,
    bins: int = 4000,
    floor: dict[str, Scheme] | None = None,
) -> Allocation | None:
    """The allocation of fewest bytes whose summed error is at most `max_error` (None: none is,
    even all 16-bit). `floor`: per unit, the cheapest scheme allowed (a retry only upgrades)."""
    options = _options(units, errors, floor)
    step = max_error / bins if max_error > 0 else 1.0
    weights = [[_bins(e, step) for _, _, e in opts] for opts in options]
    costs = [[float(b) for _, b, _ in opts] for opts in options]
    choice = _knapsack(costs, weights, bins if max_error > 0 else 0)
    return None if choice is None else _allocation(units, options, choice)


def min_error(
    units: Sequence[Unit],
    errors: Sequence[dict[Scheme, float]],
    max_bytes: int,
    bins: int = 4000,
) -> Allocation | None:
    """The allocation of least summed error whose bytes are at most `max_bytes` (None: none
    fits, even the smallest scheme everywhere)."""
    options = _options(units, errors, None)
    # only the bytes above each unit's smallest scheme are discretized (rounded up), so the
    # smallest allocation fits whenever max_bytes allows it
    least = [min(b for _, b, _ in opts) for opts in options]
    spare = max_bytes - sum(least)
    if spare < 0:
        return None
    step = max(spare, 1) / bins
    weights = [[_bins(b - low, step) for _, b, _ in opts] for opts, low in zip(options, least)]
    costs = [[e for _, _, e in opts] for opts in options]
    choice = _knapsack(costs, weights, bins)
    return None if choice is None else _allocation(units, options, choice)


def _options(
    units: Sequence[Unit], errors: Sequence[dict[Scheme, float]], floor: dict[str, Scheme] | None
) -> list[list[tuple[Scheme, int, float]]]:
    """Per unit: (scheme, bytes, error) of each measured scheme at or above its floor."""
    out = []
    for unit, errs in zip(units, errors):
        least = unit.bytes(floor[unit.name]) if floor and unit.name in floor else 0
        opts = [(s, unit.bytes(s), max(e, 0.0)) for s, e in errs.items()]
        out.append([o for o in opts if o[1] >= least])
    return out


def _bins(value: float, step: float) -> int:
    return math.ceil(value / step - 1e-9)


def _knapsack(
    costs: list[list[float]], weights: list[list[int]], capacity: int
) -> list[int] | None:
    """One option per item minimizing the summed cost with summed weight <= capacity; the
    index of each item's option, or None when nothing fits."""
    inf = float("inf")
    best = np.zeros(capacity + 1)  # best[w]: least cost of the items so far within weight w
    picks = []
    for cost, weight in zip(costs, weights):
        new = np.full(capacity + 1, inf)
        pick = np.full(capacity + 1, -1, dtype=np.int16)
        for j, (c, w) in enumerate(zip(cost, weight)):
            if w > capacity:
                continue
            cand = np.full(capacity + 1, inf)
            cand[w:] = best[: capacity + 1 - w] + c
            better = cand < new
            new[better], pick[better] = cand[better], j
        best = new
        picks.append(pick)
    if not np.isfinite(best[capacity]):
        return None
    choice, w = [], capacity
    for item in range(len(costs) - 1, -1, -1):
        j = int(picks[item][w])
        choice.append(j)
        w -= weights[item][j]
    return choice[::-1]


def _allocation(
    units: Sequence[Unit], options: list[list[tuple[Scheme, int, float]]], choice: list[int]
) -> Allocation:
    picked = [opts[j] for opts, j in zip(options, choice)]
    return Allocation(
        {u.name: s for u, (s, _, _) in zip(units, picked)},
        sum(b for _, b, _ in picked),
        sum(e for _, _, e in picked),
    )


@dataclasses.dataclass(frozen=True)
class Goal:
    """A quality budget on held-out text: a perplexity increase (`ppl`, 0.01 = +1%) or a mean
    KL per token (`kl`, nats). The prediction is c * (summed unit KLs): for `ppl` through
    exp(.) - 1, for `kl` directly; c starts fitted to the measurement's held-out reference mix
    (`start_c`) and is re-fitted to what was measured."""

    metric: str
    limit: float

    @classmethod
    def of(cls, settings: QuantizeSettings) -> Goal | None:
        """The settings' quality budget; None for a size budget (--target-bits)."""
        if settings.max_kl is not None:
            return cls("kl", settings.max_kl)
        if settings.max_increase is not None:
            return cls("ppl", settings.max_increase)
        return None

    @property
    def param(self) -> str:
        return "max_kl" if self.metric == "kl" else "max_ppl_increase"

    def max_error(self, c: float) -> float:
        """The summed unit error whose prediction is the limit."""
        return self._scaled(self.limit) / c

    def value(self, measured: Mapping[str, float]) -> float:
        """What the budget is held to: the upper CONFIDENCE bound (`upper_bound`) of the
        measurement, or the measurement itself where it has none."""
        key = "kl" if self.metric == "kl" else "increase"
        return measured.get(f"{key}_bound", measured[key])

    def met(self, measured: Mapping[str, float]) -> bool:
        return self.value(measured) <= self.limit

    def refit(self, attempts: Sequence[tuple[float, Mapping[str, float]]]) -> float:
        """c for the next attempt from the (summed unit error, measurement) of those so far:
        the c that would have predicted the last, raised by SAFETY. After a miss that followed
        an attempt of more error and more measured (the measured value rises with the error),
        the error where the line through the last two reaches the limit / SAFETY, when that
        asks for less error than proportion does: near W8 the bound shrinks more slowly than
        the mean (its width does not scale with the error), and on Gemma-3-270M at +0.5% three
        proportional steps of SAFETY ended at a bound of +0.506%."""
        error, measured = attempts[-1]
        value = self._scaled(self.value(measured))
        c = SAFETY * value / max(error, 1e-12)
        if len(attempts) < 2 or self.met(measured):
            return c
        error0, value0 = attempts[-2][0], self._scaled(self.value(attempts[-2][1]))
        if not (error0 > error and value0 > value):
            return c
        target = self._scaled(self.limit) / SAFETY
        aimed = error + (target - value) * (error0 - error) / (value0 - value)
        return max(c, self._scaled(self.limit) / aimed) if aimed > 0 else c

    def _scaled(self, value: float) -> float:
        """What c * (summed unit error) predicts: log(1 + increase) for `ppl`, the KL itself."""
        return value if self.metric == "kl" else math.log1p(value)

    def describe(self, value: float) -> str:
        if self.metric == "kl":
            return f"KL {value:.4g} nats/token"
        return f"+{100 * value:.3g}% perplexity"


def predicted(error: float, c: C) -> dict[str, float]:
    """Predicted held-out perplexity increase and KL of a summed unit error."""
    return {"increase": predicted_increase(error, c["ppl"]), "kl": c["kl"] * error}


# ------------------------------------------------------------------------ the bound


def upper_bound(samples: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """(mean, one-sided upper `confidence` bound of the mean) of per-window samples, by
    Student's t with the windows as samples (inf with fewer than 2). A checkpoint verified on
    32 windows of the held-out text is held to this bound, not to its mean, so that it meets its
    budget on windows it was not verified on too: on Gemma-3-270M, +4.79% on the first 16384
    tokens was +5.23% on the next 16384 (se of the mean 0.29 points)."""
    n = len(samples)
    mean = sum(samples) / n
    if n < 2:
        return mean, math.inf
    var = sum((x - mean) ** 2 for x in samples) / (n - 1)
    return mean, mean + t_quantile(confidence, n - 1) * math.sqrt(var / n)


def t_quantile(p: float, dof: int) -> float:
    """Student's t quantile (Cornish-Fisher expansion about the normal's; at p = 0.95 within
    0.3% of the exact value for dof >= 3, 1.2% at 2)."""
    from statistics import NormalDist

    z = NormalDist().inv_cdf(p)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    return z + g1 / dof + g2 / dof**2 + g3 / dof**3
