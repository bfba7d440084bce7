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

Biases and every other tensor keep their names. A checkpoint is written into a temporary folder
next to the destination and moved into place at the end (`output_dir.staging_dir`). With
calibration offloaded to disk, the blocks' tensors come from safetensors files and are copied into
model.safetensors one tensor at a time (`merge_safetensors`), so the whole checkpoint is never in
memory; the file is laid out as safetensors' own `save_file` lays it out, byte for byte.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from qserve.errors import QServeError
from qserve.kernels import packing
from qserve.quantize.rtn import QuantizedWeight

# What made a checkpoint (`qserve quantize`'s recipe and settings), written beside the weights
PROVENANCE_FILE = "qserve_recipe.json"

__all__ = [
    "PROVENANCE_FILE",
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


# ------------------------------------------------------------------------ streamed safetensors

# safetensors' Dtype enum order: save_file lays tensors out by dtype, this order reversed
# (so every tensor is aligned to its element size), then by name.
_DTYPE_ORDER = ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16", "I32",
                "U32", "F32", "F64", "I64", "U64")  # fmt: skip
_DTYPE_NAMES = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fn: "F8_E4M3", torch.int16: "I16", torch.float16: "F16",
    torch.bfloat16: "BF16", torch.int32: "I32", torch.float32: "F32", torch.float64: "F64",
    torch.int64: "I64",
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One tensor of the merged file: in memory, or bytes [begin, end) of a file."""

    dtype: str
    shape: list[int]
    nbytes: int
    tensor: Tensor | None = None
    file: Path | None = None
    begin: int = 0


def merge_safetensors(
    path: Path, tensors: dict[str, Tensor], files: Sequence[Path], metadata: dict[str, str]
) -> None:
    """One safetensors file of `tensors` and every tensor of `files`, what save_file writes
    for all of them together, holding one tensor in memory at a time. A name twice is refused."""
    entries = {name: _memory_entry(t) for name, t in tensors.items()}
    for file in files:
        for name, entry in _file_entries(file).items():
            if name in entries:
                raise ValueError(f"tensor {name} is in {file} and elsewhere")
            entries[name] = entry
    order = sorted(entries, key=lambda n: (-_DTYPE_ORDER.index(entries[n].dtype), n.encode()))
    header, offset = {"__metadata__": metadata}, 0
    for name in order:
        e = entries[name]
        header[name] = {
            "dtype": e.dtype,
            "shape": e.shape,
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with path.open("wb") as out:
        out.write(struct.pack("<Q", len(raw)) + raw)
        for name in order:
            out.write(_entry_bytes(entries[name]))


def _memory_entry(t: Tensor) -> _Entry:
    if t.dtype not in _DTYPE_NAMES:
        raise ValueError(f"no safetensors dtype for {t.dtype}")
    return _Entry(_DTYPE_NAMES[t.dtype], list(t.shape), t.numel() * t.element_size(), tensor=t)


def _file_entries(file: Path) -> dict[str, _Entry]:
    """The tensors of a safetensors file, by name, from its header (no data is read)."""
    with file.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    entries = {}
    for name, h in header.items():
        begin, end = h["data_offsets"]  # relative to the data, which follows the header
        entries[name] = _Entry(h["dtype"], h["shape"], end - begin, file=file, begin=8 + n + begin)
    return entries


def _entry_bytes(e: _Entry) -> bytes | memoryview:
    if e.tensor is not None:  # little-endian, as safetensors stores it
        return memoryview(e.tensor.reshape(-1).view(torch.uint8).numpy())
    with e.file.open("rb") as f:
        f.seek(e.begin)
        return f.read(e.nbytes)
