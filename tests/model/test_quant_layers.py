"""Quantized linear layers on their own: every kernel path computes dequantize-then-dense.

Checkpoint tensors are built here by RTN on random weights and packed with
`qserve.kernels.packing`; the reference is F.linear with the dequantized weight in fp32.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qserve.errors import QServeError
from qserve.kernels import cpu_w4a16, packing
from qserve.kernels.fp8_ref import quantize_weight_fp8_ref, scaled_fp8_quant_ref
from qserve.kernels.int8_ref import scaled_int8_quant_ref
from qserve.kernels.w4a16_ref import quantize_activations_ref
from qserve.model.quant import AWQLinear, GPTQLinear, QuantLinear, W8Linear
from qserve.model.quant_config import LinearScheme

# Max |out - expected| relative to max |expected|. bf16 rounds activations, outputs and (int4pack)
# the scales and zero terms to 8 significant bits: a few 2^-8 at worst; fp16 to 11 bits.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture
def torch_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The C++ CPU kernels off: the paths torch's own kernels (or dequantization) give."""
    monkeypatch.setenv("QSERVE_CPU_KERNELS", "0")


needs_cpp = pytest.mark.skipif(not cpu_w4a16.available(), reason="the C++ kernel did not build")


def rtn(w: torch.Tensor, bits: int, group: int, min_zero: int = 1, sym: bool = False):
    """RTN of w [N, K] per group of input channels: (q [K, N], zeros, scales [G, N])."""
    N, K = w.shape
    gs = K if group == -1 else group
    wg = w.t().reshape(-1, gs, N)  # [G, gs, N]
    lo, hi = wg.amin(1).clamp(max=0), wg.amax(1).clamp(min=0)
    maxq = 2**bits - 1
    scales = ((hi - lo) / maxq).clamp(min=1e-6)
    zeros = torch.round(-lo / scales).clamp(min_zero, maxq)
    if sym:  # zero 2**(bits-1): q - zero spans the signed range
        scales = (torch.maximum(-lo, hi) / (2 ** (bits - 1) - 1)).clamp(min=1e-6)
        zeros = torch.full_like(scales, 2 ** (bits - 1))
    q = torch.clamp(torch.round(wg / scales[:, None]) + zeros[:, None], 0, maxq)
    return q.reshape(K, N).to(torch.int32), zeros.to(torch.int32), scales.to(torch.float16)


def load(layer: QuantLinear, prefix: str, tensors: dict[str, torch.Tensor]) -> QuantLinear:
    state = {f"{prefix}.{k}": v for k, v in tensors.items()}
    layer.normalize(prefix, state)
    layer.load_state_dict({k.removeprefix(prefix + "."): v for k, v in state.items()}, assign=True)
    return layer


def gptq_layer(
    N: int, K: int, bits: int, group: int, act_order: bool, bias: bool = False, sym: bool = False
):
    torch.manual_seed(N + K + bits)
    w = torch.randn(N, K)
    q, zeros, scales = rtn(w, bits, group, sym=sym)
    gs = K if group == -1 else group
    g_idx = torch.arange(K, dtype=torch.int32) // gs
    if act_order:  # the channels of each group are scattered over K
        g_idx = packing.gptq_g_idx(K, group, torch.randperm(K))
        q, zeros, scales = _regroup(w, bits, g_idx, zeros.shape[0])
    tensors = {
        "qweight": packing.pack_gptq_qweight(q, bits),
        "qzeros": packing.pack_gptq_qzeros(zeros, bits),
        "scales": scales,
        "g_idx": g_idx,
    }
    if bias:
        tensors["bias"] = torch.randn(N)
    scheme = LinearScheme("gptq", bits=bits, group_size=group, desc_act=act_order)
    layer = GPTQLinear(scheme, K, N, bias, g_idx=True)
    ref = packing.dequantize_gptq(
        tensors["qweight"], tensors["qzeros"], scales.float(), g_idx, bits
    )
    return load(layer, "l", tensors), ref, tensors.get("bias")


def _regroup(w: torch.Tensor, bits: int, g_idx: torch.Tensor, G: int):
    """RTN with arbitrary group membership g_idx [K] (act-order)."""
    N, K = w.shape
    q = torch.empty(K, N, dtype=torch.int32)
    zeros = torch.empty(G, N, dtype=torch.int32)
    scales = torch.empty(G, N, dtype=torch.float16)
    for g in range(G):
        cols = (g_idx == g).nonzero().flatten()
        qg, zg, sg = rtn(w[:, cols], bits, -1)
        q[cols], zeros[g], scales[g] = qg, zg[0], sg[0]
    return q, zeros, scales


def awq_layer(N: int, K: int, group: int):
    torch.manual_seed(N * K)
    q, zeros, scales = rtn(torch.randn(N, K), 4, group, min_zero=0)
    tensors = {
        "qweight": packing.pack_awq_qweight(q),
        "qzeros": packing.pack_awq_qzeros(zeros),
        "scales": scales,
    }
    layer = AWQLinear(LinearScheme("awq", bits=4, group_size=group), K, N, bias=False)
    ref = packing.dequantize_awq(tensors["qweight"], tensors["qzeros"], scales.float(), group)
    return load(layer, "l", tensors), ref


