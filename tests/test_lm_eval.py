"""lm-eval on qserve, three ways, against lm-eval's own hf backend on the same tiny fp32 model.

The real lm-eval runs the three tasks of tests/eval_tasks (multiple-choice cloze, rolling
perplexity, generation up to a stop sequence) with (a) `local-completions` against a real
server on a loopback port, (b) the `hf` backend (transformers), (c) the model "qserve" (the
offline engine). Every document's loglikelihoods, greedy flags and generated texts, and every
metric, must agree. All runs share one context of 128 tokens, short enough that the longer
texts span several rolling windows and one cloze context is left-truncated.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

pytest.importorskip("lm_eval")

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import qserve.lm_eval_model  # noqa: E402  (registers the model "qserve")
from qserve.cli import cli  # noqa: E402
from qserve.errors import QServeError  # noqa: E402
from tests.tiny import save_tiny_llama  # noqa: E402

TASK_DIR = Path(__file__).parent / "eval_tasks"
TASKS = ["qserve_cloze", "qserve_ppl", "qserve_qa"]
CONTEXT = 128  # qserve's max_model_len; the server's too
ENGINE_ARGS = {"dtype": "float32", "max_model_len": CONTEXT, "kv_cache_memory": "4MiB"}
RTOL = 1e-4
ROUTES = ["qserve", "server"]


@pytest.fixture(scope="module", autouse=True)
def offline() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def task_manager() -> TaskManager:
    return TaskManager(include_path=str(TASK_DIR))


def _evaluate(task_manager: TaskManager, model: str, model_args: dict, **kw: Any) -> dict:
    return simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=TASKS,
        task_manager=task_manager,
        log_samples=True,
        bootstrap_iters=0,
        **kw,
    )


@pytest.fixture(scope="module")
def hf_results(model_dir: Path, task_manager: TaskManager) -> dict:
    # hf's windows hold max_length + 1 tokens (qserve's: max_model_len - 1): the same windows
    args = {"pretrained": str(model_dir), "dtype": "float32", "max_length": CONTEXT - 2}
    return _evaluate(task_manager, "hf", args, device="cpu", batch_size=4)


@pytest.fixture(scope="module")
def qserve_results(model_dir: Path, task_manager: TaskManager) -> dict:
    return _evaluate(task_manager, "qserve", {"pretrained": str(model_dir), **ENGINE_ARGS})


@pytest.fixture(scope="module")
def server_results(model_dir: Path, task_manager: TaskManager) -> dict:
    pytest.importorskip("fastapi")
    from tests.server.conftest import MODEL_NAME, running_server, tiny_engine

    engine = tiny_engine(model_dir, max_model_len=CONTEXT)
    with running_server(engine) as server:
        args = {
            "model": MODEL_NAME,
            "base_url": f"{server.base_url}/v1/completions",
            "tokenizer": str(model_dir),  # the server has no /tokenizer_info: lm-eval falls back
            "tokenized_requests": True,
            "max_length": CONTEXT,
            "batch_size": 8,  # prompts per HTTP request
            "max_retries": 1,
        }
        return _evaluate(task_manager, "local-completions", args)


@pytest.fixture
def results(request: pytest.FixtureRequest) -> dict:
    return request.getfixturevalue(f"{request.param}_results")


def _docs(results: dict, task: str) -> list[dict]:
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=RTOL)


def max_relative_difference(results: dict, reference: dict) -> float:
    """Largest |a - b| / |b| over every loglikelihood of the two scoring tasks."""
    worst = 0.0
    for task in ("qserve_cloze", "qserve_ppl"):
        for doc, ref in zip(_docs(results, task), _docs(reference, task)):
            for a, b in zip(_flat(doc["filtered_resps"]), _flat(ref["filtered_resps"])):
                worst = max(worst, abs(a - b) / abs(b))
    return worst


def _flat(resps: list) -> list[float]:
    return [r[0] if isinstance(r, (tuple, list)) else r for r in resps]


@pytest.mark.parametrize("results", ROUTES, indirect=True)
def test_cloze_loglikelihoods_agree(results: dict, hf_results: dict) -> None:
    docs, ref = _docs(results, "qserve_cloze"), _docs(hf_results, "qserve_cloze")
    assert [d["doc_id"] for d in docs] == [d["doc_id"] for d in ref] == list(range(10))
    for doc, expected in zip(docs, ref):
        got, want = doc["filtered_resps"], expected["filtered_resps"]
        assert len(got) == len(want) == 4
        for (lp, greedy), (ref_lp, ref_greedy) in zip(got, want):
            assert _close(lp, ref_lp), (doc["doc_id"], lp, ref_lp)
            assert greedy == ref_greedy
    metrics = results["results"]["qserve_cloze"]
    for name in ("acc,none", "acc_norm,none"):
        assert metrics[name] == hf_results["results"]["qserve_cloze"][name]


@pytest.mark.parametrize("results", ROUTES, indirect=True)
def test_rolling_loglikelihoods_agree(results: dict, hf_results: dict) -> None:
    docs, ref = _docs(results, "qserve_ppl"), _docs(hf_results, "qserve_ppl")
    assert len(docs) == len(ref) == 10
    for doc, expected in zip(docs, ref):
        assert _close(doc["filtered_resps"][0], expected["filtered_resps"][0]), doc["doc_id"]
    metrics, ref_metrics = results["results"]["qserve_ppl"], hf_results["results"]["qserve_ppl"]
    for name in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert _close(metrics[name], ref_metrics[name]), name
    assert max_relative_difference(results, hf_results) < RTOL


def test_generations_agree(qserve_results: dict, server_results: dict, hf_results: dict) -> None:
    ref = [d["filtered_resps"][0] for d in _docs(hf_results, "qserve_qa")]
    offline = [d["filtered_resps"][0] for d in _docs(qserve_results, "qserve_qa")]
    served = [d["filtered_resps"][0] for d in _docs(server_results, "qserve_qa")]
    assert offline == ref and len(ref) == 10
    assert all("\n" not in text for text in ref) and any(ref)
    # The server streams text: it holds back a last character cut in two by max_tokens.
    assert [t.rstrip("\ufffd") for t in served] == [t.rstrip("\ufffd") for t in ref]
    for results in (qserve_results, server_results):
        metric = results["results"]["qserve_qa"]["exact_match,strip"]
        assert metric == hf_results["results"]["qserve_qa"]["exact_match,strip"]


def test_the_data_reaches_past_the_context(model_dir: Path) -> None:
    """One cloze context is left-truncated and several paragraphs span more than one rolling
    window, so the checks above cover both."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    cloze = [len(tokenizer.encode(d["context"])) for d in _rows("cloze.jsonl")]
    paragraphs = [len(tokenizer.encode(d["text"])) for d in _rows("ppl.jsonl")]
    assert max(cloze) > CONTEXT and sum(n > CONTEXT for n in paragraphs) >= 3


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (TASK_DIR / name).read_text().splitlines()]


