"""`QuantLinear`, the base of the quantized linears (`gptq_linear`, `awq_linear`, `w8_linear`),
and the checks that pick a layer's kernel path. Swapping and preparing them: `qserve.model.quant`.

Kernel paths (`QuantLinear.path`):

    triton            CUDA tensors: `qserve.kernels.ops` (gptq_gemm, awq_gemm, w8a16_gemm,
                      w8a8_int8_linear, w8a8_fp8_linear) on the checkpoint's own layout
    cpu-w4a16         C++ kernel (`qserve.kernels.cpu_w4a16`, 4-bit GPTQ/AWQ, any activation
                      dtype): codes decoded in registers for up to 32 rows, larger batches
                      dequantize once per call into an fp32 GEMM
    cpu-int4pack      torch._weight_int4pack_mm_for_cpu (4-bit GPTQ/AWQ, 16-bit activations)
                      where the C++ kernel is off (QSERVE_CPU_KERNELS=0) or did not compile
    cpu-int8pack      torch._weight_int8pack_mm (int8 weights; W8A8 quantizes activations first)
    dequantized       dequantized once at load, F.linear (FP8 on CPU, fp32 activations, shapes or
                      groups no native kernel takes); W8A8 activations are fake-quantized first

Every path computes the same function: W = dequantize(checkpoint) and, for W8A8 schemes,
x = dequantize(quantize(x)) with the scheme's activation scales.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from qserve.errors import QServeError
from qserve.kernels import cpu_w4a16, cpu_weight_only, ops
from qserve.model.quant_config import LinearScheme

HALF_DTYPES = (torch.bfloat16, torch.float16)


class QuantLinear(nn.Module):
    """Base of the quantized linears: checkpoint tensors as buffers until `prepare`."""

    def __init__(self, scheme: LinearScheme, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.scheme = scheme
        self.in_features = in_features
        self.out_features = out_features
        self.path = "unprepared"
        self._run: Callable[[torch.Tensor], torch.Tensor] | None = None
        if bias:
            self._meta("bias", (out_features,), torch.float32)
        else:
            self.bias: torch.Tensor | None = None

    def _meta(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """A placeholder with the checkpoint's shape (the loader checks it and assigns)."""
        self.register_buffer(name, torch.empty(shape, dtype=dtype, device="meta"))

    def _drop(self, *names: str) -> None:
        """Free checkpoint tensors the chosen path no longer reads."""
        for name in names:
            if name in self._buffers:
                delattr(self, name)

    def normalize(self, prefix: str, state: dict[str, torch.Tensor]) -> None:
        """Bring this layer's checkpoint tensors to the buffer shapes (hook for subclasses)."""

    def prepare(self, dtype: torch.dtype) -> str:
        """Choose the kernel path for `dtype` activations, repack once; returns the path."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # the engine's flat batch: no reshapes (decode calls this ~200x a step)
            return self._run(x)
        lead = x.shape[:-1]
        out = self._run(x.reshape(-1, self.in_features))  # [M, N]
        return out.reshape(*lead, self.out_features)

    def _dense(self, weight: torch.Tensor, dtype: torch.dtype) -> str:
        """Keep a dequantized weight [N, K] in `dtype` and run it as a dense linear."""
        self.register_buffer("weight", weight.to(dtype).contiguous())
        self._run = lambda x: ops.linear(x, self.weight, self._bias(x))
        return "dequantized"

    def _bias(self, x: torch.Tensor) -> torch.Tensor | None:
        return None if self.bias is None else self.bias.to(x.dtype)

    def _use_w4(self, w: cpu_w4a16.W4PackedCPU) -> None:
        """Run on the C++ 4-bit kernel. `w4` / `w4_bias` stay attributes (not closed over) so
        `qserve.model.merge` can replace them by views into a fused weight."""
        self.w4 = w
        self.w4_bias = None if self.bias is None else self.bias.to(torch.float32).contiguous()
        self._run = lambda x: cpu_w4a16.w4_mm(x, self.w4, self.w4_bias)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.scheme.name}, path={self.path}"


def _use_cpu_kernel(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """torch's CPU weight-only kernels pay off with 16-bit activations (ARCHITECTURE.md 5)."""
    return t.device.type == "cpu" and dtype in HALF_DTYPES


def _use_cpu_w4a16(t: torch.Tensor, bits: int) -> bool:
    """The C++ 4-bit kernel (3-bit codes are 4-bit codes too): CPU tensors, enabled and
    compiled (compiles on first use)."""
    return t.device.type == "cpu" and bits in (3, 4) and cpu_w4a16.available()


# The layers call this as `quant_linear._on_triton` (a module lookup), so one monkeypatch here
# sends every layer kind down the Triton wiring (tests/model/test_quant_layers.py).
def _on_triton(t: torch.Tensor) -> bool:
    return ops.use_triton(t)


def _torch_int4_group_size(in_features: int, group_size: int) -> int:
    """The largest group torch's int4 CPU kernel takes that divides both the stored group and K.

    Splitting a stored group into equal smaller ones (same scale and zero) computes the same W,
    and a K that is a multiple of the group needs no zero padding of x on every call (SmolLM2:
    K = 576 = 9 x 64 with stored groups of 128). The stored group size if none divides both."""
    for g in sorted(cpu_weight_only.TORCH_GROUP_SIZES, reverse=True):
        if group_size % g == 0 and in_features % g == 0:
            return g
    return group_size


def _int4pack_runner(
    w: cpu_weight_only.Int4PackedCPU, layer: QuantLinear
) -> Callable[[torch.Tensor], torch.Tensor]:
    """x [M, K] -> [M, N] on torch's int4 kernel; the kernel alone when nothing is to be done
    around it (no act-order permutation, no K padding, no bias): decode calls it ~200 times a
    step, so the wrapper's checks and copies show."""
    if w.perm is not None or w.padded_in_features != w.in_features or layer.bias is not None:
        return lambda x: cpu_weight_only.int4pack_mm(x, w, layer._bias(x))
    packed, group_size, sz = w.packed, w.group_size, w.scales_and_zeros
    return lambda x: torch._weight_int4pack_mm_for_cpu(
        x.to(sz.dtype).contiguous(), packed, group_size, sz
    ).to(x.dtype)


def _check_divisible(size: int, factor: int, what: str, scheme: LinearScheme) -> None:
    if size % factor:
        raise QServeError(f"{scheme.name}: {what} {size} is not a multiple of {factor}")
