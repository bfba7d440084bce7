"""The input model's tensors against its config, before any work.

transformers fills a tensor the config expects but the checkpoint lacks with random values and
only warns, and skips a tensor the config does not expect: a config.json claiming 40 layers over
30 real ones gave 10 random layers, one claiming 2 gave gibberish, and both were quantized and
written with exit 0. Here every tensor the config's model expects must be in the checkpoint with
its shape (a tied lm_head may be absent), and every tensor in the checkpoint must be one of them.
Only the safetensors headers are read.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from qserve.errors import QServeError
from qserve.quantize.offload import SafetensorsCheckpoint, _open

# Tensors old checkpoints carry that transformers drops on purpose (recomputed buffers).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def meta_model(config: Any) -> Any:
    """The causal LM of `config` on the meta device (shapes, no weights): what the quantizer
    reads the linears' sizes and the expected tensors from, built once."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def check_model_tensors(
    model_path: str | Path,
    skeleton: Any,
    rename: Callable[[str], str] = str,  # str: as they are
) -> None:
    """One-line QServeError unless the checkpoint holds exactly the tensors the model needs
    (`skeleton`: its `meta_model`, its names read as `rename` gives them in checkpoints). A
    checkpoint without safetensors (pytorch_model.bin) is not checked: its names cannot be read
    without loading it."""
    if not any(Path(model_path).glob("*.safetensors")):
        return
    expected, optional = _expected_shapes(skeleton)
    expected = {rename(n): shape for n, shape in expected.items()}
    optional = {rename(n) for n in optional}
    stored = _stored_shapes(model_path)
    missing = [n for n in expected if n not in stored and n not in optional]
    unused = [n for n in stored if n not in expected and not n.endswith(IGNORED_SUFFIXES)]
    wrong = [n for n in expected if n in stored and stored[n] != expected[n]]
    if missing:
        raise _mismatch(model_path, f"has no tensor {missing[0]}", missing)
    if unused:
        raise _mismatch(model_path, f"has tensor {unused[0]}, which the config never uses", unused)
    if wrong:
        name = wrong[0]
        raise _mismatch(
            model_path,
            f"has {name} of shape {list(stored[name])} where the config needs "
            f"{list(expected[name])}",
            wrong,
        )


def _mismatch(model_path: str | Path, what: str, names: list[str]) -> QServeError:
    more = f" ({len(names) - 1} more like it)" if len(names) > 1 else ""
    return QServeError(
        f"{model_path}: the checkpoint does not match its config.json: it {what}{more}",
        param="model",
    )


def _expected_shapes(model: Any) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """(name -> shape of every tensor `model` loads, the names that may be absent because
    they are tied to another)."""
    model.tie_weights()
    state = model.state_dict(keep_vars=True)
    first_name: dict[int, str] = {}
    optional = set()
    for name, tensor in state.items():  # a tensor under two names (tied) is needed once
        key = id(tensor)
        if key in first_name:
            optional.add(name)
        else:
            first_name[key] = name
    return {n: tuple(t.shape) for n, t in state.items()}, optional


def _stored_shapes(model_path: str | Path) -> dict[str, tuple[int, ...]]:
    files = SafetensorsCheckpoint(model_path).files
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(set(files.values())):
        with _open(file) as f:
            shapes.update({n: tuple(f.get_slice(n).get_shape()) for n in f.keys()})
    return shapes
