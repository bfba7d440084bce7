"""Tensor and pipeline parallelism in the engine (issue 24, `qserve.parallel.workers`):
`LLM(..., tensor_parallel_size=2)` or `pipeline_parallel_size=2` runs rank 1 in a worker process
over gloo; greedy output and logprobs equal one process's for prompts of mixed lengths, also
under chunked prefill and preemption (and for quantized checkpoints); what does not split is
refused in one line before anything starts; a worker that dies makes the next step fail in
one line, and closing leaves no process behind."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from qserve.engine.llm import LLM
from qserve.engine.sampling_params import SamplingParams
from qserve.errors import QServeError
from qserve.model.config import ModelConfig
from tests.tiny import byte_bpe_tokenizer, save_tiny_llama
from tests.tiny_models import build_tiny_model

PROMPT_LENS = [5, 40, 25, 70, 1, 33]
MAX_TOKENS = 12
LAYER_BLOCK_BYTES = 2 * 16 * 2 * 16 * 4  # K and V, 16 tokens, 2 KV heads of 16, fp32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tp") / "llama")


@pytest.fixture(scope="module")
def deep_model_dir(tmp_path_factory) -> Path:
    """The tiny Llama with 3 layers: pipeline stages of 2 and 1."""
    return save_tiny_llama(tmp_path_factory.mktemp("tp") / "llama-3", num_layers=3)


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory) -> Path:
    """The tiny Llama with an MLP of 256: each rank's half of down_proj's input is whole
    groups of 32."""
    folder = tmp_path_factory.mktemp("tp") / "llama-256"
    build_tiny_model("llama", intermediate_size=256, vocab_size=1000).save_pretrained(folder)
    byte_bpe_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 900, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _run(
    model_dir: Path, prompts: list[list[int]], tp: int = 1, pp: int = 1, **args
) -> tuple[list, list, LLM]:
    if "kv_blocks" in args:  # as many blocks as one process: a TP rank's hold 1/tp of the KV
        layers = ModelConfig.from_pretrained(model_dir).num_hidden_layers  # heads, a PP stage's
        stage0 = -(-layers // pp)  # its layers (stage 0 has the most)
        args["kv_cache_memory"] = args.pop("kv_blocks") * LAYER_BLOCK_BYTES * stage0 // tp
    llm = LLM(str(model_dir), dtype="float32", num_threads=1, tensor_parallel_size=tp,
              pipeline_parallel_size=pp, **args)  # fmt: skip
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    finally:
        llm.engine.close()
    tokens = [o.token_ids for o in outs]
    logprobs = [[(s.top_token_ids, s.top_logprobs) for s in o.logprobs] for o in outs]
    return tokens, logprobs, llm


def _assert_same(one: tuple, two: tuple, tol: float = 1e-4) -> None:
    """Same tokens; each step's top-3 logprobs within `tol` (fp32 summation order: 1e-4), the
    same ids where that cannot swap near-ties (the top one always)."""
    assert two[0] == one[0]
    for a, b in zip(one[1], two[1]):
        for (ids_a, lp_a), (ids_b, lp_b) in zip(a, b):
            assert ids_a[0] == ids_b[0] and (tol > 1e-4 or ids_a == ids_b)
            shared = {i: lp for i, lp in zip(ids_a, lp_a)}
            for i, lp in zip(ids_b, lp_b):
                assert i not in shared or lp == pytest.approx(shared[i], abs=tol)


@pytest.mark.parametrize(
    "args",
    [
        dict(kv_cache_memory="16MiB"),
        dict(kv_cache_memory="16MiB", max_num_batched_tokens=24),  # chunked prefill
        dict(kv_blocks=6, max_model_len=96),  # preemption
    ],
    ids=["roomy", "chunked-prefill", "preemption"],
)
@pytest.mark.parametrize(
    "split", [dict(tp=2), dict(pp=2), dict(tp=2, pp=2)], ids=["tp2", "pp2", "tp2-pp2"]
)
def test_two_processes_equal_one(deep_model_dir, prompts, args, split):
    one = _run(deep_model_dir, prompts, **dict(args))
    two = _run(deep_model_dir, prompts, **split, **dict(args))
    _assert_same(one, two)
    if "max_model_len" in args:
        assert two[2].engine.scheduler.num_preemptions > 0
    assert all(not p.is_alive() for p in two[2].engine.workers.procs)


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_pipeline_micro_batches_do_not_change_the_output(deep_model_dir, prompts, micro_batches):
    """The default cut (2 micro-batches for 2 stages) is above; the stages in turn (1) and 3
    micro-batches (the prefill chunks of mixed prompts) give one process's output too."""
    args = dict(kv_cache_memory="16MiB", max_num_batched_tokens=100)
    one = _run(deep_model_dir, prompts, **args)
    _assert_same(one, _run(deep_model_dir, prompts, pp=2, pipeline_micro_batches=micro_batches,
                           **args))  # fmt: skip


def test_gemma3_stages_and_shards_equal_one_process(tmp_path, prompts):
    """Gemma 3 (sliding and global layers, scaled tied embedding, soft-capped logits, no
    residual stream between layers): PP=2, one layer a stage, in micro-batches; TP=2."""
    folder = tmp_path / "gemma3"
    build_tiny_model("gemma3", vocab_size=1000).save_pretrained(folder)
    byte_bpe_tokenizer().save_pretrained(folder)
    args = dict(kv_cache_memory="16MiB", max_num_batched_tokens=100)
    one = _run(folder, prompts, **args)
    _assert_same(one, _run(folder, prompts, pp=2, **args))
    _assert_same(one, _run(folder, prompts, tp=2, **args))


