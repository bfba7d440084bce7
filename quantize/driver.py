"""The calibration driver: quantize a Hugging Face causal LM one decoder block at a time.

    ids [num_samples, seq_len] --(embeddings, captured at block 0's input)--> X_0
    for each block b:   collect the inputs of its linears with forward hooks (running X_b through
                        the block), quantize them with the chosen method, put the dequantized
                        weights back, and X_{b+1} = block_b(X_b) with the quantized weights.
    export the quantized tensors in the method's checkpoint format.

transformers (fp32) is only the calibration vehicle. The model stays on the CPU; only block b,
its inputs X_b and what is computed from them (Hessians, statistics, the quantized weights) live
on the working device (`device`: cpu, cuda, cuda:N), so a model larger than device memory still
fits. The quantized tensors come back to the CPU after each block.

With an offload folder (`offload_dir`) the model is not loaded whole: its blocks stay on the meta
device and block b's weights are read from the checkpoint's safetensors just before it is
calibrated (`qserve.quantize.offload`). Once quantized, block b's checkpoint tensors (packed
quantized linears, its other tensors in the output dtype, KV scales) go to a file in the offload
folder and the block goes back to meta; export copies those files into the checkpoint one tensor
at a time. The CPU then holds about one block plus the embeddings, lm_head and activations, and the
checkpoint comes out the same, bit for bit.

With an FP8 `kv_cache_dtype`, the keys and values block b's attention writes into its KV cache
(after RoPE) are observed while X_{b+1} is computed, i.e. with the quantized weights the engine
will serve, and become per-tensor k_scale / v_scale (`qserve.quantize.kv_scales`).

Mixture of experts (Mixtral, Qwen3-MoE): each sparse MoE block becomes a `CalibrationMoe`
(`qserve.quantize.moe`) with per-expert linears, so that each expert is calibrated on the tokens
routed to it; the routers stay unquantized (added to the ignored modules); tensors are written
under the checkpoint's names (`ArchSpec.checkpoint_name`: Mixtral's `block_sparse_moe.`).

Methods and their formats:

    rtn    round-to-nearest                          -> GPTQ format (no calibration)
    gptq   GPTQ, true-sequential inside each block   -> GPTQ format
    awq    AWQ scale + clip search, asymmetric       -> AWQ gemm format
    int8   SmoothQuant + int8 per-channel weights    -> compressed-tensors int-quantized (W8A8)
    fp8    E4M3 weights, per-channel or per-tensor   -> compressed-tensors float-quantized (W8A8)
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from qserve.errors import QServeError
from qserve.platform import resolve_device
from qserve.quantize import export, offload
from qserve.quantize import output_dir as output_dir_rules
from qserve.quantize.arch import ArchSpec, arch_spec
from qserve.quantize.auto import run as auto_run
from qserve.quantize.block_context import FEW_TOKENS_FRACTION, BlockContext, Reference
from qserve.quantize.calibration import calibration_ids
from qserve.quantize.capture import capture_block_inputs
from qserve.quantize.export import SEARCH_FILE
from qserve.quantize.fold import ScaleResult
from qserve.quantize.generated import GENERATED
from qserve.quantize.kv_scales import KVObserver
from qserve.quantize.methods import quantize_block, quantize_lm_head
from qserve.quantize.model_check import check_model_tensors, meta_model
from qserve.quantize.moe import prepare_moe
from qserve.quantize.offload import BlockOffload
from qserve.quantize.results import BlockResults, to_device
from qserve.quantize.settings import (
    METHODS,
    QuantizeSettings,
    auto_group_size,
    check_group_size,
    out_dtype,
    with_routers_ignored,
)

__all__ = [
    "METHODS",
    "SEARCH_FILE",
    "QuantizeSettings",
    "check_group_size",
    "default_output_dir",
    "quantize_model",
    "quantize_blocks",
    "resolve_device",
]

logger = logging.getLogger("qserve")

Progress = Callable[[int, int, float], None]  # (blocks done, total blocks, seconds left)


def quantize_model(
    model_path: str | Path,
    output_dir: str | Path | None = None,
    settings: QuantizeSettings | None = None,
    *,
    scales: str | Path | None = None,
    device: str | None = None,
    offload_dir: str | Path | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
    model_name: str | None = None,
    provenance: Mapping[str, Any] | None = None,
) -> Path:
    """Quantize the HF model folder `model_path` into a checkpoint folder `output_dir`, as
    `settings` says (default: `QuantizeSettings()`, GPTQ W4 with GPTAQ). Returns the folder.

    `output_dir` None: `./<model_name>-<scheme>` in the current folder (`default_output_dir`;
    `model_name` defaults to the name of `model_path`'s folder). `provenance`: what made the
    checkpoint (the CLI's recipe and options), written as PROVENANCE_FILE inside the checkpoint
    before it is moved into place; by default the settings used.

    These say where and how the run goes, not what the checkpoint is (a recipe cannot set them):
    `scales` (awq, int8): where the AWQ/SmoothQuant search result is saved, or, if the file
    exists, replayed from without calibration; the result is also saved in the checkpoint as
    SEARCH_FILE. `device`: where each block is calibrated and quantized (cpu, cuda, cuda:N;
    default cuda when available, else cpu). `offload_dir`: keep the decoder blocks on disk
    instead of in memory, reading each from the checkpoint's safetensors when it is calibrated;
    a temporary folder inside `offload_dir` (created if missing) holds the quantized blocks
    until export and is removed at the end, even on error. `overwrite`: replace a non-empty
    `output_dir`.
    """
    from transformers import AutoConfig, AutoTokenizer

    settings = settings if settings is not None else QuantizeSettings()
    if settings.method == "auto":  # measure, allocate, then this function once per attempt
        if output_dir is None:
            output_dir = default_output_dir(model_name or Path(model_path).name, settings)

        def attempt(s: QuantizeSettings, folder: Path) -> Path:
            return quantize_model(model_path, folder, s, device=device, offload_dir=offload_dir,
                                  progress=progress, provenance=provenance)  # fmt: skip

        return auto_run.quantize_auto(
            Path(model_path), Path(output_dir), settings, quantize=attempt, overwrite=overwrite,
            cache_dir=auto_cache_dir(), progress=progress, provenance=provenance,
        )  # fmt: skip
    if offload_dir is not None and settings.calib == GENERATED and settings.needs_calibration():
        raise QServeError(
            "calib: 'generated' samples from the whole model in memory; with --offload-dir "
            "calibrate on a text instead (--calib moby-dick, mixed or a file)", "calib",
        )  # fmt: skip
    working_device = resolve_device(device)
    float_dtype = out_dtype(settings.dtype, settings.method)
    if not Path(model_path, "config.json").is_file():
        raise QServeError(f"{model_path} is not a model folder (no config.json)", param="model")
    if scales is not None and Path(scales).is_dir():
        raise QServeError(f"scales file {scales} is a folder", param="scales")
    config = AutoConfig.from_pretrained(model_path)
    spec = arch_spec(config.model_type)
    settings = with_routers_ignored(settings, spec)
    skeleton = meta_model(config)
    prepare_moe(skeleton, spec)
    if settings.group_size == "auto":
        group_size = auto_group_size(skeleton, spec, settings)
        settings = dataclasses.replace(settings, group_size=group_size)
    check_model_tensors(model_path, skeleton, spec.checkpoint_name)
    check_group_size(skeleton, spec, settings)
    if output_dir is None:
        output_dir = default_output_dir(model_name or Path(model_path).name, settings)
    output_dir_rules.check_output_dir(output_dir, overwrite, model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    searched = settings.searches_scales
    replay = searched and scales is not None and Path(scales).is_file()
    input_ids = None
    if settings.needs_calibration(replay):  # before loading: `generated` runs the model itself
        _check_seq_len(settings, config)
        input_ids = calibration_ids(
            model_path, tokenizer, settings.calib, settings.num_samples, settings.seq_len
        )
    loaded = _calibration_model(model_path, spec, offload_dir, output_dir, settings, float_dtype)
    with loaded as (model, blocks):
        found = ScaleResult.load(scales) if replay else ScaleResult()
        if replay and blocks is None:
            found.apply(model, settings.group_size)
        elif replay:
            blocks.set_replay(found)
        results = quantize_blocks(
            model, spec, settings, input_ids, None if replay else found, progress,
            working_device, blocks,
        )  # fmt: skip
        if searched and scales is not None and not replay:
            found.save(scales)

        with output_dir_rules.staging_dir(output_dir, overwrite, model_path) as tmp:
            export.write_quantized(
                tmp, model, tokenizer, spec, results, settings, float_dtype, blocks
            )
            if searched:  # replayable with --scales; a subfolder, so no loader takes it for weights
                (tmp / SEARCH_FILE).parent.mkdir()
                found.save(tmp / SEARCH_FILE)
            made_by = provenance or {"recipe": None, "effective": dataclasses.asdict(settings)}
            made_by = {**made_by, **_fallback_record(spec, results.fallbacks)}
            export.write_provenance(tmp, made_by)
    return Path(output_dir)


def _check_seq_len(settings: QuantizeSettings, config: Any) -> None:
    """Calibration windows longer than the model's context are refused in one line."""
    context = getattr(config.get_text_config(), "max_position_embeddings", None)
    if context and settings.seq_len > context:
        raise QServeError(
            f"seq_len {settings.seq_len} is longer than the model's context ({context} "
            "tokens): calibration windows must fit in it", "seq_len",
        )  # fmt: skip


def _fallback_record(spec: ArchSpec, fallbacks: dict[str, int]) -> dict[str, Any]:
    """The provenance entry (and a warning) naming the linears that saw too few calibration
    tokens to be calibrated on (experts no or few tokens are routed to); {} when none did."""
    if not fallbacks:
        return {}
    names = {spec.checkpoint_name(n): tokens for n, tokens in fallbacks.items()}
    rule = (
        f"fewer than {FEW_TOKENS_FRACTION:.1%} of the calibration tokens: rounded to nearest "
        "(awq: no scale or clip search; static input scales: the largest of the experts')"
    )
    logger.warning(
        "%d linear(s) saw too few calibration tokens (%s), e.g. %s with %d",
        len(names), rule, *next(iter(names.items())),
    )  # fmt: skip
    return {"few_token_fallback": {"rule": rule, "linears": names}}


def auto_cache_dir() -> Path:
    """Where `--method auto` keeps its measurements (`qserve.quantize.auto.measure`)."""
    from qserve.model.builtin import cache_dir

    return cache_dir() / "autoquant"


def default_output_dir(model_name: str, settings: QuantizeSettings) -> Path:
    """`<cwd>/<model_name>-<scheme>`, e.g. smollm2-135m-gptq-w4g64 (a hub id's last part)."""
    name = Path(model_name.rstrip("/")).name.removesuffix(".gguf")
    return Path.cwd() / f"{name}-{settings.scheme_name}"


@contextlib.contextmanager
def _calibration_model(
    model_path: str | Path,
    spec: ArchSpec,
    offload_dir: str | Path | None,
    output_dir: str | Path,
    settings: QuantizeSettings,
    dtype: torch.dtype,
) -> Iterator[tuple[nn.Module, BlockOffload | None]]:
    """The fp32 model on the CPU: whole, or (with `offload_dir`) without its blocks' weights,
    with the BlockOffload that reads and writes them, in a temporary folder removed after."""
    from transformers import AutoModelForCausalLM

    if offload_dir is None:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        prepare_moe(model, spec)
        yield model, None
        return
    checkpoint = offload.SafetensorsCheckpoint(model_path)  # refuses .bin-only before any work
    with offload.offload_folder(offload_dir, output_dir) as folder:
        model = offload.empty_model(model_path, checkpoint, spec.blocks)
        prepare_moe(model, spec)
        blocks = BlockOffload(model, spec.blocks, checkpoint, folder, settings, dtype)
        blocks.rename = spec.checkpoint_name  # read and written under the checkpoint's names
        yield model, blocks


@torch.no_grad()
def quantize_blocks(
    model: nn.Module,
    spec: ArchSpec,
    settings: QuantizeSettings,
    input_ids: Tensor | None,
    scales: ScaleResult | None = None,
    progress: Progress | None = None,
    device: torch.device | str = "cpu",
    offloaded: BlockOffload | None = None,
) -> BlockResults:
    """Quantize every block of `model` (on the CPU) in place, one at a time on `device`: weights
    become their dequantized values; the quantized tensors (and, with an FP8 kv_cache_dtype, the
    K/V absmax of each attention) are returned on the CPU, by full module name.

    `input_ids` [S, T] is None for methods that need no calibration. `scales` collects the
    AWQ / SmoothQuant search results; None skips the search (scales already applied, or none).
    `offloaded`: the blocks are on meta; each is read before and written to the offload folder
    after it is quantized (the results then stay there: the returned ones are empty).
    """
    device = torch.device(device)
    prepare_moe(model, spec)  # a no-op after quantize_model (and for dense models)
    settings = with_routers_ignored(settings, spec)
    blocks: nn.ModuleList = model.get_submodule(spec.blocks)
    X, block_kwargs = (
        capture_block_inputs(model, blocks, input_ids)
        if input_ids is not None
        else ([], [{} for _ in blocks])
    )
    X_fp = list(X) if settings.gptaq else None  # GPTAQ: the full-precision model's stream
    results = BlockResults()
    start = time.monotonic()
    for b, block in enumerate(blocks):
        prefix = f"{spec.blocks}.{b}."
        if offloaded is not None:
            offloaded.load(block, prefix)
        with _working_device(block, device):
            X, kwargs = to_device(X, device), to_device(block_kwargs[b], device)
            block_spec = spec.for_block(block)
            reference = None
            if X_fp is not None:
                reference = Reference.run(block, block_spec, to_device(X_fp, device), kwargs)
                X_fp = reference.outputs
            ctx = BlockContext(block, prefix, block_spec, settings, X, kwargs, reference)
            done = BlockResults(to_device(quantize_block(ctx, scales), "cpu"))
            done.fallbacks = {prefix + n: tokens for n, tokens in ctx.fallbacks.items()}
            X, kv_absmax = _block_outputs(ctx, last=b == len(blocks) - 1)
            del ctx, reference
            if kv_absmax is not None:
                done.kv_absmax[prefix + spec.attention] = to_device(kv_absmax, "cpu")
        if offloaded is None:
            results.update(done)
        else:
            offloaded.save(block, prefix, done)
            results.fallbacks.update(done.fallbacks)
        if progress is not None:
            elapsed = time.monotonic() - start
            progress(b + 1, len(blocks), elapsed / (b + 1) * (len(blocks) - b - 1))
    if settings.quantize_lm_head:
        X, X_fp = to_device(X, "cpu"), to_device(X_fp, "cpu")
        results.linears["lm_head"] = quantize_lm_head(model, settings, X, X_fp)
    return results


@contextlib.contextmanager
def _working_device(block: nn.Module, device: torch.device) -> Iterator[None]:
    """`block` on `device` inside, back on the CPU after. The tensors the algorithms create
    (torch.zeros, torch.eye: Hessians, codes, scales) default to `device` inside, too."""
    if device.type == "cpu":
        yield
        return
    block.to(device)
    try:
        with device:
            yield
    finally:
        block.to("cpu")


def _block_outputs(
    ctx: BlockContext, last: bool
) -> tuple[list[Tensor], tuple[Tensor, Tensor] | None]:
    """X_{b+1} = block_b(X_b) with the quantized weights (not needed after the last block unless
    KV scales are calibrated) and, for KV scales, (max |K|, max |V|) of what attention wrote."""
    if not ctx.s.calibrates_kv_scales:
        needed = not last or ctx.s.lm_head_needs_inputs  # GPTQ of lm_head: the last block's too
        if not needed:
            return [], None
        with ctx.attention_replay():
            return [ctx.block(x, **ctx.kwargs) for x in ctx.X], None
    observer = KVObserver()
    kwargs = {**ctx.kwargs, _cache_argument(ctx.block): observer}
    X = [ctx.block(x, **kwargs) for x in ctx.X]
    if observer.absmax is None:
        raise QServeError(
            f"{ctx.prefix}{ctx.spec.attention} wrote no keys/values into the KV cache it was "
            "given: cannot calibrate KV cache scales for this model"
        )
    return X, observer.absmax


def _cache_argument(block: nn.Module) -> str:
    """The name under which a transformers decoder block takes its KV cache."""
    parameters = inspect.signature(block.forward).parameters
    for name in ("cache", "past_key_values", "past_key_value"):
        if name in parameters:
            return name
    raise QServeError(f"{type(block).__name__} takes no KV cache: cannot calibrate KV scales")
