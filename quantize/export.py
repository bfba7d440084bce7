"""Exporters: quantized tensors -> the on-disk formats of ARCHITECTURE.md section 4.

Bit packing is `qserve.kernels.packing`'s job; this module only names tensors, picks dtypes and
writes the configs. Tensor names per quantized linear `<name>`:

    GPTQ   <name>.qweight int32 [K*bits/32, N]   <name>.qzeros int32 [G, N*bits/32]
           <name>.scales fp16 [G, N]             <name>.g_idx int32 [K]
    AWQ    <name>.qweight int32 [K, N/8]         <name>.qzeros int32 [G, N/8]
           <name>.scales fp16 [G, N]
    compressed-tensors (int8 / fp8)
           <name>.weight int8|float8_e4m3fn [N, K]
           <name>.weight_scale fp32 [N, 1] (channel) or [1] (tensor)
           <name>.input_scale fp32 [1]  (static activations only)

FP8 KV cache scales (`--kv-cache-dtype`), per attention module `<attn>` (model.layers.N.self_attn),
in every format: <attn>.k_scale fp32 [1], <attn>.v_scale fp32 [1], the names compressed-tensors
gives them. compressed-tensors checkpoints also declare `kv_cache_scheme` (8-bit float, per tensor,
i.e. fp8_e4m3). qserve reads these scales in every format; vLLM loads them for compressed-tensors
(and its own fp8 format) and ignores them in GPTQ / AWQ checkpoints, whose quantization configs
give its attention layers no KV scales.

Biases and every other tensor keep their names, as checkpoints write them: Mixtral's MoE blocks
are `block_sparse_moe.` (transformers 5 calls them `mlp.`), each expert's linears
`experts.N.w1` / `w2` / `w3` (Qwen3-MoE: `mlp.experts.N.gate_proj` / `up_proj` / `down_proj`),
as vLLM and transformers read them; the routers (`.gate`) stay in floating point and are named
among the unquantized modules of each format. A checkpoint is written into a temporary folder
next to the destination and moved into place at the end (`output_dir.staging_dir`). With
calibration offloaded to disk, the blocks' tensors come from safetensors files and are copied into
model.safetensors one tensor at a time (`merge_safetensors`), so the whole checkpoint is never in
memory; the file is laid out as safetensors' own `save_file` lays it out, byte for byte.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from qserve.errors import QServeError
from qserve.kernels import packing
from qserve.quantize import export_packed
from qserve.quantize.arch import ArchSpec
from qserve.quantize.dynamic import Scheme, disjoint_rules, gptq_dynamic
from qserve.quantize.kv_scales import kv_scale
from qserve.quantize.results import BlockResults
from qserve.quantize.rtn import QuantizedWeight
from qserve.quantize.safetensors_merge import merge_safetensors
from qserve.quantize.settings import GPTQ_DAMP, QuantizeSettings

if TYPE_CHECKING:
    from qserve.quantize.offload import BlockOffload

SEARCH_FILE = "qserve/search_scales.safetensors"  # AWQ / SmoothQuant search, in the checkpoint
# What made a checkpoint (`qserve quantize`'s recipe and settings), written beside the weights
PROVENANCE_FILE = "qserve_recipe.json"

__all__ = [
    "PROVENANCE_FILE",
    "SEARCH_FILE",
    "write_provenance",
    "gptq_tensors",
    "awq_tensors",
    "compressed_tensors",
    "kv_scale_tensors",
    "gptq_config",
    "awq_config",
    "compressed_tensors_config",
    "kv_cache_scheme",
    "write_checkpoint",
    "merge_safetensors",
    "write_quantized",
    "checkpoint_tensors",
    "quantization_config",
]


# ------------------------------------------------------------------------------------- tensors


def gptq_tensors(qw: QuantizedWeight) -> dict[str, Tensor]:
    """GPTQ v1 tensors of one linear (suffix -> tensor)."""
    if qw.Q.shape[1] * qw.bits % 32 or qw.Q.shape[0] * qw.bits % 32:
        raise QServeError(f"GPTQ {qw.bits}-bit packing needs K and N divisible by {32 // qw.bits}")
    return {
        "qweight": packing.pack_gptq_qweight(qw.Q.t(), qw.bits),
        "qzeros": packing.pack_gptq_qzeros(qw.zeros, qw.bits),
        "scales": qw.scales.to(torch.float16).contiguous(),
        "g_idx": qw.g_idx.to(torch.int32).contiguous(),
    }


def awq_tensors(qw: QuantizedWeight) -> dict[str, Tensor]:
    """AWQ gemm tensors of one linear; AWQ needs 4 bit, asymmetric, groups in natural order."""
    K = qw.Q.shape[1]
    if qw.bits != 4:
        raise QServeError(f"the AWQ format stores 4-bit weights, got {qw.bits}")
    gs = K if qw.group_size == -1 else qw.group_size
    if not torch.equal(qw.g_idx.long(), torch.arange(K) // gs):
        raise QServeError("the AWQ format has no g_idx: groups must be in natural order")
    return {
        "qweight": packing.pack_awq_qweight(qw.Q.t()),
        "qzeros": packing.pack_awq_qzeros(qw.zeros),
        "scales": qw.scales.to(torch.float16).contiguous(),
    }


def compressed_tensors(
    Q: Tensor, weight_scale: Tensor, input_scale: Tensor | None = None
) -> dict[str, Tensor]:
    """compressed-tensors int8 / fp8 tensors of one linear."""
    out = {"weight": Q.contiguous(), "weight_scale": weight_scale.float().contiguous()}
    if input_scale is not None:
        out["input_scale"] = input_scale.float().reshape(1).contiguous()
    return out


def kv_scale_tensors(attention: str, k_scale: Tensor, v_scale: Tensor) -> dict[str, Tensor]:
    """Per-tensor FP8 KV cache scales of one attention module (full name -> fp32 [1])."""
    return {
        f"{attention}.k_scale": k_scale.float().reshape(1).contiguous(),
        f"{attention}.v_scale": v_scale.float().reshape(1).contiguous(),
    }


# ------------------------------------------------------------------------------------- configs


def gptq_config(
    bits: int,
    group_size: int,
    sym: bool,
    desc_act: bool,
    damp_percent: float = 0.01,
    static_groups: bool = False,
    true_sequential: bool = True,
) -> dict[str, Any]:
    """`quantize_config.json`, also stored as config.json["quantization_config"]."""
    return {
        "bits": bits,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": sym,
        "damp_percent": damp_percent,
        "static_groups": static_groups,
        "true_sequential": true_sequential,
        "quant_method": "gptq",
        "checkpoint_format": "gptq",
        "meta": {"quantizer": ["qserve:0.1.0"]},
    }


def awq_config(group_size: int, modules_to_not_convert: list[str] | None = None) -> dict[str, Any]:
    return {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": modules_to_not_convert or None,
    }


def compressed_tensors_config(
    kind: str,
    weight_strategy: str = "channel",
    static_activations: bool = False,
    ignore: list[str] | None = None,
    kv_cache_scheme: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """W8A8 config; kind "int" (int8, per-token activations) or "float" (fp8 E4M3).
    `kv_cache_scheme`: see `kv_cache_scheme()`; None when the checkpoint has no KV scales."""
    if kind not in ("int", "float"):
        raise ValueError(f"kind must be 'int' or 'float', got {kind!r}")
    return {
        "quant_method": "compressed-tensors",
        "format": f"{kind}-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": kind,
                    "symmetric": True,
                    "strategy": weight_strategy,
                    "dynamic": False,
                },
                "input_activations": {
                    "num_bits": 8,
                    "type": kind,
                    "symmetric": True,
                    "strategy": "tensor" if static_activations else "token",
                    "dynamic": not static_activations,
                },
            }
        },
        "ignore": list(ignore) if ignore else ["lm_head"],
        "kv_cache_scheme": kv_cache_scheme,
    }


def kv_cache_scheme() -> dict[str, Any]:
    """compressed-tensors `kv_cache_scheme` of static per-tensor FP8 (E4M3) KV scales, what
    vLLM's CompressedTensorsKVCacheMethod accepts (8-bit float, strategy tensor, symmetric)."""
    return {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "strategy": "tensor",
        "dynamic": False,
    }


