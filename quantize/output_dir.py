"""Where a checkpoint is written: refusing folders qserve must not touch, staging, the swap.

A checkpoint is written into a hidden staging folder beside the destination (`.NAME.tmp-PID-*`)
and renamed into place at the end. `overwrite` replaces an existing folder only when it holds a
checkpoint and nothing else (config.json, weights, tokenizer files, qserve's own files): never
the current folder or one above it, never the input model or a folder above it, never a folder
with anything else in it. The old folder is renamed aside before the new one takes its place and
deleted only after, so a failure leaves one of the two whole. Staging folders that a process no
longer running left behind are removed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from qserve.errors import QServeError

__all__ = ["check_output_dir", "staging_dir", "set_default_permissions"]

# What a Hugging Face / qserve checkpoint folder holds: weights, configs, tokenizer files, a
# model card, and qserve's saved scale search (a `qserve/` subfolder of safetensors).
CHECKPOINT_SUFFIXES = {".safetensors", ".json", ".jinja", ".txt", ".model", ".md", ".bin"}
CHECKPOINT_FILES = {".gitattributes"}
CHECKPOINT_SUBFOLDER = "qserve"


def check_output_dir(
    output_dir: str | Path, overwrite: bool, model_path: str | Path | None = None
) -> Path:
    """The destination, if qserve may write there: absent, empty, or (with `overwrite`) a
    checkpoint folder that is neither the input model nor above it or the current folder."""
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise QServeError(f"output path {out} exists and is not a folder", param="output")
    blocking = next((p for p in out.absolute().parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise QServeError(f"output path {out}: {blocking} is a file, not a folder", "output")
    if _is_or_holds(out, Path.cwd()):
        raise QServeError(
            f"output folder {out} is the current folder or holds it; name a new folder",
            param="output",
        )
    if model_path is not None and _is_or_holds(out, Path(model_path)):
        raise QServeError(
            f"output folder {out} is the input model's folder or holds it", param="output"
        )
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise QServeError(
                f"output folder {out} is not empty (pass overwrite=True to replace it)",
                param="output",
            )
        _check_replaceable(out)
    return out


def _is_or_holds(folder: Path, path: Path) -> bool:
    """Whether `folder` is `path` or one of the folders above it (links resolved)."""
    folder, path = folder.resolve(), path.resolve()
    return folder == path or folder in path.parents


def _check_replaceable(folder: Path) -> None:
    """`overwrite` replaces only a checkpoint: config.json and checkpoint files, nothing else."""
    strangers = [p.name for p in folder.iterdir() if not _is_checkpoint_entry(p)]
    if strangers or not (folder / "config.json").is_file():
        what = f"{', '.join(sorted(strangers)[:3])} in it" if strangers else "no config.json"
        raise QServeError(
            f"output folder {folder} is not a checkpoint folder ({what}); overwrite only "
            "replaces a folder that holds a checkpoint and nothing else",
            param="output",
        )


def _is_checkpoint_entry(path: Path) -> bool:
    if path.is_symlink():
        return False
    if path.is_dir():
        return path.name == CHECKPOINT_SUBFOLDER and all(
            p.is_file() and p.suffix in (".safetensors", ".json") for p in path.iterdir()
        )
    return path.suffix in CHECKPOINT_SUFFIXES or path.name in CHECKPOINT_FILES


@contextlib.contextmanager
def staging_dir(
    output_dir: str | Path, overwrite: bool = False, model_path: str | Path | None = None
) -> Iterator[Path]:
    """A temporary folder beside `output_dir`, moved into its place when the block succeeds."""
    out = check_output_dir(output_dir, overwrite, model_path).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    try:
        yield tmp
        set_default_permissions(tmp)
        _swap_into_place(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _swap_into_place(new: Path, out: Path) -> None:
    """Rename `new` to `out`; an existing `out` is renamed aside first and deleted after."""
    if not out.exists():
        new.rename(out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-{os.getpid()}-", dir=out.parent))
    old.rmdir()
    out.rename(old)
    try:
        new.rename(out)
    except BaseException:
        old.rename(out)  # put the old checkpoint back
        raise
    shutil.rmtree(old, ignore_errors=True)


def remove_stale_staging(out: Path) -> None:
    """Delete `.NAME.tmp-PID-*` / `.NAME.old-PID-*` folders beside `out` whose process is gone
    (an interrupted run's leftovers); a running process's are left alone."""
    for kind in ("tmp", "old"):
        for folder in out.parent.glob(f".{out.name}.{kind}-*-*"):
            pid = folder.name.removeprefix(f".{out.name}.{kind}-").split("-")[0]
            if folder.is_dir() and pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def set_default_permissions(folder: Path) -> None:
    """Folders 0777 and files 0666 less the umask (0755 / 0644 under the usual 022), as
    `save_pretrained` leaves them: `mkdtemp` makes its folder 0700, which another user (a
    server in a container with another uid) cannot read."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob("*"):
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)
