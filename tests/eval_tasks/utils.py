"""Loads a task's JSONL files from this folder, whatever the working directory.

lm-eval passes a task's `dataset_kwargs` (and its metadata, which holds the model arguments) to
`custom_dataset`; `datasets.load_dataset("json", ...)` would resolve the file names against
the working directory instead of the task's folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets

HERE = Path(__file__).resolve().parent


def load_jsonl(data_files: dict[str, str], **_: Any) -> datasets.DatasetDict:
    """One split per entry of `data_files` (split name: a JSONL file next to this one)."""
    return datasets.DatasetDict(
        {
            split: datasets.Dataset.from_list(_rows(HERE / name))
            for split, name in data_files.items()
        }
    )


def _rows(path: Path) -> list[dict[str, Any]]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]
