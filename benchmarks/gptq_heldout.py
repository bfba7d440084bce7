"""Why GPTQ's gain over RTN shrinks on text unlike its calibration (issue 27): one setting at a
time, each scored in-domain and held-out.

    python benchmarks/gptq_heldout.py [--model smollm2-135m] [--variants all]
        [--num-samples 128] [--calib-seq-len 512] [--max-tokens 4096] [--dtype float32]
        [--num-threads 2] [--output benchmarks/results/gptq_heldout.json] [--append]

Every variant is `qserve quantize` w4 at the model's group size (64 for SmolLM2) with one
setting changed from qserve's GPTQ on Moby-Dick ch. 11+ (or on `mixed`, or `generated`: the
default since issue 27), a
third-party quantizer on the same calibration ids, or INT8 / FP8 W8A8 (their own defaults).
Scoring is `benchmarks/quality.py`'s: perplexity on Moby-Dick ch. 1-10 (in-domain: the book of
the default calibration) and on the State of the Union 2010-2020 (held-out: no calibration
source is of its kind), the first `--max-tokens` tokens of each in 512-token windows. The
`recovery` columns are the share of RTN's perplexity increase a variant wins back (issue 27's
target: at least 50% held-out). Prints a table and writes JSON (a row at a time, so a long run
that dies keeps its finished rows).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import quality  # noqa: E402
from benchmarks.results_file import run_and_report, run_arguments, write_results  # noqa: E402
from qserve.model.resolve import resolve_model  # noqa: E402

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "gptq_heldout.json"
W4 = {"bits": 4}


@dataclass(frozen=True)
class Variant:
    name: str
    calib: str  # moby-dick (ch. 11+) | generated (GPTQ's default) | mixed (five sources)
    method: quality.Method
    num_samples: int | None = None  # None: --num-samples


def _gptq(name: str, label: str, calib: str, **options: Any) -> Variant:
    opts = {"method": "gptq", **W4, **options}
    return Variant(name, calib, quality.Method(name, label, opts))


VARIANTS = {
    v.name: v
    for v in [
        Variant("baseline", "moby-dick", quality.METHODS["baseline"]),
        Variant("rtn", "moby-dick", quality.METHODS["rtn"]),
        _gptq("gptq", "GPTQ (GPTAQ + mse), moby-dick", "moby-dick"),
        _gptq("gptq-minmax", "GPTQ (GPTAQ) --no-mse", "moby-dick", mse=False),
        _gptq("gptq-plain", "GPTQ --no-gptaq", "moby-dick", gptaq=False),
        _gptq("gptq-plain-minmax", "GPTQ --no-gptaq --no-mse", "moby-dick", gptaq=False, mse=False),
        _gptq("gptq-damp0.1", "GPTQ damp 0.1", "moby-dick", damp=0.1),
        _gptq("gptq-damp0.3", "GPTQ damp 0.3", "moby-dick", damp=0.3),
        _gptq("gptq-act", "GPTQ act-order", "moby-dick", desc_act=True),
        _gptq("generated-gptq", "GPTQ (default: GPTAQ, mse, generated)", "generated"),
        _gptq("mixed-gptq", "GPTQ, --calib mixed", "mixed"),
        _gptq("mixed-gptq-minmax", "GPTQ --no-mse, --calib mixed", "mixed", mse=False),
        _gptq(
            "mixed-gptq-plain-minmax",
            "GPTQ --no-gptaq --no-mse, mixed",
            "mixed",
            gptaq=False,
            mse=False,
        ),  # fmt: skip
        replace(_gptq("mixed-gptq-32", "GPTQ, --calib mixed, 32 samples", "mixed"), num_samples=32),
        Variant("awq", "moby-dick", quality.METHODS["awq"]),
        Variant("mixed-awq", "mixed", replace(quality.METHODS["awq"], name="mixed-awq")),
        Variant("gptqmodel", "moby-dick", quality.METHODS["gptqmodel"]),
        Variant(
            "mixed-gptqmodel",
            "mixed",
            replace(quality.METHODS["gptqmodel"], name="mixed-gptqmodel"),
        ),
        Variant("int8", "moby-dick", quality.METHODS["int8"]),
        Variant("fp8", "moby-dick", quality.METHODS["fp8"]),
    ]
}


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.num_threads)
    model = resolve_model(args.model)
    ids, heldout = quality.eval_tokens(model), quality.heldout_tokens(model)
    args.group_size = quality.auto_group_size(model)
    rows = _kept_rows(args)
    with tempfile.TemporaryDirectory(prefix="qserve-gptq-heldout-") as tmp:
        for name in args.variants:
            v = VARIANTS[name]
            if not _installed(v.method.tool):
                quality.log(f"{name}: skipped ({v.method.tool} not installed)")
                continue
            method = quality.with_group_size(v.method, args.group_size)
            run_args = argparse.Namespace(**vars(args))
            run_args.calib = v.calib
            run_args.num_samples = v.num_samples or args.num_samples
            row = quality.run_method(model, method, ids, Path(tmp), run_args, heldout)
            rows = [r for r in rows if r["variant"] != name]
            day = time.strftime("%Y-%m-%d")
            rows.append({"variant": name, "calib": v.calib, "measured": day, **asdict(row)})
            quality.log(f"  {name}: {row.perplexity:.3f} in-domain, {row.heldout_perplexity:.3f}")
            write_results(args.output, summarize(args, rows))
    return summarize(args, rows)


def _kept_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """With --append, the output's rows of variants this run does not measure (perplexities
    are deterministic for a checkpoint; each row's times are its own run's)."""
    if not args.append or not args.output.is_file():
        return []
    old = json.loads(args.output.read_text())["rows"]
    return [r for r in old if r["variant"] not in args.variants and r["variant"] in VARIANTS]


def _installed(tool: str) -> bool:
    module = {"gptqmodel": "gptqmodel", "autoawq": "awq"}.get(tool)
    return module is None or importlib.util.find_spec(module) is not None


def summarize(args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, Any]:
    by = {r["variant"]: r for r in rows}
    for r in rows:
        r["recovery"] = _recovery(by, r, "perplexity")
        r["heldout_recovery"] = _recovery(by, r, "heldout_perplexity")
        for key, name in (("perplexity", "increase"), ("heldout_perplexity", "heldout_increase")):
            base = by.get("baseline", {}).get(key)
            r[name] = r[key] / base - 1 if base else None
    return {"model": args.model, "settings": run_arguments(args), "rows": rows}


def _recovery(by: dict[str, dict[str, Any]], row: dict[str, Any], key: str) -> float | None:
    if "baseline" not in by or "rtn" not in by or row["quant_seconds"] is None:
        return None
    if row["variant"] in ("int8", "fp8"):
        return None  # W8: compared with the baseline, not with W4 RTN
    base, rtn = by["baseline"][key], by["rtn"][key]
    return (rtn - row[key]) / (rtn - base) if rtn > base else None


def format_table(summary: dict[str, Any]) -> str:
    head = (
        f"{'variant':<36}{'in-domain':>10}{'vs base':>8}{'recov':>7}"
        f"{'held-out':>10}{'vs base':>8}{'recov':>7}{'quant s':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in summary["rows"]:
        quant = "-" if r["quant_seconds"] is None else f"{r['quant_seconds']:.0f}"
        lines.append(
            f"{r['label']:<36}{r['perplexity']:>10.3f}{_pct(r.get('increase'), '+'):>8}"
            f"{_pct(r['recovery']):>7}{r['heldout_perplexity']:>10.3f}"
            f"{_pct(r.get('heldout_increase'), '+'):>8}{_pct(r['heldout_recovery']):>7}{quant:>9}"
        )
    return "\n".join(lines)


def _pct(x: float | None, sign: str = "") -> str:
    return "-" if x is None else f"{100 * x:{sign}.1f}%"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--variants", default="all", help=f"all, or some of {', '.join(VARIANTS)}")
    p.add_argument("--num-samples", type=int, default=128)
    p.add_argument("--calib-seq-len", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    p.add_argument("--kv-cache-memory", default="64MiB")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    p.add_argument(
        "--append", action="store_true", help="keep the output's rows of the other variants"
    )
    args = p.parse_args(argv)
    names = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    args.variants = ["baseline", "rtn", *[n for n in names if n not in ("baseline", "rtn")]]
    return args


def main(argv: list[str] | None = None) -> int:
    return run_and_report(argv, parse_args, run, format_table)


if __name__ == "__main__":
    sys.exit(main())
