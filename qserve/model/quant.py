"""Quantized linear layers: swapped in for `nn.Linear` by name, filled from the checkpoint, then
prepared once for the kernel that will run them.

    swap_quant_linears(model, scheme, state)   # meta buffers named like the checkpoint's tensors
    ... load_state_dict(state, assign=True) ...
    paths = prepare_quant_linears(model, dtype)  # repack once; {layer kind: kernel path}

The layers live one module each, `QuantLinear` (base, kernel paths) in `quant_linear`, then
`gptq_linear`, `awq_linear` and `w8_linear`; they are importable from here too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from qserve.model.awq_linear import AWQLinear
from qserve.model.gptq_linear import GPTQLinear, gptq_from_pack_quantized
from qserve.model.quant_config import LinearScheme, QuantScheme
from qserve.model.quant_linear import HALF_DTYPES, QuantLinear
from qserve.model.w8_linear import W8Linear

# Checkpoint tensors that keep their stored dtype (the loader casts every other float tensor).
QUANT_TENSOR_SUFFIXES = (".scales", "_scale")  # weight_scale, input_scale, k_scale, v_scale, ...


def keeps_stored_dtype(name: str, tensor: torch.Tensor) -> bool:
    """Quantization scales and int8/fp8 weights are never cast to the activation dtype."""
    if not tensor.is_floating_point() or tensor.element_size() == 1:
        return True
    return name.endswith(QUANT_TENSOR_SUFFIXES)


def _make(
    scheme: LinearScheme, linear: nn.Linear, prefix: str, state: dict[str, torch.Tensor]
) -> QuantLinear:
    K, N = linear.in_features, linear.out_features
    bias = f"{prefix}.bias" in state  # old AutoGPTQ stores zero biases even for Llama
    if scheme.format == "gptq":
        if f"{prefix}.weight_packed" in state:  # compressed-tensors pack-quantized
            gptq_from_pack_quantized(prefix, state, scheme.bits)
        g_idx = f"{prefix}.g_idx" in state
        scales = state.get(f"{prefix}.scales")  # g_idx names its groups (act-order TP slice)
        groups = scales.shape[0] if g_idx and scales is not None else None
        return GPTQLinear(scheme, K, N, bias, g_idx=g_idx, num_groups=groups)
    if scheme.format == "awq":
        return AWQLinear(scheme, K, N, bias)
    return W8Linear(scheme, K, N, bias)


def swap_quant_linears(
    model: nn.Module,
    scheme: QuantScheme,
    state: dict[str, torch.Tensor],
    checkpoint_name: Callable[[str], str] = str,
    keep_dense: Callable[[str], bool] | None = None,
) -> dict[str, QuantLinear]:
    """Replace every nn.Linear the scheme quantizes (on meta) by its QuantLinear; normalize the
    checkpoint tensors of those layers in `state`. Returns {module name: layer}.

    The scheme is asked under the name the checkpoint gives a module (`checkpoint_name`; str:
    ours); `keep_dense` names modules that stay dense whatever it says (MoE routers)."""
    swapped = {}
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or (keep_dense is not None and keep_dense(name)):
            continue
        linear_scheme = scheme.for_module(checkpoint_name(name))
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
