"""The throughput benchmark's cheap parts: arguments, decode bookkeeping, the report; and one
smoke run of the whole script on a tiny random model."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import throughput as tp
from tests.tiny import save_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def checkpoint_dir(root: Path, name: str) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    return folder


def test_defaults_keep_the_workload_options() -> None:
    args = tp.parse_args([])
    assert args.checkpoint == [] and args.dtype == "auto" and args.max_num_seqs == 64
    assert args.decode_batch_sizes == [1, 64] and args.decode_prompt_len == 128
    assert not (args.skip_hf or args.skip_decode or args.skip_workload or args.quick)


def test_checkpoint_is_repeatable(tmp_path: Path) -> None:
    a, b = checkpoint_dir(tmp_path, "rtn-w4g128"), checkpoint_dir(tmp_path, "int8")
    args = tp.parse_args(["--checkpoint", str(a), "--checkpoint", str(b), "--skip-hf"])
    assert args.checkpoint == [a, b] and args.skip_hf


def test_checkpoint_without_config_fails(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        tp.parse_args(["--checkpoint", str(tmp_path)])


@pytest.mark.parametrize("argv", [["--decode-steps", "0"], ["--decode-batch-sizes", "0", "1"]])
def test_bad_decode_arguments_fail(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        tp.parse_args(argv)


def test_quick_shrinks_the_decode_run() -> None:
    args = tp.parse_args(["--quick"])
    assert args.decode_batch_sizes == [1] and args.decode_prompt_len == 32
    assert args.decode_steps == 4


def test_decode_rows_are_dense_fp32_bf16_then_checkpoints_by_folder_name(tmp_path: Path) -> None:
    a, b = tmp_path / "x" / "w4", tmp_path / "y" / "w4"
    specs = tp.decode_specs("smollm2-135m", [a, b])
    assert [(s.label, s.dtype) for s in specs] == [
        ("dense fp32", "float32"),
        (tp.BASELINE, "bfloat16"),
        ("w4", "auto"),
        ("w4'", "auto"),
    ]
    assert specs[2].model == str(a) and specs[3].model == str(b)


def test_decode_max_tokens_outlasts_chunked_prefill() -> None:
    # 64 prompts of 128 tokens = 8192 tokens: 4 full chunks of 2048, at most 5 prefill steps.
    assert tp.decode_max_tokens(64, 128, 16, 2048) == 5 + tp.DECODE_WARMUP_STEPS + 16 + 1
    assert tp.decode_max_tokens(1, 128, 16, 2048) == 2 + tp.DECODE_WARMUP_STEPS + 16 + 1


def fake_engine(running: list[tuple[int, int]], waiting: int = 0) -> SimpleNamespace:
    """An engine whose scheduler holds requests of (num_tokens, num_computed_tokens)."""
    reqs = [SimpleNamespace(num_tokens=t, num_computed_tokens=c) for t, c in running]
    return SimpleNamespace(scheduler=SimpleNamespace(running=reqs, waiting=[None] * waiting))


def test_steady_decode_means_every_request_running_one_token_behind() -> None:
    assert tp.is_steady(fake_engine([(129, 128), (140, 139)]), 2)
    assert not tp.is_steady(fake_engine([(129, 128)]), 2)  # one finished or not admitted
    assert not tp.is_steady(fake_engine([(129, 128), (128, 64)]), 2)  # a prompt half read
    assert not tp.is_steady(fake_engine([(129, 128), (140, 139)], waiting=1), 2)


def decode_result(label: str, batch: int, step_ms: float, cpu_ms: float) -> tp.DecodeResult:
    info = {"dtype": "bfloat16", "linear_paths": {"q_proj": "cpu-int4pack"}}
    return tp.DecodeResult(label, batch, step_ms, cpu_ms, 8, info)


def test_decode_ratios_are_to_dense_bf16() -> None:
    rows = [decode_result(tp.BASELINE, 1, 60.0, 50.0), decode_result("w4", 1, 40.0, 25.0)]
    summary = tp.decode_summary({"1": rows})["1"]
    assert summary[0]["over_bf16"] == pytest.approx(1.0)
    assert summary[1]["tokens_per_s"] == pytest.approx(25.0)
    assert summary[1]["over_bf16"] == pytest.approx(1.5)
    assert summary[1]["over_bf16_cpu"] == pytest.approx(2.0)
    batch64 = tp.decode_summary({"64": [decode_result("w4", 64, 1000.0, 900.0)]})["64"][0]
    assert batch64["tokens_per_s"] == pytest.approx(64.0) and batch64["over_bf16"] is None


def test_workload_ratios_are_to_the_dense_run() -> None:
    results = [
        tp.RunResult(tp.DENSE, 100, 10.0),
        tp.RunResult("qserve w4", 100, 20.0),
        tp.RunResult("transformers", 100, 40.0),
    ]
    args = tp.parse_args(["--skip-decode"])
    summary = tp.report(results, [], args)
    assert summary["qserve_over_transformers"] == pytest.approx(4.0)
    assert summary["over_dense"] == {"qserve w4": pytest.approx(0.5)}
    assert summary["decode"] == {}


def test_smoke_run_on_a_tiny_model(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "throughput.json"
    argv = ["--model", str(tiny), "--quick", "--skip-hf", "--num-threads", "1"]
    argv += ["--decode-batch-sizes", "1", "3", "--decode-steps", "2", "--output", str(out)]
    assert tp.main(argv) == 0
    summary = json.loads(out.read_text())
    assert summary["results"][tp.DENSE]["output_tokens"] == summary["workload"]["output_tokens"]
    assert summary["results"][tp.EAGER]["output_tokens"] == summary["workload"]["output_tokens"]
    for batch in ("1", "3"):
        rows = summary["decode"][batch]
        assert [r["label"] for r in rows] == ["dense fp32", tp.BASELINE]
        assert [r["dtype"] for r in rows] == ["float32", "bfloat16"]
        assert all(r["num_steps"] == 2 and r["num_preemptions"] == 0 for r in rows)
        assert rows[1]["over_bf16"] == pytest.approx(1.0)
