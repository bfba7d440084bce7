"""GPTQ's generalization gap, layer by layer (issue 27): each variant's output error on the
calibration text beside the same error on held-out text, for a few linears of the float model.

    python benchmarks/gptq_layer_error.py [--model smollm2-135m] [--calib mixed]
        [--num-samples 64] [--layers 4,14,24,29] [--output benchmarks/results/gptq_layer_error.json]

For linear W [N, K] of layer l, H_cal and H_held are the second moments of its input on the
calibration windows and on 8 x 512 tokens of the held-out text (State of the Union 2010-2020),
both from the float model. Each variant quantizes W (w4 g64, on H_cal) to Q; its error on a
text is tr((W - Q) H (W - Q)^T) / tr(W H W^T). RTN's two errors are about equal; GPTQ's
calibration error is what it minimizes, and its held-out error is what generalizes. Much faster
than full quantization plus perplexity (`gptq_heldout.py`), so it screens settings first; the
sum over linears is not perplexity. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_file import run_and_report, run_arguments  # noqa: E402
from qserve.model.resolve import resolve_model  # noqa: E402

LINEARS = ("self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")


def variants(W: torch.Tensor, H: torch.Tensor) -> dict[str, torch.Tensor]:
    """name -> dequantized Q of W, each from the calibration Hessian H (GPTQ's 2/n sum x x^T)."""
    from qserve.quantize.gptq import gptq_quantize
    from qserve.quantize.rtn import rtn_quantize

    def gptq(H: torch.Tensor, **kw: Any) -> torch.Tensor:
        damp = kw.pop("damp", 0.01)
        kw.setdefault("act_group_aware", not kw.get("desc_act", False))
        return gptq_quantize(W, H, 4, 64, True, damp, min_zero=1, **kw).dequantize()

    diag = torch.diag(torch.diag(H))
    return {
        "rtn": rtn_quantize(W, 4, 64, True, 1).dequantize(),
        "gptq (default)": gptq(H),
        "gptq damp 0.1": gptq(H, damp=0.1),
        "gptq mse": gptq(H, mse=True),
        "gptq shrink 0.3": gptq(0.7 * H + 0.3 * diag),
        "gptq shrink 0.3 + mse": gptq(0.7 * H + 0.3 * diag, mse=True),
        "gptq act-order": gptq(H, desc_act=True),
    }


def second_moments(model: Any, ids: torch.Tensor, layers: list[int]) -> dict[str, torch.Tensor]:
    """'l.name' -> mean x x^T of that linear's input over the windows `ids` [S, T]."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    hooks = []
    for layer in layers:
        for name in LINEARS:
            key = f"{layer}.{name}"

            def hook(module: Any, args: Any, out: Any, key: str = key) -> None:
                x = args[0].reshape(-1, args[0].shape[-1]).float()
                sums[key] = sums.get(key, 0) + x.t() @ x
                counts[key] = counts.get(key, 0) + x.shape[0]

            module = model.model.layers[layer].get_submodule(name)
            hooks.append(module.register_forward_hook(hook))
    with torch.no_grad():
        for window in ids:
            model(window[None])
    for h in hooks:
        h.remove()
    return {k: sums[k] / counts[k] for k in sums}


def relative_error(W: torch.Tensor, Q: torch.Tensor, H: torch.Tensor) -> float:
    d = W - Q
    return float(((d @ H) * d).sum() / ((W @ H) * W).sum())


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qserve.data import heldout_text
    from qserve.quantize.calibration import calibration_windows, load_calibration_text

    torch.set_num_threads(args.num_threads)
    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    calib = load_calibration_text(args.calib)
    start = time.monotonic()
    cal = second_moments(model, calibration_windows(tok, calib, args.num_samples, 512), args.layers)
    held = second_moments(model, calibration_windows(tok, heldout_text(), 8, 512), args.layers)
    rows = []
    for key, H in cal.items():
        layer, name = key.split(".", 1)
        W = model.model.layers[int(layer)].get_submodule(name).weight.data.float()
        for variant, Q in variants(W, 2 * H).items():
            rows.append({"linear": key, "variant": variant,
                         "calibration": relative_error(W, Q, H),
                         "heldout": relative_error(W, Q, held[key])})  # fmt: skip
    return {"model": args.model, "args": run_arguments(args), "rows": rows,
            "seconds": time.monotonic() - start}  # fmt: skip


def format_table(summary: dict[str, Any]) -> str:
    totals: dict[str, list[float]] = {}
    for r in summary["rows"]:
        t = totals.setdefault(r["variant"], [0.0, 0.0])
        t[0] += r["calibration"]
        t[1] += r["heldout"]
    lines = [f"{'variant':<24}{'calibration':>12}{'held-out':>10}{'gap':>7}"]
    for variant, (c, h) in totals.items():
        lines.append(f"{variant:<24}{c:>12.4f}{h:>10.4f}{h / c:>7.2f}")
    return "\n".join(lines) + "\n(sum of relative output errors over the linears)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--calib", default="mixed")
    p.add_argument("--num-samples", type=int, default=64)
    p.add_argument("--layers", default="4,14,24,29")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--output", type=Path, default=Path(__file__).parent / "results" /
                   "gptq_layer_error.json")  # fmt: skip
    args = p.parse_args(argv)
    args.layers = [int(x) for x in args.layers.split(",")]
    return args


def main(argv: list[str] | None = None) -> int:
    return run_and_report(argv, parse_args, run, format_table)


if __name__ == "__main__":
    sys.exit(main())
