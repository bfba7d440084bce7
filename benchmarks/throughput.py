"""Offline throughput: qserve (continuous batching, paged KV) against transformers `generate`,
and decode speed of quantized checkpoints against the dense model.

    python benchmarks/throughput.py [--num-requests 64] [--seed 0] [--dtype auto]
        [--num-threads 2] [--max-num-seqs 64] [--kv-cache-memory 1GiB] [--skip-hf] [--quick]
        [--checkpoint DIR ...] [--decode-batch-sizes 1 64] [--decode-prompt-len 128]
        [--decode-steps 16] [--skip-decode] [--skip-workload]
        [--output benchmarks/results/throughput.json]

Workload (64 concurrent requests). One seeded workload (benchmarks/workload.py: real prompts of
32-512 tokens, 16-256 output tokens, EOS ignored) runs side by side in one process, same thread
count, each engine after a warm-up:

- qserve: all requests added at once, the engine stepped to completion (the dense model twice:
  with the compiled decode step, the default, and with --enforce-eager); after every step the KV
  cache is sampled (`get_stats`: slots holding computed tokens / slots of the blocks held) and
  compared with a contiguous allocation that reserves prompt + max_tokens, or max_model_len, slots
  per running request from the start. The dense model runs in --dtype; every --checkpoint
  (a quantized folder from `qserve quantize` or the ecosystem) gets a row too, in the engine's
  dtype for it (`auto`: bf16 activations on CPU, what torch's weight-only kernels take).
- transformers: static batches of 8 in workload order, left padded, every batch generating its
  longest output (`min_new_tokens = max_new_tokens`); only each request's own output tokens count.

Decode. For each batch size B, the dense model in fp32 and in bf16 and every checkpoint each get
B requests of --decode-prompt-len tokens (cut from the same text for all); once every request is
past its prompt, the engines take turns stepping (round robin, so load from other processes falls
on all of them alike) for --decode-steps timed steps after two untimed ones. Reported: the median
step time, wall clock and process CPU time, as tokens/s (B / step time), and the ratio to dense
bf16. B = 1 is latency-bound decode; B = 64 is the decode half of the 64-request workload.

Prints tables and writes JSON.
"""

from __future__ import annotations

import argparse
import gc
import math
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_file import write_results  # noqa: E402
from benchmarks.workload import QUICK, BenchRequest, WorkloadConfig, make_workload  # noqa: E402

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "throughput.json"
HF_BATCH_SIZE = 8
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
DENSE = "qserve"  # the result key of the dense model's workload run (kept from earlier JSON)
EAGER = "qserve --enforce-eager"  # the same model without the compiled decode step
BASELINE = "dense bf16"  # decode ratios are to this row
DECODE_WARMUP_STEPS = 2


@dataclass
class RunResult:
    name: str
    output_tokens: int
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


@dataclass
class KVSample:
    """One step's KV cache: live token slots, paged slots held, contiguous reservations."""

    live: int
    allocated: int
    reserved_request: int  # sum of prompt + max_tokens over running requests
    reserved_max_len: int  # running requests x max_model_len


@dataclass(frozen=True)
class ModelSpec:
    """One model to run: a label for the tables, a folder (or alias) and the engine dtype."""

    label: str
    model: str
    dtype: str  # "auto" or a DTYPES key
    enforce_eager: bool = False  # True: no compiled decode step (the engine's --enforce-eager)


# ------------------------------------------------------------------------------------ qserve


def make_llm(args: argparse.Namespace, spec: ModelSpec) -> Any:
    from qserve import LLM

    return LLM(
        spec.model,
        dtype=spec.dtype,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        num_threads=args.num_threads,
        enforce_eager=spec.enforce_eager,
    )


def warm_up_qserve(llm: Any) -> None:
    """A few short requests on token ids that no workload prompt starts with (no cache hits)."""
    from qserve import SamplingParams

    vocab = llm.engine.model_config.vocab_size - 100
    prompts = [[(1000 + 7 * i + j) % vocab + 100 for j in range(16 + 8 * i)] for i in range(4)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))


