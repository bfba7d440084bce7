"""GPTQ v1 checkpoints as a quantized linear (`GPTQLinear`)."""

from __future__ import annotations

import logging

import torch

from qserve.errors import QServeError
from qserve.kernels import cpu_w4a16, cpu_weight_only, ops, packing
from qserve.model import quant_linear
from qserve.model.quant_config import LinearScheme
from qserve.model.quant_linear import (
    QuantLinear,
    _check_divisible,
    _int4pack_runner,
    _torch_int4_group_size,
    _use_cpu_kernel,
    _use_cpu_w4a16,
)

logger = logging.getLogger("qserve")


class GPTQLinear(QuantLinear):
    """GPTQ v1 tensors: qweight [K*bits/32, N], qzeros [G, N*bits/32], scales [G, N], g_idx [K].

    G is ceil(K / group size), or `num_groups` where g_idx names the groups: a tensor-parallel
    rank's act-order slice of K keeps every group's scales and zeros (as vLLM's do)."""

    def __init__(
        self,
        scheme: LinearScheme,
        in_features: int,
        out_features: int,
        bias: bool,
        g_idx: bool,
        num_groups: int | None = None,
    ):
        super().__init__(scheme, in_features, out_features, bias)
        bits, K, N = scheme.bits, in_features, out_features
        values, words = packing.pack_block(bits)
        gs = K if scheme.group_size == -1 else scheme.group_size
        self.num_groups = -(-K // gs) if num_groups is None or not g_idx else num_groups
        self.group_size = gs
        _check_divisible(K, values, "in_features", scheme)
        _check_divisible(N, values, "out_features", scheme)
        self._meta("qweight", (K // values * words, N), torch.int32)
        self._meta("qzeros", (self.num_groups, N // values * words), torch.int32)
        self._meta("scales", (self.num_groups, N), torch.float16)
        if g_idx:
            self._meta("g_idx", (K,), torch.int32)
        else:
            self.g_idx: torch.Tensor | None = None

    def _groups(self) -> torch.Tensor:
        """g_idx int64 [K], checked: every group id names a stored group."""
        if self.g_idx is None:
            return torch.arange(self.in_features, device=self.qweight.device) // self.group_size
        g = self.g_idx.to(torch.int64)
        if g.numel() and (int(g.min()) < 0 or int(g.max()) >= self.num_groups):
            raise QServeError(f"GPTQ g_idx names groups outside [0, {self.num_groups})")
        return g

    def _consecutive(self, g: torch.Tensor) -> bool:
        return torch.equal(g, torch.arange(self.in_features, device=g.device) // self.group_size)

    def prepare(self, dtype: torch.dtype) -> str:
        """The layer's kernel: 3-bit codes run on the 4-bit CPU kernels (a code in [0, 7] with
        its zero is a 4-bit code); the Triton kernels take 4 and 8 bits, so a 3-bit layer on
        GPU is dequantized once to a dense weight."""
        g, bits = self._groups(), self.scheme.bits
        if quant_linear._on_triton(self.qweight) and bits != 3:
            self.path = self._triton(g)
        elif _use_cpu_w4a16(self.qweight, bits) and self._cpu_w4a16(g):
            self.path = "cpu-w4a16"
        elif _use_cpu_kernel(self.qweight, dtype) and bits in (3, 4):
            self.path = self._int4pack(g, dtype)
        elif _use_cpu_kernel(self.qweight, dtype) and self._fits_int8(g):
            self.path = self._int8pack(dtype)
        else:
            self.path = self._dense_gptq(g, dtype)
        return self.path

    def _triton(self, g: torch.Tensor) -> str:
        g_idx = None if self._consecutive(g) else g.to(torch.int32)
        args = (self.qweight, self.qzeros, self.scales, g_idx, self.scheme.bits)
        self._run = lambda x: ops.gptq_gemm(x, *args, bias=self._bias(x))
        return "triton"

    def _cpu_w4a16(self, g: torch.Tensor) -> bool:
        try:
            w = cpu_w4a16.w4_from_gptq(self.qweight, self.qzeros, self.scales, g, self.scheme.bits)
        except ValueError as exc:  # shapes or groups the kernel does not take
            logger.debug("cpu_w4a16 rejected a GPTQ layer (%s)", exc)
            return False
        self._drop("qweight", "qzeros", "scales", "g_idx")
        self._use_w4(w)
        return True

    def _int4pack(self, g: torch.Tensor, dtype: torch.dtype) -> str:
        g_fine, rows = _split_gptq_groups(g, self.group_size, self.num_groups)
        try:
            w = cpu_weight_only.int4pack_from_gptq(
                self.qweight, self.qzeros[rows], self.scales[rows], g_fine, dtype,
                self.scheme.bits,
            )  # fmt: skip
        except ValueError as exc:  # shapes or groups torch's kernel rejects
            logger.debug("int4pack rejected a GPTQ layer (%s): dequantizing", exc)
            return self._dense_gptq(g, dtype)
        self._drop("qweight", "qzeros", "scales", "g_idx")
        self._run = _int4pack_runner(w, self)
        return "cpu-int4pack"

    def _codes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q int32 [K, N], zeros int32 [G, N]) with the v1 offset added back."""
        bits = self.scheme.bits
        q = packing.unpack_gptq_qweight(self.qweight, bits)
        return q, packing.unpack_gptq_qzeros(self.qzeros, bits)

    def _fits_int8(self, g: torch.Tensor) -> bool:
        """8-bit, one group per channel, and q - zero inside int8: torch's int8 kernel fits."""
        if self.scheme.bits != 8 or self.num_groups != 1:
            return False
        q, zeros = self._codes()
        diff = q - zeros[0]
        return bool(diff.min() >= -128 and diff.max() <= 127)

    def _int8pack(self, dtype: torch.dtype) -> str:
        q, zeros = self._codes()
        w_q = cpu_weight_only.aligned((q - zeros[0]).t().to(torch.int8))  # [N, K]
        w_scale = self.scales[0].to(torch.float32)  # [N]
        self._drop("qweight", "qzeros", "scales", "g_idx")
        self._run = lambda x: cpu_weight_only.int8pack_mm(x, w_q, w_scale, self._bias(x))
        return "cpu-int8pack"

    def _dense_gptq(self, g: torch.Tensor, dtype: torch.dtype) -> str:
        scales = self.scales.to(torch.float32)  # one rounding: fp32 product, then `dtype`
        w = packing.dequantize_gptq(self.qweight, self.qzeros, scales, g, self.scheme.bits)
        self._drop("qweight", "qzeros", "scales", "g_idx")
        return self._dense(w, dtype)


def _split_gptq_groups(
    g: torch.Tensor, group_size: int, num_groups: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(g_idx [K] over finer groups, stored group of each finer group) for `int4pack_from_gptq`.

    Only when the channels sorted by g_idx form consecutive stored groups of `group_size` (plain
    and act-order GPTQ); otherwise g and the stored groups unchanged (the packer decides)."""
    K = g.numel()
    identity = torch.arange(num_groups)
    perm = torch.argsort(g, stable=True)
    fine = _torch_int4_group_size(K, group_size)
    if fine == group_size or not torch.equal(g[perm], torch.arange(K) // group_size):
        return g, identity
    g_fine = torch.empty_like(g)
    g_fine[perm] = torch.arange(K) // fine  # stable: argsort(g_fine) is perm again
    return g_fine, g[perm][::fine]


def gptq_from_pack_quantized(prefix: str, state: dict[str, torch.Tensor], bits: int) -> None:
    """Replace one linear's compressed-tensors pack-quantized tensors in `state` by the GPTQ v1
    tensors of the same codes (lossless; `kernels.packing` documents both layouts):
    weight_packed [N, K/P] -> qweight [K/P, N], weight_scale [N, G] -> scales [G, N] (dtype kept),
    weight_zero_point [N/P, G] (or 2**(bits-1) when symmetric) -> qzeros, weight_g_idx -> g_idx."""
    packed = state.pop(f"{prefix}.weight_packed")
    scale = state.pop(f"{prefix}.weight_scale")
    shape = state.pop(f"{prefix}.weight_shape", None)
    zero_point = state.pop(f"{prefix}.weight_zero_point", None)
    g_idx = state.pop(f"{prefix}.weight_g_idx", None)
    N, K = packed.shape[0], packed.shape[1] * packing.pack_factor(bits)
    if shape is not None and [int(v) for v in shape.reshape(-1)] != [N, K]:
        raise QServeError(f"{prefix}.weight_shape is {shape.tolist()}, packed as [{N}, {K}]")
    scale = scale.reshape(N, -1)
    if zero_point is None:
        zeros = torch.full((scale.shape[1], N), 1 << (bits - 1), dtype=torch.int32)
    else:
        zeros = packing.unpack_ct_zero_point(zero_point, bits)
    if zeros.numel() and int(zeros.min()) == 0:
        raise QServeError(
            f"{prefix}: a zero point of 0 has no GPTQ v1 form (stored as zero - 1); "
            "qserve cannot load this asymmetric pack-quantized layer"
        )
    state[f"{prefix}.qweight"] = packed.t().contiguous()
    state[f"{prefix}.qzeros"] = packing.pack_gptq_qzeros(zeros, bits)
    state[f"{prefix}.scales"] = scale.t().contiguous()
    if g_idx is not None:
        state[f"{prefix}.g_idx"] = g_idx.to(torch.int32)
