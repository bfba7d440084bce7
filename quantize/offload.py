"""Disk offload for calibration: decoder blocks come from the checkpoint one at a time.

Calibration walks the decoder blocks in order and each block is done once, so the blocks need
not all be in memory. With an offload folder the model is built on the meta device (shapes
only) and only what sits outside the blocks (embeddings, final norm, lm_head) is read from the
checkpoint. Each block's tensors are read from the checkpoint's safetensors just before it is
calibrated and released (back to meta) after it is quantized, once what the exported checkpoint
needs of it has been written to the offload folder. The CPU then holds one block, the non-block
tensors and the calibration activations, not the whole model; the policy (what is written per
block, when) is the driver's.

    SafetensorsCheckpoint   tensor name -> shard file, read a few names at a time (fp32)
    empty_model             the model, its blocks on meta, the rest read from the checkpoint
    materialize / release   put a module's tensors in place / back on meta
    offload_folder          a temporary folder inside the user's offload folder, removed after
    BlockOffload            the driver's side: read a block, write its checkpoint tensors, free it
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from qserve.errors import QServeError
from qserve.quantize import export
from qserve.quantize.fold import ScaleResult
from qserve.quantize.results import BlockResults
from qserve.quantize.settings import QuantizeSettings

__all__ = [
    "SafetensorsCheckpoint",
    "empty_model",
    "materialize",
    "release",
    "is_materialized",
    "offload_folder",
    "BlockOffload",
    "select_scales",
]

INDEX_FILE = "model.safetensors.index.json"


class SafetensorsCheckpoint:
    """The safetensors weights of a model folder (one file, or shards with an index)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.files = _tensor_files(self.folder)  # tensor name -> file

    def read(self, names: Iterable[str]) -> dict[str, Tensor]:
        """The named tensors, floating point ones in fp32 (as the model is calibrated)."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            if name not in self.files:
                raise QServeError(
                    f"{self.folder} has no tensor {name} (offloading reads the checkpoint's "
                    "tensors by the names transformers gives them)",
                    param="offload_dir",
                )
            by_file.setdefault(self.files[name], []).append(name)
        out = {}
        for file, file_names in by_file.items():
            # pread: owned copies. Memory-mapped, an fp32 tensor would be a view that keeps the
            # whole shard mapped (and what was read of it resident) as long as it lives.
            with _open(file, backend="pread") as f:
                out.update({n: _fp32(f.get_tensor(n)) for n in file_names})
        return out


def _open(file: Path, backend: str = "mmap") -> Any:
    """safe_open, with a one-line error for a missing or malformed file."""
    try:
        return safe_open(str(file), "pt", backend=backend)
    except (OSError, SafetensorError) as e:
        raise QServeError(f"cannot read {file}: {e}", param="model") from None


def _tensor_files(folder: Path) -> dict[str, Path]:
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: folder / file for name, file in weight_map.items()}
        except (ValueError, KeyError, TypeError, AttributeError):
            raise QServeError(f"{index} is not a safetensors index", param="model") from None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise QServeError(
            f"{folder} has no .safetensors weights: offloading reads decoder blocks from "
            "safetensors (convert the checkpoint, or quantize without an offload folder)",
            param="offload_dir",
        )
    out = {}
    for file in files:
        with _open(file) as f:
            out.update(dict.fromkeys(f.keys(), file))
    return out


def _fp32(t: Tensor) -> Tensor:
    return t.float() if t.is_floating_point() else t


def empty_model(
    model_path: str | Path, checkpoint: SafetensorsCheckpoint, blocks: str
) -> nn.Module:
    """The causal LM of `model_path` in fp32 with the decoder blocks under `blocks` (a dotted
    path) on the meta device and every other tensor read from `checkpoint`; tied embeddings
    are tied again after reading. What from_pretrained gives, minus the blocks' weights."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with init_empty_weights(include_buffers=False):  # buffers (RoPE inv_freq) are computed
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    outside = [n for n in _meta_names(model) if not n.startswith(blocks + ".")]
    stored = [n for n in outside if n in checkpoint.files]
    materialize(model, checkpoint.read(stored))
    model.tie_weights()
    missing = [n for n in _meta_names(model) if not n.startswith(blocks + ".")]
    if missing:
        checkpoint.read(missing[:1])  # the one-line error naming the tensor
    _load_generation_config(model, model_path)
    return model


def _meta_names(module: nn.Module) -> list[str]:
    return [n for n, t in module.state_dict(keep_vars=True).items() if t.is_meta]


def _load_generation_config(model: nn.Module, model_path: str | Path) -> None:
    """generation_config.json, or one made from config.json, as from_pretrained does."""
    from transformers import GenerationConfig

    if not model.can_generate():
        return
    try:
        model.generation_config = GenerationConfig.from_pretrained(model_path)
    except OSError:
        model.generation_config = GenerationConfig.from_pretrained(
            model_path, config_file_name="config.json", _from_model_config=True
        )


def materialize(module: nn.Module, tensors: dict[str, Tensor]) -> None:
    """Put `tensors` (names relative to `module`) in place of the module's meta tensors."""
    expected = module.state_dict(keep_vars=True)
    for name, t in tensors.items():
        if name in expected and expected[name].shape != t.shape:
            raise QServeError(
                f"checkpoint tensor {name} has shape {list(t.shape)}, the model expects "
                f"{list(expected[name].shape)}",
                param="model",
            )
    module.load_state_dict(tensors, strict=False, assign=True)