def run_qserve(
    requests: list[BenchRequest], args: argparse.Namespace, spec: ModelSpec, name: str = DENSE
) -> RunResult:
    from qserve import SamplingParams

    llm = make_llm(args, spec)
    warm_up_qserve(llm)
    engine = llm.engine
    start_stats = engine.get_stats()
    num_tokens, samples, step_times = 0, [], []
    start = time.perf_counter()
    for r in requests:
        params = SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
        engine.add_request(f"bench-{r.request_id}", r.prompt_token_ids, params)
    sampling_s = 0.0
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outputs = engine.step()
        t1 = time.perf_counter()
        num_tokens += sum(len(o.outputs[0].token_ids) for o in outputs if o.finished)
        samples.append(sample_kv(engine))
        step_times.append(t1 - t0)
        sampling_s += time.perf_counter() - t1
    seconds = time.perf_counter() - start - sampling_s
    extra = {**describe(spec, engine), **qserve_extra(engine, start_stats, step_times, samples)}
    del llm, engine
    gc.collect()
    return RunResult(name, num_tokens, seconds, extra)


def describe(spec: ModelSpec, engine: Any) -> dict[str, Any]:
    """What ran: the folder, activation dtype, weight scheme, kernel path per layer kind and
    the projections merged into one matmul (qkv_proj, gate_up_proj)."""
    report = engine.load_report
    return {
        "model": spec.model,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "scheme": report.scheme,
        "linear_paths": report.linear_paths,
        "merged": list(report.merged),
    }


def sample_kv(engine: Any) -> KVSample:
    stats = engine.get_stats()
    running = engine.scheduler.running
    return KVSample(
        live=stats.kv_live_slots,
        allocated=stats.kv_allocated_slots,
        reserved_request=sum(r.num_prompt_tokens + r.sampling_params.max_tokens for r in running),
        reserved_max_len=len(running) * engine.max_model_len,
    )


def qserve_extra(
    engine: Any, start_stats: dict[str, float], step_times: list[float], samples: list[KVSample]
) -> dict[str, Any]:
    stats = engine.get_stats()
    return {
        "num_steps": len(step_times),
        "median_step_ms": 1e3 * statistics.median(step_times),
        "max_model_len": engine.max_model_len,
        "kv_cache_tokens": engine.model_runner.kv_spec.num_tokens,
        "num_preemptions": stats.num_preemptions - start_stats.num_preemptions,
        "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
        "kv": kv_summary(samples),
    }


def kv_summary(samples: list[KVSample]) -> dict[str, float]:
    """Mean per-step utilisation (live / slots held or reserved) and the peak slots needed."""
    used = [s for s in samples if s.allocated > 0]

    def mean(values: list[float]) -> float:
        return statistics.fmean(values) if values else float("nan")

    return {
        "utilisation_paged": mean([s.live / s.allocated for s in used]),
        "utilisation_contiguous_request": mean([s.live / s.reserved_request for s in used]),
        "utilisation_contiguous_max_len": mean([s.live / s.reserved_max_len for s in used]),
        "peak_slots_paged": max((s.allocated for s in samples), default=0),
        "peak_slots_contiguous_request": max((s.reserved_request for s in samples), default=0),
        "peak_slots_contiguous_max_len": max((s.reserved_max_len for s in samples), default=0),
        "num_samples": len(used),
    }


# ------------------------------------------------------------------------------------ decode


@dataclass
class DecodeResult:
    """Median time of one decode step with `batch_size` requests running."""

    label: str
    batch_size: int
    step_ms: float  # wall clock
    cpu_ms: float  # process CPU time (all threads): what other processes' load leaves alone
    num_steps: int
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return 1e3 * self.batch_size / self.step_ms

    @property
    def cpu_tokens_per_s(self) -> float:
        return 1e3 * self.batch_size / self.cpu_ms


def decode_specs(dense: str, checkpoints: list[Path]) -> list[ModelSpec]:
    """Dense fp32 and bf16, then each checkpoint under its folder name (made unique)."""
    specs = [ModelSpec("dense fp32", dense, "float32"), ModelSpec(BASELINE, dense, "bfloat16")]
    return specs + checkpoint_specs(checkpoints)


def checkpoint_specs(checkpoints: list[Path]) -> list[ModelSpec]:
    specs: list[ModelSpec] = []
    for path in checkpoints:
        label = path.name or str(path)
        while label in {s.label for s in specs}:
            label += "'"
        specs.append(ModelSpec(label, str(path), "auto"))
    return specs


