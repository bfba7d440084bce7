"""Engine configuration: one frozen dataclass, checked once, derived values as properties."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qserve.errors import QServeError
from qserve.platform import native_half_matmul

if TYPE_CHECKING:  # torch is imported lazily so that recipes and the CLI start fast
    import torch

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def parse_memory(text: str | int) -> int:
    """'2GiB' -> 2147483648; '512MB' -> 512000000; plain numbers are bytes."""
    if isinstance(text, int):
        return text
    m = _MEMORY.match(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise QServeError(f"cannot read memory size {text!r}; expected e.g. 2GiB, 512MiB, 1GB")
    return int(float(m.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # folder, .gguf, hub id or built-in alias; None = smollm2-135m
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "cpu"
    block_size: int = 16  # tokens per KV block
    kv_cache_memory: int | str = "1GiB"
    kv_cache_dtype: str = "auto"  # auto | fp8_e4m3 | fp8_e5m2
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's context, capped by the KV cache
    enable_prefix_caching: bool = True
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise QServeError(f"unknown dtype {self.dtype!r}; expected auto, {', '.join(DTYPES)}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            allowed = ", ".join(["auto", *KV_CACHE_DTYPES])
            raise QServeError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; expected {allowed}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise QServeError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise QServeError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_cache_memory_bytes <= 0:
            raise QServeError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")

    @property
    def kv_cache_memory_bytes(self) -> int:
        return parse_memory(self.kv_cache_memory)

    def torch_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        import torch

        """'auto' is bf16 where the hardware computes it natively (CUDA; CPUs with AMX or
        AVX-512 BF16) and fp32 elsewhere: on an AVX2-only CPU a bf16 matmul is 4-5x slower
        than fp32. An fp16 checkpoint keeps fp16 on CUDA."""
        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        if self.device.startswith("cuda"):
            return torch.float16 if checkpoint_dtype == torch.float16 else torch.bfloat16
        return torch.bfloat16 if native_half_matmul() else torch.float32

    def kv_torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        import torch

        name = KV_CACHE_DTYPES.get(self.kv_cache_dtype)
        return getattr(torch, name) if name else model_dtype
