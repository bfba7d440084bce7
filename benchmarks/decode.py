"""Decode ms/token against the memory-bandwidth floor (issue 22), in one run.

    python benchmarks/decode.py [--model smollm2-135m] [--batch-sizes 1 16 64]
        [--decode-prompt-len 64] [--decode-steps 16] [--num-threads 2] [--skip-hf]
        [--device cpu|cuda] [--output benchmarks/results/decode.json]

Rows: dense fp32, dense bf16, W4 (RTN, group 64 or the largest dividing every linear) with
lm_head 16-bit, and W4 with a W4 lm_head (`--quantize-lm-head`); each in qserve's engine,
eager (`--enforce-eager`) and with the compiled decode step (step graphs on CPU, CUDA graphs
with `--device cuda`: the batch size's graph is captured in an untimed step, and its capture
time reported). A row's ms/token is the
median wall time of one decode step with B requests running (`throughput.py`'s steady-state
measurement: all engines prefilled, then stepped round robin), i.e. each sequence's time per
token.

The floor is the bytes one step must read divided by the read bandwidth measured in the same
run (`read_bandwidth`: a sum over a 1 GiB buffer with the same threads): every tensor the
loaded model holds, as its kernels hold them (repacked W4 codes, scales and zeros included,
`step_bytes`), except the input embeddings unless lm_head reads them too (a step reads B of
their rows).
transformers' bf16 `generate` at batch 1 runs beside them: (t(129) - t(1)) / 128 per token.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import throughput  # noqa: E402
from benchmarks.results_file import run_and_report, run_arguments  # noqa: E402
from qserve.model.resolve import resolve_model  # noqa: E402

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "decode.json"
BANDWIDTH_BYTES = 1 << 30


def read_bandwidth(num_threads: int, repeats: int = 7, device: str = "cpu") -> float:
    """GB/s of reading a 1 GiB fp32 buffer (a sum over it) on `device`, the median of
    `repeats`."""
    torch.set_num_threads(num_threads)
    buf = torch.ones(BANDWIDTH_BYTES // 4, device=device)
    buf.sum()  # touch every page first
    times = []
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        buf.sum()
        _sync(device)
        times.append(time.perf_counter() - t)
    return BANDWIDTH_BYTES / statistics.median(times) / 1e9


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def step_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor storage the model holds, less the input embeddings unless tied to
    lm_head. Kernel paths keep repacked weights outside parameters and buffers (the C++ W4
    layout as a `w4` attribute, torch's int4 / int8 packs in the closure that runs them): those
    are found through module attributes, dataclass fields and closure cells, each storage once."""
    storages: dict[int, int] = {}
    for module in model.modules():
        for t in _held_tensors([*module._parameters.values(), *module._buffers.values(),
                                *vars(module).values()]):  # fmt: skip
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    embed = model.model.embed_tokens.weight  # qserve's model code names it as transformers does
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    tied = head is not None and head.data_ptr() == embed.data_ptr()
    return sum(storages.values()) - (0 if tied else embed.untyped_storage().nbytes())


def _held_tensors(values: list[Any], depth: int = 2) -> list[torch.Tensor]:
    """The tensors among `values`, in dataclasses among them, or in functions' closures."""
    found = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif depth and dataclasses.is_dataclass(v) and not isinstance(v, type):
            found += _held_tensors([getattr(v, f.name) for f in dataclasses.fields(v)], depth - 1)
        elif depth and callable(v) and getattr(v, "__closure__", None):
            found += _held_tensors([c.cell_contents for c in v.__closure__], depth - 1)
    return found


def w4_checkpoints(model: Path, folder: Path) -> list[Path]:
    """RTN W4 with lm_head 16-bit, and with a W4 lm_head (decode speed, not quality)."""
    from qserve.quantize.driver import quantize_model
    from qserve.quantize.settings import QuantizeSettings

    out = []
    for name, head in (("w4", False), ("w4 + w4 lm_head", True)):
        settings = QuantizeSettings(method="rtn", quantize_lm_head=head)
        out.append(quantize_model(model, folder / name, settings))
    return out


def eager_and_graphs(specs: list[throughput.ModelSpec]) -> list[throughput.ModelSpec]:
    """Each model twice: eager (--enforce-eager) and with the compiled decode step."""
    out = []
    for s in specs:
        out.append(dataclasses.replace(s, label=f"{s.label} eager", enforce_eager=True))
        out.append(dataclasses.replace(s, label=f"{s.label} graph", enforce_eager=False))
    return out


