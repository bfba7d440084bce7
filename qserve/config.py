"""Engine configuration: one frozen dataclass, checked once, derived values as properties.

Its fields are the engine's CLI options and a recipe's `serve:` keys (`qserve.options`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Literal

from qserve.errors import QServeError
from qserve.options import Range, check_fields, setting
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


Dtype = Literal["auto", "float32", "bfloat16", "float16"]
KVCacheDtype = Literal["auto", "fp8_e4m3", "fp8_e5m2"]
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


@dataclass(frozen=True)
class EngineConfig:
    """Every engine option (`generate`, `serve`, `eval` flags and recipe `serve:` keys)."""

    model: str | None = setting(None, "Folder, .gguf, hub id or built-in alias.",
                                default_text="smollm2-135m")  # fmt: skip
    dtype: Dtype = setting(
        "auto", "Activation dtype; auto: bf16 on CUDA and AMX/AVX512-BF16 CPUs, else fp32."
    )
    device: str = setting("cpu", "cpu, cuda or cuda:N.")
    block_size: Annotated[int, Range(1)] = setting(16, "Tokens per KV block.")
    kv_cache_memory: int | str = setting("1GiB", "Memory for KV pages, e.g. 2GiB, 512MiB.")
    kv_cache_dtype: KVCacheDtype = setting(
        "auto", "KV cache page dtype (fp8: scaled by the checkpoint's k_scale/v_scale)."
    )
    max_num_seqs: Annotated[int, Range(1)] = setting(64, "Sequences decoded together.")
    max_num_batched_tokens: Annotated[int, Range(1)] = setting(2048, "Token budget of one step.")
    max_model_len: Annotated[int, Range(2)] | None = setting(
        None, "Context limit (prompt + output).", default_text="the model's"
    )
    enable_prefix_caching: bool = setting(True, "Share the KV blocks of common prompt prefixes.")
    num_threads: Annotated[int, Range(1)] | None = setting(
        None, "torch CPU threads.", default_text="torch's"
    )
    tensor_parallel_size: Annotated[int, Range(1)] = setting(
        1, "Processes that each run a shard of every layer (CPU, gloo; Llama family, Gemma 3)."
    )
    pipeline_parallel_size: Annotated[int, Range(1)] = setting(
        1, "Processes that each run a range of the layers (CPU, gloo; Llama family, Gemma 3)."
    )
    pipeline_micro_batches: Annotated[int, Range(1)] | None = setting(
        None,
        "Micro-batches a pipeline-parallel step is cut into, so stages overlap (1: in turn).",
        default_text="the stage count",
    )
    enforce_eager: bool = setting(
        False,
        "Run every step eagerly (no captured decode-step graphs: step graphs on CPU, CUDA "
        "graphs on CUDA).",
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if not _DEVICE.match(self.device):
            raise QServeError(
                f"device: expected cpu, cuda or cuda:N, got {self.device!r}", "device"
            )
        try:
            size = self.kv_cache_memory_bytes
        except QServeError as exc:
            raise QServeError(f"kv_cache_memory: {exc}", "kv_cache_memory") from None
        if size <= 0:
            message = f"kv_cache_memory: must be positive, got {self.kv_cache_memory}"
            raise QServeError(message, "kv_cache_memory")

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
