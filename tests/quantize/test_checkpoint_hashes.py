"""Checkpoints stay bit-identical across refactors of the quantize driver.

Each case quantizes the tiny Llama and hashes what the checkpoint holds for a loader: every
tensor (name, dtype, shape, bytes) and the quantization configs. The provenance file is left
out: it records how the checkpoint was made, not what it is.

Float rounding depends on the CPU's vector unit and BLAS (a GPTQ Cholesky on AVX2 and on
AVX-512 differs in the last bits), so hashes are recorded per CPU kind (`cpu_kind`). On a kind
with no recorded hashes the test skips, naming the kind; `python -m tests.quantize.
test_checkpoint_hashes` prints this machine's hashes to add to HASHES.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from qserve.quantize.driver import quantize_model
from qserve.quantize.settings import QuantizeSettings

CALIB = {"num_samples": 8, "seq_len": 64}
CASES: dict[str, dict[str, Any]] = {
    "rtn": {"method": "rtn", "group_size": 32},
    "rtn-w8-channel": {"method": "rtn", "bits": 8, "group_size": -1, "sym": False},
    "gptq": {"method": "gptq", "group_size": 32, "gptaq": False, **CALIB},
    "gptq-act-order": {
        "method": "gptq",
        "group_size": 32,
        "gptaq": False,
        "desc_act": True,
        **CALIB,
    },  # fmt: skip
    "gptaq": {"method": "gptq", "group_size": 32, **CALIB},
    "gptaq-lm-head": {"method": "gptq", "group_size": 32, "quantize_lm_head": True, **CALIB},
    "awq": {"method": "awq", "group_size": 32, **CALIB},
    "int8": {"method": "int8", **CALIB},
    "int8-static": {
        "method": "int8",
        "activation_scheme": "static",
        "gptq_weights": False,
        **CALIB,
    },  # fmt: skip
    "fp8": {"method": "fp8", **CALIB},
    "fp8-dynamic-kv": {
        "method": "fp8",
        "gptq_weights": False,
        "kv_cache_dtype": "fp8_e4m3",
        **CALIB,
    },  # fmt: skip
}
# cpu_kind -> case -> sha256 (recorded at commit eddb644, before the driver was split; the gptq
# cases again when --mse became GPTQ's default and when --calib generated did)
HASHES: dict[str, dict[str, str]] = {
    "x86_64-AVX512-GenuineIntel": {  # Intel Xeon with AMX and AVX-512 BF16
        "awq": "9719ffa293ade867ff6a79ee47abe138aa0de53292bdf3372ca101f63dc97868",
        "fp8": "327da466984fa54b98f9493556a090a117cb7ede44c9272489a3e8bc9219558c",
        "fp8-dynamic-kv": "0335aad702da971e7c9c39d9589a5bce04feec4f82d100dccaa8a03983e9e5d0",
        "gptaq": "0a4a9bffca461b3e2b2b0c4df7c10ba3e9d96acc923dcec3874f0da12c091ed9",
        "gptaq-lm-head": "b996b62569ce484f580f8216da9435e22b313d2cc9a1abe8a6c435002050e0c7",
        "gptq": "fcbbd46aa78e38e87824e39de19d5220a461455395d5e98a90e65ae1e6478dc0",
        "gptq-act-order": "6f2f4dbc90eb414859a84721b9d25138191feba03e7143b9062f732e64ae5165",
        "int8": "47297089996c98785e4826ad4139d014643758d217de4c0e7ac21162d2d03ccc",
        "int8-static": "13f0d534cd0cfd3436f87c80b9d4a796c33238369bf6a80df593f069b12e9507",
        "rtn": "1d25db01851bf237fb271325566daf867a0cde35c04378f1623f3a15305687e4",
        "rtn-w8-channel": "e32a44303e784c9066ba62845ad54c44f19a7307f10871bf4357953e200d7897",
    },
}


def cpu_kind() -> str:
    """torch's vector unit and the CPU vendor: what decides the last bits of float math."""
    vendor = "unknown"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("vendor_id"):
                vendor = line.split(":", 1)[1].strip()
                break
    return f"{platform.machine()}-{torch.backends.cpu.get_cpu_capability()}-{vendor}"


def checkpoint_hash(folder: Path) -> str:
    """sha256 of every tensor (sorted by name) and of the quantization configs."""
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in sorted(f.keys()):
                t = f.get_tensor(name).contiguous()
                digest.update(f"{name} {t.dtype} {tuple(t.shape)}\n".encode())
                digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    config = json.loads((folder / "config.json").read_text())
    digest.update(json.dumps(config.get("quantization_config"), sort_keys=True).encode())
    extra = folder / "quantize_config.json"
    if extra.is_file():
        digest.update(json.dumps(json.loads(extra.read_text()), sort_keys=True).encode())
    return digest.hexdigest()


def quantize_case(model: Path, out: Path, case: str) -> Path:
    torch.manual_seed(0)
    return quantize_model(model, out, QuantizeSettings(**CASES[case]))


@pytest.mark.parametrize("case", sorted(CASES))
def test_checkpoint_is_bit_identical(case: str, tiny_llama: Path, tmp_path: Path) -> None:
    recorded = HASHES.get(cpu_kind())
    if recorded is None:
        pytest.skip(f"no checkpoint hashes recorded for CPU kind {cpu_kind()}")
    folder = quantize_case(tiny_llama, tmp_path / case, case)
    assert checkpoint_hash(folder) == recorded[case], case


def test_hash_sees_every_tensor_byte(tiny_llama: Path, tmp_path: Path) -> None:
    """The hash changes when one byte of one tensor does (it is not a hash of names)."""
    from safetensors.torch import load_file, save_file

    folder = quantize_case(tiny_llama, tmp_path / "rtn", "rtn")
    before = checkpoint_hash(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.norm.weight"][0] += 1
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert checkpoint_hash(folder) != before


def _record() -> None:
    """Print this machine's hashes as a HASHES entry."""
    import tempfile

    from ._helpers import make_tiny_model

    torch.set_num_threads(1)  # as the tests run (tests/quantize/conftest.py)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp, "tiny"))
        hashes = {c: checkpoint_hash(quantize_case(model, Path(tmp, c), c)) for c in sorted(CASES)}
    json.dump({cpu_kind(): hashes}, sys.stdout, indent=4)
    print()


if __name__ == "__main__":
    _record()
