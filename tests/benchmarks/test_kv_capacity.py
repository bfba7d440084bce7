"""The KV capacity benchmark: capacities from the engine's scheduler, contiguous bounds, and the
real engine matching the simulation (on a tiny random model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import kv_capacity as kc
from benchmarks.workload import BenchRequest
from qserve.engine.model_runner import KVCacheSpec
from qserve.errors import QServeError
from tests.tiny import save_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def request(i: int, prompt_len: int, max_tokens: int) -> BenchRequest:
    ids = [(7 * i + j) % 900 + 50 for j in range(prompt_len)]  # distinct: no prefix hits
    return BenchRequest(str(i), "", ids, max_tokens)


def spec(num_blocks: int, block_size: int = 16) -> KVCacheSpec:
    return KVCacheSpec(num_blocks, block_size, 1, 1, 8, torch.bfloat16)


def test_largest_prefix_stops_at_the_first_failure() -> None:
    assert kc.largest_prefix(lambda n: n <= 3, 10) == 3
    assert kc.largest_prefix(lambda n: n != 2, 10) == 1  # every prefix must fit
    assert kc.largest_prefix(lambda n: True, 5) == 5


def test_simulation_of_requests_that_fit() -> None:
    # Two requests of 32 prompt + 16 output tokens: 3 blocks each at the end, 6 of 8 used.
    sim = kc.simulate([request(0, 32, 16), request(1, 32, 16)], spec(8), 1024)
    assert sim.fits and sim.preemptions == 0 and len(sim.trace) == 16
    assert sim.trace[0] == (2, 4, 0)  # both prompts read in the first step: 2 blocks each
    assert min(s[1] for s in sim.trace) == 2 and sim.trace[-1] == (0, 8, 0)
    assert sim.trace[sim.peak_step][1] == 2


def test_simulation_that_preempts() -> None:
    sim = kc.simulate([request(i, 32, 16) for i in range(3)], spec(8), 1024)
    assert not sim.fits and sim.first_preemption_step is not None


def test_paged_capacity_and_the_step_where_one_more_preempts() -> None:
    requests = [request(i, 32, 16) for i in range(6)]
    row, sim = kc.paged_capacity(requests, spec(8), 1024, "bf16")
    assert row.num_seqs == 2 and not row.capped and row.num_blocks == 8
    assert row.tokens_reserved == 6 * 16  # 6 blocks held at the peak
    assert (
        row.next_preempts_at_step == kc.simulate(requests[:3], spec(8), 1024).first_preemption_step
    )
    capped, _ = kc.paged_capacity(requests[:2], spec(8), 1024, "bf16")
    assert capped.num_seqs == 2 and capped.capped and capped.next_preempts_at_step is None


def test_contiguous_layouts() -> None:
    requests = [request(0, 40, 10), request(1, 90, 10), request(2, 20, 10)]  # 50, 100, 30
    assert kc.contiguous_max_len(requests, 199).num_seqs == 1  # 2 x 100 > 199
    assert kc.contiguous_max_len(requests, 300).num_seqs == 3
    assert kc.contiguous_per_request(requests, 160).num_seqs == 2
    assert kc.contiguous_per_request(requests, 180).capped
    bound = kc.contiguous_model_len(requests, 450, 128)  # slots of the workload's bound
    assert (bound.num_seqs, bound.tokens_reserved, bound.capped) == (3, 384, True)
    assert kc.contiguous_model_len(requests, 300, 128).num_seqs == 2


def test_validation_stops_after_the_peak_unless_asked() -> None:
    sim = kc.Simulation([(2, 5, 0), (2, 3, 0), (1, 6, 0)] + [(1, 7, 0)] * 20)
    assert sim.peak_step == 1
    assert kc.validation_steps(sim, full=False) == 2 + kc.VALIDATION_MARGIN_STEPS
    assert kc.validation_steps(sim, full=True) == 23


def test_arguments() -> None:
    args = kc.parse_args([])
    assert args.kv_cache_memory == "256MiB" and args.sweep == ["128MiB", "512MiB"]
    assert args.validate and not args.full_validation
    assert kc.workload_config(args).num_requests == 256
    quick = kc.parse_args(["--quick"])
    assert quick.kv_cache_memory == "4MiB" and quick.sweep == []
    with pytest.raises(QServeError):
        kc.parse_args(["--sweep", "lots"])


def test_real_engine_matches_the_simulation(tiny: Path, tmp_path: Path) -> None:
    # Tiny model: 2 layers x 2 KV heads x 16 dims -> 256 B/token in bf16, 4 KiB a block.
    out = tmp_path / "kv.json"
    argv = ["--model", str(tiny), "--quick", "--kv-cache-memory", "64KiB", "--num-threads", "1"]
    argv += ["--full-validation", "--sweep", "32KiB", "--output", str(out)]
    assert kc.main(argv) == 0
    summary = json.loads(out.read_text())
    bf16, fp8 = summary["rows"][:2]
    assert (bf16["num_blocks"], fp8["num_blocks"]) == (16, 32)
    for row in (bf16, fp8):
        v = row["validated"]
        assert v["matches_simulation"] and v["preemptions"] == 0
        assert v["num_blocks"] == row["num_blocks"] and v["steps_run"] == v["steps_simulated"]
        assert v["peak_running"] == row["num_seqs"]
    assert fp8["num_seqs"] >= bf16["num_seqs"] >= 1
    assert summary["sweep"][0]["kv_cache_memory"] == "32KiB"
