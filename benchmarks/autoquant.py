"""Quality-budgeted quantization (issue 21): checkpoint size against perplexity for `--method
auto` at several budgets, beside uniform schemes and a llama.cpp-style mix, in one run.

    python benchmarks/autoquant.py [--model smollm2-135m] [--budgets 0.5,1,2,5,10]
        [--num-samples 32] [--seq-len 512] [--measure-samples N] [--eval-tokens 4096]
        [--num-threads 2] [--pareto-only | --budgets-only] [--no-chart]
        [--output benchmarks/results/autoquant.json] [--chart benchmarks/results/autoquant.png]

Rows, each a GPTQ checkpoint written by `quantize_model` (qserve's GPTQ defaults: GPTAQ, mse,
`--calib generated`, `--num-samples` x `--seq-len` tokens):

    uniform      W4 at every group size that divides the model's linears, W8 per channel,
                 W3 at the coarsest of them (a candidate of auto's, GPTQ format only)
    llama.cpp    Q4_K_M's rule at our schemes: attention q/k/v (llama.cpp: attn_v) and
                 down_proj at W8 in the layers llama.cpp gives more bits (the first and last
                 eighth, and every third between), W4 g64 elsewhere
    auto <b>%    --method auto --max-ppl-increase b%
    auto @<row>  --method auto --target-bits at the bits per weight of uniform W4 g64 and of
                 the llama.cpp mix: the Pareto comparison at equal size

Each row: bits per weight of the quantized linears (every tensor they store: codes, scales,
zeros, g_idx; 16-bit ones at 16), checkpoint MB, perplexity on the held-out text (the State of
the Union 2010-2020, what `auto` verifies its budget on) and in-domain (Moby-Dick ch. 1-10), each
the first `--eval-tokens` tokens in 512-token windows, fp32 through the engine, and for `auto`
the predicted increase and what its verification measured (the increase on the first 16384
held-out tokens and the upper 95% bound there that the budget is held to). Each `auto @<row>`
is also compared with its row on the same windows: the relative perplexity with a 95% interval
over windows (a paired comparison: both score the same text, so the spread of the text's
difficulty cancels).
`--pareto-only` runs just that comparison at W4 g64's size, `--budgets-only` just the budget
rows. The measurement pass's time is reported beside one GPTQ quantization's (target: at most
3x). Prints a table, writes the JSON after every row (a run takes hours) and a PNG chart.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_file import run_arguments, write_results  # noqa: E402
from qserve.model.resolve import resolve_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


@dataclasses.dataclass
class Row:
    name: str
    kind: str  # baseline | uniform | heuristic | auto
    bits_per_weight: float
    size_mb: float
    heldout: float
    in_domain: float
    heldout_windows: list[float]  # mean NLL per token of each window: for paired comparisons
    in_domain_windows: list[float]
    quant_seconds: float | None = None
    predicted_increase: float | None = None
    attempts: int | None = None
    budget: float | None = None
    verified_increase: float | None = None  # auto: on the verification's windows, and its
    verified_bound: float | None = None  # upper 95% bound there, what the budget is held to


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's rule (llama-quant.cpp) for the layers Q4_K_M gives attn_v / ffn_down more
    bits."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def heuristic_rules(num_layers: int) -> tuple[str, ...]:
    layers = "|".join(str(i) for i in range(num_layers) if use_more_bits(i, num_layers))
    return (rf".*\.layers\.({layers})\.(self_attn\.[qkv]_proj|mlp\.down_proj)$=w8ch",)


def linear_bits(folder: Path, prefix: str = "model.layers.") -> float:
    """Bits per weight of the decoder blocks' linears as stored (16-bit ones at 16)."""
    stored, weights = 0, 0
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = [k for k in f.keys() if k.startswith(prefix)]
        for key in keys:
            name, _, kind = key.rpartition(".")
            t = f.get_slice(key)
            numel = 1
            for d in t.get_shape():
                numel *= d
            size = numel * {"I32": 4, "F16": 2, "BF16": 2, "F32": 4}[t.get_dtype()]
            if kind == "qweight":
                stored += size
                g_idx = f.get_slice(f"{name}.g_idx").get_shape()[0]
                weights += g_idx * t.get_shape()[1]
            elif kind in ("qzeros", "scales", "g_idx"):
                stored += size
            elif kind == "weight" and len(t.get_shape()) == 2:
                stored += numel * 2
                weights += numel
    return 8 * stored / weights


