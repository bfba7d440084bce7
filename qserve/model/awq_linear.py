"""AWQ gemm checkpoints as a quantized linear (`AWQLinear`)."""

from __future__ import annotations

import logging

import torch

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


class AWQLinear(QuantLinear):
    """AWQ gemm tensors: qweight [K, N/8], qzeros [G, N/8], scales [G, N]."""

    def __init__(self, scheme: LinearScheme, in_features: int, out_features: int, bias: bool):
        super().__init__(scheme, in_features, out_features, bias)
        K, N = in_features, out_features
        _check_divisible(N, 8, "out_features", scheme)
        self.group_size = scheme.group_size
        gs = K if scheme.group_size == -1 else scheme.group_size
        groups = -(-K // gs)
        self._meta("qweight", (K, N // 8), torch.int32)
        self._meta("qzeros", (groups, N // 8), torch.int32)
        self._meta("scales", (groups, N), torch.float16)

    def prepare(self, dtype: torch.dtype) -> str:
        if quant_linear._on_triton(self.qweight):
            args = (self.qweight, self.qzeros, self.scales, self.group_size)
            self._run = lambda x: ops.awq_gemm(x, *args, bias=self._bias(x))
            self.path = "triton"
        elif _use_cpu_w4a16(self.qweight, 4) and self._cpu_w4a16():
            self.path = "cpu-w4a16"
        elif _use_cpu_kernel(self.qweight, dtype):
            self.path = self._int4pack(dtype)
        else:
            self.path = self._dense_awq(dtype)
        return self.path

    def _cpu_w4a16(self) -> bool:
        try:
            w = cpu_w4a16.w4_from_awq(self.qweight, self.qzeros, self.scales, self.group_size)
        except ValueError as exc:
            logger.debug("cpu_w4a16 rejected an AWQ layer (%s)", exc)
            return False
        self._drop("qweight", "qzeros", "scales")
        self._use_w4(w)
        return True

    def _int4pack(self, dtype: torch.dtype) -> str:
        gs = self.in_features if self.group_size == -1 else self.group_size
        fine = _torch_int4_group_size(self.in_features, gs)
        rows = torch.arange(0, self.in_features, fine) // gs  # stored group of each fine group
        try:
            w = cpu_weight_only.int4pack_from_awq(
                self.qweight, self.qzeros[rows], self.scales[rows], fine, dtype
            )
        except ValueError as exc:
            logger.debug("int4pack rejected an AWQ layer (%s): dequantizing", exc)
            return self._dense_awq(dtype)
        self._drop("qweight", "qzeros", "scales")
        self._run = _int4pack_runner(w, self)
        return "cpu-int4pack"

    def _dense_awq(self, dtype: torch.dtype) -> str:
        scales = self.scales.to(torch.float32)
        w = packing.dequantize_awq(self.qweight, self.qzeros, scales, self.group_size)
        self._drop("qweight", "qzeros", "scales")
        return self._dense(w, dtype)
