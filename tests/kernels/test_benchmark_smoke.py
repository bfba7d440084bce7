"""benchmarks/kernels.py stays runnable: every case once, tiny shapes, CPU interpreter."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_kernel_benchmark_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "kernels.py"), "--smoke", "--json", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    names = {r["name"] for r in rows}
    assert {
        "gptq_w4a16_g128",
        "awq_w4a16_g128",
        "w8a16",
        "int8_scaled_mm",
        "fp8_scaled_mm",
    } <= names
    assert {"paged_attn_decode_float8_e4m3fn", "cache_write_float16"} <= names
    assert all(r["median_us"] > 0 and r["bytes"] > 0 for r in rows)
