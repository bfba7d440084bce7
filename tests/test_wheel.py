"""The wheel, installed outside the checkout, runs with its C++ kernels and its bundled data.

`pip wheel` builds qserve from a copy of the source tree; the wheel goes into a new virtualenv
(its dependencies are this environment's, reached through a .pth line: the editable qserve
here is not, so the wheel's is the only qserve there). From a folder outside the checkout, with
an empty torch extensions folder (so the kernels compile from the wheel's own sources), it
quantizes a tiny model into the default output folder and generates from both models. Where a
C++ compiler exists, QSERVE_CPU_KERNELS=require turns any kernel build failure into an error.
`.ci/run` does the same with a fully fresh install and the built-in model.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from qserve.kernels import cpu_build
from tests.tiny import save_tiny_llama

REPO = Path(__file__).resolve().parents[1]
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv*", "__pycache__", "build", "dist", "*.egg-info")


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, **kw)
    assert proc.returncode == 0, f"{cmd[:4]} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The wheel built from a copy of the sources and installed into a new virtualenv."""
    root = tmp_path_factory.mktemp("wheel")
    shutil.copytree(REPO, root / "src", ignore=NOT_SOURCE)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", root / "dist", "."],
         cwd=root / "src")  # fmt: skip
    (wheel,) = (root / "dist").glob("qserve-*.whl")
    _run([sys.executable, "-m", "venv", "--without-pip", root / "venv"])
    python = root / "venv" / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "-q", wheel])
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    Path(site.stdout.strip(), "outer_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return {"bin": root / "venv" / "bin", "work": root / "work", "ext": root / "torch_ext"}


def _qserve(env_paths: dict[str, Path], *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "TORCH_EXTENSIONS_DIR": str(env_paths["ext"]),
        "PATH": f"{env_paths['bin']}{os.pathsep}{os.environ['PATH']}",
        cpu_build.ENV_VAR: "require" if cpu_build.compiler() else "1",
    }
    env.pop("PYTHONPATH", None)
    env_paths["work"].mkdir(exist_ok=True)
    return _run([str(env_paths["bin"] / "qserve"), *args], cwd=env_paths["work"], env=env)


def test_wheel_ships_sources_headers_and_data(wheel_env: dict[str, Path]) -> None:
    python = wheel_env["bin"] / "python"
    probe = (
        "import qserve, qserve.data as d, qserve.kernels.cpu_build as b; "
        "print(qserve.__file__); print(sorted(p.name for p in b.CSRC.iterdir())); "
        "print(len(d.moby_dick(1, 135))); "
        "print(all(d.read_text(f) for f in [*d.CALIBRATION_SOURCES.values(), d.HELDOUT_FILE])); "
        "import importlib.resources as r; "
        "print(sorted(p.name for p in r.files('qserve.server').joinpath('static').iterdir()))"
    )
    out = _run([python, "-c", probe], cwd=wheel_env["bin"]).stdout.splitlines()
    assert str(wheel_env["bin"].parent) in out[0], "the wheel's qserve is not the one imported"
    for name in ("cpu_vec.h", "cpu_dtypes.h", "paged_attention_cpu.cpp", "w4a16_cpu.cpp"):
        assert name in out[1]
    assert out[2] == "135"
    assert out[3] == "True", "a calibration or held-out text file is missing from the wheel"
    assert out[4] == str(["app.js", "index.html", "style.css"]), "the playground's files"


def test_installed_wheel_quantizes_and_generates_with_cpp_kernels(
    wheel_env: dict[str, Path], tmp_path: Path
) -> None:
    model = save_tiny_llama(tmp_path / "tiny")
    quantized = _qserve(wheel_env, "quantize", str(model), "--method", "rtn", "-q")
    folder = wheel_env["work"] / "tiny-rtn-w4g32"  # intermediate size 160: groups of 32
    assert f"wrote {folder}" in quantized.stdout
    for checkpoint, linear_path in ((model, "dense"), (folder, "cpu-w4a16")):
        log = _qserve(wheel_env, "generate", str(checkpoint), "-p", "Call me", "--max-tokens", "4")
        assert log.stdout.strip(), log.stderr
        assert "WARNING" not in log.stderr, log.stderr
        assert linear_path in log.stderr
        if cpu_build.compiler():
            assert "CPU kernels: paged attention C++, model ops C++" in log.stderr, log.stderr
