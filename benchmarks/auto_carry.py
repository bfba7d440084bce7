"""How well `--method auto`'s measurement carries a unit's KL from its reference scheme to the
others, against each scheme's KL measured directly.

    python benchmarks/auto_carry.py [--model gemma3-270m] [--blocks 0 4 8 12 16] [--num-samples 32]
        [--seq-len 512] [--num-threads 2] [--output benchmarks/results/auto_carry_gemma3_270m.json]

For each unit of the chosen blocks, as the measurement pass (`quantize/auto/measure.py`) takes
it: float Hessians on --num-samples calibration windows, KLs of the final logits on the 4 KL
windows after them, only that unit quantized. At every W4 and W3 group scheme of the unit, its
KL measured directly (GPTQ with the run's MSE range search) beside two carries: the pass's (the
reference's KL times the ratio of the plain GPTQ proxy errors; W3 from the coarsest W3's) and
the ratio of the MSE-searched weights' proxy errors. A carry that overstates how much finer
groups buy makes the allocator trade bytes for error that GPTQ does not deliver. Then, over
these units, the least-error allocation at uniform W4 g64's bytes (`budget.min_error`) by each
estimate and by the measured KLs: its summed KL against uniform's, as that estimate predicts and
as measured. Prints a table (medians over units of carried / measured, per scheme) and writes
JSON with every unit.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_file import run_and_report, run_arguments  # noqa: E402
from qserve.model.resolve import resolve_model  # noqa: E402


def run(args: argparse.Namespace) -> dict[str, Any]:
    from qserve.quantize.auto.blocks import FloatWalk
    from qserve.quantize.settings import QuantizeSettings

    torch.set_num_threads(args.num_threads)
    path = resolve_model(args.model)
    s = QuantizeSettings(
        method="auto", max_ppl_increase="1%", num_samples=args.num_samples, seq_len=args.seq_len
    )
    start = time.monotonic()
    if max(args.blocks) >= (n := _num_blocks(path)):
        raise SystemExit(f"--blocks: {args.model} has blocks 0 to {n - 1}")
    walk = FloatWalk(path, s)
    units = []
    with torch.no_grad():
        for step in walk:
            if step.b not in args.blocks:
                continue
            for names in step.groups:
                units.append(_unit(walk, step, names))
                print(_line(units[-1]), flush=True)
            if step.b == max(args.blocks):
                break
    return {
        "model": args.model,
        "settings": run_arguments(args),
        "seconds": time.monotonic() - start,
        "summary": _summary(units),
        "allocations": _allocations(units),
        "units": units,
    }


def _num_blocks(path: Path) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    return getattr(config, "text_config", config).num_hidden_layers


def _unit(walk, step, names) -> dict[str, Any]:
    """One unit's measured KLs and carries at every W4/W3 group scheme."""
    from qserve.quantize.auto.blocks import unit_gptq, unit_proxy
    from qserve.quantize.auto.budget import anchor, candidate_schemes, directly_measured

    ctx, hessians, unit = step.ctx, step.hessians, walk.unit(step, names)
    linears = [ctx.linear(n) for n in names]
    schemes = [sc for sc in candidate_schemes(unit) if sc.bits in (3, 4) and sc.group_size > 0]
    measured = directly_measured(schemes)
    kl, plain, mse = {}, {}, {}
    for sc in schemes:
        w_mse = unit_gptq(ctx, names, hessians, sc, mse=True)
        w_plain = unit_gptq(ctx, names, hessians, sc, mse=False)
        kl[sc] = walk.tail.kl_with(step.b, step.kl_inputs, list(zip(linears, w_mse)))
        plain[sc] = unit_proxy(ctx, names, hessians, w_plain)
        mse[sc] = unit_proxy(ctx, names, hessians, w_mse)
    shapes = [list(sh) for sh in unit.shapes]
    out = {"name": unit.name, "shapes": shapes, "kl": {}, "pass_carry": {}, "mse_carry": {}}
    for sc in schemes:
        a = anchor(sc, measured)
        out["kl"][sc.name] = kl[sc]
        out["pass_carry"][sc.name] = kl[a] * plain[sc] / plain[a]
        out["mse_carry"][sc.name] = kl[a] * mse[sc] / mse[a]
    return out


