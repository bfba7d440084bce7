"""int8 / fp8 weight checkpoints (W8A16, W8A8) as a quantized linear (`W8Linear`)."""

from __future__ import annotations

import torch

from qserve.errors import QServeError
from qserve.kernels import cpu_weight_only, ops
from qserve.kernels.fp8_ref import FP8_MAX, scaled_fp8_quant_ref
from qserve.kernels.int8_ref import INT8_MAX, scaled_int8_quant_ref
from qserve.model import quant_linear
from qserve.model.quant_config import LinearScheme
from qserve.model.quant_linear import QuantLinear, _use_cpu_kernel


class W8Linear(QuantLinear):
    """compressed-tensors / vLLM fp8: weight int8|fp8 [N, K], weight_scale [N, 1] or [1],
    input_scale [1] for static activations."""

    def __init__(self, scheme: LinearScheme, in_features: int, out_features: int, bias: bool):
        super().__init__(scheme, in_features, out_features, bias)
        K, N = in_features, out_features
        self.qmax = INT8_MAX if scheme.format == "int8" else FP8_MAX
        self._meta("weight", (N, K), torch.int8)
        self._meta("weight_scale", (N, 1), torch.float32)
        if scheme.activations == "static":
            self._meta("input_scale", (1,), torch.float32)
        else:
            self.input_scale: torch.Tensor | None = None

    def normalize(self, prefix: str, state: dict[str, torch.Tensor]) -> None:
        """Scales as [N, 1] (channel) or [1] (tensor, also vLLM's 0-d scalars); the buffer
        follows the checkpoint's choice."""
        name = f"{prefix}.weight_scale"
        scale = state.get(name)
        if scale is not None and scale.numel() in (1, self.out_features):
            state[name] = scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(1)
            self._meta("weight_scale", tuple(state[name].shape), torch.float32)
        weight = state.get(f"{prefix}.weight")
        if weight is not None and weight.element_size() != 1:
            raise QServeError(
                f"{prefix}.weight is {str(weight.dtype).removeprefix('torch.')}; "
                f"{self.scheme.name} expects a serialized 8-bit weight"
            )
        if f"{prefix}.input_scale" in state:
            state[f"{prefix}.input_scale"] = state[f"{prefix}.input_scale"].reshape(1)
            if self.input_scale is None:  # dynamic schemes: a stored scale is not used
                del state[f"{prefix}.input_scale"]

    def prepare(self, dtype: torch.dtype) -> str:
        self.weight_scale = self.weight_scale.to(torch.float32)
        if self.scheme.format == "int8" and self.weight.dtype != torch.int8:
            raise QServeError(f"{self.scheme.name}: weight is {self.weight.dtype}, expected int8")
        if self.scheme.format == "fp8" and self.weight.dtype != torch.float8_e4m3fn:
            raise QServeError(f"{self.scheme.name}: weight is {self.weight.dtype}, expected e4m3")
        if quant_linear._on_triton(self.weight) and self._triton():
            self.path = "triton"
        elif self.scheme.format == "int8" and _use_cpu_kernel(self.weight, dtype):
            self.path = self._int8pack()
        else:
            self.path = self._dense_w8(dtype)
        return self.path

    def _quant_act(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] -> (codes, fp32 scale [M, 1] or [1]) by the scheme's activation rule."""
        scale = self.input_scale
        if self.scheme.activations == "tensor":
            scale = (x.abs().amax().to(torch.float32).clamp(min=1e-10) / self.qmax).reshape(1)
        quant = scaled_int8_quant_ref if self.scheme.format == "int8" else scaled_fp8_quant_ref
        return quant(x, scale)

    def _fake_quant_act(self, x: torch.Tensor) -> torch.Tensor:
        if self.scheme.activations is None:
            return x
        codes, scale = self._quant_act(x)
        return (codes.to(torch.float32) * scale).to(x.dtype)

    def _triton(self) -> bool:
        acts = self.scheme.activations
        if acts is None and self.scheme.format == "int8":
            self._run = lambda x: ops.w8a16_gemm(x, self.weight, self.weight_scale, self._bias(x))
            return True
        if acts is None:
            return False  # fp8 weight-only: no kernel, dequantize
        linear = ops.w8a8_int8_linear if self.scheme.format == "int8" else ops.w8a8_fp8_linear
        self._run = lambda x: linear(
            x, self.weight, self.weight_scale, self._triton_input_scale(x), self._bias(x)
        )
        return True

    def _triton_input_scale(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.scheme.activations == "tensor":
            return (x.abs().amax().to(torch.float32).clamp(min=1e-10) / self.qmax).reshape(1)
        return self.input_scale  # None: the kernels quantize per token

    def _int8pack(self) -> str:
        w_q = cpu_weight_only.aligned(self.weight)
        scale = self.weight_scale.reshape(-1)  # [N] or [1]
        self._drop("weight")
        if self.scheme.activations is None:
            self._run = lambda x: cpu_weight_only.int8pack_mm(x, w_q, scale, self._bias(x))
            return "cpu-int8pack"

        def run(x: torch.Tensor) -> torch.Tensor:
            codes, x_scale = self._quant_act(x)  # int8 codes are exact in bf16/fp16
            out = cpu_weight_only.int8pack_mm(codes.to(x.dtype), w_q, scale)
            out = (out.to(torch.float32) * x_scale.reshape(-1, 1)).to(x.dtype)
            return out if self.bias is None else out + self._bias(x)

        self._run = run
        return "cpu-int8pack"

    def _dense_w8(self, dtype: torch.dtype) -> str:
        w = self.weight.to(torch.float32) * self.weight_scale  # [N, K]
        self._drop("weight")
        path = self._dense(w, dtype)
        self._run = lambda x: ops.linear(self._fake_quant_act(x), self.weight, self._bias(x))
        return path
