"""Tiny random Hugging Face checkpoints (no download), saved once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_models import TINY_MODELS, build_tiny_model


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> folder of a saved random model (fp32 safetensors)."""
    folders = {}
    for name in TINY_MODELS:
        folder = tmp_path_factory.mktemp(f"tiny-{name}")
        build_tiny_model(name).save_pretrained(folder)
        folders[name] = folder
    return folders