def test_fit_window() -> None:
    fit = qserve.lm_eval_model.fit_window
    assert fit(list(range(200)), [7, 8], 127) == ([*range(75, 200), 7, 8], 125)
    assert fit([1, 2], [3], 127) == ([1, 2, 3], 2)
    with pytest.raises(QServeError, match="no room for context"):
        fit([1], list(range(127)), 127)


def test_a_greedy_continuation_is_greedy(model_dir: Path) -> None:
    """The tiny model's own greedy tokens score as greedy, with hf's logprob; one other token
    in their place does not (no cloze choice happens to be greedy for a random model)."""
    from lm_eval.models.huggingface import HFLM

    from qserve.engine.sampling_params import SamplingParams

    model = qserve.lm_eval_model.QServeLM(pretrained=str(model_dir), **ENGINE_ARGS)
    context = model.tok_encode("Call me Ishmael.")
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    tokens = model.llm.generate([context], greedy)[0].outputs[0].token_ids
    other = [*tokens[:2], (tokens[2] + 1) % model.tokenizer.vocab_size, tokens[3]]
    requests = [(None, context, tokens), (None, context, other)]
    hf = HFLM(pretrained=str(model_dir), dtype="float32", device="cpu", batch_size=2)
    got, want = model._loglikelihood_tokens(requests), hf._loglikelihood_tokens(requests)
    assert [g for _, g in got] == [g for _, g in want] == [True, False]
    assert all(_close(a, b) for (a, _), (b, _) in zip(got, want))


