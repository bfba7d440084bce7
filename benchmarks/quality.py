"""Quality of each quantization method: perplexity, checkpoint size and quantization time.

    python benchmarks/quality.py [--model smollm2-135m] [--methods rtn,gptq,gptq-plain,gptq-act,
        awq,int8,fp8,fp8-rtn,fp8-kv,gptqmodel,autoawq] [--group-size auto] [--num-samples 32]
        [--calib-seq-len 256] [--seq-len 512] [--max-tokens 2048] [--dtype bfloat16]
        [--num-threads 1] [--output benchmarks/results/quality.json]

Calibration (`--calib`): each method's default in `qserve quantize` (`generated` for GPTQ:
half text the model samples itself, half Moby-Dick ch. 11-135; `moby-dick` for AWQ, INT8 and
FP8, and for the third-party tools' rows the default of qserve's method of their kind);
`moby-dick`, `generated`, `mixed` (the bundled mix of fiction, drama, encyclopedia prose,
Python documentation and Python code, `qserve.data.calibration_text`) or a file for all rows.
Every row is scored on two texts, each the first `--max-tokens` tokens (0: all) in
non-overlapping `--seq-len` windows, the same token ids for every row (tokenized once):

    in-domain   Moby-Dick ch. 1-10 (`moby-dick-eval`): the book of one calibration source
    held-out    State of the Union addresses 2010-2020 (`qserve.data.heldout_text`): a source
                and a kind of text (modern speeches) that no calibration source is

The held-out column is the one that says whether a method's gain over RTN generalizes.

Rows: the unquantized baseline (at `--dtype`), RTN / GPTQ / GPTQ act-order / AWQ w4, INT8
W8A8 (SmoothQuant), FP8 W8A8 and FP8 KV (baseline weights, fp8_e4m3 pages with scale 1.0), each
at qserve's defaults (GPTQ with GPTAQ; int8 / fp8 weights rounded with GPTQ); `-plain` and `-rtn`
rows turn those off (plain GPTQ, round-to-nearest int8 / fp8 weights). Each
checkpoint is written by `quantize_model` into a temp folder and scored by `qserve.eval.perplexity`
through LLMEngine (path `engine`: our quantized linears and paged KV cache). If the engine cannot
load a checkpoint, its weights are dequantized into a plain fp32 folder that the engine scores
instead (path `dequantized`; for int8/fp8 that leaves activations unquantized). The path is a
column of the table.

Third-party baselines (`benchmarks/third_party.py`): gptqmodel 7.6.0 GPTQ and autoawq 0.2.9 AWQ,
w4 at the same group size, quantized on exactly the calibration token ids qserve's GPTQ/AWQ use
(the same `calibration_windows` of the same text and tokenizer) and scored by the same engine
path. They are in the default `--methods` where their packages import, and reported "not
installed" where not.

`--group-size auto` (the default) is the largest of 128, 64, 32 that divides every linear's input
size (no format has partial groups): 128 for most models, 64 for SmolLM2 (hidden 576).
Prints a table and writes JSON.

`--model gemma3-270m` gives the Gemma 3 270M rows (`results/quality_gemma3_270m.json`: qserve's
methods, fp32, all of ch. 1-10, in-domain only: measured before the held-out column existed).
Every window starts with the tokenizer's prefix (Gemma's <bos>, which it needs).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qserve.config import EngineConfig  # noqa: E402
from qserve.engine.llm_engine import LLMEngine  # noqa: E402
from qserve.eval import load_eval_text, perplexity, text_prefix  # noqa: E402
from qserve.model.resolve import resolve_model  # noqa: E402

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "quality.json"
W4 = {"bits": 4}  # group_size: --group-size, filled in by `with_group_size`
GROUP_SIZES = (128, 64, 32)


@dataclass(frozen=True)
class Method:
    name: str
    label: str
    quantize: dict[str, Any] | None  # options of `tool`'s quantizer; None: the baseline weights
    kv_cache_dtype: str = "auto"
    tool: str = "qserve"  # qserve | gptqmodel | autoawq (benchmarks/third_party.py)


METHODS = {
    m.name: m
    for m in [
        Method("baseline", "baseline", None),
        Method("rtn", "RTN w4g{g}", {"method": "rtn", **W4}),
        # qserve's gptq default is GPTAQ (gptaq on); "-plain" rows are GPTQModel's default GPTQ.
        Method("gptq", "GPTQ w4g{g} (GPTAQ)", {"method": "gptq", "gptaq": True, **W4}),
        Method("gptq-plain", "GPTQ w4g{g} --no-gptaq", {"method": "gptq", "gptaq": False, **W4}),
        Method(
            "gptq-mse",
            "GPTQ w4g{g} --no-gptaq + mse",
            {"method": "gptq", "gptaq": False, "mse": True, **W4},
        ),
        Method(
            "gptq-act",
            "GPTQ w4g{g} act-order (GPTAQ)",
            {"method": "gptq", "gptaq": True, "desc_act": True, **W4},
        ),
        Method(
            "gptq-act-plain",
            "GPTQ w4g{g} act-order --no-gptaq",
            {"method": "gptq", "gptaq": False, "desc_act": True, **W4},
        ),
        Method("awq", "AWQ w4g{g}", {"method": "awq", **W4}),
        # int8 / fp8 default: GPTQ rounding of the weights; "-rtn" rows round to nearest.
        Method("int8", "INT8 W8A8", {"method": "int8", "bits": 8, "gptq_weights": True}),
        Method(
            "int8-rtn",
            "INT8 W8A8 --no-gptq-weights",
            {"method": "int8", "bits": 8, "gptq_weights": False},
        ),
        Method("fp8", "FP8 W8A8", {"method": "fp8", "bits": 8, "gptq_weights": True}),
        Method(
            "fp8-rtn",
            "FP8 W8A8 --no-gptq-weights",
            {"method": "fp8", "bits": 8, "gptq_weights": False},
        ),
        Method("fp8-kv", "FP8 KV (e4m3)", None, kv_cache_dtype="fp8_e4m3"),
        Method("gptqmodel", "gptqmodel 7.6.0 GPTQ w4g{g}", W4, tool="gptqmodel"),
        Method(
            "gptqmodel-gptaq",
            "gptqmodel 7.6.0 GPTAQ w4g{g}",
            {"gptaq": True, **W4},
            tool="gptqmodel",
        ),
        Method("autoawq", "autoawq 0.2.9 AWQ w4g{g}", {}, tool="autoawq"),
    ]
}
# method -> the module it imports
THIRD_PARTY = {"gptqmodel": "gptqmodel", "gptqmodel-gptaq": "gptqmodel", "autoawq": "awq"}


@dataclass
class Row:
    method: str
    label: str
    perplexity: float
    num_tokens: int
    num_windows: int
    eval_seconds: float
    size_mb: float
    quant_seconds: float | None
    path: str  # engine | dequantized
    scheme: str
    notes: list[str] = field(default_factory=list)
    heldout_perplexity: float | None = None  # on `heldout_text`; `perplexity`: in-domain
    heldout_num_tokens: int | None = None


# ----------------------------------------------------------------------------- checkpoints


def weights_mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e6


def fp32_note(folder: Path) -> str | None:
    """For a checkpoint that stores floating tensors in fp32 (the baseline, gptqmodel's and
    autoawq's unquantized tensors): what it would take with them in 16 bit."""
    from safetensors import safe_open

    numel, nbytes = 0, 0
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                t = f.get_slice(key)
                n = int(torch.Size(t.get_shape()).numel())
                numel += n if t.get_dtype() == "F32" and not key.endswith(_QUANT_AUX) else 0
                nbytes += n * _DTYPE_BYTES.get(t.get_dtype(), 2)
    if not numel:
        return None
    return f"{numel / 1e6:.1f}M floats stored as fp32; {(nbytes - 2 * numel) / 1e6:.1f} MB in bf16"


_DTYPE_BYTES = {"F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1, "F8_E4M3": 1}


def quantize(model: Path, method: Method, out: Path, args: argparse.Namespace) -> float:
    """Write `method`'s checkpoint into `out`; returns the seconds it took."""
    from qserve.quantize.driver import quantize_model
    from qserve.quantize.settings import QuantizeSettings

    if method.tool != "qserve":
        return quantize_third_party(model, method, out, args)
    start = time.monotonic()
    quantize_model(
        model,
        out,
        QuantizeSettings(
            calib=args.calib,
            num_samples=args.num_samples,
            seq_len=args.calib_seq_len,
            **method.quantize,
        ),
    )
    return time.monotonic() - start


def quantize_third_party(model: Path, method: Method, out: Path, args: argparse.Namespace) -> float:
    """gptqmodel / autoawq on qserve's calibration ids; their logs go to stderr."""
    from benchmarks import third_party

    quantizer = {
        "gptqmodel": third_party.gptqmodel_quantize,
        "autoawq": third_party.autoawq_quantize,
    }[method.tool]
    with contextlib.redirect_stdout(sys.stderr):
        kind = "gptq" if method.tool == "gptqmodel" else "awq"
        return quantizer(model, out, calibration_ids(model, args, kind), **method.quantize)


def calibration_ids(model: Path, args: argparse.Namespace, method: str = "gptq") -> torch.Tensor:
    """The windows `quantize_model` calibrates on: [num_samples, calib_seq_len] token ids of
    `--calib` ("default": what qserve's `method` calibrates on by default), tokenized by the
    model's tokenizer."""
    from transformers import AutoTokenizer

    from qserve.quantize.calibration import calibration_ids as ids_of
    from qserve.quantize.settings import CALIB_DEFAULTS

    tokenizer = AutoTokenizer.from_pretrained(model)
    calib = CALIB_DEFAULTS[method] if args.calib == "default" else args.calib
    return ids_of(model, tokenizer, calib, args.num_samples, args.calib_seq_len)


def auto_group_size(model: Path) -> int:
    """The largest of GROUP_SIZES dividing every linear's input size (-1: none does)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    widths = {config.hidden_size, config.intermediate_size, config.num_attention_heads * head_dim}
    return next((g for g in GROUP_SIZES if all(k % g == 0 for k in widths)), -1)


def with_group_size(method: Method, group_size: int) -> Method:
    """`method` at `group_size`, for the grouped (w4) methods; the others as they are."""
    if "{g}" not in method.label:
        return method
    label = method.label.format(g=group_size if group_size != -1 else "-channel")
    return replace(method, label=label, quantize={**method.quantize, "group_size": group_size})


def dequantized_folder(folder: Path, out: Path) -> Path:
    """A plain fp32 checkpoint with `folder`'s dequantized weights (config without
    quantization_config, the other files copied as they are)."""
    from safetensors.torch import load_file, save_file

    config = json.loads((folder / "config.json").read_text())
    qc = config.pop("quantization_config")
    out.mkdir(parents=True)
    state: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(file)))
    save_file(_dequantize_state(state, qc), str(out / "model.safetensors"))
    for f in folder.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in _QUANT_FILES:
            shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


_QUANT_FILES = {"config.json", "quantize_config.json", "model.safetensors.index.json"}
_QUANT_AUX = ("qzeros", "scales", "g_idx", "weight_scale", "input_scale", "k_scale", "v_scale")


def _dequantize_state(sd: dict[str, torch.Tensor], qc: dict[str, Any]) -> dict[str, torch.Tensor]:
    from qserve.kernels.packing import dequantize_awq, dequantize_gptq

    out: dict[str, torch.Tensor] = {}
    for key, t in sd.items():
        name, _, kind = key.rpartition(".")
        if kind == "qweight" and qc["quant_method"] == "gptq":
            q = (sd[f"{name}.qzeros"], sd[f"{name}.scales"], sd[f"{name}.g_idx"], qc["bits"])
            out[f"{name}.weight"] = dequantize_gptq(t, *q).float().contiguous()
        elif kind == "qweight":
            q = (sd[f"{name}.qzeros"], sd[f"{name}.scales"], qc["group_size"])
            out[f"{name}.weight"] = dequantize_awq(t, *q).float().contiguous()
        elif kind == "weight" and f"{name}.weight_scale" in sd:
            out[key] = (t.float() * sd[f"{name}.weight_scale"].float()).contiguous()
        elif kind not in _QUANT_AUX:
            out[key] = t.float().contiguous()
    return out


# ------------------------------------------------------------------------------ evaluation


def make_engine(folder: Path, kv_cache_dtype: str, args: argparse.Namespace) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            str(folder),
            dtype=args.dtype,
            kv_cache_memory=args.kv_cache_memory,
            kv_cache_dtype=kv_cache_dtype,
            num_threads=args.num_threads,
        )
    )


def load_engine(folder: Path, method: Method, tmp: Path, args: argparse.Namespace):
    """(engine, path, note): the quantized checkpoint through the engine, or its dequantized
    weights when the engine cannot load it."""
    try:
        return make_engine(folder, method.kv_cache_dtype, args), "engine", None
    except Exception as exc:  # not loadable yet: fall back, and say why in the table
        if method.quantize is None:
            raise
        note = f"engine could not load it ({type(exc).__name__}: {str(exc).splitlines()[0]})"
    plain = dequantized_folder(folder, tmp / f"{method.name}-dequantized")
    return make_engine(plain, method.kv_cache_dtype, args), "dequantized", note


def evaluate(
    folder: Path,
    method: Method,
    ids: list[int],
    tmp: Path,
    args: argparse.Namespace,
    heldout: list[int] | None = None,
) -> Row:
    """Perplexity on the in-domain `ids` and, when given, on the `heldout` ids (same engine)."""
    engine, path, note = load_engine(folder, method, tmp, args)
    prefix = text_prefix(engine.tokenizer)  # each window starts as a text does (Gemma: <bos>)
    result = perplexity(engine, ids, args.seq_len, args.max_tokens or None, prefix)
    held = None
    if heldout is not None:
        held = perplexity(engine, heldout, args.seq_len, args.max_tokens or None, prefix)
    scheme = engine.load_report.scheme
    del engine
    gc.collect()
    return Row(
        method.name,
        method.label,
        result.perplexity,
        result.num_tokens,
        result.num_windows,
        result.seconds,
        weights_mb(folder),
        None,
        path,
        scheme,
        [note] if note else [],
        held.perplexity if held else None,
        held.num_tokens if held else None,
    )


def run_method(
    model: Path,
    method: Method,
    ids: list[int],
    tmp: Path,
    args: argparse.Namespace,
    heldout: list[int] | None = None,
) -> Row:
    log(f"{method.label}: quantizing" if method.quantize else f"{method.label}: evaluating")
    if method.quantize is None:
        row = evaluate(model, method, ids, tmp, args, heldout)
        row.notes += [n for n in [fp32_note(model)] if n]
        return row
    folder = tmp / method.name
    seconds = quantize(model, method, folder, args)
    row = evaluate(folder, method, ids, tmp, args, heldout)
    row.quant_seconds = seconds
    fp32 = fp32_note(folder) if method.tool != "qserve" else None
    row.notes += [fp32] if fp32 else []
    return row


def eval_tokens(model: Path) -> list[int]:
    """Chapters 1-10, tokenized once with the model's tokenizer: the same ids for every row
    (without special tokens: `perplexity` starts each window with the tokenizer's prefix)."""
    from qserve.model.loader import load_tokenizer

    text = load_eval_text("moby-dick-eval")
    return load_tokenizer(model).encode(text, add_special_tokens=False)


def heldout_tokens(model: Path) -> list[int]:
    """The held-out text (`qserve.data.heldout_text`), tokenized once as `eval_tokens`."""
    from qserve.data import heldout_text
    from qserve.model.loader import load_tokenizer

    return load_tokenizer(model).encode(heldout_text(), add_special_tokens=False)


def installed(name: str) -> bool:
    """Whether `name` is a qserve method or a third-party one whose package is installed."""
    module = THIRD_PARTY.get(name)
    return module is None or importlib.util.find_spec(module) is not None


def third_party(names: list[str], group_size: int) -> dict[str, str]:
    """What became of the gptqmodel / autoawq rows."""
    out = {}
    for name, module in THIRD_PARTY.items():
        label = with_group_size(METHODS[name], group_size).label
        if not installed(name):
            out[label] = f"not installed (pip install the `test` extra for {module})"
        else:
            out[label] = "row above" if name in names else "installed, not requested"
    return out


# ---------------------------------------------------------------------------------- report


def recovery(rows: dict[str, Row], field_name: str = "perplexity") -> dict[str, float]:
    """Share of RTN's perplexity increase that GPTQ / AWQ win back (target >= 0.5), on the
    in-domain text (`perplexity`) or the held-out one (`heldout_perplexity`)."""
    base, rtn = rows.get("baseline"), rows.get("rtn")
    if base is None or rtn is None:
        return {}
    b, r = getattr(base, field_name), getattr(rtn, field_name)
    if b is None or r is None or r <= b:
        return {}
    names = [n for n in rows if n not in ("baseline", "rtn") and rows[n].quant_seconds is not None]
    names = [n for n in names if n.startswith(("gptq", "awq", "autoawq"))]
    names = [n for n in names if getattr(rows[n], field_name) is not None]
    return {n: (r - getattr(rows[n], field_name)) / (r - b) for n in names}


def format_table(rows: list[Row], base: float, heldout_base: float | None = None) -> str:
    """One line a row: in-domain perplexity, held-out perplexity (each also vs the baseline),
    size, times and path."""
    head = (
        f"{'method':<32}{'in-domain':>10}{'vs base':>9}{'held-out':>10}{'vs base':>9}"
        f"{'MB':>7}{'quant s':>8}{'eval s':>7}  path"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        quant = f"{r.quant_seconds:.0f}" if r.quant_seconds is not None else "-"
        held, held_delta = "-", "-"
        if r.heldout_perplexity is not None and heldout_base:
            held = f"{r.heldout_perplexity:.3f}"
            held_delta = f"{100 * (r.heldout_perplexity / heldout_base - 1):+.2f}%"
        lines.append(
            f"{r.label:<32}{r.perplexity:>10.3f}{_delta(r.perplexity, base):>9}{held:>10}"
            f"{held_delta:>9}{r.size_mb:>7.1f}{quant:>8}{r.eval_seconds:>7.1f}  "
            f"{r.path} ({r.scheme})"
        )
    return "\n".join(lines)


def _delta(value: float, base: float) -> str:
    return f"{100 * (value / base - 1):+.2f}%"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def measure(
    args: argparse.Namespace, on_row: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """Every row in turn; `on_row` gets the summary so far after each (a long run that dies
    keeps its finished rows)."""
    torch.set_num_threads(args.num_threads)
    model = resolve_model(args.model)
    ids = eval_tokens(model)
    heldout = heldout_tokens(model)
    if args.group_size == "auto":
        args.group_size = auto_group_size(model)
    names = ["baseline", *[n for n in args.methods if n != "baseline" and installed(n)]]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="qserve-quality-") as tmp:
        for name in names:
            method = with_group_size(METHODS[name], args.group_size)
            rows.append(run_method(model, method, ids, Path(tmp), args, heldout))
            r = rows[-1]
            quant = "-" if r.quant_seconds is None else f"{r.quant_seconds:.0f} s"
            log(f"  ppl {r.perplexity:.3f} ({r.path}), quantization {quant}")
            if on_row is not None:
                on_row(summarize(args, ids, names, rows))
    return summarize(args, ids, names, rows)


def summarize(
    args: argparse.Namespace, ids: Any, names: list[str], rows: list[Row]
) -> dict[str, Any]:
    return {
        "model": str(args.model),
        "settings": {k: v for k, v in vars(args).items() if k != "output"},
        "eval_tokens_available": len(ids),
        "rows": [asdict(r) for r in rows],
        "recovery_of_rtn_gap": recovery({r.method: r for r in rows}),
        "heldout_recovery_of_rtn_gap": recovery({r.method: r for r in rows}, "heldout_perplexity"),
        "third_party": third_party(names, args.group_size),
    }


def print_summary(summary: dict[str, Any]) -> None:
    rows = [Row(**r) for r in summary["rows"]]
    s = summary["settings"]
    span = f"first {s['max_tokens']}" if s["max_tokens"] else "all"
    print(
        f"{summary['model']}: perplexity, {span} tokens in {s['seq_len']}-token windows, of "
        f"Moby-Dick ch. 1-10 (in-domain, {rows[0].num_tokens} scored) and of State of the Union "
        f"2010-2020 (held-out, {rows[0].heldout_num_tokens} scored); calibration: "
        f"{s.get('calib', 'default')}, {s['num_samples']} x {s['calib_seq_len']} tokens; "
        f"activations {s['dtype']}"
    )
    print(format_table(rows, rows[0].perplexity, rows[0].heldout_perplexity))
    labels = {r.method: r.label for r in rows}
    held = summary.get("heldout_recovery_of_rtn_gap", {})
    for name, share in summary["recovery_of_rtn_gap"].items():
        tail = f", held-out {100 * held[name]:.0f}%" if name in held else ""
        print(f"{labels[name]} recovers {100 * share:.0f}% of RTN's increase in-domain{tail}")
    for label, state in summary["third_party"].items():
        print(f"{label}: {state}")
    for r in rows:
        for note in r.notes:
            print(f"note, {r.label}: {note}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--methods", default=",".join(n for n in METHODS if n != "baseline"))
    p.add_argument("--group-size", default="auto", choices=["auto", "128", "64", "32", "-1"])
    p.add_argument(
        "--calib",
        default="default",
        help="default (each method's: generated for GPTQ, moby-dick otherwise), moby-dick, "
        "generated, mixed, or a file.",
    )
    p.add_argument("--num-samples", type=int, default=32, help="Calibration windows.")
    p.add_argument("--calib-seq-len", type=int, default=256, help="Tokens per calibration window.")
    p.add_argument("--seq-len", type=int, default=512, help="Evaluation window.")
    p.add_argument(
        "--max-tokens", type=int, default=2048, help="Evaluation tokens; 0: all of ch. 1-10."
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--kv-cache-memory", default="64MiB")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    args.group_size = args.group_size if args.group_size == "auto" else int(args.group_size)
    if args.max_tokens < 0:
        p.error(f"--max-tokens must be >= 0 (0: all), got {args.max_tokens}")
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        p.error(f"unknown method {unknown[0]!r}; choose from {', '.join(METHODS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.getLogger("qserve").setLevel(logging.WARNING)
    args.output.parent.mkdir(parents=True, exist_ok=True)

    def write(summary: dict[str, Any]) -> None:
        args.output.write_text(json.dumps(summary, indent=2) + "\n")

    summary = measure(args, on_row=write)
    write(summary)
    print_summary(summary)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
