"""--method auto --max-kl (issue 21): the KL of next-token distributions on held-out text that
verifies the budget, and the whole run on the tiny Llama."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from qserve.cli import cli
from qserve.config import EngineConfig
from qserve.data import heldout_text
from qserve.engine.llm_engine import LLMEngine
from qserve.eval import perplexity
from qserve.model.loader import load_model, load_tokenizer
from qserve.quantize.auto import verify
from qserve.quantize.auto.kl import heldout_kl, window_hidden
from tests.quantize.test_auto import auto_args, run_auto


def test_kl_is_zero_against_itself_and_its_logprobs_are_the_engines(tiny_llama: Path) -> None:
    import torch

    ids = load_tokenizer(tiny_llama).encode(heldout_text(), add_special_tokens=False)
    assert heldout_kl(tiny_llama, tiny_llama, ids, 64, 512) == [0.0] * 8
    engine = LLMEngine(EngineConfig(str(tiny_llama), dtype="float32", kv_cache_memory="16MiB"))
    want = perplexity(engine, ids, 64, 512).perplexity
    model, config = load_model(tiny_llama, torch.float32)
    nll = 0.0
    with torch.inference_mode():
        for i in range(8):
            window = ids[64 * i : 64 * (i + 1)]
            logp = torch.log_softmax(model.compute_logits(window_hidden(model, config, window)), -1)
            nll -= float(logp[torch.arange(63), torch.tensor(window[1:])].sum())
    assert math.exp(nll / (8 * 63)) == pytest.approx(want, rel=1e-5)


def test_auto_meets_a_kl_budget(tiny_llama: Path, tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "auto-kl"
    record = run_auto(tiny_llama, out, ["--max-kl", "0.002"], monkeypatch)
    assert record["budget"]["max_kl"] == 0.002 and record["met"]
    assert 0 < record["measured"]["kl"] <= 0.002
    assert all(a["measured_kl"] is not None for a in record["attempts"])
    schemes = {a["scheme"] for a in record["allocation"]}
    assert schemes != {"bf16"}  # something was quantized
    ids, prefix, window = verify._heldout_ids(out)  # what was verified is what the folder holds
    kls = heldout_kl(tiny_llama, out, ids, window, verify.VERIFY_TOKENS, prefix)
    assert sum(kls) / len(kls) == pytest.approx(record["measured"]["kl"], rel=1e-9)
    assert record["measured"]["kl_bound"] > record["measured"]["kl"]  # held to the bound


@pytest.mark.parametrize("budget", [["--max-kl", "1e-12"], ["--max-ppl-increase", "1e-9"]])
def test_a_budget_only_16_bit_meets_is_said_so(
    tiny_llama: Path, tmp_path: Path, monkeypatch, budget: list[str]
) -> None:
    monkeypatch.setenv("QSERVE_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "never"
    result = CliRunner().invoke(cli, [*auto_args(tiny_llama, budget), "-o", str(out)])
    assert result.exit_code == 2 and "only every linear at 16 bits" in result.output
    assert "Traceback" not in result.output and not out.exists()
