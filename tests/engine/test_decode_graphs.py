"""The compiled decode step (step graphs, `decode_graphs`): a replay computes what the eager step
computes on the new inputs; what would bake a step's values into Python is refused; and every
tiny architecture's greedy output with graphs equals its output with `enforce_eager`, batches
padded to capture sizes included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qserve.engine.decode_graphs import capture_sizes
from qserve.engine.llm import LLM
from qserve.engine.sampling_params import SamplingParams
from qserve.engine.step_graph import NotCapturable, StepGraph, UnavailableList
from qserve.kernels import cpu_model_ops
from tests.engine.test_architectures import PROMPT_LENS, saved_model
from tests.kernels._helpers import require_built
from tests.tiny import byte_bpe_tokenizer
from tests.tiny_models import MOE_MODELS, TINY_MODELS, build_tiny_model


def test_capture_sizes_are_vllms():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1) == [1]


def test_replay_runs_launches_and_torch_ops_on_new_inputs():
    require_built(cpu_model_ops.load_library(), "CPU model ops")
    x = torch.randn(3, 64)
    weight = torch.randn(64)

    def step() -> torch.Tensor:
        h = x * 2  # functional: replayed into the tensor it returned
        h = cpu_model_ops.rms_norm(h, weight, 1e-6)  # a kernel launch
        h.add_(1)  # in place
        return h.to(torch.float64)  # `to` that copies (its schema says it may alias)

    with torch.inference_mode():
        graph = StepGraph.capture(step)
        assert graph.num_launches == 1 and len(graph.steps) == 4
        # functional ops replay into their captured results: `out=` overloads, `to` as copy_
        replayed = [args[0] for _, args, is_launch in graph.steps if not is_launch]
        assert replayed == [torch.ops.aten.mul.out, torch.ops.aten.add_.Tensor,
                            torch.Tensor.copy_]  # fmt: skip
        assert graph.held_bytes >= 3 * 64 * (4 + 4 + 8)  # x * 2, the norm's output, float64
        for _ in range(2):
            x.copy_(torch.randn(3, 64))
            out = graph.replay()
            assert out is graph.output
            torch.testing.assert_close(out, step(), rtol=0, atol=0)


@pytest.mark.parametrize(
    "read",
    [
        lambda x: x.sum().item(),
        lambda x: x.tolist(),
        lambda x: torch.nonzero(x),
        lambda x: x + torch.randn(x.shape),
        lambda x: len(UnavailableList("seq_lens_cpu")),
        lambda x: bool(UnavailableList("prompt_lens_cpu")),
    ],
    ids=["item", "tolist", "nonzero", "random", "len-metadata", "bool-metadata"],
)
def test_values_read_into_python_are_refused(read):
    x = torch.randn(4)
    with torch.inference_mode(), pytest.raises(NotCapturable):
        StepGraph.capture(lambda: read(x))


def _greedy(folder, prompts, dtype="float32", **args) -> tuple[LLM, list[list[int]]]:
    """Greedy continuations of 12, 9, 6, 3, ... tokens, so the decode batch shrinks as they
    finish (8 padded rows down to 1)."""
    llm = LLM(str(folder), dtype=dtype, block_size=16, num_threads=1, max_num_seqs=8,
              kv_cache_memory="16MiB", **args)  # fmt: skip
    params = [
        SamplingParams(temperature=0, max_tokens=12 - 3 * (i % 4), ignore_eos=True)
        for i in range(len(prompts))
    ]
    return llm, [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


# head_dim 64, which the C++ attention kernel takes (the tiny models' 16 and 32 take the torch
# reference, which reads lengths into Python); LongRoPE's factors and the MoE models stay as is
WIDE = dict(hidden_size=256, head_dim=64)
EAGER = {"phi3-longrope", *MOE_MODELS}


def _folder(name: str, root: Path, **overrides) -> Path:
    """The tiny model, at head_dim 64 unless it runs eager anyway."""
    if name in EAGER and not overrides:
        return saved_model(name, root)
    overrides = WIDE | overrides
    folder = root / ("graphs-" + name + "-".join(f"{k}{v}" for k, v in overrides.items()))
    if not folder.exists():
        build_tiny_model(name, **overrides).save_pretrained(folder)
        byte_bpe_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_graphs_equal_eager(name, tmp_path_factory):
    """6 prompts of mixed lengths; greedy tokens equal."""
    folder = _folder(name, tmp_path_factory.getbasetemp())
    vocab = TINY_MODELS[name][1].vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    _, eager = _greedy(folder, prompts, enforce_eager=True)
    llm, graphed = _greedy(folder, prompts)
    assert graphed == eager
    graphs = llm.engine.model_runner.decode_graphs
    if cpu_model_ops.load_library() is None:  # torch paths read lengths into Python: eager
        return
    if name in MOE_MODELS:  # the experts' routing reads token ids into Python
        assert graphs.not_capturable is not None and not graphs.graphs
    elif name == "phi3-longrope":  # picks each token's frequencies by its prompt's length
        assert "prompt_lens_cpu" in graphs.not_capturable
    else:
        assert graphs.not_capturable is None
        assert {8, 4, 2}.issubset(graphs.graphs)


def test_enforce_eager_makes_no_graphs(tmp_path_factory):
    folder = _folder("llama", tmp_path_factory.getbasetemp())
    llm, _ = _greedy(folder, [[1, 2, 3]], enforce_eager=True)
    assert llm.engine.model_runner.decode_graphs is None


def w4_bf16_greedy(root: Path, device: str = "cpu") -> tuple[LLM, list, list]:
    """A W4 checkpoint of the tiny Llama with a W4 lm_head, in bf16: the engine with graphs,
    its greedy tokens, and the tokens with `enforce_eager`."""
    from qserve.quantize.driver import quantize_model
    from qserve.quantize.settings import QuantizeSettings

    folder = root / "llama-w4"
    if not folder.exists():
        settings = QuantizeSettings(method="rtn", group_size=32, quantize_lm_head=True)
        quantize_model(_folder("llama", root, vocab_size=320), folder, settings)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 200, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    _, eager = _greedy(folder, prompts, dtype="bfloat16", enforce_eager=True, device=device)
    llm, graphed = _greedy(folder, prompts, dtype="bfloat16", device=device)
    return llm, graphed, eager


def test_w4_bf16_graphs_equal_eager(tmp_path_factory):
    """A W4 checkpoint with a W4 lm_head in bf16 (the int8 loop on x86): rows are computed
    independently, so padded graphs give the eager tokens exactly."""
    llm, graphed, eager = w4_bf16_greedy(tmp_path_factory.getbasetemp())
    assert graphed == eager
    if cpu_model_ops.load_library() is not None:
        assert {8, 4, 2}.issubset(llm.engine.model_runner.decode_graphs.graphs)


@pytest.mark.parametrize(
    "name, overrides",
    [("gemma3", dict(head_dim=256, num_key_value_heads=1)), ("phi3", dict(head_dim=96))],
    ids=["gemma3-256-one-kv-head", "phi3-96"],
)
def test_wide_heads_take_the_cpu_kernel_and_graphs(name, overrides, tmp_path_factory):
    """Gemma 3's head_dim 256 (with one KV head, as Gemma-3-270M: its page scale is a
    one-element tensor the step must not read) and Phi-3's 96 decode through the C++ attention
    kernel, so their decode steps are captured too; greedy tokens equal eager."""
    folder = _folder(name, tmp_path_factory.getbasetemp(), **overrides)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 200, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    _, eager = _greedy(folder, prompts, enforce_eager=True)
    llm, graphed = _greedy(folder, prompts)
    assert graphed == eager
    if cpu_model_ops.load_library() is not None:
        graphs = llm.engine.model_runner.decode_graphs
        assert graphs.not_capturable is None and {8, 4, 2}.issubset(graphs.graphs)
