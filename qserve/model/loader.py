"""Load a Hugging Face folder (safetensors, single or sharded) into our model classes.

The model is built on the `meta` device (no random init, no memory), then every parameter is
assigned straight from the checkpoint in the target dtype and device.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from qserve.errors import QServeError
from qserve.model.config import ModelConfig
from qserve.model.kv_scales import apply_kv_scales, pop_kv_scales
from qserve.model.llama import LlamaForCausalLM
from qserve.model.moe import (
    checkpoint_namer,
    checkpoint_renames,
    is_router,
    moe_checkpoint_tensors,
)
from qserve.model.moe_fused import prepare_moe_blocks
from qserve.model.quant import keeps_stored_dtype, prepare_quant_linears, swap_quant_linears
from qserve.model.rotary import RotaryEmbedding
from qserve.quantize.export import PROVENANCE_FILE

if TYPE_CHECKING:  # qserve.parallel builds on the model code, not the reverse
    from qserve.parallel.pipeline_parallel import PPRank
    from qserve.parallel.tensor_parallel import TPRank

logger = logging.getLogger("qserve")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
# Tensors some checkpoints carry that we recompute instead (old Llama saves held RoPE frequencies).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class LoadReport:
    """What loading chose: the quantization scheme, the kernel path of each kind of linear
    (q_proj, ..., lm_head; `experts`: how MoE experts run, `moe_fused`), the projections merged
    into one matmul (qkv_proj, gate_up_proj: `qserve.model.merge`) and how many attention
    layers got FP8 KV scales from the checkpoint."""

    scheme: str  # "dense" or QuantScheme.describe()
    linear_paths: dict[str, str]
    num_kv_scaled_layers: int
    num_layers: int
    merged: tuple[str, ...] = ()
    provenance: dict[str, Any] | None = None  # what made the checkpoint (qserve quantize)

    @property
    def has_kv_scales(self) -> bool:
        return self.num_kv_scaled_layers == self.num_layers


def load_model(
    path: Path,
    dtype: torch.dtype,
    device: str = "cpu",
    tp: TPRank | None = None,
    pp: PPRank | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model of `path/config.json` and fill it from the folder's safetensors.

    Quantized checkpoints: the linears the scheme names are swapped for `QuantLinear`s before
    the tensors are assigned, then repacked once for their kernel. The choices are left in
    `model.load_report` (a LoadReport). With `tp`, rank tp.rank's share of the model
    (`qserve.parallel.tensor_parallel`); with `pp`, stage pp.rank's layers
    (`qserve.parallel.pipeline_parallel`); the config returned is that rank's."""
    path = Path(path)
    config = full_config = ModelConfig.from_pretrained(path)
    if tp is not None:
        config = tp.rank_config(config)
    if pp is not None:
        config = pp.rank_config(config)
    with torch.device("meta"):
        model = model_class(config)(config)
    stored = read_state_dict(path, dtype, device)
    if tp is not None:
        stored = tp.shard_state(stored, full_config)
    if pp is not None:
        stored = pp.shard_state(stored)
        pp.attach(model)
    renames = checkpoint_renames(stored, config)
    checkpoint_name = checkpoint_namer(renames)
    state = moe_checkpoint_tensors(stored, config, renames)
    kv_scales = pop_kv_scales(state)
    if config.quantization is not None:
        routers = functools.partial(is_router, model)  # dense in every scheme, as in vLLM
        swap_quant_linears(model, config.quantization, state, checkpoint_name, routers)
    _assign_weights(model, state, source=str(path))
    if tp is not None:  # on the modules that run: quantized linears replaced the dense ones
        tp.add_all_reduce(model, full_config)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.init_cache(device)
    _check_materialized(model)
    del stored, state  # the model holds the tensors: stacking MoE experts frees theirs per layer
    moe_paths = prepare_moe_blocks(model)  # stacks checkpoint tensors: before their prepare
    linear_paths = {**prepare_quant_linears(model, dtype), **moe_paths}
    model.load_report = LoadReport(
        scheme=config.quantization.describe() if config.quantization else "dense",
        linear_paths=linear_paths,
        num_kv_scaled_layers=apply_kv_scales(model, kv_scales),
        num_layers=config.num_hidden_layers,
        merged=tuple(model.merge_projections()),
        provenance=read_provenance(path),
    )
    return model.eval().requires_grad_(False), config


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The model class of the config's architecture family."""
    if config.family == "gemma3":
        from qserve.model.gemma3 import Gemma3ForCausalLM

        return Gemma3ForCausalLM
    return LlamaForCausalLM


