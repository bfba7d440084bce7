"""`qserve eval` on SmolLM2-135M in fp32, through the engine's prompt logprobs, gives the
perplexity it gave before the rebuild (its own path around the scheduler, commit cba6b1f)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from qserve.cli import cli

pytestmark = pytest.mark.slow

# moby-dick-eval, --seq-len 512 --max-tokens 4096, fp32: 8 windows, 4088 tokens scored (measured
# on an Intel Xeon with AVX-512, before the rebuild; the rebuild gave 60.555744, 3e-8 away)
BEFORE_REBUILD = 60.55574571506897


def test_smollm2_perplexity_unchanged() -> None:
    args = ["eval", "smollm2-135m", "--data", "moby-dick-eval", "--dtype", "float32"]
    args += ["--seq-len", "512", "--max-tokens", "4096", "--json"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.output.strip().splitlines()[-1])
    assert (out["num_windows"], out["num_tokens"]) == (8, 4088)
    assert out["perplexity"] == pytest.approx(BEFORE_REBUILD, rel=1e-5)