def decode_max_tokens(batch_size: int, prompt_len: int, steps: int, max_batched: int) -> int:
    """Output tokens each request needs so that none finishes before the last timed step.

    Chunked prefill lets early requests decode while later prompts are still being read: at
    most one token per prefill step, and there are at most ceil(B * L / budget) + 1 of those."""
    prefill_steps = math.ceil(batch_size * prompt_len / max_batched) + 1
    return prefill_steps + DECODE_WARMUP_STEPS + steps + 1


def decode_kv_bytes(model: str, num_seqs: int, tokens_per_seq: int, block_size: int = 16) -> int:
    """KV memory for `num_seqs` sequences of `tokens_per_seq` tokens in fp32 pages (the widest
    page dtype the decode runs use), plus one spare block per sequence."""
    from qserve.engine.model_runner import KVCacheSpec
    from qserve.model.config import ModelConfig
    from qserve.model.resolve import resolve_model

    config = ModelConfig.from_pretrained(resolve_model(model))
    spec = KVCacheSpec.from_memory(config, 0, block_size, torch.float32)
    return num_seqs * (math.ceil(tokens_per_seq / block_size) + 1) * spec.bytes_per_block


def make_decode_engine(spec: ModelSpec, args: argparse.Namespace, batch: int, tokens: int) -> Any:
    from qserve import LLM

    llm = LLM(
        spec.model,
        dtype=spec.dtype,
        kv_cache_memory=decode_kv_bytes(spec.model, batch, tokens),
        max_num_seqs=batch,
        num_threads=args.num_threads,
        enforce_eager=spec.enforce_eager,
        device=getattr(args, "device", "cpu"),
    )
    return llm.engine


def is_steady(engine: Any, batch_size: int) -> bool:
    """Every one of the batch's requests is running and past its prompt: the next step decodes
    one token for each of them and nothing else."""
    scheduler = engine.scheduler
    if scheduler.waiting or len(scheduler.running) != batch_size:
        return False
    return all(r.num_tokens - r.num_computed_tokens == 1 for r in scheduler.running)


def start_decode(engine: Any, prompts: list[list[int]], max_tokens: int) -> None:
    """Add the prompts and step until the batch is in steady decode (prefill untimed)."""
    from qserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"decode-{i}", prompt, params)
    while not is_steady(engine, len(prompts)):
        if not engine.has_unfinished_requests():
            raise RuntimeError("the decode batch finished before reaching steady state")
        engine.step()


def timed_step(engine: Any, batch_size: int) -> tuple[float, float]:
    """(wall, process CPU) seconds of one step; fails if the batch is no longer all decoding."""
    if not is_steady(engine, batch_size):
        raise RuntimeError("a decode request finished or was preempted inside the timed window")
    wall, cpu = time.perf_counter(), time.process_time()
    engine.step()
    return time.perf_counter() - wall, time.process_time() - cpu


def measure_decode(
    specs: list[ModelSpec], prompts: list[list[int]], args: argparse.Namespace
) -> list[DecodeResult]:
    """All engines in steady decode at once, then stepped round robin; medians per engine."""
    engines = start_engines(specs, prompts, args)
    times = step_in_turn(engines, len(prompts), args.decode_steps)
    results = [decode_result(s, engines[s.label], len(prompts), times[s.label]) for s in specs]
    del engines
    gc.collect()
    return results


def start_engines(
    specs: list[ModelSpec], prompts: list[list[int]], args: argparse.Namespace
) -> dict[str, Any]:
    """One engine per spec, each with the batch prefilled and decoding."""
    from qserve.config import EngineConfig

    batch, prompt_len = len(prompts), len(prompts[0])
    max_batched = EngineConfig.max_num_batched_tokens  # the engines' default
    max_tokens = decode_max_tokens(batch, prompt_len, args.decode_steps, max_batched)
    engines = {}
    for s in specs:
        print(f"decode B={batch}: prefilling {s.label} ...", flush=True)
        engines[s.label] = make_decode_engine(s, args, batch, prompt_len + max_tokens)
        start_decode(engines[s.label], prompts, max_tokens)
    return engines