# -------------------------------------------------------------------------------------- output


def write_provenance(folder: Path, made_by: dict[str, Any]) -> None:
    """PROVENANCE_FILE: what made the checkpoint (read back by `qserve.model.loader`)."""
    (folder / PROVENANCE_FILE).write_text(json.dumps(made_by, indent=2, default=str) + "\n")


def write_checkpoint(
    folder: Path,
    tensors: dict[str, Tensor],
    config: dict[str, Any],
    extra_json: dict[str, dict[str, Any]] | None = None,
    files: Sequence[Path] = (),
) -> None:
    """model.safetensors + config.json (+ extra JSON files such as quantize_config.json).
    The weights are `tensors` plus every tensor of the safetensors `files`."""
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    if files:
        merge_safetensors(folder / "model.safetensors", tensors, files, {"format": "pt"})
    else:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name, payload in (extra_json or {}).items():
        (folder / name).write_text(json.dumps(payload, indent=2) + "\n")


# ------------------------------------------------------------------------- quantized checkpoints


def write_quantized(
    folder: Path,
    model: nn.Module,
    tokenizer: Any,
    spec: ArchSpec,
    results: BlockResults,
    settings: QuantizeSettings,
    dtype: torch.dtype,
    blocks: BlockOffload | None = None,
) -> None:
    """The checkpoint folder: weights, config with quantization_config, tokenizer files.
    Offloaded (`blocks`), the blocks' tensors are copied from their files in the offload folder
    (`results` then holds only what lies outside the blocks: a quantized lm_head, if any)."""
    state = {k: v.detach() for k, v in model.state_dict().items() if not v.is_meta}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    tensors = checkpoint_tensors(state, results, settings, dtype)
    tensors = {spec.checkpoint_name(k): v for k, v in tensors.items()}
    quantized = set(results.linears) | (blocks.quantized if blocks is not None else set())
    qconfig, extra = quantization_config(model, spec, quantized, settings)
    config = model.config.to_dict()
    config["quantization_config"] = qconfig
    config["dtype"] = str(dtype).removeprefix("torch.")
    write_checkpoint(folder, tensors, config, extra, blocks.files if blocks else ())
    tokenizer.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)


