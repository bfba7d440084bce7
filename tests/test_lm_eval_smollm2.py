"""On SmolLM2-135M in fp32, lm-eval's cloze task through a real `qserve serve`
(`local-completions`) gives the accuracy, and the per-choice loglikelihoods, of lm-eval's own
`hf` backend."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

pytestmark = pytest.mark.slow

TASK_DIR = Path(__file__).parent / "eval_tasks"
TASK = "qserve_cloze"
CONTEXT = 512


@pytest.fixture(scope="module", autouse=True)
def offline() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield


def _evaluate(model: str, model_args: dict, **kw: object) -> dict:
    return simple_evaluate(model=model, model_args=model_args, tasks=[TASK], log_samples=True,
                           task_manager=TaskManager(include_path=str(TASK_DIR)),
                           bootstrap_iters=0, **kw)  # fmt: skip


def test_cloze_through_the_server_equals_hf() -> None:
    pytest.importorskip("fastapi")
    from qserve.config import EngineConfig
    from qserve.engine.llm_engine import LLMEngine
    from qserve.model.resolve import resolve_model
    from tests.server.conftest import MODEL_NAME, running_server

    model_dir = str(resolve_model("smollm2-135m"))
    hf = _evaluate("hf", {"pretrained": model_dir, "dtype": "float32", "max_length": CONTEXT},
                   device="cpu", batch_size=4)  # fmt: skip
    engine = LLMEngine(EngineConfig(model_dir, dtype="float32", max_model_len=CONTEXT,
                                    kv_cache_memory="64MiB"))  # fmt: skip
    with running_server(engine) as server:
        args = {"model": MODEL_NAME, "base_url": f"{server.base_url}/v1/completions",
                "tokenizer": model_dir, "tokenized_requests": True, "max_length": CONTEXT,
                "batch_size": 8, "max_retries": 1}  # fmt: skip
        ours = _evaluate("local-completions", args)
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"][TASK][metric] == hf["results"][TASK][metric]
    theirs = {s["doc_id"]: s for s in hf["samples"][TASK]}
    for sample in ours["samples"][TASK]:
        ref = theirs[sample["doc_id"]]
        got = [r[0][0] for r in sample["resps"]]  # per choice: [(loglikelihood, is_greedy)]
        want = [r[0][0] for r in ref["resps"]]
        assert got == pytest.approx(want, rel=1e-4, abs=1e-4)
