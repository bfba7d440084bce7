"""One safetensors file from tensors in memory plus the tensors of other safetensors files,
written as safetensors' own `save_file` lays it out, byte for byte, holding one tensor in
memory at a time (export of a checkpoint whose blocks were offloaded to disk)."""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["merge_safetensors"]


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