def _line(u: dict[str, Any]) -> str:
    cells = [
        f"{k} {v:.2e} ({u['pass_carry'][k] / v:.2f}/{u['mse_carry'][k] / v:.2f})"
        for k, v in u["kl"].items()
    ]
    return f"{u['name']}: " + "  ".join(cells)


def _allocations(units: list[dict[str, Any]]) -> dict[str, Any]:
    """The least-error allocation at uniform W4 g64's bytes (g32's where 64 does not divide
    every unit's K) over these units by each estimate
    (the pass's carries, the MSE proxies' carries, the measured KLs): its summed KL by that
    estimate and by the measured KLs, each against uniform W4 g64's by the same."""
    from qserve.quantize.auto.budget import Unit, min_error
    from qserve.quantize.dynamic import Scheme

    objs = [Unit(u["name"], (u["name"],), tuple(tuple(s) for s in u["shapes"])) for u in units]
    measured = [{Scheme.parse(k): v for k, v in u["kl"].items()} for u in units]
    g64 = next(s for s in (Scheme(4, 64), Scheme(4, 32)) if all(s in m for m in measured))
    uniform = sum(m[g64] for m in measured)
    out: dict[str, Any] = {"uniform": g64.name}
    for key in ("pass_carry", "mse_carry", "kl"):
        est = [{Scheme.parse(k): v for k, v in u[key].items()} for u in units]
        a = min_error(objs, est, sum(o.bytes(g64) for o in objs))
        real = sum(m[a.schemes[o.name]] for o, m in zip(objs, measured))
        out[key] = {
            "predicted": a.error / sum(e[g64] for e in est) - 1,
            "measured": real / uniform - 1,
            "bits": a.bits_per_weight(objs),
        }  # fmt: skip
    return out


def _summary(units: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per scheme: median, min and max over units of each carry / the measured KL."""
    out: dict[str, dict[str, float]] = {}
    schemes = {k for u in units for k in u["kl"]}
    for sc in sorted(schemes):
        for carry in ("pass_carry", "mse_carry"):
            r = [u[carry][sc] / u["kl"][sc] for u in units if sc in u["kl"] and u["kl"][sc] > 0]
            if r:
                out[f"{sc} {carry}"] = {
                    "median": statistics.median(r), "min": min(r), "max": max(r), "units": len(r)
                }  # fmt: skip
    return out


def format_table(summary: dict[str, Any]) -> str:
    lines = [f"{'scheme, carry':<24}{'median':>8}{'min':>8}{'max':>8}{'units':>7}"]
    for key, r in summary["summary"].items():
        lines.append(f"{key:<24}{r['median']:>8.3f}{r['min']:>8.3f}{r['max']:>8.3f}{r['units']:>7}")
    uniform = summary["allocations"]["uniform"]
    lines.append(f"least-error allocation at {uniform}'s bytes: KL vs uniform's, own, measured")
    for key, a in list(summary["allocations"].items())[1:]:
        lines.append(f"  {key:<22}{100 * a['predicted']:>+8.1f}%{100 * a['measured']:>+8.1f}%")
    lines.append(f"{summary['seconds']:.0f} s")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--blocks", type=int, nargs="+", default=[0, 4, 8, 12, 16])
    p.add_argument("--num-samples", type=int, default=32, help="Hessian windows")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args(argv)
    if min(args.num_samples, args.seq_len, args.num_threads) < 1 or min(args.blocks) < 0:
        p.error("--num-samples, --seq-len, --num-threads must be positive, --blocks not negative")
    if args.output is None:
        name = f"auto_carry_{args.model.replace('-', '_').replace('.', '_')}.json"
        args.output = Path(__file__).resolve().parent / "results" / name
    return args


def main(argv: list[str] | None = None) -> int:
    return run_and_report(argv, parse_args, run, format_table)


if __name__ == "__main__":
    sys.exit(main())
