"""The compiled decode step on CUDA (`cuda_graph`): a replayed CUDA graph computes what the
eager step computes on new inputs; a step that reads device values on the host is refused before
any capture; the engine's greedy tokens with CUDA graphs equal `enforce_eager`'s for every tiny
architecture (fp32) and a W4 checkpoint (bf16), batches padded to capture sizes included.

Needs a CUDA device (run by `benchmarks/gpu_check.sh`); skipped elsewhere. The guard that
refuses host reads is also tested on CPU (test_attention's host-bounds test, and below)."""

from __future__ import annotations

import pytest
import torch

from qserve.engine.step_graph import HostReadGuard, NotCapturable
from tests.engine.test_architectures import PROMPT_LENS
from tests.engine.test_decode_graphs import _folder, _greedy, w4_bf16_greedy
from tests.tiny_models import MOE_MODELS, TINY_MODELS

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device")


@pytest.mark.parametrize(
    "read",
    [lambda x: x.sum().item(), lambda x: x.tolist(), lambda x: torch.nonzero(x)],
    ids=["item", "tolist", "nonzero"],
)
def test_host_read_guard_refuses_value_reads(read):
    with torch.inference_mode(), pytest.raises(NotCapturable), HostReadGuard():
        read(torch.randn(4))


def test_host_read_guard_runs_the_ops():
    x = torch.randn(8)
    with torch.inference_mode(), HostReadGuard():
        y = torch.nn.functional.silu(x) * 2
    torch.testing.assert_close(y, torch.nn.functional.silu(x) * 2)


@needs_cuda
def test_replay_computes_the_step_on_new_inputs():
    from qserve.engine.cuda_graph import CudaStepGraph

    x = torch.randn(3, 64, device="cuda")
    weight = torch.randn(64, device="cuda")

    def step() -> torch.Tensor:
        h = torch.nn.functional.rms_norm(x * 2, (64,), weight, 1e-6)
        return h.add_(1).to(torch.float64)

    with torch.inference_mode():
        graph = CudaStepGraph.capture(step, torch.cuda.graph_pool_handle())
        torch.testing.assert_close(graph.output, step())  # the capture's own replay
        for _ in range(2):
            x.copy_(torch.randn(3, 64, device="cuda"))
            out = graph.replay()
            assert out is graph.output
            torch.testing.assert_close(out, step(), rtol=0, atol=0)


@needs_cuda
@pytest.mark.parametrize(
    "read",
    [lambda x: x.sum().item(), lambda x: x.cpu(), lambda x: x[x > 0]],
    ids=["item", "to-host", "mask"],
)
def test_host_reads_are_refused_before_capture(read):
    from qserve.engine.cuda_graph import CudaStepGraph

    x = torch.randn(4, device="cuda")
    with torch.inference_mode(), pytest.raises(NotCapturable):
        CudaStepGraph.capture(lambda: read(x), torch.cuda.graph_pool_handle())


@needs_cuda
@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_cuda_graphs_equal_eager(name, tmp_path_factory):
    """6 prompts of mixed lengths, fp32 on CUDA; greedy tokens equal, and the sizes the
    shrinking batch passed through were captured (MoE and LongRoPE may stay eager: then the
    reason is recorded)."""
    folder = _folder(name, tmp_path_factory.getbasetemp())
    vocab = TINY_MODELS[name][1].vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    _, eager = _greedy(folder, prompts, enforce_eager=True, device="cuda")
    llm, graphed = _greedy(folder, prompts, device="cuda")
    assert graphed == eager
    graphs = llm.engine.model_runner.decode_graphs
    if name in MOE_MODELS or name == "phi3-longrope":
        assert graphs.graphs or graphs.not_capturable
    else:
        assert graphs.not_capturable is None
        assert {8, 4, 2}.issubset(graphs.graphs)


@needs_cuda
def test_w4_bf16_cuda_graphs_equal_eager(tmp_path_factory):
    """A W4 checkpoint with a W4 lm_head in bf16 through the Triton W4 GEMM, graphs against
    eager."""
    llm, graphed, eager = w4_bf16_greedy(tmp_path_factory.getbasetemp(), device="cuda")
    assert graphed == eager
    assert {8, 4, 2}.issubset(llm.engine.model_runner.decode_graphs.graphs)
