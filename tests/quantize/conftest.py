"""Fixtures for the quantize tests: a tiny random Llama with a small byte-level BPE tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ._helpers import make_tiny_model


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"))
