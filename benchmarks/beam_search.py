"""KV blocks and step time of a beam search against as many independent samples, side by side.

    python benchmarks/beam_search.py [--model smollm2-135m] [--width 8] [--prompt-len 200]
        [--max-tokens 64] [--output benchmarks/results/beam_search.json]

One prompt, run twice on one engine (fp32): a beam search of `width` beams
(`LLM.beam_search`: beams fork the prompt's blocks, a partial block is copied on write, pruned
beams free theirs) and `n = width` independent samples (`LLM.generate`, temperature 1: they
fork the first sample's prompt blocks the same way, each computes and holds the rest). Both
generate `max_tokens` tokens per sequence (EOS ignored). Reported: the peak number of blocks
held by requests after any step, the median and total step time, and the number of steps.
Beams hold finished hypotheses' blocks too, which the peak includes. `least` is the peak of
the fewest blocks any copy-on-write paged cache needs for the live sequences' tokens (one per
distinct prefix ending at a block boundary or at a sequence's end): how far the beams diverge
bounds the ratio, whatever the cache does.
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

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "beam_search.json"


def least_blocks(requests: Any, block_size: int) -> int:
    """The fewest blocks that can hold these requests' computed tokens with copy-on-write
    sharing: one per distinct (token prefix up to a block's end) among them."""
    keys = set()
    for r in requests:
        n = r.num_computed_tokens
        for end in range(block_size, n + block_size, block_size):
            keys.add(tuple(r.all_token_ids[: min(end, n)]))
    return len(keys)


def measured(llm: Any, run: Any) -> dict[str, Any]:
    """Run `run()` with every engine step timed and the blocks held after it counted."""
    engine = llm.engine
    pool = engine.scheduler.kv_cache_manager.block_pool
    step, times, held, least = engine.step, [], [], []

    def timed_step() -> list:
        start = time.perf_counter()
        outputs = step()
        times.append(time.perf_counter() - start)
        held.append(pool.num_blocks - pool.get_num_free_blocks())
        least.append(least_blocks(engine.scheduler.requests.values(), engine.config.block_size))
        return outputs

    engine.step = timed_step
    try:
        run()
    finally:
        engine.step = step
    return {
        "peak_blocks": max(held),
        "peak_least_blocks": max(least),
        "steps": len(times),
        "median_step_ms": round(statistics.median(times) * 1e3, 2),
        "total_s": round(sum(times), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args()

    from qserve import data
    from qserve.engine.beam_search import BeamSearchParams
    from qserve.engine.llm import LLM
    from qserve.engine.sampling_params import SamplingParams

    llm = LLM(args.model, dtype="float32", kv_cache_memory="256MiB")
    ids = llm.get_tokenizer().encode("\n".join(data.moby_dick(1, 2)))[: args.prompt_len]
    prompt = {"prompt_token_ids": ids}
    llm.generate(prompt, SamplingParams(max_tokens=4))  # warm-up
    beams = BeamSearchParams(args.width, args.max_tokens, ignore_eos=True)
    samples = SamplingParams(n=args.width, max_tokens=args.max_tokens, ignore_eos=True, seed=0)
    rows = {
        f"beam search, width {args.width}": measured(llm, lambda: llm.beam_search(prompt, beams)),
        f"n={args.width} samples": measured(llm, lambda: llm.generate(prompt, samples)),
    }
    block_size = llm.engine.config.block_size
    print(f"prompt {len(ids)} tokens, {args.max_tokens} generated, blocks of {block_size} tokens")
    print(
        f"{'run':<24} {'peak blocks':>11} {'least':>6} {'steps':>6} {'median step ms':>15} "
        f"{'total s':>8}"
    )
    for name, r in rows.items():
        print(
            f"{name:<24} {r['peak_blocks']:>11} {r['peak_least_blocks']:>6} {r['steps']:>6} "
            f"{r['median_step_ms']:>15} {r['total_s']:>8}"
        )
    beam, sampled = rows.values()
    ratio = beam["peak_blocks"] / sampled["peak_blocks"]
    print(f"peak blocks, beam / samples: {ratio:.2f}")
    write_results(
        args.output,
        {"args": run_arguments(args), "rows": rows, "peak_blocks_ratio": round(ratio, 3)},
    )


if __name__ == "__main__":
    main()
