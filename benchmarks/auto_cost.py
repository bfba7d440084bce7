"""What `--method auto`'s measurement pass costs beside GPTQ quantizations (issue 21's target: at
most 3x one GPTQ quantization), in one process.

    python benchmarks/auto_cost.py [--model smollm2-135m] [--num-samples 128 32] [--seq-len 512]
        [--pass-num-samples 128] [--num-threads 2] [--output benchmarks/results/auto_cost.json]

Times, one after the other: the measurement pass from a cold cache (qserve's defaults: Hessians
on --pass-num-samples windows of --seq-len tokens (128), KLs on 4 more, `generated` calibration),
then one GPTQ quantization per --num-samples (128: qserve's default; 32: what
`benchmarks/autoquant.py` uses, with `--pass-num-samples 32` for its pass). Each run has an
empty cache of its own (`QSERVE_CACHE_DIR`), so each time includes sampling its `generated`
windows, as a first quantization of a model does (`--method auto` samples once for its pass
and its quantization: the pass's windows are the quantization's and a few more). Prints a
table and writes JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_file import run_and_report, run_arguments  # noqa: E402
from qserve.model.resolve import resolve_model  # noqa: E402

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "auto_cost.json"


def run(args: argparse.Namespace) -> dict[str, Any]:
    from qserve.quantize.auto.measure import measure
    from qserve.quantize.driver import quantize_model
    from qserve.quantize.settings import QuantizeSettings

    torch.set_num_threads(args.num_threads)
    model = resolve_model(args.model)
    seconds: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="qserve-auto-cost-") as tmp:
        start = time.monotonic()
        auto = QuantizeSettings(
            method="auto", max_ppl_increase="1%", num_samples=args.pass_num_samples,
            seq_len=args.seq_len,
        )  # fmt: skip
        with _cache(Path(tmp) / "pass"):  # measured, not read back
            measure(model, auto, Path(tmp) / "pass" / "autoquant")
        seconds["measurement pass"] = time.monotonic() - start
        for n in args.num_samples:
            name = f"GPTQ, {n} x {args.seq_len}"
            settings = QuantizeSettings(num_samples=n, seq_len=args.seq_len)
            start = time.monotonic()
            with _cache(Path(tmp) / f"gptq-{len(seconds)}") as root:
                quantize_model(model, root / "out", settings)
            seconds[name] = time.monotonic() - start
    return {"model": args.model, "settings": run_arguments(args), "seconds": seconds}


@contextlib.contextmanager
def _cache(root: Path) -> Iterator[Path]:
    """Inside, qserve's cache (the sampled calibration windows) is the empty folder `root`."""
    before = os.environ.get("QSERVE_CACHE_DIR")
    os.environ["QSERVE_CACHE_DIR"] = str(root)
    try:
        yield root
    finally:
        if before is None:
            del os.environ["QSERVE_CACHE_DIR"]
        else:
            os.environ["QSERVE_CACHE_DIR"] = before


def format_table(summary: dict[str, Any]) -> str:
    s = summary["seconds"]
    measure = s["measurement pass"]
    lines = [f"{'run':<30}{'seconds':>9}{'pass / run':>12}"]
    lines += [f"{name:<30}{t:>9.0f}{measure / t:>12.2f}" for name, t in s.items()]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--num-samples", type=int, nargs="+", default=[128, 32], help="GPTQ windows")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per calibration window")
    p.add_argument("--pass-num-samples", type=int, default=128, help="the pass's Hessian windows")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = p.parse_args(argv)
    if min(*args.num_samples, args.pass_num_samples, args.seq_len, args.num_threads) < 1:
        p.error("--num-samples, --pass-num-samples, --seq-len, --num-threads must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    return run_and_report(argv, parse_args, run, format_table)


if __name__ == "__main__":
    sys.exit(main())