def run(layer: QuantLinear, ref_w: torch.Tensor, dtype: torch.dtype, bias=None, x_fn=None):
    x = torch.randn(5, 3, layer.in_features).to(dtype)
    out = layer(x)
    x_ref = x if x_fn is None else x_fn(x.reshape(-1, layer.in_features)).reshape(x.shape)
    b = None if bias is None else bias.float()
    expected = F.linear(x_ref.float(), ref_w.float(), b)
    assert out.shape == (5, 3, layer.out_features) and out.dtype == dtype
    err = (out.float() - expected).abs().max() / expected.abs().max()
    assert err <= TOL[dtype], f"relative error {err:.2e} > {TOL[dtype]:.0e}"


@pytest.mark.parametrize(
    ("N", "K", "bits", "group", "act_order", "dtype", "path"),
    [
        (64, 128, 4, 32, False, torch.bfloat16, "cpu-int4pack"),
        (64, 128, 4, 32, True, torch.bfloat16, "cpu-int4pack"),
        (48, 160, 4, 32, False, torch.bfloat16, "cpu-int4pack"),  # K not a multiple of 64
        (64, 96, 4, -1, False, torch.bfloat16, "cpu-int4pack"),  # per channel
        (64, 96, 4, 48, False, torch.bfloat16, "dequantized"),  # a group torch's kernel rejects
        (8, 64, 4, 32, False, torch.bfloat16, "dequantized"),  # N % 16 != 0
        (64, 128, 4, 32, True, torch.float32, "dequantized"),  # fp32 activations
        (32, 64, 8, -1, False, torch.bfloat16, "dequantized"),  # asym: q - zero leaves int8
        (32, 64, 8, 32, False, torch.bfloat16, "dequantized"),  # grouped 8-bit
        (32, 64, 8, 32, True, torch.float32, "dequantized"),
    ],
)
def test_gptq_paths_without_cpp(N, K, bits, group, act_order, dtype, path, torch_kernels):
    layer, ref, bias = gptq_layer(N, K, bits, group, act_order, bias=True)
    assert layer.prepare(dtype) == path
    layer.bias = layer.bias.to(dtype)
    run(layer, ref, dtype, bias.to(dtype))


@needs_cpp
@pytest.mark.parametrize(
    ("N", "K", "group", "act_order", "dtype", "path"),
    [
        (64, 128, 32, False, torch.bfloat16, "cpu-w4a16"),
        (64, 128, 32, True, torch.bfloat16, "cpu-w4a16"),
        (64, 128, 32, True, torch.float32, "cpu-w4a16"),
        (48, 160, 32, False, torch.float16, "cpu-w4a16"),
        (64, 96, -1, False, torch.bfloat16, "cpu-w4a16"),  # per channel
        (64, 96, 48, False, torch.float32, "cpu-w4a16"),  # a group torch's kernel rejects
        (8, 64, 32, False, torch.bfloat16, "cpu-w4a16"),  # N % 16 != 0
        (40, 80, 20, False, torch.float32, "dequantized"),  # groups not a multiple of 8
    ],
)
def test_gptq_4bit_paths_with_cpp(N, K, group, act_order, dtype, path):
    layer, ref, bias = gptq_layer(N, K, 4, group, act_order, bias=True)
    g_idx = layer.g_idx.clone()
    assert layer.prepare(dtype) == path
    x_fn = w4_loop_activations(g_idx, dtype) if path == "cpu-w4a16" else None
    run(layer, ref, dtype, bias, x_fn=x_fn)


def w4_loop_activations(g_idx: torch.Tensor, dtype: torch.dtype):
    """x as the C++ W4 loop multiplies it (16-bit x rounded to int8 per group where it takes
    them through int8), for `run`'s reference."""
    if not cpu_w4a16.int8_activations(dtype):
        return None
    return lambda x: quantize_activations_ref(x, g_idx)


@needs_cpp
@pytest.mark.parametrize(
    ("N", "K", "group", "dtype"),
    [(64, 128, 32, torch.bfloat16), (24, 64, 32, torch.float32), (32, 192, -1, torch.float32)],
)
def test_awq_paths_with_cpp(N, K, group, dtype):
    layer, ref = awq_layer(N, K, group)
    assert layer.prepare(dtype) == "cpu-w4a16"
    groups = torch.arange(K) // (K if group == -1 else group)
    run(layer, ref, dtype, x_fn=w4_loop_activations(groups, dtype))


def test_gptq_8bit_symmetric_per_channel_runs_on_the_int8_kernel():
    layer, ref, _ = gptq_layer(32, 64, 8, -1, act_order=False, sym=True)
    assert layer.prepare(torch.bfloat16) == "cpu-int8pack"
    run(layer, ref, torch.bfloat16)


