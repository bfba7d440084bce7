"""`qserve quantize --method auto`: measure, allocate, quantize with GPTQ, verify, write.

    1. measure    each unit's predicted KL at each scheme (`measure`, cached under the qserve
                  cache, `autoquant/`)
    2. allocate   the fewest bytes within the quality budget (`budget.min_bytes`): a perplexity
                  increase (--max-ppl-increase) or a mean KL per token (--max-kl, `Goal`); or
                  the least error within --target-bits (`budget.min_error`)
    3. quantize   GPTQ with the allocation as `dynamic` rules (one exact rule per scheme, the
                  most common W4 scheme as the checkpoint's default)
    4. verify     perplexity of the quantized checkpoint and the float model on the held-out
                  text (`qserve.data.heldout_text`, a kind of text no calibration source is),
                  through the engine in fp32; for --max-kl also the KL of their next-token
                  distributions there (`kl.heldout_kl`). Both per window of the text: the
                  budget is met when the upper 95% bound of the mean over the windows is in
                  it (`budget.upper_bound`), not the mean alone, so that it holds on text
                  beyond the verified windows too
    5. retry      c (`Goal.refit`) is re-fitted to what was measured (after two misses, to
                  the line through them where that asks for more) and the allocation
                  re-solved: over budget, only upgrading units; within it, for fewer bytes
                  (a budget met with room to spare is not the smallest checkpoint). Once an
                  attempt met the budget and a smaller one missed it, the next is the least
                  error at the bytes halfway between them (`_bisect`), until they are within
                  BRACKET_BITS per weight; at most MAX_ATTEMPTS quantizations. The smallest
                  checkpoint that met its budget is written, and none when no attempt met it.

The checkpoint's qserve_recipe.json records the allocation (unit, scheme, bytes, predicted KL),
the prediction and the measured result.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from qserve.errors import QServeError
from qserve.quantize import output_dir as output_rules
from qserve.quantize.auto import budget
from qserve.quantize.auto.budget import Allocation, Unit
from qserve.quantize.auto.measure import Measurement, measure
from qserve.quantize.auto.verify import VERIFY_TOKENS, HeldOut
from qserve.quantize.dynamic import DynamicRule, Scheme
from qserve.quantize.settings import QuantizeSettings

__all__ = [
    "BRACKET_BITS",
    "MAX_ATTEMPTS",
    "VERIFY_TOKENS",
    "allocate",
    "format_allocation",
    "plan_auto",
    "quantize_auto",
]

logger = logging.getLogger("qserve")
MAX_ATTEMPTS = 4
# a met attempt and a smaller missed one closer than this (bits per weight) are not bisected:
# what another quantization could save is smaller than the verification's noise in bytes
BRACKET_BITS = 0.05


def plan_auto(
    model_path: Path,
    settings: QuantizeSettings,
    cache_dir: Path | None,
    progress: Callable[[int, int, float], None] | None = None,
) -> tuple[Measurement, Allocation]:
    """The measurement (cached) and the first allocation: what --dry-run prints."""
    m = _writable(measure(model_path, settings, cache_dir, progress), settings)
    allocation = allocate(m, settings, start_c(m))
    _check_quantizes(allocation, budget.Goal.of(settings))
    return m, allocation


def quantize_auto(
    model_path: Path,
    output_dir: Path,
    settings: QuantizeSettings,
    *,
    quantize: Callable[[QuantizeSettings, Path], Path],
    cache_dir: Path | None,
    overwrite: bool = False,
    progress: Callable[[int, int, float], None] | None = None,
    provenance: Mapping[str, Any] | None = None,
) -> Path:
    """Write the smallest checkpoint meeting `settings`' budget into `output_dir`.
    `quantize(settings, folder)` writes a GPTQ checkpoint (`quantize_model` with the run's
    options)."""
    output_rules.check_output_dir(output_dir, overwrite, model_path)
    m, allocation = plan_auto(model_path, settings, cache_dir, progress)
    goal = budget.Goal.of(settings)
    c, measured = start_c(m), {"increase": math.inf}
    scorer = HeldOut(model_path)
    tried: list[_Tried] = []
    best: _Met | None = None
    with output_rules.staging_dir(output_dir, overwrite, model_path) as stage:
        for attempt in range(1, MAX_ATTEMPTS + 1):
            folder = stage / f".attempt-{attempt}"
            quantize(gptq_settings(settings, m.units, allocation), folder)
            measured = scorer.measure(folder, with_kl=goal is not None and goal.metric == "kl")
            tried.append(_Tried(allocation, c, measured))
            logger.warning(
                "auto attempt %d: %s", attempt, _summary(allocation, m.units, c, measured)
            )
            if goal is None or goal.met(measured):
                if best is not None:
                    shutil.rmtree(best.folder)
                best = _Met(allocation, c, measured, folder)
            else:
                shutil.rmtree(folder)
            if goal is None or attempt == MAX_ATTEMPTS:
                break
            c = {**c, goal.metric: goal.refit([(t.allocation.error, t.measured) for t in tried])}
            allocation = _next_allocation(m, goal, c[goal.metric], tried, best)
            if allocation is None:
                break
        if best is None:
            assert goal is not None
            raise QServeError(
                f"auto: no checkpoint met {goal.describe(goal.limit)} in {len(tried)} "
                f"attempts (the last measured {goal.describe(goal.value(measured))} at the upper "
                f"{100 * budget.CONFIDENCE:g}% bound over the held-out windows); nothing written",
                goal.param,
            )  # fmt: skip
        attempts = [_attempt_record(t.allocation, m.units, t.c, t.measured) for t in tried]
        record = _record(settings, m, best.allocation, best.c, best.measured, attempts, scorer)
        _write_record(best.folder, provenance, record)
        for entry in best.folder.iterdir():
            entry.rename(stage / entry.name)
        best.folder.rmdir()
        return Path(output_dir)


def _writable(m: Measurement, settings: QuantizeSettings) -> Measurement:
    """`m` without the schemes the checkpoint's format does not write (W3 in compressed-tensors:
    `QuantizeSettings._check_format_bits`)."""
    if settings.format != "compressed-tensors":
        return m
    errors = [{s: e for s, e in errs.items() if s.bits != 3} for errs in m.errors]
    return dataclasses.replace(m, errors=errors)


@dataclasses.dataclass
class _Tried:
    """One attempt: what was quantized, the constants it was solved under, what it measured."""

    allocation: Allocation
    c: budget.C
    measured: Mapping[str, float]


@dataclasses.dataclass
class _Met(_Tried):
    """The smallest attempt so far that met the budget, and the folder it was written to."""

    folder: Path


def _next_allocation(
    m: Measurement, goal: budget.Goal, c: float, tried: list[_Tried], best: _Met | None
) -> Allocation | None:
    """The next attempt, or None when none is worth quantizing: between the smallest met and a
    smaller miss, halfway in bytes (`_bisect`); after a miss with nothing met, the last
    upgraded under the re-fitted `c` (`_upgrade`); after a checkpoint that met the budget with
    nothing smaller tried, the fewest bytes the re-fitted prediction allows (a budget met with
    room to spare is not the smallest checkpoint). Nothing as large as the best met so far is
    tried."""
    last = tried[-1].allocation
    missed = [t.allocation.bytes for t in tried if not goal.met(t.measured)]
    if best is not None and any(b < best.allocation.bytes for b in missed):
        found = _bisect(m, max(b for b in missed if b < best.allocation.bytes), best.allocation)
    elif best is not None:
        found = budget.min_bytes(m.units, m.errors, goal.max_error(c))
    else:
        found = _upgrade(m, goal, c, last)
    if found is None or (best is not None and found.bytes >= best.allocation.bytes):
        return None
    _check_quantizes(found, goal)
    return found


def _bisect(m: Measurement, missed: int, met: Allocation) -> Allocation | None:
    """The least predicted error at the bytes halfway between a missed attempt and a smaller
    met one (None once they are within BRACKET_BITS per weight, or when the halfway allocation
    is no larger than the miss). Halving in bytes, not re-fitting c: near a tight budget the
    bound's width barely scales with the error, so a fitted step overshoots (SmolLM2-135M at
    +2%: 6.776 and 7.089 bits missed, the next fitted step 7.548, met at +0.58%)."""
    weights = sum(u.weights for u in m.units)
    if 8 * (met.bytes - missed) < BRACKET_BITS * weights:
        return None
    found = budget.min_error(m.units, m.errors, (missed + met.bytes) // 2)
    return found if found is not None and found.bytes > missed else None


def _check_quantizes(allocation: Allocation, goal: budget.Goal | None) -> None:
    """A budget only 16-bit everywhere meets is said so, not written as a "quantized" copy."""
    if goal is not None and all(s.dense for s in allocation.schemes.values()):
        raise QServeError(
            f"auto: only every linear at 16 bits is predicted to meet "
            f"{goal.describe(goal.limit)}; nothing written (serve the model as it is, or "
            "allow more)", goal.param,
        )  # fmt: skip


def start_c(m: Measurement) -> budget.C:
    """The prediction's constants fitted to the measurement's held-out reference mix."""
    return budget.start_c(m.heldout, m.additivity["sum"])


def allocate(m: Measurement, settings: QuantizeSettings, c: budget.C) -> Allocation:
    """The allocation `settings`' budget asks for, under the prediction's constants `c`."""
    if settings.target_bits is not None:
        max_bytes = int(settings.target_bits / 8 * sum(u.weights for u in m.units))
        found = budget.min_error(m.units, m.errors, max_bytes)
        if found is None:
            least = sum(min(u.bytes(s) for s in errs) for u, errs in zip(m.units, m.errors))
            bits = 8 * least / sum(u.weights for u in m.units)
            raise QServeError(
                f"target_bits {settings.target_bits:g} is below the smallest scheme every unit "
                f"can take: {math.ceil(bits * 1000) / 1000:.3f} bits per weight here",
                "target_bits",
            )  # fmt: skip
        return found
    goal = budget.Goal.of(settings)
    assert goal is not None
    found = budget.min_bytes(m.units, m.errors, goal.max_error(c[goal.metric]))
    assert found is not None  # all 16-bit has error 0: always within budget
    return found


def _upgrade(m: Measurement, goal: budget.Goal, c: float, last: Allocation) -> Allocation:
    """Re-solved under the re-fitted `c`, no unit below its last scheme; when that changes
    nothing, the unit of largest predicted error moves up one scheme."""
    max_error = goal.max_error(c)
    found = budget.min_bytes(m.units, m.errors, max_error, floor=last.schemes)
    if found is not None and found.schemes != last.schemes:
        return found
    worst = max(range(len(m.units)), key=lambda i: m.errors[i][last.schemes[m.units[i].name]])
    unit, errors = m.units[worst], m.errors[worst]
    better = sorted(
        (s for s in errors if unit.bytes(s) > unit.bytes(last.schemes[unit.name])),
        key=unit.bytes,
    )
    schemes = {**last.schemes, unit.name: better[0] if better else budget.DENSE}
    error = sum(errs[schemes[u.name]] for u, errs in zip(m.units, m.errors))
    return Allocation(schemes, sum(u.bytes(schemes[u.name]) for u in m.units), error)


def gptq_settings(
    settings: QuantizeSettings, units: list[Unit], allocation: Allocation
) -> QuantizeSettings:
    """The GPTQ run of `allocation`: the most common quantized scheme as the checkpoint's
    bits and group size, one exact `dynamic` rule for each other scheme."""
    by_scheme: dict[Scheme, list[str]] = {}
    for unit in units:
        by_scheme.setdefault(allocation.schemes[unit.name], []).extend(unit.linears)
    quantized = [s for s in by_scheme if not s.dense]
    default = max(quantized, key=lambda s: len(by_scheme[s])) if quantized else Scheme(8, -1)
    rules = [
        str(DynamicRule(_exact(names), scheme))
        for scheme, names in by_scheme.items()
        if scheme != default
    ]
    return dataclasses.replace(
        settings, method="gptq", bits=default.bits, group_size=default.group_size,
        dynamic=tuple(rules), max_ppl_increase=None, max_kl=None, target_bits=None,
        measure_samples=None,
    )  # fmt: skip


def _exact(names: list[str]) -> str:
    return "(?:" + "|".join(n.replace(".", r"\.") for n in names) + ")$"


# ------------------------------------------------------------------------------ reporting


def format_allocation(m: Measurement, allocation: Allocation) -> str:
    """The --dry-run table: one line per unit, then the totals and the prediction."""
    width = max(len(u.name) for u in m.units)
    lines = [f"{'unit':<{width}}  {'scheme':>6}  {'bytes':>10}  {'predicted KL':>12}"]
    for unit, errors in zip(m.units, m.errors):
        s = allocation.schemes[unit.name]
        lines.append(f"{unit.name:<{width}}  {s.name:>6}  {unit.bytes(s):>10}  {errors[s]:>12.3e}")
    lines.append(_summary(allocation, m.units, start_c(m)))
    return "\n".join(lines)


def _summary(
    allocation: Allocation,
    units: list[Unit],
    c: budget.C,
    measured: Mapping[str, float] | None = None,
) -> str:
    bpw = allocation.bits_per_weight(units)
    predicted = budget.predicted(allocation.error, c)
    text = f"{allocation.bytes / 2**20:.2f} MiB of linears ({bpw:.3f} bits/weight), "
    text += f"predicted perplexity {100 * predicted['increase']:+.3f}%, KL {predicted['kl']:.4g}"
    if measured is None:
        return text
    text += f"; measured perplexity {100 * measured['increase']:+.3f}%"
    if "increase_bound" in measured:
        text += f" (bound {100 * measured['increase_bound']:+.3f}%)"
    if "kl" in measured:
        text += f", KL {measured['kl']:.4g}"
    return text + (f" (bound {measured['kl_bound']:.4g})" if "kl_bound" in measured else "")


def _attempt_record(
    allocation: Allocation,
    units: list[Unit],
    c: budget.C,
    measured: Mapping[str, float],
) -> dict[str, Any]:
    predicted = budget.predicted(allocation.error, c)
    return {
        "bytes": allocation.bytes,
        "bits_per_weight": allocation.bits_per_weight(units),
        "predicted_increase": predicted["increase"],
        "predicted_kl": predicted["kl"],
        "measured_increase": measured["increase"],
        "measured_increase_bound": measured.get("increase_bound"),
        "measured_kl": measured.get("kl"),
        "measured_kl_bound": measured.get("kl_bound"),
        "c": c,
    }


def _record(
    settings: QuantizeSettings,
    m: Measurement,
    allocation: Allocation,
    c: budget.C,
    measured: Mapping[str, float],
    attempts: list[dict[str, Any]],
    scorer: HeldOut,
) -> dict[str, Any]:
    goal = budget.Goal.of(settings)
    return {
        "budget": {
            "max_ppl_increase": settings.max_increase,
            "max_kl": settings.max_kl,
            "target_bits": settings.target_bits,
        },
        "met": goal is None or goal.met(measured),
        "measured": {
            "text": "qserve.data.heldout_text (State of the Union 2010-2020)",
            "tokens": scorer.tokens,
            "windows": len(scorer.base_windows),
            "confidence": budget.CONFIDENCE,
            "base_perplexity": scorer.base,
            **measured,
        },
        "predicted_increase": budget.predicted(allocation.error, c)["increase"],
        "predicted_kl": budget.predicted(allocation.error, c)["kl"],
        "attempts": attempts,
        "measurement": {
            "tokens": m.tokens,
            "seconds": m.seconds,
            "additivity": m.additivity,
            "heldout_reference": m.heldout,
        },
        "allocation": [
            {
                "unit": u.name,
                "scheme": allocation.schemes[u.name].name,
                "bytes": u.bytes(allocation.schemes[u.name]),
                "predicted_kl": errs[allocation.schemes[u.name]],
            }
            for u, errs in zip(m.units, m.errors)
        ],
    }


def _write_record(folder: Path, provenance: Mapping[str, Any] | None, record: dict) -> None:
    from qserve.quantize.export import PROVENANCE_FILE

    path = folder / PROVENANCE_FILE
    made_by = json.loads(path.read_text()) if path.is_file() else dict(provenance or {})
    made_by["auto"] = record
    path.write_text(json.dumps(made_by, indent=2, default=str) + "\n")