def step_in_turn(
    engines: dict[str, Any], batch: int, steps: int
) -> dict[str, list[tuple[float, float]]]:
    """(wall, CPU) seconds of `steps` steps per engine, after untimed warm-up steps."""
    times: dict[str, list[tuple[float, float]]] = {label: [] for label in engines}
    for i in range(DECODE_WARMUP_STEPS + steps):
        for label, engine in engines.items():
            t = timed_step(engine, batch)
            if i >= DECODE_WARMUP_STEPS:
                times[label].append(t)
    return times


def decode_result(
    spec: ModelSpec, engine: Any, batch: int, times: list[tuple[float, float]]
) -> DecodeResult:
    wall = 1e3 * statistics.median(t[0] for t in times)
    cpu = 1e3 * statistics.median(t[1] for t in times)
    preempted = engine.scheduler.num_preemptions
    info = {**describe(spec, engine), "num_preemptions": preempted}
    return DecodeResult(spec.label, batch, wall, cpu, len(times), info)


def decode_prompts(tokenizer: Any, args: argparse.Namespace, batch: int) -> list[list[int]]:
    """`batch` prompts of exactly --decode-prompt-len tokens from the workload's text."""
    n = args.decode_prompt_len
    config = WorkloadConfig(batch, n, n, 1, 1, args.seed)
    return [r.prompt_token_ids for r in make_workload(tokenizer, config)]


def run_decode(
    args: argparse.Namespace, dense: str, tokenizer: Any
) -> dict[str, list[DecodeResult]]:
    specs = decode_specs(dense, args.checkpoint)
    return {
        str(b): measure_decode(specs, decode_prompts(tokenizer, args, b), args)
        for b in args.decode_batch_sizes
    }


# ------------------------------------------------------------------------------ transformers


