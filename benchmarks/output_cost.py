"""What one step's output costs the engine, at token 100 and at token 4000 of a generation.

    python benchmarks/output_cost.py [--positions 100 4000] [--steps 200] [--logprobs 5]
        [--output benchmarks/results/output_cost.json]

For each output kind (CUMULATIVE: every output holds the whole history; DELTA: only what is
new, what the server asks for), a request is grown to the position with the built-in model's
tokenizer, then `--steps` more tokens are added one at a time and the engine's per-sample
output (`output_processor.completion_output`, with the detokenizer's update) is timed; the
median per step is reported. Only the output path is measured, not the model.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_file import run_arguments, write_results  # noqa: E402

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "output_cost.json"


def _sample(tokenizer: Any, kind: Any, logprobs: int) -> Any:
    """A sample of an empty request, as the engine keeps it."""
    from qserve.engine.detokenizer import IncrementalDetokenizer
    from qserve.engine.output_processor import SampleState
    from qserve.engine.request import Request
    from qserve.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=None, logprobs=logprobs, output_kind=kind, ignore_eos=True)
    prompt = tokenizer.encode("Call me Ishmael.")
    request = Request("r", prompt, params)
    return SampleState(0, request, IncrementalDetokenizer(tokenizer, prompt, params), [])


def _step(sample: Any, token: int, entry: Any) -> None:
    sample.request.append_output_token_ids(token)
    sample.detokenizer.update([token], False)
    sample.logprobs.append(entry)


def measure(tokenizer: Any, kind: Any, position: int, steps: int, logprobs: int) -> float:
    """Median seconds per step of the output path, `steps` steps after `position` tokens."""
    from qserve.engine.output_processor import completion_output
    from qserve.engine.sampler import Logprobs
    from qserve.engine.sampling_params import RequestOutputKind

    sample = _sample(tokenizer, kind, logprobs)
    text_ids = tokenizer.encode(" the whale swam on and on through the sea" * 500)
    entry = Logprobs(0, -1.0, 1, list(range(logprobs)), [-1.0] * logprobs)
    delta = kind == RequestOutputKind.DELTA
    for i in range(position):
        _step(sample, text_ids[i % len(text_ids)], entry)
        if i % 64 == 0:
            completion_output(sample, delta)
    times = []
    for i in range(steps):
        start = time.perf_counter()
        _step(sample, text_ids[(position + i) % len(text_ids)], entry)
        completion_output(sample, delta)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--positions", type=int, nargs="+", default=[100, 4000])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--logprobs", type=int, default=5)
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = p.parse_args(argv)

    from qserve.engine.sampling_params import RequestOutputKind
    from qserve.model.loader import load_tokenizer
    from qserve.model.resolve import resolve_model

    tokenizer = load_tokenizer(resolve_model("smollm2-135m"))
    rows = []
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
        us = {
            n: measure(tokenizer, kind, n, args.steps, args.logprobs) * 1e6 for n in args.positions
        }
        first, last = args.positions[0], args.positions[-1]
        rows.append({"kind": kind.name, "us_per_step": us, "growth": us[last] / us[first]})
    header = "".join(f"{f'token {n} (us)':>16}" for n in args.positions)
    print(f"{'output kind':<14}{header}{'last / first':>14}")
    for row in rows:
        cells = "".join(f"{row['us_per_step'][n]:>16.1f}" for n in args.positions)
        print(f"{row['kind']:<14}{cells}{row['growth']:>13.2f}x")
    write_results(args.output, {"args": run_arguments(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
