"""Ranks started by a launcher (issue 24): with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT
set, as torchrun sets them on each machine, `qserve generate --tensor-parallel-size 2` (or
`--pipeline-parallel-size 2`, or both over 4 ranks) spawns nothing; rank 0 runs the engine
and prints, the others serve its steps and exit 0, and the text equals one process's. A
WORLD_SIZE that does not match is one line, before anything waits on a peer."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny import save_tiny_llama

REPO = Path(__file__).resolve().parents[1]
ARGS = ["--prompt", "The whale", "--max-tokens", "8", "--dtype", "float32", "--num-threads", "1"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("launch") / "llama", num_layers=3)


def _generate(model_dir: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    command = [sys.executable, "-m", "qserve.cli", "generate", str(model_dir), *ARGS, *extra]
    # a crash in C++ (an abort at exit) shows the Python stack it happened under
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONFAULTHANDLER": "1", **(env or {})}
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "split",
    [
        ["--tensor-parallel-size", "2"],
        ["--pipeline-parallel-size", "2"],
        ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"],  # 4 ranks
    ],
    ids=["tp2", "pp2", "tp2-pp2"],
)
def test_launched_ranks_equal_one_process(model_dir, split):
    one = _generate(model_dir)
    expected, _ = one.communicate(timeout=120)
    assert one.returncode == 0
    world = 4 if len(split) == 4 else 2
    env = {"WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "LOCAL_WORLD_SIZE": str(world)}  # fmt: skip
    ranks = [_generate(model_dir, *split, env={**env, "RANK": str(r)}) for r in range(world)]
    outs = [p.communicate(timeout=180) for p in ranks]
    assert [p.returncode for p in ranks] == [0] * world, outs[0][1].decode()[-2000:]
    assert outs[0][0] == expected and all(out == b"" for out, _ in outs[1:])


def test_a_world_size_that_does_not_match_is_one_line(model_dir):
    env = {"WORLD_SIZE": "3", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    p = _generate(model_dir, "--tensor-parallel-size", "2", env=env)
    _, err = p.communicate(timeout=60)
    assert p.returncode != 0
    assert err.decode().strip().splitlines()[-1] == (
        "error: WORLD_SIZE 3 (from the launcher) is not --tensor-parallel-size 2"
    )