def load_hf(model_path: Path, dtype: torch.dtype) -> tuple[Any, int]:
    """The transformers model in eval mode and the id it pads with."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pad = tokenizer.pad_token_id
    return model, tokenizer.eos_token_id if pad is None else pad


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask [batch, longest prompt], padded on the left."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(prompts), width), dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask


@torch.inference_mode()
def hf_generate(model: Any, pad_id: int, prompts: list[list[int]], new_tokens: int) -> int:
    """One static batch, greedy, exactly `new_tokens` tokens per row; returns tokens generated."""
    ids, mask = left_pad(prompts, pad_id)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
        pad_token_id=pad_id,
    )
    return out.shape[1] - ids.shape[1]


def run_hf(requests: list[BenchRequest], args: argparse.Namespace, model_path: Path) -> RunResult:
    torch.set_num_threads(args.num_threads)
    model, pad_id = load_hf(model_path, DTYPES[args.dtype])
    batches = [requests[i : i + HF_BATCH_SIZE] for i in range(0, len(requests), HF_BATCH_SIZE)]
    hf_generate(model, pad_id, [r.prompt_token_ids[:16] for r in batches[0]], 4)  # warm-up
    useful, padded, batch_times = 0, 0, []
    for batch in batches:
        longest = max(r.max_tokens for r in batch)
        t0 = time.perf_counter()
        generated = hf_generate(model, pad_id, [r.prompt_token_ids for r in batch], longest)
        batch_times.append(time.perf_counter() - t0)
        assert generated == longest, f"transformers generated {generated}, wanted {longest}"
        useful += sum(r.max_tokens for r in batch)
        padded += longest * len(batch)
    extra = {"batch_size": HF_BATCH_SIZE, "generated_tokens_incl_padding": padded}
    del model
    gc.collect()
    return RunResult("transformers", useful, sum(batch_times), extra)


# ---------------------------------------------------------------------------------- report


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def report(
    results: list[RunResult],
    requests: list[BenchRequest],
    args: argparse.Namespace,
    decode: dict[str, list[DecodeResult]] | None = None,
) -> dict[str, Any]:
    by_name = {r.name: r.tokens_per_s for r in results}
    return {
        "config": {k: v for k, v in vars(args).items() if k != "output"},
        "machine": {"platform": platform.platform(), "torch": torch.__version__},
        "workload": {
            "num_requests": len(requests),
            "prompt_tokens": sum(r.prompt_len for r in requests),
            "output_tokens": sum(r.max_tokens for r in requests),
        },
        "results": {
            r.name: {
                "output_tokens": r.output_tokens,
                "seconds": r.seconds,
                "output_tokens_per_s": r.tokens_per_s,
                **r.extra,
            }
            for r in results
        },
        "qserve_over_transformers": ratio(by_name.get(DENSE), by_name.get("transformers")),
        "over_dense": {
            name: ratio(tps, by_name.get(DENSE))
            for name, tps in by_name.items()
            if name not in (DENSE, "transformers")
        },
        "decode": decode_summary(decode or {}),
    }


def decode_summary(decode: dict[str, list[DecodeResult]]) -> dict[str, Any]:
    """Per batch size: each row with its tokens/s and its ratios to dense bf16."""
    summary = {}
    for batch, rows in decode.items():
        base = next((r for r in rows if r.label == BASELINE), None)
        summary[batch] = [decode_row(r, base) for r in rows]
    return summary


def decode_row(r: DecodeResult, base: DecodeResult | None) -> dict[str, Any]:
    return {
        "label": r.label,
        "batch_size": r.batch_size,
        "median_step_ms": r.step_ms,
        "median_step_cpu_ms": r.cpu_ms,
        "tokens_per_s": r.tokens_per_s,
        "cpu_tokens_per_s": r.cpu_tokens_per_s,
        "over_bf16": ratio(r.tokens_per_s, base and base.tokens_per_s),
        "over_bf16_cpu": ratio(r.cpu_tokens_per_s, base and base.cpu_tokens_per_s),
        "num_steps": r.num_steps,
        **r.info,
    }


def format_table(summary: dict[str, Any]) -> str:
    lines: list[str] = []
    if summary["results"]:
        lines += format_workload(summary)
    for batch, rows in summary["decode"].items():
        lines += ["", *format_decode(batch, rows)]
    return "\n".join(lines).strip("\n")


def format_workload(summary: dict[str, Any]) -> list[str]:
    n = summary["workload"]["num_requests"]
    lines = [
        f"workload: {n} requests at once, up to {summary['config']['max_num_seqs']} running",
        f"{'engine':<28}{'dtype':>10}{'out tokens':>12}{'seconds':>10}{'out tok/s':>11}"
        f"{'vs dense':>10}",
    ]
    for name, r in summary["results"].items():
        over = 1.0 if name == DENSE else summary["over_dense"].get(name)
        lines.append(
            f"{name:<28}{r.get('dtype', summary['config']['dtype']):>10}{r['output_tokens']:>12}"
            f"{r['seconds']:>10.1f}{r['output_tokens_per_s']:>11.2f}{fmt_ratio(over):>10}"
        )
    if summary["qserve_over_transformers"] is not None:
        lines.append(f"qserve / transformers: {summary['qserve_over_transformers']:.2f}x")
    q = summary["results"].get(DENSE)
    if q is not None and "kv" in q:
        lines += format_kv(q)
    return lines


def fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def format_decode(batch: str, rows: list[dict[str, Any]]) -> list[str]:
    steps = rows[0]["num_steps"] if rows else 0
    lines = [
        f"decode at batch {batch} (median of {steps} steps, engines stepped in turn)",
        f"{'model':<22}{'dtype':>10}{'kernel':>15}{'lm_head':>12}{'ms/step':>9}{'tok/s':>9}"
        f"{'vs bf16':>9}"
        f"{'cpu ms':>9}{'cpu tok/s':>11}{'vs bf16':>9}",
    ]
    for r in rows:
        lines.append(
            f"{r['label']:<22}{r['dtype']:>10}{main_path(r['linear_paths']):>15}"
            f"{main_path(r['linear_paths'], 'lm_head'):>12}{r['median_step_ms']:>9.1f}"
            f"{r['tokens_per_s']:>9.2f}{fmt_ratio(r['over_bf16']):>9}"
            f"{r['median_step_cpu_ms']:>9.1f}{r['cpu_tokens_per_s']:>11.2f}"
            f"{fmt_ratio(r['over_bf16_cpu']):>9}"
        )
    return lines


def main_path(paths: dict[str, str], kind: str = "q_proj") -> str:
    """The kernel path of the decoder's linears (q_proj stands for all but lm_head) or of
    `kind`."""
    path = paths.get(kind, "dense")
    return "dense" if path.startswith("dense") else path


def format_kv(q: dict[str, Any]) -> list[str]:
    kv = q["kv"]
    return [
        f"qserve: {q['num_steps']} steps, median {q['median_step_ms']:.1f} ms/step, "
        f"{q['num_preemptions']} preemptions, prefix-cache hit rate "
        f"{q['prefix_cache_hit_rate']:.3f}",
        f"KV utilisation (mean over steps): paged {kv['utilisation_paged']:.1%} | contiguous "
        f"prompt+max_tokens {kv['utilisation_contiguous_request']:.1%} | contiguous "
        f"max_model_len ({q['max_model_len']}) {kv['utilisation_contiguous_max_len']:.2%}",
        f"peak KV slots: paged {kv['peak_slots_paged']} | contiguous prompt+max_tokens "
        f"{kv['peak_slots_contiguous_request']} | contiguous max_model_len "
        f"{kv['peak_slots_contiguous_max_len']}",
    ]


# ------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--num-requests", type=int, default=None, help="64 (8 with --quick)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dtype",
        choices=["auto", *sorted(DTYPES)],
        default="auto",
        help="dense model in the workload run; auto: the engine's rule (bf16 where the CPU "
        "computes it natively, else fp32)",
    )
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--skip-hf", action="store_true", help="no transformers run")
    p.add_argument("--quick", action="store_true", help="8 short requests: a smoke run")
    p.add_argument(
        "--checkpoint",
        type=Path,
        action="append",
        default=[],
        metavar="DIR",
        help="a quantized checkpoint folder: one more row in each table (repeatable)",
    )
    p.add_argument("--decode-batch-sizes", type=int, nargs="+", default=[1, 64], metavar="B")
    p.add_argument("--decode-prompt-len", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=16, help="timed steps per engine")
    p.add_argument("--skip-decode", action="store_true", help="no decode measurement")
    p.add_argument("--skip-workload", action="store_true", help="no workload run (nor hf)")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for path in args.checkpoint:
        if not (path / "config.json").is_file():
            p.error(f"--checkpoint {path}: no config.json there")
    if min(args.decode_batch_sizes) < 1 or args.decode_prompt_len < 1 or args.decode_steps < 1:
        p.error("decode batch sizes, prompt length and steps must be >= 1")
    if args.quick:  # a smoke run decodes briefly
        args.decode_batch_sizes = [b for b in args.decode_batch_sizes if b <= 8] or [1]
        args.decode_prompt_len = min(args.decode_prompt_len, 32)
        args.decode_steps = min(args.decode_steps, 4)


def workload_config(args: argparse.Namespace) -> WorkloadConfig:
    base = QUICK if args.quick else WorkloadConfig()
    n = args.num_requests or base.num_requests
    return WorkloadConfig(
        n,
        base.min_prompt_len,
        base.max_prompt_len,
        base.min_output_len,
        base.max_output_len,
        args.seed,
    )


def run_workload(
    args: argparse.Namespace, model_path: Path, requests: list[BenchRequest]
) -> list[RunResult]:
    """The dense model (compiled decode step, then --enforce-eager), each checkpoint, then
    transformers, one after the other."""
    dense = ModelSpec(DENSE, str(model_path), args.dtype)
    results = [run_qserve(requests, args, dense)]
    eager = ModelSpec(EAGER, str(model_path), args.dtype, enforce_eager=True)
    print("workload: dense --enforce-eager ...", flush=True)
    results.append(run_qserve(requests, args, eager, EAGER))
    for spec in checkpoint_specs(args.checkpoint):
        print(f"workload: {spec.label} ...", flush=True)
        results.append(run_qserve(requests, args, spec, f"qserve {spec.label}"))
    if not args.skip_hf:
        results.append(run_hf(requests, args, model_path))
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dtype == "auto":  # resolve once so both sides run the same dtype
        from qserve.config import EngineConfig

        args.dtype = str(EngineConfig().torch_dtype(torch.float32)).removeprefix("torch.")
    from qserve.model.loader import load_tokenizer
    from qserve.model.resolve import resolve_model

    torch.set_num_threads(args.num_threads)
    model_path = resolve_model(args.model)
    tokenizer = load_tokenizer(model_path)
    requests = make_workload(tokenizer, workload_config(args))
    results = [] if args.skip_workload else run_workload(args, model_path, requests)
    decode = None if args.skip_decode else run_decode(args, str(model_path), tokenizer)
    summary = report(results, requests, args, decode)
    print(format_table(summary))
    write_results(args.output, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