def score(folder: Path, ids: dict[str, list[int]], tokens: int) -> dict[str, list[float]]:
    """Per text, the mean NLL per token of each 512-token window (the perplexity is the
    exponential of their mean: every window scores as many tokens)."""
    from qserve.config import EngineConfig
    from qserve.engine.llm_engine import LLMEngine
    from qserve.eval import text_prefix, window_nlls

    engine = LLMEngine(EngineConfig(str(folder), dtype="float32", kv_cache_memory="64MiB"))
    prefix = text_prefix(engine.tokenizer)
    window = min(512, engine.max_model_len - 1)
    out = {}
    for name, text in ids.items():
        nlls, count = window_nlls(engine, text, window, tokens, prefix)
        out[name] = [nll / count for nll in nlls]
    del engine
    gc.collect()
    return out


def perplexity(windows: list[float]) -> float:
    return math.exp(sum(windows) / len(windows))


def paired(a: list[float], b: list[float]) -> tuple[float, float]:
    """Perplexity of `a` relative to `b` scored on the same windows (a / b - 1), and the
    half-width of its 95% interval with the windows as samples (normal approximation)."""
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    n = len(diffs)
    mean = sum(diffs) / n
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1) / n) if n > 1 else math.inf
    return math.expm1(mean), math.expm1(mean + 1.96 * se) - math.expm1(mean)


def row_of(name: str, kind: str, bits: float, mb: float, nll: dict[str, list[float]]) -> Row:
    h, i = nll["heldout"], nll["in_domain"]
    return Row(name, kind, bits, mb, perplexity(h), perplexity(i), h, i)


def texts(model: Path) -> dict[str, list[int]]:
    from qserve.data import heldout_text
    from qserve.eval import load_eval_text
    from qserve.model.loader import load_tokenizer

    tok = load_tokenizer(model)
    return {
        "heldout": tok.encode(heldout_text(), add_special_tokens=False),
        "in_domain": tok.encode(load_eval_text("moby-dick-eval"), add_special_tokens=False),
    }


def quantized_row(
    model: Path, name: str, kind: str, settings: Any, tmp: Path, args: argparse.Namespace, ids
) -> Row | None:
    """The row of one checkpoint; None (and a line on stderr) when it cannot be made."""
    from qserve.errors import QServeError

    try:
        return _quantized_row(model, name, kind, settings, tmp, args, ids)
    except QServeError as exc:
        print(f"  {name}: not made ({exc})", file=sys.stderr, flush=True)
        return None


def _quantized_row(
    model: Path, name: str, kind: str, settings: Any, tmp: Path, args: argparse.Namespace, ids
) -> Row:
    from qserve.quantize.driver import quantize_model

    folder = tmp / name.replace(" ", "_").replace("%", "pct").replace("@", "at")
    start = time.monotonic()
    quantize_model(model, folder, settings)
    seconds = time.monotonic() - start
    row = row_of(name, kind, linear_bits(folder), _mb(folder), score(folder, ids, args.eval_tokens))
    row.quant_seconds = seconds
    recipe = folder / "qserve_recipe.json"
    auto = json.loads(recipe.read_text()).get("auto") if recipe.is_file() else None
    if auto is not None:
        row.predicted_increase = auto["predicted_increase"]
        row.attempts = len(auto["attempts"])
        row.budget = auto["budget"]["max_ppl_increase"]
        row.verified_increase = auto["measured"]["increase"]
        row.verified_bound = auto["measured"].get("increase_bound")
    return row


def _mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 1e6


