"""Quality of each quantization method: perplexity, checkpoint size and quantization time.

    python benchmarks/quality.py [--model smollm2-135m] [--methods rtn,gptq,gptq-act,awq,int8,
        fp8,fp8-kv] [--num-samples 32] [--calib-seq-len 256] [--seq-len 512] [--max-tokens 2048]
        [--dtype bfloat16] [--threads 1] [--output benchmarks/results/quality.json]

Calibration: the bundled Moby-Dick chapters 11-30 (`qserve.quantize` default). Evaluation:
chapters 1-10 (`moby-dick-eval`, ../shared/data), the first `--max-tokens` tokens in
non-overlapping `--seq-len` windows, the same token ids for every row (tokenized once).

Rows: the unquantized baseline (at `--dtype`), RTN / GPTQ / GPTQ act-order / AWQ w4g128, INT8
W8A8 (SmoothQuant), FP8 W8A8 and FP8 KV (baseline weights, fp8_e4m3 pages with scale 1.0). Each
checkpoint is written by `quantize_model` into a temp folder and scored by `qserve.eval.perplexity`
through LLMEngine (path `engine`: our quantized linears and paged KV cache). If the engine cannot
load a checkpoint, its weights are dequantized into a plain fp32 folder that the engine scores
instead (path `dequantized`; for int8/fp8 that leaves activations unquantized). The path is a
column of the table.

gptqmodel / autoawq baselines are reported as "not installed" unless those packages import.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import logging
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qserve.config import EngineConfig  # noqa: E402
from qserve.engine.llm_engine import LLMEngine  # noqa: E402
from qserve.eval import load_eval_text, perplexity  # noqa: E402
from qserve.model.resolve import resolve_model  # noqa: E402

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "quality.json"
W4G128 = {"bits": 4, "group_size": 128}


@dataclass(frozen=True)
class Method:
    name: str
    label: str
    quantize: dict[str, Any] | None  # quantize_model options; None: the baseline weights
    kv_cache_dtype: str = "auto"


METHODS = {
    m.name: m
    for m in [
        Method("baseline", "baseline", None),
        Method("rtn", "RTN w4g128", {"method": "rtn", **W4G128}),
        Method("gptq", "GPTQ w4g128", {"method": "gptq", **W4G128}),
        Method("gptq-act", "GPTQ w4g128 act-order", {"method": "gptq", "desc_act": True, **W4G128}),
        Method("awq", "AWQ w4g128", {"method": "awq", **W4G128}),
        Method("int8", "INT8 W8A8", {"method": "int8", "bits": 8}),
        Method("fp8", "FP8 W8A8", {"method": "fp8", "bits": 8}),
        Method("fp8-kv", "FP8 KV (e4m3)", None, kv_cache_dtype="fp8_e4m3"),
    ]
}
THIRD_PARTY = {"gptqmodel": "gptqmodel 7.6.0 GPTQ", "awq": "autoawq 0.2.9 AWQ"}


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


# ----------------------------------------------------------------------------- checkpoints


def weights_mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e6


def fp32_note(folder: Path) -> str | None:
    """For a checkpoint stored in fp32: what it would take at 2 bytes per weight."""
    from safetensors import safe_open

    numel, fp32 = 0, True
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                t = f.get_slice(key)
                numel += int(torch.Size(t.get_shape()).numel())
                fp32 = fp32 and t.get_dtype() == "F32"
    return f"weights stored as fp32; {2 * numel / 1e6:.1f} MB in bf16" if fp32 else None


def quantize(model: Path, method: Method, out: Path, args: argparse.Namespace) -> float:
    """Write `method`'s checkpoint into `out`; returns the seconds it took."""
    from qserve.quantize.driver import quantize_model

    start = time.monotonic()
    quantize_model(
        model, out, num_samples=args.num_samples, seq_len=args.calib_seq_len, **method.quantize
    )
    return time.monotonic() - start


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
            num_threads=args.threads,
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
    folder: Path, method: Method, ids: list[int], tmp: Path, args: argparse.Namespace
) -> Row:
    engine, path, note = load_engine(folder, method, tmp, args)
    result = perplexity(engine, ids, args.seq_len, args.max_tokens)
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
    )


