"""Peak memory of scoring a prompt (SamplingParams.prompt_logprobs), by prompt length.

    python benchmarks/prompt_logprobs_memory.py [--model smollm2-135m]
        [--lengths 512 1024 2048 4096] [--max-num-batched-tokens 2048]
        [--output benchmarks/results/prompt_logprobs_memory.json]

Each length runs in a fresh process: the engine loads (fp32; its KV cache is allocated up front),
scores a 16-token warm-up prompt, then records its peak resident memory (ru_maxrss), scores one
prompt of that many tokens with prompt_logprobs=5, and reports how far the peak rose: the step's
activations, the logits chunks and the entries kept. The model runner turns prompt positions
into logprobs 128 rows of logits at a time, for the chunk a step runs, so the rise should stop
growing once a prompt is longer than one chunk (max_num_batched_tokens); beside it, what one
fp32 [prompt_len, vocab] logits tensor would take.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_file import run_arguments, write_results  # noqa: E402

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "prompt_logprobs_memory.json"
MiB = 2**20


def peak_rss() -> int:
    """This process's peak resident memory in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure_one(model: str, length: int, budget: int, context: int = 8192) -> dict[str, Any]:
    """In this process: the rise of the peak RSS while one `length`-token prompt is scored."""
    import time

    from qserve.engine.llm import LLM
    from qserve.engine.sampling_params import SamplingParams

    llm = LLM(model, dtype="float32", kv_cache_memory="512MiB", max_model_len=context,
              max_num_batched_tokens=budget)  # fmt: skip
    vocab = llm.engine.model_config.vocab_size
    text = llm.get_tokenizer().encode("Call me Ishmael. Some years ago, never mind how. " * 800)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=5)
    llm.generate([text[:16]], params)  # warm-up: a short prompt
    before = peak_rss()
    start = time.monotonic()
    [out] = llm.generate([text[:length]], params)
    seconds = time.monotonic() - start
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == length
    rise = peak_rss() - before
    return {
        "prompt_len": length,
        "peak_rise_mib": round(rise / MiB, 1),
        "full_logits_mib": round(length * vocab * 4 / MiB, 1),
        "seconds": round(seconds, 2),
    }


def run_child(model: str, length: int, budget: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", "--model", model, "--lengths", str(length),
           "--max-num-batched-tokens", str(budget)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(measure_one(args.model, args.lengths[0], args.max_num_batched_tokens)))
        return
    rows = [run_child(args.model, n, args.max_num_batched_tokens) for n in args.lengths]
    print(f"{'prompt tokens':>14} {'peak rise MiB':>14} {'[len, vocab] MiB':>17} {'seconds':>8}")
    for row in rows:
        print(f"{row['prompt_len']:>14} {row['peak_rise_mib']:>14} "
              f"{row['full_logits_mib']:>17} {row['seconds']:>8}")  # fmt: skip
    write_results(args.output, {"args": run_arguments(args), "rows": rows})


if __name__ == "__main__":
    main()