@pytest.mark.parametrize(
    "args, message",
    [
        (dict(tensor_parallel_size=3), "do not split over --tensor-parallel-size 3"),
        (dict(pipeline_parallel_size=3), "more stages than the model's 2 decoder layers"),
        (
            dict(tensor_parallel_size=3, pipeline_parallel_size=2),
            "split over --tensor-parallel-size 3",
        ),
        (dict(device="cuda", tensor_parallel_size=2), "CPU"),
    ],
    ids=["tp-heads", "pp-layers", "tp-heads-with-pp", "cuda"],
)
def test_what_does_not_split_is_refused_before_starting(model_dir, args, message):
    with pytest.raises(QServeError, match=message) as info:
        LLM(str(model_dir), dtype="float32", **args)
    assert "\n" not in str(info.value)


def test_a_dead_worker_fails_the_next_step_in_one_line(model_dir, prompts):
    llm = LLM(str(model_dir), dtype="float32", num_threads=1, tensor_parallel_size=2)
    try:
        worker = llm.engine.workers.procs[0]
        worker.kill()
        worker.join()
        start = time.monotonic()
        with pytest.raises(QServeError, match="worker rank 1 exited") as info:
            llm.generate(prompts[:2], SamplingParams(max_tokens=4))
        assert time.monotonic() - start < 10 and "\n" not in str(info.value)
    finally:
        llm.engine.close()
    assert not worker.is_alive()


@pytest.mark.parametrize(
    "settings, tol",
    [
        (dict(method="rtn", group_size=32), 1e-4),  # GPTQ format, 4-bit: whole groups along K
        # compressed-tensors W8A8 int8: a row-parallel rank rounds its half of each token to
        # int8 on that half's own scale (as vLLM's ranks do), so logprobs move by ~1e-3
        (dict(method="int8", num_samples=4, seq_len=64), 1e-2),
    ],
    ids=["gptq-w4-g32", "int8-w8a8"],
)
def test_quantized_tp2_equals_one_process(wide_model_dir, prompts, tmp_path, settings, tol):
    from qserve.quantize.driver import quantize_model
    from qserve.quantize.settings import QuantizeSettings

    folder = quantize_model(wide_model_dir, tmp_path / "q", QuantizeSettings(**settings))
    one = _run(folder, prompts, kv_cache_memory="16MiB")
    two = _run(folder, prompts, tp=2, kv_cache_memory="16MiB")
    _assert_same(one, two, tol)
    if settings["method"] != "rtn":
        return
    _assert_same(one, _run(folder, prompts, pp=2, kv_cache_memory="16MiB"))  # layers as stored
    for args in (dict(kv_cache_memory="16MiB", max_num_batched_tokens=24),  # chunked prefill
                 dict(kv_blocks=6, max_model_len=96)):  # preemption  # fmt: skip
        two = _run(folder, prompts, tp=2, **dict(args))
        _assert_same(_run(folder, prompts, **dict(args)), two)
        assert "kv_blocks" not in args or two[2].engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize(
    "settings",
    [
        # act-order: each rank's half of down_proj's channels reads groups from all over
        # the layer; every rank keeps all the scales and zeros and its half of g_idx
        dict(method="gptq", group_size=32, desc_act=True, num_samples=4, seq_len=64),
        # compressed-tensors pack-quantized W4: cut as the GPTQ tensors of the same codes
        dict(method="rtn", group_size=32, format="compressed-tensors"),
    ],
    ids=["gptq-act-order", "compressed-tensors-w4"],
)
def test_act_order_and_pack_quantized_tp2_equal_one_process(
    wide_model_dir, prompts, tmp_path, settings
):
    from qserve.quantize.driver import quantize_model
    from qserve.quantize.settings import QuantizeSettings

    folder = quantize_model(wide_model_dir, tmp_path / "q", QuantizeSettings(**settings))
    _assert_same(_run(folder, prompts, kv_cache_memory="16MiB"),
                 _run(folder, prompts, tp=2, kv_cache_memory="16MiB"))  # fmt: skip


def test_one_kv_head_replicated_over_two_ranks(tmp_path, prompts):
    """4 query heads and 1 KV head at TP=2: each rank runs 2 query heads on its own copy of
    the KV head (and caches it)."""
    folder = tmp_path / "llama-kv1"
    build_tiny_model("llama", vocab_size=1000, num_key_value_heads=1).save_pretrained(folder)
    byte_bpe_tokenizer().save_pretrained(folder)
    _assert_same(_run(folder, prompts, kv_cache_memory="16MiB"),
                 _run(folder, prompts, tp=2, kv_cache_memory="16MiB"))  # fmt: skip


def test_prompt_logprobs_and_vocab_parallel_lm_head(deep_model_dir, prompts):
    """The tiny vocabulary (1000) splits over 2 ranks: each holds half the embedding and lm_head
    rows, and the prompt logprobs rank 0 computes (in 128-row chunks) gather every rank's."""
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2, ignore_eos=True)
    outs = {}
    for tp in (1, 2):
        llm = LLM(str(deep_model_dir), dtype="float32", num_threads=1, tensor_parallel_size=tp,
                  max_num_batched_tokens=64)  # fmt: skip
        try:
            outs[tp] = llm.generate(prompts, params)
            embed = llm.engine.model_runner.model.model.embed_tokens.weight
            assert embed.shape[0] == 1000 // tp
        finally:
            llm.engine.close()
    for a, b in zip(outs[1], outs[2]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert la.top_token_ids == lb.top_token_ids
            assert la.logprob == pytest.approx(lb.logprob, abs=1e-4)
