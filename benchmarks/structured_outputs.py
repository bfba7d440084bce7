"""What grammar-constrained decoding costs: decode-step time with and without a JSON-schema
constraint at 1 and 16 concurrent requests, and grammar compile time per schema.

    python benchmarks/structured_outputs.py [--model smollm2-135m] [--concurrency 1 16]
        [--max-tokens 48] [--output benchmarks/results/structured_outputs.json]

Both runs, side by side in one process, send the same prompts with the same sampling
(temperature 1.0, one seed per request); the constrained one asks for SCHEMA (an object whose
free-text array keeps the model writing for the whole --max-tokens). Each `engine.step()` after
the first (the prompts' prefill) is timed; the median per step is reported, and its ratio to
the free run. Compile times are cold (a new compiler each time), median of 5.
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

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "structured_outputs.json"
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "notes": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["title", "notes"],
}
COMPILE_SCHEMAS: dict[str, Any] = {
    "flat object": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
        "required": ["a", "b"],
    },  # fmt: skip
    "nested + arrays": SCHEMA
    | {
        "properties": {
            **SCHEMA["properties"],
            "author": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "born": {"type": "integer", "minimum": 1000, "maximum": 2100},
                },
            },
        }
    },  # fmt: skip
    "enum": {"enum": [f"option-{i}" for i in range(50)]},
    "json_object": None,
}


def step_times(engine: Any, params: list[Any], prompt: str) -> list[float]:
    """Seconds of each decode step (every step after the first) until all requests end."""
    for i, p in enumerate(params):
        engine.add_request(f"r{i}-{time.monotonic_ns()}", prompt, p)
    engine.step()  # the prompts
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def decode_rows(engine: Any, concurrency: int, max_tokens: int) -> list[dict[str, Any]]:
    from qserve.engine.sampling_params import SamplingParams
    from qserve.engine.structured_outputs import StructuredOutputsParams

    prompt = "Write a title and some notes about whales as JSON:"
    constraint = StructuredOutputsParams(json=SCHEMA)
    rows = []
    for name, structured in (("free", None), ("json schema", constraint)):
        kw = dict(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
        params = [SamplingParams(seed=s, structured_outputs=structured, **kw)
                  for s in range(concurrency)]  # fmt: skip
        step_times(engine, params, prompt)  # warm-up (and the grammar compiled once)
        times = step_times(engine, params, prompt)
        rows.append({"concurrency": concurrency, "mode": name, "steps": len(times),
                     "ms_per_step": round(1000 * statistics.median(times), 2)})  # fmt: skip
    rows[1]["vs_free"] = round(rows[1]["ms_per_step"] / rows[0]["ms_per_step"], 3)
    return rows


def compile_rows(engine: Any) -> list[dict[str, Any]]:
    from qserve.engine.structured_outputs import StructuredOutputManager, StructuredOutputsParams

    rows = []
    for name, schema in COMPILE_SCHEMAS.items():
        params = (StructuredOutputsParams(json_object=True) if schema is None
                  else StructuredOutputsParams(json=schema))  # fmt: skip
        times = []
        for _ in range(5):
            manager = StructuredOutputManager(engine.tokenizer, engine.model_config.vocab_size)
            start = time.perf_counter()
            manager.compile(params)
            times.append(time.perf_counter() - start)
        rows.append({"schema": name, "compile_ms": round(1000 * statistics.median(times), 2)})
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    from qserve.config import EngineConfig
    from qserve.engine.llm_engine import LLMEngine

    args = parse_args(argv)
    engine = LLMEngine(EngineConfig(args.model, kv_cache_memory="256MiB"))
    decode = [row for c in args.concurrency for row in decode_rows(engine, c, args.max_tokens)]
    compiled = compile_rows(engine)
    print(f"{'concurrency':>11} {'mode':>12} {'ms/step':>9} {'vs free':>8}")
    for row in decode:
        print(f"{row['concurrency']:>11} {row['mode']:>12} {row['ms_per_step']:>9} "
              f"{row.get('vs_free', ''):>8}")  # fmt: skip
    print(f"\n{'schema':>16} {'compile ms':>11}")
    for row in compiled:
        print(f"{row['schema']:>16} {row['compile_ms']:>11}")
    write_results(args.output, {"args": run_arguments(args), "decode": decode,
                                "compile": compiled})  # fmt: skip


if __name__ == "__main__":
    main()
