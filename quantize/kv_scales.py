"""FP8 KV cache scales from calibration: one k_scale and one v_scale per attention layer.

    k_scale = max |K| / fp8_max        K [tokens, num_kv_heads, head_dim]: the keys as written into
    v_scale = max |V| / fp8_max        the KV cache (after RoPE), over every calibration token

fp8_max is 448 for fp8_e4m3 (float8_e4m3fn) and 57344 for fp8_e5m2. FP8 pages hold x / scale, so
the largest calibration value lands on the largest finite FP8 number (vLLM's per-tensor scales).

Keys and values are observed with `KVObserver`, handed to a transformers decoder block as its KV
cache: attention gives the cache K/V exactly as it would store them, whatever the architecture
does before (RoPE, q/k norms).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from qserve.errors import QServeError

__all__ = ["KV_CACHE_DTYPES", "check_kv_cache_dtype", "fp8_max", "kv_scale", "KVObserver"]

KV_CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_MIN_SCALE = 1e-12  # a layer whose K or V is all zeros still gets a positive scale


def check_kv_cache_dtype(kv_cache_dtype: str | None) -> str | None:
    """The FP8 KV cache dtype to calibrate scales for; None for "auto" (pages in model dtype)."""
    if kv_cache_dtype in (None, "auto"):
        return None
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        choices = ", ".join(["auto", *KV_CACHE_DTYPES])
        raise QServeError(
            f"kv_cache_dtype must be one of {choices}, got {kv_cache_dtype!r}", "kv_cache_dtype"
        )
    return kv_cache_dtype


def fp8_max(kv_cache_dtype: str) -> float:
    """Largest finite value of the page dtype: 448.0 (fp8_e4m3) or 57344.0 (fp8_e5m2)."""
    return float(torch.finfo(KV_CACHE_DTYPES[kv_cache_dtype]).max)


def kv_scale(absmax: Tensor, kv_cache_dtype: str) -> Tensor:
    """Per-tensor page scale, fp32 [1], from the calibration max |K| (or |V|)."""
    return (absmax.float().reshape(1) / fp8_max(kv_cache_dtype)).clamp(min=_MIN_SCALE)


def _running_absmax(acc: Tensor | None, x: Tensor) -> Tensor:
    m = x.detach().abs().amax().float()
    return m if acc is None else torch.maximum(acc, m)


class KVObserver:
    """Stands in for a transformers KV cache (`cache.update(key, value, layer_idx, ...)`): keeps
    the running max |K| and max |V| of what attention writes and stores nothing."""

    def __init__(self) -> None:
        self.k_absmax: Tensor | None = None
        self.v_absmax: Tensor | None = None

    def update(
        self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        """key/value_states [batch, num_kv_heads, tokens, head_dim], returned as they came
        (the cache's extra arguments, `cache_kwargs` or `kwargs=`, are not needed)."""
        self.k_absmax = _running_absmax(self.k_absmax, key_states)
        self.v_absmax = _running_absmax(self.v_absmax, value_states)
        return key_states, value_states

    @property
    def absmax(self) -> tuple[Tensor, Tensor] | None:
        """(max |K|, max |V|) once attention has written something, else None."""
        if self.k_absmax is None or self.v_absmax is None:
            return None
        return self.k_absmax, self.v_absmax
