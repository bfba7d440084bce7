"""Offline throughput: qserve (continuous batching, paged KV) against transformers `generate`.

    python benchmarks/throughput.py [--num-requests 64] [--seed 0] [--dtype auto]
        [--threads 2] [--max-num-seqs 64] [--kv-cache-memory 1GiB] [--skip-hf] [--quick]
        [--output benchmarks/results/throughput.json]

One seeded workload (benchmarks/workload.py: real prompts of 32-512 tokens, 16-256 output tokens,
EOS ignored) runs side by side in one process, same model, dtype and thread count, each after a
warm-up:

- qserve: all requests added at once, the engine stepped to completion; after every step the KV
  cache is sampled (`get_stats`: slots holding computed tokens / slots of the blocks held) and
  compared with a contiguous allocation that reserves prompt + max_tokens, or max_model_len, slots
  per running request from the start.
- transformers: static batches of 8 in workload order, left padded, every batch generating its
  longest output (`min_new_tokens = max_new_tokens`); only each request's own output tokens count.

Prints a table and writes JSON: output tok/s of each, the ratio, total times, KV utilisation.
"""

from __future__ import annotations

import argparse
import gc
import json
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

from benchmarks.workload import QUICK, BenchRequest, WorkloadConfig, make_workload  # noqa: E402

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "throughput.json"
HF_BATCH_SIZE = 8
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


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


# ------------------------------------------------------------------------------------ qserve


def make_llm(args: argparse.Namespace, model: str) -> Any:
    from qserve import LLM

    return LLM(
        model,
        dtype=args.dtype,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        num_threads=args.threads,
    )


def warm_up_qserve(llm: Any) -> None:
    """A few short requests on token ids that no workload prompt starts with (no cache hits)."""
    from qserve import SamplingParams

    prompts = [[(1000 + 7 * i + j) % 40000 + 100 for j in range(16 + 8 * i)] for i in range(4)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))


def run_qserve(requests: list[BenchRequest], args: argparse.Namespace, model: str) -> RunResult:
    from qserve import SamplingParams

    llm = make_llm(args, model)
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
    extra = qserve_extra(engine, start_stats, step_times, samples)
    del llm, engine
    gc.collect()
    return RunResult("qserve", num_tokens, seconds, extra)


def sample_kv(engine: Any) -> KVSample:
    stats = engine.get_stats()
    running = engine.scheduler.running
    return KVSample(
        live=int(stats["kv_live_slots"]),
        allocated=int(stats["kv_allocated_slots"]),
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
        "num_preemptions": int(stats["num_preemptions"] - start_stats["num_preemptions"]),
        "prefix_cache_hit_rate": stats["prefix_cache_hit_rate"],
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
    torch.set_num_threads(args.threads)
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


def report(
    results: list[RunResult], requests: list[BenchRequest], args: argparse.Namespace
) -> dict[str, Any]:
    by_name = {r.name: r for r in results}
    ratio = None
    if "qserve" in by_name and "transformers" in by_name:
        ratio = by_name["qserve"].tokens_per_s / by_name["transformers"].tokens_per_s
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
        "qserve_over_transformers": ratio,
    }


def format_table(summary: dict[str, Any]) -> str:
    lines = [f"{'engine':<14}{'out tokens':>12}{'seconds':>10}{'out tok/s':>11}"]
    for name, r in summary["results"].items():
        lines.append(
            f"{name:<14}{r['output_tokens']:>12}{r['seconds']:>10.1f}"
            f"{r['output_tokens_per_s']:>11.1f}"
        )
    if summary["qserve_over_transformers"] is not None:
        lines.append(f"qserve / transformers: {summary['qserve_over_transformers']:.2f}x")
    q = summary["results"].get("qserve")
    if q is not None:
        lines += format_kv(q)
    return "\n".join(lines)


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
        help="auto: the engine's rule (bf16 where the CPU computes it natively, else fp32)",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--skip-hf", action="store_true", help="run qserve only")
    p.add_argument("--quick", action="store_true", help="8 short requests: a smoke run")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    return p.parse_args(argv)


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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dtype == "auto":  # resolve once so both sides run the same dtype
        from qserve.config import EngineConfig

        args.dtype = str(EngineConfig().torch_dtype(torch.float32)).removeprefix("torch.")
    from qserve.model.loader import load_tokenizer
    from qserve.model.resolve import resolve_model

    torch.set_num_threads(args.threads)
    model_path = resolve_model(args.model)
    requests = make_workload(load_tokenizer(model_path), workload_config(args))
    results = [run_qserve(requests, args, str(model_path))]
    if not args.skip_hf:
        results.append(run_hf(requests, args, model_path))
    summary = report(results, requests, args)
    print(format_table(summary))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