def run_method(
    model: Path, method: Method, ids: list[int], tmp: Path, args: argparse.Namespace
) -> Row:
    log(f"{method.label}: quantizing" if method.quantize else f"{method.label}: evaluating")
    if method.quantize is None:
        row = evaluate(model, method, ids, tmp, args)
        row.notes += [n for n in [fp32_note(model)] if n]
        return row
    folder = tmp / method.name
    seconds = quantize(model, method, folder, args)
    row = evaluate(folder, method, ids, tmp, args)
    row.quant_seconds = seconds
    return row


def eval_tokens(model: Path) -> list[int]:
    """Chapters 1-10, tokenized once with the model's tokenizer: the same ids for every row."""
    from qserve.model.loader import load_tokenizer

    return load_tokenizer(model).encode(load_eval_text("moby-dick-eval"))


def third_party() -> dict[str, str]:
    """The optional gptqmodel / autoawq columns: only where those packages import."""
    out = {}
    for module, label in THIRD_PARTY.items():
        found = importlib.util.find_spec(module) is not None
        out[label] = "installed, not wired into this benchmark yet" if found else "not installed"
    return out


# ---------------------------------------------------------------------------------- report


def recovery(rows: dict[str, Row]) -> dict[str, float]:
    """Share of RTN's perplexity increase that GPTQ / AWQ win back (target >= 0.5)."""
    base, rtn = rows.get("baseline"), rows.get("rtn")
    if base is None or rtn is None or rtn.perplexity <= base.perplexity:
        return {}
    gap = rtn.perplexity - base.perplexity
    names = [n for n in ("gptq", "gptq-act", "awq") if n in rows]
    return {n: (rtn.perplexity - rows[n].perplexity) / gap for n in names}


def format_table(rows: list[Row], base: float) -> str:
    head = f"{'method':<24}{'ppl':>9}{'vs base':>9}{'MB':>8}{'quant s':>9}{'eval s':>8}  path"
    lines = [head, "-" * len(head)]
    for r in rows:
        quant = f"{r.quant_seconds:.0f}" if r.quant_seconds is not None else "-"
        delta = f"{100 * (r.perplexity / base - 1):+.2f}%"
        lines.append(
            f"{r.label:<24}{r.perplexity:>9.3f}{delta:>9}{r.size_mb:>8.1f}{quant:>9}"
            f"{r.eval_seconds:>8.1f}  {r.path} ({r.scheme})"
        )
    return "\n".join(lines)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    model = resolve_model(args.model)
    ids = eval_tokens(model)
    names = ["baseline", *[n for n in args.methods if n != "baseline"]]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="qserve-quality-") as tmp:
        for name in names:
            rows.append(run_method(model, METHODS[name], ids, Path(tmp), args))
            log(f"  ppl {rows[-1].perplexity:.3f} ({rows[-1].path})")
    return {
        "model": str(args.model),
        "settings": {k: v for k, v in vars(args).items() if k != "output"},
        "eval_tokens_available": len(ids),
        "rows": [asdict(r) for r in rows],
        "recovery_of_rtn_gap": recovery({r.method: r for r in rows}),
        "third_party": third_party(),
    }


def print_summary(summary: dict[str, Any]) -> None:
    rows = [Row(**r) for r in summary["rows"]]
    s = summary["settings"]
    print(
        f"{summary['model']}: perplexity on Moby-Dick ch. 1-10, first {s['max_tokens']} tokens in "
        f"{s['seq_len']}-token windows ({rows[0].num_tokens} scored); calibration ch. 11-30, "
        f"{s['num_samples']} x {s['calib_seq_len']} tokens; activations {s['dtype']}"
    )
    print(format_table(rows, rows[0].perplexity))
    for name, share in summary["recovery_of_rtn_gap"].items():
        print(f"{METHODS[name].label} recovers {100 * share:.0f}% of RTN's increase")
    for label, state in summary["third_party"].items():
        print(f"{label}: {state}")
    for r in rows:
        for note in r.notes:
            print(f"note, {r.label}: {note}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--methods", default=",".join(n for n in METHODS if n != "baseline"))
    p.add_argument("--num-samples", type=int, default=32, help="Calibration windows.")
    p.add_argument("--calib-seq-len", type=int, default=256, help="Tokens per calibration window.")
    p.add_argument("--seq-len", type=int, default=512, help="Evaluation window.")
    p.add_argument("--max-tokens", type=int, default=2048, help="Evaluation tokens.")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--kv-cache-memory", default="64MiB")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        p.error(f"unknown method {unknown[0]!r}; choose from {', '.join(METHODS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.getLogger("qserve").setLevel(logging.WARNING)
    summary = measure(args)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(summary, indent=2) + "\n")
    print_summary(summary)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
