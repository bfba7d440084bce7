"""`qserve serve --tensor-parallel-size 2` (issue 24): it serves, and when its worker process is
killed in the middle of a streamed request the stream ends with the error, and the server exits
non-zero within 10 s with a one-line error, leaving no process behind."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import openai

from tests.server.conftest import MODEL_NAME
from tests.server.test_lifecycle import serve_process


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid` and that multiprocessing spawned (the TP workers)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        if ppid == pid and b"spawn_main" in cmdline:
            out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def _stream(base_url: str, first: threading.Event, result: list[object]) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60)
    try:
        stream = client.completions.create(
            model=MODEL_NAME, prompt="The whale", max_tokens=400, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        for _ in stream:
            first.set()
        result.append("finished")
    except Exception as exc:  # noqa: BLE001 - the error is what the test reads
        result.append(exc)
    first.set()


def test_a_killed_worker_stops_the_server_in_one_line(tiny_model_dir: Path) -> None:
    stderr: list[str] = []
    tp = ("--tensor-parallel-size", "2")
    with serve_process(tiny_model_dir, "30", *tp, stderr_lines=stderr) as (process, base_url):
        workers = _children(process.pid)
        assert len(workers) == 1
        first, result = threading.Event(), []
        client = threading.Thread(target=_stream, args=(base_url, first, result))
        client.start()
        assert first.wait(30)
        os.kill(workers[0], signal.SIGKILL)
        start = time.monotonic()
        code = process.wait(10)
        assert time.monotonic() - start < 10 and code != 0
        client.join(30)
        assert result and result[0] != "finished"
    assert stderr[-1].startswith("error: tensor-parallel worker rank 1 exited"), stderr[-20:]
    assert not any(_alive(pid) for pid in workers)