def capture_ms(engine: Any, batch: int) -> float | None:
    """How long capturing this batch size's decode step took (None: eager)."""
    graphs = engine.model_runner.decode_graphs
    size = None if graphs is None else graphs.size_for(batch)
    graph = None if size is None else graphs.graphs.get(size)
    return None if graph is None else 1e3 * graph.capture_seconds


def hf_ms_per_token(model: Path, prompt: list[int], num_threads: int) -> float:
    """transformers bf16 greedy `generate` at batch 1: (t(129 tokens) - t(1)) / 128, medians."""
    torch.set_num_threads(num_threads)
    hf, pad = throughput.load_hf(model, torch.bfloat16)
    throughput.hf_generate(hf, pad, [prompt], 4)  # warm-up

    def timed(n: int) -> float:
        runs = []
        for _ in range(3):
            t = time.perf_counter()
            throughput.hf_generate(hf, pad, [prompt], n)
            runs.append(time.perf_counter() - t)
        return statistics.median(runs)

    return 1e3 * (timed(129) - timed(1)) / 128


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    model = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    bandwidth = read_bandwidth(args.num_threads, device=args.device)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="qserve-decode-") as tmp:
        specs = eager_and_graphs(
            throughput.decode_specs(str(model), w4_checkpoints(model, Path(tmp)))
        )
        for batch in args.batch_sizes:
            prompts = throughput.decode_prompts(tokenizer, args, batch)
            engines = throughput.start_engines(specs, prompts, args)
            times = throughput.step_in_turn(engines, batch, args.decode_steps)
            for s in specs:
                ms = 1e3 * statistics.median(t[0] for t in times[s.label])
                engine = engines[s.label]
                nbytes = step_bytes(engine.model_runner.model)
                floor = 1e3 * nbytes / (bandwidth * 1e9)
                rows.append({"label": s.label.rsplit(" ", 1)[0], "batch_size": batch,
                             "mode": "eager" if s.enforce_eager else "graph",
                             "ms_per_token": ms, "weight_mb": nbytes / 1e6, "floor_ms": floor,
                             "x_floor": ms / floor,
                             "capture_ms": capture_ms(engine, batch)})  # fmt: skip
            del engines
            gc.collect()
    hf = None if args.skip_hf else hf_ms_per_token(model, prompts[0], args.num_threads)
    return {"model": args.model, "device": args.device, "settings": run_arguments(args),
            "read_gb_s": bandwidth, "hf_bf16_ms_per_token_b1": hf, "rows": rows}  # fmt: skip


def format_table(summary: dict[str, Any]) -> str:
    head = (
        f"{'model':<18}{'mode':>6}{'B':>4}{'ms/token':>10}{'weights MB':>12}{'floor ms':>10}"
        f"{'x floor':>9}{'capture ms':>12}"
    )
    device = summary.get("device", "cpu")
    lines = [f"{device}: read bandwidth {summary['read_gb_s']:.1f} GB/s", head, "-" * len(head)]
    for r in summary["rows"]:
        capture = r.get("capture_ms")
        lines.append(
            f"{r['label']:<18}{r.get('mode', 'eager'):>6}{r['batch_size']:>4}"
            f"{r['ms_per_token']:>10.2f}{r['weight_mb']:>12.1f}{r['floor_ms']:>10.2f}"
            f"{r['x_floor']:>9.2f}{'-' if capture is None else f'{capture:.0f}':>12}"
        )
    hf = summary["hf_bf16_ms_per_token_b1"]
    if hf is not None:
        lines.append(f"transformers bf16 generate, B=1: {hf:.2f} ms/token")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64], metavar="B")
    p.add_argument("--decode-prompt-len", type=int, default=64)
    p.add_argument("--decode-steps", type=int, default=16, help="timed steps per engine")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-hf", action="store_true", help="no transformers row")
    p.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cuda: CUDA graphs against eager (with --skip-hf)",
    )
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = p.parse_args(argv)
    if min(args.batch_sizes) < 1 or args.decode_steps < 1 or args.decode_prompt_len < 1:
        p.error("batch sizes, --decode-steps and --decode-prompt-len must be positive")
    if args.device != "cpu" and not args.skip_hf:
        p.error("the transformers row runs on CPU only: pass --skip-hf with --device")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device on this machine")
    return args


def main(argv: list[str] | None = None) -> int:
    return run_and_report(argv, parse_args, run, format_table)


if __name__ == "__main__":
    sys.exit(main())