def checkpoint_tensors(
    state: dict[str, Tensor], results: BlockResults, s: QuantizeSettings, dtype: torch.dtype
) -> dict[str, Tensor]:
    """The checkpoint's tensors for the float `state` (cast to `dtype`) and the `results`
    quantized from it: a quantized linear's weight becomes the tensors of its format."""
    tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    to_tensors = {
        "rtn": gptq_tensors,
        "gptq": gptq_tensors,
        "awq": awq_tensors,
    }.get(s.method, lambda r: compressed_tensors(r.Q, r.weight_scale, r.input_scale))
    if s.format == export_packed.FORMAT:
        to_tensors = lambda r: export_packed.pack_quantized_tensors(r, dtype)  # noqa: E731
    for name, r in results.linears.items():
        del tensors[f"{name}.weight"]
        tensors.update({f"{name}.{k}": v for k, v in to_tensors(r).items()})
    for attention, (k_absmax, v_absmax) in results.kv_absmax.items():
        k_scale, v_scale = (kv_scale(m, s.kv_cache_dtype) for m in (k_absmax, v_absmax))
        tensors.update(kv_scale_tensors(attention, k_scale, v_scale))
    return tensors


def quantization_config(
    model: nn.Module, spec: ArchSpec, quantized: set[str], s: QuantizeSettings
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(config.json["quantization_config"], extra JSON files), naming the unquantized linears
    (routers of mixture-of-experts blocks among them) as checkpoints name them."""
    skipped = [
        spec.checkpoint_name(n)
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and n not in quantized
    ]
    if s.method == "awq":
        return awq_config(s.group_size, [n for n in skipped if n != "lm_head"]), {}
    if s.method in ("int8", "fp8"):
        kind = "int" if s.method == "int8" else "float"
        static = s.activation_scheme == "static"
        # compressed-tensors' 8-bit float is E4M3: e5m2 scales are written but not declared
        kv = kv_cache_scheme() if s.kv_cache_dtype == "fp8_e4m3" else None
        qconfig = compressed_tensors_config(kind, s.weight_strategy, static, skipped, kv)
        return qconfig, {}
    if s.format == export_packed.FORMAT:
        schemes = {spec.checkpoint_name(n): s.scheme_of(spec.checkpoint_name(n)) for n in quantized}
        sym, act_order = bool(s.sym), bool(s.desc_act)
        return export_packed.pack_quantized_config(schemes, skipped, sym, act_order), {}
    gptq = s.method == "gptq"  # rtn writes the same format, with natural order and no Hessian
    damp = s.damp if gptq else GPTQ_DAMP  # GPTQModel records its default for RTN too
    qconfig = gptq_config(
        s.bits, s.group_size, s.sym, bool(s.desc_act), damp, bool(s.static_groups),
        true_sequential=gptq,
    )  # fmt: skip
    if "lm_head" in quantized:
        qconfig["lm_head"] = True
    if s.dynamic:  # per-module schemes: GPTQModel's format, read by vLLM and qserve
        names = [
            spec.checkpoint_name(n) for n, m in model.named_modules() if isinstance(m, nn.Linear)
        ]
        default = Scheme(s.bits, s.group_size)
        qconfig["dynamic"] = gptq_dynamic(disjoint_rules(s.rules, names, default))
    if any(n.startswith(f"{spec.blocks}.") for n in skipped):
        # optimum/GPTQModel's way of naming the linears that carry quantized tensors
        qconfig["modules_in_block_to_quantize"] = _block_modules(model, spec, quantized)
    return qconfig, {"quantize_config.json": qconfig}


def _block_modules(model: nn.Module, spec: ArchSpec, quantized: set[str]) -> list[list[str]]:
    """The quantized linears of a block per sequential group, relative to the block, as
    checkpoints name them: a linear quantized in any block is listed (a "-:" dynamic rule may
    leave it dense in some); the groups of every kind of block (sparse and dense MoE layers)."""
    found: dict[tuple[ArchSpec, int], dict[str, None]] = {}
    for b, block in enumerate(model.get_submodule(spec.blocks)):
        block_spec = spec.for_block(block)
        prefix = f"{spec.blocks}.{b}."
        for g, group in enumerate(block_spec.sequential):
            names = [spec.checkpoint_name(prefix + n) for n in group if prefix + n in quantized]
            found.setdefault((block_spec, g), {}).update(
                dict.fromkeys(n.removeprefix(prefix) for n in names)
            )
    groups: list[list[str]] = []
    for names in found.values():
        if not names or list(names) not in groups:  # attention's, in both kinds of MoE layer
            groups.append(list(names))
    return groups
