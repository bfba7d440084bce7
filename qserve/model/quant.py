"""Quantized linear layers: swapped in for `nn.Linear` by name, filled from the checkpoint, then
prepared once for the kernel that will run them.

    swap_quant_linears(model, scheme, state)   # meta buffers named like the checkpoint's tensors
    ... load_state_dict(state, assign=True) ...
    paths = prepare_quant_linears(model, dtype)  # repack once; {layer kind: kernel path}

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

import logging
from collections.abc import Callable

import torch
from torch import nn

from qserve.errors import QServeError
from qserve.kernels import cpu_w4a16, cpu_weight_only, ops, packing
from qserve.kernels.fp8_ref import FP8_MAX, scaled_fp8_quant_ref
from qserve.kernels.int8_ref import INT8_MAX, scaled_int8_quant_ref
from qserve.model.quant_config import LinearScheme, QuantScheme

logger = logging.getLogger("qserve")

HALF_DTYPES = (torch.bfloat16, torch.float16)
# Checkpoint tensors that keep their stored dtype (the loader casts every other float tensor).
QUANT_TENSOR_SUFFIXES = (".scales", "_scale")  # weight_scale, input_scale, k_scale, v_scale, ...


def keeps_stored_dtype(name: str, tensor: torch.Tensor) -> bool:
    """Quantization scales and int8/fp8 weights are never cast to the activation dtype."""
    if not tensor.is_floating_point() or tensor.element_size() == 1:
        return True
    return name.endswith(QUANT_TENSOR_SUFFIXES)


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
    """The C++ 4-bit kernel: CPU tensors, enabled and compiled (compiles on first use)."""
    return t.device.type == "cpu" and bits == 4 and cpu_w4a16.available()


def _on_triton(t: torch.Tensor) -> bool:
    return ops.use_triton(t)


# ---------------------------------------------------------------------------------------- GPTQ


class GPTQLinear(QuantLinear):
    """GPTQ v1 tensors: qweight [K*bits/32, N], qzeros [G, N*bits/32], scales [G, N], g_idx [K]."""

    def __init__(
        self, scheme: LinearScheme, in_features: int, out_features: int, bias: bool, g_idx: bool
    ):
        super().__init__(scheme, in_features, out_features, bias)
        bits, K, N = scheme.bits, in_features, out_features
        per_word = packing.pack_factor(bits)
        gs = K if scheme.group_size == -1 else scheme.group_size
        self.num_groups = -(-K // gs)
        self.group_size = gs
        _check_divisible(K, per_word, "in_features", scheme)
        _check_divisible(N, per_word, "out_features", scheme)
        self._meta("qweight", (K // per_word, N), torch.int32)
        self._meta("qzeros", (self.num_groups, N // per_word), torch.int32)
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
        g = self._groups()
        if _on_triton(self.qweight):
            self.path = self._triton(g)
        elif _use_cpu_w4a16(self.qweight, self.scheme.bits) and self._cpu_w4a16(g):
            self.path = "cpu-w4a16"
        elif _use_cpu_kernel(self.qweight, dtype) and self.scheme.bits == 4:
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
            w = cpu_w4a16.w4_from_gptq(self.qweight, self.qzeros, self.scales, g)
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
                self.qweight, self.qzeros[rows], self.scales[rows], g_fine, dtype
            )
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


def _torch_int4_group_size(in_features: int, group_size: int) -> int:
    """The largest group torch's int4 CPU kernel takes that divides both the stored group and K.

    Splitting a stored group into equal smaller ones (same scale and zero) computes the same W,
    and a K that is a multiple of the group needs no zero padding of x on every call (SmolLM2:
    K = 576 = 9 x 64 with stored groups of 128). The stored group size if none divides both."""
    for g in sorted(cpu_weight_only.TORCH_GROUP_SIZES, reverse=True):
        if group_size % g == 0 and in_features % g == 0:
            return g
    return group_size


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


# ----------------------------------------------------------------------------------------- AWQ


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
        if _on_triton(self.qweight):
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


# ----------------------------------------------------------------------------- int8 / fp8


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
        if _on_triton(self.weight) and self._triton():
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


# ------------------------------------------------------------------------------ model surgery


def _make(
    scheme: LinearScheme, linear: nn.Linear, prefix: str, state: dict[str, torch.Tensor]
) -> QuantLinear:
    K, N = linear.in_features, linear.out_features
    bias = f"{prefix}.bias" in state  # old AutoGPTQ stores zero biases even for Llama
    if scheme.format == "gptq":
        return GPTQLinear(scheme, K, N, bias, g_idx=f"{prefix}.g_idx" in state)
    if scheme.format == "awq":
        return AWQLinear(scheme, K, N, bias)
    return W8Linear(scheme, K, N, bias)


def swap_quant_linears(
    model: nn.Module, scheme: QuantScheme, state: dict[str, torch.Tensor]
) -> dict[str, QuantLinear]:
    """Replace every nn.Linear the scheme quantizes (on meta) by its QuantLinear; normalize the
    checkpoint tensors of those layers in `state`. Returns {module name: layer}."""
    swapped = {}
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        linear_scheme = scheme.for_module(name)
        if linear_scheme is None:
            continue
        layer = _make(linear_scheme, module, name, state)
        layer.normalize(name, state)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
        swapped[name] = layer
    return swapped


def prepare_quant_linears(model: nn.Module, dtype: torch.dtype) -> dict[str, str]:
    """Prepare every QuantLinear for `dtype` activations; {layer kind: path(s)} for the log.

    A layer kind is the module's last name (q_proj, ..., down_proj); dense ones say "dense"."""
    kinds: dict[str, set[str]] = {}
    for name, module in model.named_modules():
        kind = name.rpartition(".")[2]
        if isinstance(module, QuantLinear):
            kinds.setdefault(kind, set()).add(module.prepare(dtype))
        elif isinstance(module, nn.Linear):
            kinds.setdefault(kind, set()).add("dense (not quantized)")
    return {kind: " + ".join(sorted(paths)) for kind, paths in kinds.items()}


def activation_dtype(checkpoint_dtype: torch.dtype, device: str) -> torch.dtype:
    """`--dtype auto` for quantized checkpoints: bf16 on CPU (torch's weight-only kernels and
    AMX are fast in bf16; GPTQ/AWQ checkpoints say float16), the checkpoint's 16-bit dtype on
    GPUs (fp32 checkpoints run in bf16)."""
    if torch.device(device).type == "cpu" or checkpoint_dtype not in HALF_DTYPES:
        return torch.bfloat16
    return checkpoint_dtype
