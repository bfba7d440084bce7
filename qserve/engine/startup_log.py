"""What an engine logs at startup (`LLMEngine.__init__`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from qserve.kernels import ops
from qserve.kernels.attention_ref import is_fp8

if TYPE_CHECKING:
    from qserve.engine.llm_engine import LLMEngine
    from qserve.engine.model_runner import KVCacheSpec

logger = logging.getLogger("qserve")


def log_startup(engine: LLMEngine, path: Any, kv_spec: KVCacheSpec) -> None:
    """The engine's startup lines: model, KV cache, weights and kernel paths, decode mode."""
    gib = kv_spec.num_blocks * kv_spec.bytes_per_block / 2**30
    logger.info(
        "model %s (%s, %s) on %s; KV cache: %d blocks x %d tokens = %d tokens "
        "(%.2f GiB, %s); max_model_len %d",
        path,
        engine.model_config.architecture,
        str(engine.dtype).removeprefix("torch."),
        engine.config.device,
        kv_spec.num_blocks,
        kv_spec.block_size,
        kv_spec.num_tokens,
        gib,
        str(kv_spec.dtype).removeprefix("torch."),
        engine.max_model_len,
    )
    report = engine.load_report
    made_by = report.provenance
    recipe = ""
    if made_by:
        named = f", recipe {made_by['recipe']}" if made_by.get("recipe") else ""
        recipe = f" (made by qserve quantize{named})"
    logger.info("weights: %s%s", report.scheme, recipe)
    for kind, kernel in report.linear_paths.items():
        logger.info("  %-10s %s", kind, kernel)
    if report.merged:
        logger.info("  merged into one matmul each: %s", ", ".join(report.merged))
    if torch.device(engine.config.device).type == "cpu":
        paths = ops.cpu_kernel_paths().items()
        logger.info("CPU kernels: %s", ", ".join(f"{name} {path}" for name, path in paths))
    logger.info("decode steps: %s", _decode_mode(engine))
    if is_fp8(kv_spec.dtype):
        scales = "from the checkpoint" if report.has_kv_scales else "1.0 (not calibrated)"
        logger.info("FP8 KV pages: k_scale/v_scale %s", scales)


def _decode_mode(engine: LLMEngine) -> str:
    graphs = engine.model_runner.decode_graphs
    if graphs is not None:
        sizes = ", ".join(map(str, graphs.sizes))
        kind = "CUDA graph" if graphs.device.type == "cuda" else "step graph"
        return f"compiled (a {kind} per batch size {sizes}, captured on first use)"
    if engine.config.enforce_eager:
        return "eager (--enforce-eager)"
    if engine.workers is not None:
        args = engine.workers.args
        return f"eager ({args.kind}-parallel over {args.world} processes)"
    return "eager"