@pytest.mark.parametrize(
    ("N", "K", "group", "dtype", "path"),
    [
        (64, 128, 32, torch.bfloat16, "cpu-int4pack"),
        (32, 192, 64, torch.bfloat16, "cpu-int4pack"),
        (64, 128, 128, torch.float32, "dequantized"),
        (24, 64, 32, torch.bfloat16, "dequantized"),
    ],
)
def test_awq_paths_without_cpp(N, K, group, dtype, path, torch_kernels):
    layer, ref = awq_layer(N, K, group)
    assert layer.prepare(dtype) == path
    run(layer, ref, dtype)


def w8_layer(fmt: str, acts: str | None, per_channel: bool, N: int = 48, K: int = 80):
    torch.manual_seed(7)
    w = torch.randn(N, K)
    if fmt == "int8":
        scale = w.abs().amax(1, keepdim=True) / 127 if per_channel else w.abs().max() / 127
        q = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
        scale = scale.reshape(-1, 1) if per_channel else scale.reshape(())  # 0-d, like vLLM
    else:
        q, scale = quantize_weight_fp8_ref(w, per_channel)
    tensors = {"weight": q, "weight_scale": scale}
    input_scale = torch.tensor([0.02])
    if acts == "static":
        tensors["input_scale"] = input_scale
    layer = W8Linear(LinearScheme(fmt, activations=acts), K, N, bias=False)
    ref = q.float() * scale.float().reshape(-1, 1) if per_channel else q.float() * scale.float()
    return load(layer, "l", tensors), ref, input_scale


def fake_quant(fmt: str, acts: str | None, input_scale: torch.Tensor):
    quant = scaled_int8_quant_ref if fmt == "int8" else scaled_fp8_quant_ref
    qmax = 127 if fmt == "int8" else 448

    def fn(x: torch.Tensor) -> torch.Tensor:
        if acts is None:
            return x
        scale = {"static": input_scale, "token": None}.get(acts)
        if acts == "tensor":
            scale = (x.float().abs().amax() / qmax).reshape(1)
        codes, s = quant(x, scale)
        return (codes.float() * s).to(x.dtype)

    return fn


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("fmt", "acts", "per_channel"),
    [
        ("int8", "token", True),
        ("int8", "static", False),
        ("int8", None, True),
        ("fp8", "token", True),
        ("fp8", "tensor", False),
        ("fp8", "static", False),
    ],
)
def test_w8_paths(fmt, acts, per_channel, dtype):
    layer, ref, input_scale = w8_layer(fmt, acts, per_channel)
    expected_path = "cpu-int8pack" if fmt == "int8" and dtype == torch.bfloat16 else "dequantized"
    assert layer.prepare(dtype) == expected_path
    assert tuple(layer.weight_scale.shape) == ((48, 1) if per_channel else (1,))
    run(layer, ref, dtype, x_fn=fake_quant(fmt, acts, input_scale))


def test_w8_rejects_a_16_bit_weight():
    layer = W8Linear(LinearScheme("fp8", activations="token"), 16, 16, bias=False)
    state = {"l.weight": torch.randn(16, 16), "l.weight_scale": torch.ones(16, 1)}
    with pytest.raises(QServeError, match="expects a serialized 8-bit weight"):
        layer.normalize("l", state)


def test_gptq_rejects_g_idx_outside_the_groups():
    layer, _, _ = gptq_layer(32, 64, 4, 32, act_order=False)
    layer.g_idx = torch.full((64,), 5, dtype=torch.int32)
    with pytest.raises(QServeError, match=r"g_idx names groups outside \[0, 2\)"):
        layer.prepare(torch.bfloat16)


@pytest.mark.parametrize(
    "make",
    [
        lambda: gptq_layer(64, 128, 4, 32, act_order=True, bias=True),
        lambda: gptq_layer(32, 64, 8, 32, act_order=False),
        lambda: (*awq_layer(64, 128, 32), None),
    ],
    ids=["gptq-act-order", "gptq-8bit", "awq"],
)
def test_triton_wiring_through_ops(monkeypatch, make):
    """The CUDA path's arguments, checked on CPU: `ops` falls back to the torch references."""
    import qserve.model.quant_linear as quant

    monkeypatch.setattr(quant, "_on_triton", lambda t: True)
    layer, ref, bias = make()
    assert layer.prepare(torch.bfloat16) == "triton"
    run(layer, ref, torch.bfloat16, bias)


@pytest.mark.parametrize(
    ("fmt", "acts"), [("int8", "token"), ("int8", "static"), ("int8", None), ("fp8", "tensor")]
)
def test_triton_wiring_through_ops_w8(monkeypatch, fmt, acts):
    import qserve.model.quant_linear as quant

    monkeypatch.setattr(quant, "_on_triton", lambda t: True)
    layer, ref, input_scale = w8_layer(fmt, acts, per_channel=True)
    assert layer.prepare(torch.bfloat16) == "triton"
    run(layer, ref, torch.bfloat16, x_fn=fake_quant(fmt, acts, input_scale))


def test_without_the_cpp_build_4bit_takes_torch_int4(monkeypatch):
    monkeypatch.setattr(cpu_w4a16, "load_library", lambda: None)  # as after a failed compile
    layer, ref, _ = gptq_layer(64, 128, 4, 32, act_order=False)
    assert layer.prepare(torch.bfloat16) == "cpu-int4pack"
    run(layer, ref, torch.bfloat16)
