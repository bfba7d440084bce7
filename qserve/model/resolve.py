"""Turn a user's model spec into a plain Hugging Face folder on disk.

A spec is one of: None or a built-in alias (`smollm2-135m`, the default), a local HF folder, a
`.gguf` file (converted once into the cache), or a hub id `org/name` (snapshot_download).
"""

from __future__ import annotations

import re
from pathlib import Path

from qserve.errors import QServeError
from qserve.model.builtin import BUILTIN_MODELS, DEFAULT_MODEL, resolve_builtin, resolve_gguf
from qserve.model.config import read_json
from qserve.model.loader import safetensors_files

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "tokenizer*"]


def resolve_model(spec: str | None) -> Path:
    """Return a folder holding config.json and safetensors weights for `spec`."""
    if spec is None or spec in BUILTIN_MODELS:
        return resolve_builtin(spec or DEFAULT_MODEL)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        return resolve_gguf(path)
    if path.is_dir():
        return check_model_folder(path)
    if path.exists():
        raise QServeError(f"{path} is a file; expected a model folder or a .gguf file")
    if _HUB_ID.match(spec):
        return check_model_folder(_download_from_hub(spec))
    aliases = ", ".join(sorted(BUILTIN_MODELS))
    raise QServeError(
        f"model {spec} does not exist; expected a model folder, a .gguf file, a hub id "
        f"(org/name) or a built-in alias ({aliases})"
    )


def model_files_stamp(path: Path) -> list[tuple[str, int, int]]:
    """(name, size, mtime) of a model folder's config and weight files: what a cache of
    something computed from the model is keyed by."""
    files = sorted(p for p in Path(path).iterdir() if p.suffix in (".json", ".safetensors"))
    return [(p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in files]


def check_model_folder(path: Path) -> Path:
    """Raise QServeError unless `path` has a readable config.json and safetensors weights."""
    read_json(path / "config.json", what="model config")
    safetensors_files(path)
    return path


def _download_from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
    except Exception as exc:  # offline, unknown repo, gated repo, ...: all one line for the user
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        raise QServeError(
            f"model {repo_id} is not a local folder and could not be fetched from the "
            f"Hugging Face hub: {lines[0]}"
        ) from None