def run(args: argparse.Namespace) -> dict[str, Any]:
    from qserve.quantize.auto.measure import measure
    from qserve.quantize.driver import auto_cache_dir
    from qserve.quantize.settings import QuantizeSettings

    torch.set_num_threads(args.num_threads)
    model = resolve_model(args.model)
    ids = texts(model)
    common = dict(num_samples=args.num_samples, seq_len=args.seq_len)
    config = json.loads((model / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    groups = [g for g in (128, 64, 32) if hidden % g == 0 and inter % g == 0]
    rows: list[Row | None] = []
    summary: dict[str, Any] = {"model": args.model, "args": run_arguments(args)}

    def add(row: Row | None) -> None:
        """A row, logged and written at once (a run of hours is not lost to an interruption)."""
        rows.append(row)
        log(row, rows[0])
        write_results(args.output, {**summary, **_totals(rows, pareto)}, quiet=True)

    pareto = "W4 g64" if 64 in groups else f"W4 g{groups[0]}"  # the equal-size comparison
    add(row_of("baseline", "baseline", 16.0, _mb(model), score(model, ids, args.eval_tokens)))
    with tempfile.TemporaryDirectory(prefix="qserve-autoquant-") as tmp:
        measured = dict(measure_samples=args.measure_samples) if args.measure_samples else {}
        auto = QuantizeSettings(method="auto", max_ppl_increase="1%", **common, **measured)
        # the measurement records its own time (when read back from the cache, that of the
        # run that made it); the auto rows read it from the cache
        summary["measure_seconds"] = measure(model, auto, auto_cache_dir()).seconds
        jobs = uniform_and_mix(groups, config["num_hidden_layers"], common)
        if args.budgets_only:
            jobs = []
        elif args.pareto_only:
            jobs = [job for job in jobs if job[0] == pareto]
        for name, kind, settings in jobs:
            add(quantized_row(model, name, kind, settings, Path(tmp), args, ids))
        for target in [r for r in rows if r is not None and r.name in (pareto, "llama.cpp mix")]:
            bits = target.bits_per_weight
            settings = QuantizeSettings(method="auto", target_bits=bits, **common, **measured)
            name = f"auto @{target.name}"
            add(quantized_row(model, name, "auto", settings, Path(tmp), args, ids))
        for b in [] if args.pareto_only else args.budgets:
            settings = QuantizeSettings(
                method="auto", max_ppl_increase=f"{b}%", **common, **measured
            )
            add(quantized_row(model, f"auto {b:g}%", "auto", settings, Path(tmp), args, ids))
    return {**summary, **_totals(rows, pareto)}


def _totals(rows: list[Row | None], pareto: str) -> dict[str, Any]:
    """The rows made so far, and the time of one GPTQ quantization (the equal-size uniform's)."""
    w4 = next((r for r in rows if r is not None and r.name == pareto), None)
    return {
        "gptq_seconds": w4.quant_seconds if w4 else None,
        "rows": [dataclasses.asdict(r) for r in rows if r is not None],
    }


def uniform_and_mix(groups: list[int], num_layers: int, common: dict) -> list[tuple]:
    """(name, kind, settings) of the uniform rows and the llama.cpp-style mix."""
    from qserve.quantize.settings import QuantizeSettings

    jobs = [
        (f"W4 g{g}", "uniform", QuantizeSettings(bits=4, group_size=g, **common)) for g in groups
    ]
    jobs.append(("W8", "uniform", QuantizeSettings(bits=8, group_size=-1, **common)))
    w3 = QuantizeSettings(bits=3, group_size=groups[0], **common)
    jobs.append((f"W3 g{groups[0]}", "uniform", w3))
    mix = QuantizeSettings(group_size=64, dynamic=heuristic_rules(num_layers), **common)
    jobs.append(("llama.cpp mix", "heuristic", mix))
    return jobs


def log(row: Row | None, base: Row | None) -> None:
    """A line per row on stderr."""
    if row is None or base is None:
        return
    print(
        f"  {row.name}: {row.bits_per_weight:.3f} bits, held-out {row.heldout:.3f} "
        f"({100 * (row.heldout / base.heldout - 1):+.2f}%)",
        file=sys.stderr,
        flush=True,
    )


def format_table(summary: dict[str, Any]) -> str:
    rows = summary["rows"]
    base_h, base_i = rows[0]["heldout"], rows[0]["in_domain"]
    head = (
        f"{'checkpoint':<18}{'bits/w':>8}{'MB':>8}{'held-out':>10}{'vs base':>9}"
        f"{'predicted':>10}{'budget':>8}{'bound':>8}{'in-domain':>11}{'vs base':>9}{'quant s':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        pred = "-" if r["predicted_increase"] is None else f"{100 * r['predicted_increase']:+.2f}%"
        bud = "-" if r["budget"] is None else f"{100 * r['budget']:g}%"
        quant = "-" if r["quant_seconds"] is None else f"{r['quant_seconds']:.0f}"
        bound = "-" if r.get("verified_bound") is None else f"{100 * r['verified_bound']:+.2f}%"
        lines.append(
            f"{r['name']:<18}{r['bits_per_weight']:>8.3f}{r['size_mb']:>8.1f}"
            f"{r['heldout']:>10.3f}{100 * (r['heldout'] / base_h - 1):>+8.2f}%{pred:>10}{bud:>8}"
            f"{bound:>8}"
            f"{r['in_domain']:>11.3f}{100 * (r['in_domain'] / base_i - 1):>+8.2f}%{quant:>9}"
        )
    lines += paired_lines(rows)
    if summary.get("gptq_seconds") and summary.get("measure_seconds"):
        ratio = summary["measure_seconds"] / summary["gptq_seconds"]
        lines.append(
            f"measurement pass {summary['measure_seconds']:.0f} s, one GPTQ quantization "
            f"{summary['gptq_seconds']:.0f} s: {ratio:.2f}x"
        )
    return "\n".join(lines)


def paired_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Each `auto @<row>` against <row> on the same windows: the relative perplexity and its
    95% interval, held-out and in-domain."""
    by_name = {r["name"]: r for r in rows}
    lines = []
    for r in rows:
        other = by_name.get(r["name"].partition("@")[2])
        if not r["name"].startswith("auto @") or other is None:
            continue
        text = [f"{r['name']} against {other['name']}:"]
        for key, label in [("heldout", "held-out"), ("in_domain", "in-domain")]:
            diff, half = paired(r[f"{key}_windows"], other[f"{key}_windows"])
            n = len(r[f"{key}_windows"])
            text.append(f"{label} {100 * diff:+.2f}% +- {100 * half:.2f}% ({n} windows)")
        lines.append(" ".join(text))
    return lines


def chart(summary: dict[str, Any], path: Path) -> None:
    """Held-out perplexity increase against bits per weight, one marker kind per row kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    base = rows[0]["heldout"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kind, marker in [("uniform", "s"), ("heuristic", "^"), ("auto", "o")]:
        pts = sorted(
            (r["bits_per_weight"], 100 * (r["heldout"] / base - 1), r["name"])
            for r in rows
            if r["kind"] == kind
        )
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=kind)
            for x, y, name in pts:
                ax.annotate(name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("bits per weight of the quantized linears")
    ax.set_ylabel("held-out perplexity increase (%)")
    ax.set_yscale("symlog", linthresh=1)
    ax.set_title(f"{summary['model']}: size against quality")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--budgets", default="0.5,1,2,5,10", help="percent, comma-separated")
    p.add_argument("--num-samples", type=int, default=32, help="GPTQ calibration windows")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per calibration window")
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument(
        "--measure-samples", type=int, default=None, help="auto's KL windows (default: its own)"
    )
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument(
        "--pareto-only",
        action="store_true",
        help="only the equal-size comparison: baseline, uniform W4 g64 (the coarsest W4 where 64 "
        "does not divide the linears), auto at its size",
    )
    p.add_argument(
        "--budgets-only",
        action="store_true",
        help="only the baseline and the auto budget rows (what a change to the verification "
        "moves: the uniform and equal-size rows do not depend on it)",
    )
    p.add_argument("--output", type=Path, default=RESULTS / "autoquant.json")
    p.add_argument("--chart", type=Path, default=RESULTS / "autoquant.png")
    p.add_argument("--no-chart", action="store_true", help="no PNG (needs no matplotlib)")
    args = p.parse_args(argv)
    try:
        args.budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    except ValueError:
        p.error(f"--budgets takes percentages separated by commas, got {args.budgets!r}")
    counts = [args.num_samples, args.seq_len - 1, args.eval_tokens, args.num_threads]
    if min(counts) < 1 or (args.measure_samples is not None and args.measure_samples < 1):
        p.error("--num-samples, --measure-samples, --eval-tokens, --num-threads must be positive "
                "and --seq-len at least 2")  # fmt: skip
    if args.pareto_only and args.budgets_only:
        p.error("--pareto-only and --budgets-only are each other's complement: give one")
    if any(b <= 0 for b in args.budgets):
        p.error("--budgets must be positive percentages")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    summary = run(args)
    write_results(args.output, summary)
    print(format_table(summary))
    if not args.no_chart:
        chart(summary, args.chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