def test_lm_eval_command_line(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`qserve-lm-eval` / `python -m qserve.lm_eval_model`: lm-eval's own CLI, model "qserve"."""
    import lm_eval.utils

    monkeypatch.setattr(lm_eval.utils, "_LOGGING_CONFIGURED", True)  # no handler on our stderr
    model_args = ",".join(f"{k}={v}" for k, v in {"pretrained": model_dir, **ENGINE_ARGS}.items())
    argv = ["lm_eval", "run", "--model", "qserve", "--model_args", model_args]
    argv += ["--tasks", "qserve_cloze", "--include_path", str(TASK_DIR), "--limit", "2"]
    monkeypatch.setattr(sys, "argv", argv)
    qserve.lm_eval_model.main()
    out = capsys.readouterr().out
    assert "|qserve_cloze|" in out and "acc_norm" in out


# -- qserve eval --tasks ---------------------------------------------------------------------


def _eval(*args: str) -> Any:
    return CliRunner().invoke(cli, ["eval", *args])


def test_cli_prints_lm_eval_table(model_dir: Path) -> None:
    args = [str(model_dir), "--tasks", "qserve_cloze,qserve_ppl", "--include-path", str(TASK_DIR)]
    args += ["--limit", "3", "--dtype", "float32", "--max-model-len", str(CONTEXT)]
    result = _eval(*args, "--kv-cache-memory", "4MiB")
    assert result.exit_code == 0, result.output
    table = result.stdout
    assert "|qserve_cloze|" in table and "|qserve_ppl  |" in table
    assert "acc_norm" in table and "word_perplexity" in table


TASKS_OPTION = ["--tasks", "qserve_cloze", "--include-path", str(TASK_DIR)]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--data", "moby-dick-eval", *TASKS_OPTION], "not both"),
        ([], "not neither"),
        (["--tasks", "no_such_task", "--include-path", str(TASK_DIR)], "unknown lm-eval task"),
        (["--tasks", "qserve_cloze", "--include-path", "/no/such/dir"], "is not a folder"),
        (["--tasks", ","], "names no task"),
        ([*TASKS_OPTION, "--seq-len", "64"], "--seq-len does not apply with --tasks"),
        (["--data", "moby-dick-eval", "--limit", "3"], "--limit does not apply with --data"),
    ],
)
def test_cli_errors(model_dir: Path, args: list[str], message: str) -> None:
    result = _eval(str(model_dir), *args)
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    assert line.startswith("error: ") and "\n" not in line and message in line, line


def test_cli_without_lm_eval(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval now fails
    result = _eval(str(model_dir), "--tasks", "qserve_cloze")
    assert result.exit_code == 2
    line = result.stderr.strip()
    assert "pip install 'qserve[eval]'" in line and "\n" not in line, line


def test_model_args(model_dir: Path) -> None:
    lm = qserve.lm_eval_model
    with pytest.raises(QServeError, match="unknown qserve model args: colour"):
        lm.QServeLM(pretrained=str(model_dir), colour="red")
    model = lm.QServeLM(
        pretrained=str(model_dir),
        batch_size="auto:4",
        device="cuda:99",  # lm-eval's --device, where there is none: the engine's default
        max_length=64,
        max_batch_size=3,
        trust_remote_code=True,
        dtype="float32",
        kv_cache_memory="1MiB",
    )
    assert (model.max_length, model.llm.engine.config.max_num_seqs) == (64, 3)
    assert model.llm.engine.config.device == "cpu"
    assert model.prefix_token_id == model.tokenizer.eos_token_id  # this tokenizer has no BOS
