"""ops dispatch: the torch path without CUDA (and without triton), Triton on CUDA."""

import subprocess
import sys

import torch

from qserve.kernels import ops
from qserve.kernels import packing as P
from qserve.kernels.fp8_ref import quantize_weight_fp8_ref, w8a8_fp8_linear_ref
from qserve.kernels.int8_ref import w8a8_int8_linear_ref, w8a16_gemm_ref
from qserve.kernels.w4a16_ref import awq_gemm_ref, gptq_gemm_ref


def test_ops_import_and_run_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from qserve.kernels import ops\n"
        "assert not ops.triton_available()\n"
        "x = torch.randn(2, 8)\n"
        "q, s = ops.scaled_int8_quant(x)\n"
        "assert q.dtype == torch.int8 and s.shape == (2, 1)\n"
        "assert 'triton' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_ops_match_references(device) -> None:
    M, K, N, gs = 3, 128, 64, 64
    x = torch.randn(M, K, dtype=torch.float16)
    q = torch.randint(0, 16, (K, N), dtype=torch.int32)
    z = torch.randint(1, 16, (K // gs, N), dtype=torch.int32)
    scales = (torch.rand(K // gs, N) * 0.02).half()
    g_idx = P.gptq_g_idx(K, gs, torch.randperm(K))
    gptq = (P.pack_gptq_qweight(q, 4), P.pack_gptq_qzeros(z, 4), scales, g_idx)
    awq = (P.pack_awq_qweight(q), P.pack_awq_qzeros(z), scales)
    w_i8 = torch.randint(-127, 128, (N, K), dtype=torch.int8)
    ws = torch.rand(N, 1) * 0.01
    w_f8, ws_f8 = quantize_weight_fp8_ref(torch.randn(N, K) * 0.05)

    def d(*ts):
        return [t.to(device) for t in ts]

    cases = [
        (ops.gptq_gemm(*d(x, *gptq)), gptq_gemm_ref(x, *gptq)),
        (ops.awq_gemm(*d(x, *awq), gs), awq_gemm_ref(x, *awq, gs)),
        (ops.w8a16_gemm(*d(x, w_i8, ws)), w8a16_gemm_ref(x, w_i8, ws)),
        (ops.w8a8_int8_linear(*d(x, w_i8, ws)), w8a8_int8_linear_ref(x, w_i8, ws)),
        (ops.w8a8_fp8_linear(*d(x, w_f8, ws_f8)), w8a8_fp8_linear_ref(x, w_f8, ws_f8)),
    ]
    for out, ref in cases:
        assert out.device.type == torch.device(device).type and out.dtype == ref.dtype
        atol = 2e-3 * ref.float().abs().max().item()
        torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=2e-3, atol=atol)