def read_provenance(folder: Path) -> dict[str, Any] | None:
    """What made the checkpoint in `folder` (qserve quantize's PROVENANCE_FILE), or None."""
    path = folder / PROVENANCE_FILE
    if not path.is_file():
        return None
    try:
        made_by = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raise QServeError(f"{path} is not readable JSON", param="model") from None
    return made_by if isinstance(made_by, dict) else None


def load_tokenizer(path: Path) -> Any:
    """The folder's Hugging Face tokenizer (with its chat template)."""
    from transformers import AutoTokenizer

    path = Path(path)
    # Without these, transformers 5 quietly builds an empty tokenizer from config.json alone.
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        names = ", ".join(TOKENIZER_FILES)
        raise QServeError(f"model folder {path} has no tokenizer; expected one of: {names}")
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # transformers raises OSError, ValueError, ... for broken folders
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        raise QServeError(f"could not load a tokenizer from {path}: {lines[0]}") from None


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint files of a folder: `model.safetensors` or the shards its index names."""
    index = path / INDEX_FILE
    if index.is_file():
        return _shard_files(index)
    single = path / SINGLE_FILE
    if single.is_file():
        return [single]
    raise QServeError(f"model folder {path} has no {SINGLE_FILE} or {INDEX_FILE}")


def _shard_files(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        raise QServeError(f"{index} is not a safetensors index (expected a weight_map)") from None
    files = [index.parent / name for name in names]
    for file in files:
        if not file.is_file():
            raise QServeError(f"{index} names shard {file.name}, which is not in {index.parent}")
    return files


def iter_checkpoint_tensors(path: Path, device: str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of the folder's safetensors, in its stored dtype."""
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt", device=device) as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise QServeError(f"{file} is not a readable safetensors file: {exc}") from None


def read_state_dict(path: Path, dtype: torch.dtype, device: str = "cpu") -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint; floating ones cast to `dtype`, except quantization scales
    and 8-bit (fp8) weights, which keep their stored dtype."""
    state = {}
    for name, tensor in iter_checkpoint_tensors(path, device):
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        state[name] = tensor if keeps_stored_dtype(name, tensor) else tensor.to(dtype)
    return state


def _assign_weights(model: LlamaForCausalLM, state: dict[str, torch.Tensor], source: str) -> None:
    expected = model.state_dict(keep_vars=True)  # meta tensors: names and shapes only
    if model.config.tie_word_embeddings and isinstance(model.lm_head, nn.Linear):
        state.pop("lm_head.weight", None)  # some tied checkpoints store a copy: the embedding wins
        expected.pop("lm_head.weight")
    _check_names(set(expected), set(state), source)
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            want, got = list(expected[name].shape), list(tensor.shape)
            raise QServeError(f"{source}: tensor {name} has shape {got}; expected {want}")
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()


def _check_names(expected: set[str], found: set[str], source: str) -> None:
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing:
        raise QServeError(
            f"checkpoint {source} lacks {len(missing)} tensor(s) the model needs, e.g. {missing[0]}"
        )
    if unexpected:
        raise QServeError(
            f"checkpoint {source} holds {len(unexpected)} tensor(s) the model does not use, "
            f"e.g. {unexpected[0]}"
        )


def _check_materialized(model: torch.nn.Module) -> None:
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_meta:
            raise RuntimeError(f"{name} was not loaded (still on the meta device)")