def release(module: nn.Module) -> None:
    """Free the module's parameters and persistent buffers: back to meta (shapes kept)."""
    meta = {n: torch.empty_like(t, device="meta") for n, t in module.state_dict().items()}
    module.load_state_dict(meta, assign=True)


def is_materialized(module: nn.Module) -> bool:
    """Whether any parameter of `module` holds data (is not on the meta device)."""
    return any(not p.is_meta for p in module.parameters())


@contextlib.contextmanager
def offload_folder(offload_dir: str | Path, output_dir: str | Path) -> Iterator[Path]:
    """A fresh temporary folder inside `offload_dir` (created if missing), for one run's
    blocks. It is removed at the end, even on error, and so is `offload_dir` if this created
    it and nothing else was put there; what `offload_dir` held before is never touched."""
    root = Path(offload_dir)
    _check_offload_dir(root, Path(output_dir))
    created = _make_folder(root)
    try:
        tmp = Path(tempfile.mkdtemp(prefix="qserve-offload-", dir=root))
    except OSError as e:
        _remove_created(root, created)
        raise QServeError(f"cannot write to offload folder {root}: {e.strerror or e}") from None
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_created(root, created)


def _check_offload_dir(root: Path, output_dir: Path) -> None:
    if root.exists() and not root.is_dir():
        raise QServeError(f"offload folder {root} exists and is not a folder", "offload_dir")
    resolved, out = root.resolve(), output_dir.resolve()
    if resolved == out or out in resolved.parents:
        raise QServeError(
            f"offload folder {root} is inside the output folder {output_dir}: choose another",
            param="offload_dir",
        )


def _make_folder(root: Path) -> Path | None:
    """Create `root` with its parents; the topmost folder created, or None if it existed."""
    if root.is_dir():
        return None
    top = root
    while not top.parent.exists():
        top = top.parent
    try:
        root.mkdir(parents=True)
    except OSError as e:
        raise QServeError(
            f"cannot create offload folder {root}: {e.strerror or e}", param="offload_dir"
        ) from None
    return top


def _remove_created(root: Path, top: Path | None) -> None:
    """Remove the folders `_make_folder` created, innermost first, while they are empty."""
    if top is None:
        return
    for folder in [root, *root.parents]:
        try:
            folder.rmdir()
        except OSError:
            return
        if folder == top:
            return


# ------------------------------------------------------------------------------ the driver's side


@dataclasses.dataclass
class BlockOffload:
    """The decoder blocks of `model` (under `blocks`) kept on disk: each is read from
    `checkpoint` before it is quantized, then written to `folder` and put back on meta.

    A finished block leaves one file in `folder` holding exactly its tensors of the output
    checkpoint (`_checkpoint_tensors` of the block); `quantized` names its quantized linears.
    `replay`: a saved AWQ / SmoothQuant search, folded into each block as it is read.
    `rename`: a full name in the model -> in the checkpoint (`ArchSpec.checkpoint_name`), used
    to read the block and to name what is written.
    """

    model: nn.Module
    blocks: str
    checkpoint: SafetensorsCheckpoint
    folder: Path
    settings: QuantizeSettings
    dtype: torch.dtype
    replay: ScaleResult | None = None
    files: list[Path] = dataclasses.field(default_factory=list)
    quantized: set[str] = dataclasses.field(default_factory=set)
    rename: Callable[[str], str] = str  # str: the same names

    def set_replay(self, scales: ScaleResult) -> None:
        """Check `scales` against the model now; fold what lies outside the blocks now, the
        rest block by block (folds of different blocks touch different tensors)."""
        modules = dict(self.model.named_modules())
        missing = [n for n in [*scales.scales, *scales.clips] if n not in modules]
        if missing:
            raise QServeError(f"scales do not match the model: it has no module {missing[0]}")
        outside = select_scales(scales, lambda name: not name.startswith(self.blocks + "."))
        outside.apply(self.model, self.settings.group_size)
        self.replay = scales

    def load(self, block: nn.Module, prefix: str) -> None:
        """Read the block's tensors (fp32) from the checkpoint, and fold the replayed search."""
        names = {self.rename(prefix + n): n for n in block.state_dict()}
        tensors = self.checkpoint.read(names)
        materialize(block, {names[n]: t for n, t in tensors.items()})
        if self.replay is not None:
            mine = select_scales(self.replay, lambda name: name.startswith(prefix))
            mine.apply(self.model, self.settings.group_size)

    def save(self, block: nn.Module, prefix: str, done: BlockResults) -> None:
        """Write the block's checkpoint tensors to the offload folder and free the block."""
        state = {k: v.detach() for k, v in block.state_dict(prefix=prefix).items()}
        tensors = export.checkpoint_tensors(state, done, self.settings, self.dtype)
        tensors = {self.rename(k): v for k, v in tensors.items()}
        path = self.folder / f"{prefix.rstrip('.')}.safetensors"
        try:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
        except OSError as e:
            raise QServeError(f"cannot write {path}: {e.strerror or e}", "offload_dir") from None
        self.files.append(path)
        self.quantized.update(done.linears)
        release(block)


def select_scales(scales: ScaleResult, keep: Callable[[str], bool]) -> ScaleResult:
    """The entries of `scales` whose module name `keep` accepts, in their order."""
    return ScaleResult(
        scales={k: v for k, v in scales.scales.items() if keep(k)},
        linears={k: v for k, v in scales.linears.items() if keep(k)},
        clips={k: v for k, v in scales.clips.items() if keep(k)},
    )
