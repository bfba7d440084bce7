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

Methods and their formats:

    rtn    round-to-nearest                          -> GPTQ format (no calibration)
    gptq   GPTQ, true-sequential inside each block   -> GPTQ format
    awq    AWQ scale + clip search, asymmetric       -> AWQ gemm format
    int8   SmoothQuant + int8 per-channel weights    -> compressed-tensors int-quantized (W8A8)
    fp8    E4M3 weights, per-channel or per-tensor   -> compressed-tensors float-quantized (W8A8)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from qserve.errors import QServeError
from qserve.platform import resolve_device
from qserve.quantize import export, offload
from qserve.quantize import output_dir as output_dir_rules
from qserve.quantize.arch import ArchSpec, ScaleMapping, arch_spec
from qserve.quantize.awq import rescale_stats, search_clip, search_scale
from qserve.quantize.calibration import calibration_windows, load_calibration_text
from qserve.quantize.fold import ScaleResult, apply_scales, clip_weight
from qserve.quantize.fp8 import dequantize_fp8, fp8_input_scale, quantize_fp8
from qserve.quantize.gptq import (
    accumulate_dxxt,
    accumulate_hessian,
    gptq_quantize,
    gptq_w8_quantize,
)
from qserve.quantize.kv_scales import KVObserver, check_kv_cache_dtype, kv_scale
from qserve.quantize.model_check import check_model_tensors, meta_model
from qserve.quantize.rtn import QuantizedWeight, rtn_quantize
from qserve.quantize.smoothquant import (
    activation_absmax,
    dequantize_int8,
    int8_input_scale,
    quantize_int8,
    smooth_scales,
)

__all__ = [
    "METHODS",
    "SEARCH_FILE",
    "check_group_size",
    "auto_group_size",
    "QuantizeSettings",
    "W8Weight",
    "BlockResults",
    "BlockOffload",
    "quantize_model",
    "quantize_blocks",
    "resolve_device",
]

METHODS = ("rtn", "gptq", "awq", "int8", "fp8")
SEARCH_FILE = "qserve/search_scales.safetensors"  # AWQ / SmoothQuant search, in the checkpoint
Progress = Callable[[int, int, float], None]  # (blocks done, total blocks, seconds left)


GROUP_SIZES = (128, 64, 32)  # what the formats and kernels take; "auto" picks the largest fitting


@dataclasses.dataclass(frozen=True)
class QuantizeSettings:
    """What to quantize and how; checked once in __post_init__."""

    method: str = "gptq"
    bits: int = 4
    group_size: int | str = 128  # "auto": resolved per model by `auto_group_size`
    sym: bool = True
    desc_act: bool = False
    damp: float = 0.01
    static_groups: bool = False
    mse: bool = False  # gptq: MSE grid search of each group's range
    act_group_aware: bool = True  # gptq without desc_act: group-aware order (GPTQModel's default)
    gptaq: bool | None = None  # gptq: GPTAQ's asymmetric target; None: on for gptq
    gptaq_alpha: float = 0.25
    quantize_lm_head: bool = False  # rtn / gptq: lm_head too, by the same method ("lm_head": true)
    ignore: tuple[str, ...] = ("lm_head",)
    smooth_alpha: float = 0.5  # SmoothQuant; <= 0 turns smoothing off
    weight_strategy: str = "channel"  # int8 / fp8: channel | tensor
    activation_scheme: str = "dynamic"  # int8 / fp8: dynamic | static
    gptq_weights: bool | None = None  # int8 / fp8: GPTQ rounding (same format); None: on
    kv_cache_dtype: str = "auto"  # fp8_e4m3 | fp8_e5m2: also calibrate k_scale / v_scale

    def __post_init__(self) -> None:
        m = self.method
        if m not in METHODS:
            raise QServeError(f"unknown method {m!r} (choose from {', '.join(METHODS)})", "method")
        if m in ("rtn", "gptq") and self.bits not in (4, 8):
            raise QServeError(f"{m} supports bits 4 or 8, got {self.bits}", "bits")
        if m == "awq" and (self.bits != 4 or self.group_size == -1):
            raise QServeError("awq supports bits 4 with a group_size (32, 64, 128)", "bits")
        if m in ("rtn", "gptq", "awq") and self.group_size not in (-1, *GROUP_SIZES, "auto"):
            raise QServeError(
                f"group_size must be -1, 32, 64, 128 or auto, got {self.group_size}", "group_size"
            )
        if self.weight_strategy not in ("channel", "tensor"):
            raise QServeError("weight_strategy must be 'channel' or 'tensor'", "weight_strategy")
        if self.activation_scheme not in ("dynamic", "static"):
            raise QServeError("activation_scheme must be 'dynamic' or 'static'")
        if self.quantize_lm_head and m not in ("rtn", "gptq"):
            raise QServeError(
                f"quantize_lm_head is supported for rtn and gptq (the GPTQ format), not {m}",
                "quantize_lm_head",
            )
        if self.gptaq and m != "gptq":
            raise QServeError(f"gptaq is a variant of gptq, not of {m}", "gptaq")
        if self.gptq_weights and m not in ("int8", "fp8"):
            raise QServeError(f"gptq_weights rounds int8 / fp8 weights, not {m}'s", "gptq_weights")
        # Unset options take the method's default: GPTAQ for gptq, GPTQ rounding for int8 / fp8.
        if self.gptaq is None:
            object.__setattr__(self, "gptaq", m == "gptq")
        if self.gptq_weights is None:
            object.__setattr__(self, "gptq_weights", m in ("int8", "fp8"))
        if not 0 <= self.damp < 1:
            raise QServeError(f"damp must be in [0, 1), got {self.damp}", "damp")
        check_kv_cache_dtype(self.kv_cache_dtype)

    @property
    def lm_head_needs_inputs(self) -> bool:
        """GPTQ of lm_head needs the final hidden states (RTN does not)."""
        return self.quantize_lm_head and self.method == "gptq"

    @property
    def calibrates_kv_scales(self) -> bool:
        return check_kv_cache_dtype(self.kv_cache_dtype) is not None

    @property
    def searches_scales(self) -> bool:
        """AWQ and SmoothQuant produce a ScaleResult that can be saved and replayed."""
        return self.method == "awq" or (self.method == "int8" and self.smooth_alpha > 0)

    def needs_calibration(self, replay: bool = False) -> bool:
        """Whether calibration inputs are needed (not for a replayed AWQ/SmoothQuant search, nor
        for RTN and dynamic int8/fp8, unless KV cache scales are asked for)."""
        if self.calibrates_kv_scales:
            return True
        if self.method in ("int8", "fp8") and (
            self.activation_scheme == "static" or self.gptq_weights
        ):
            return True
        return self.method == "gptq" or (self.searches_scales and not replay)

    @property
    def scheme_name(self) -> str:
        """What a default output folder is named after: `gptq-w4g64`, `rtn-w8ch` (per
        channel), `int8-w8a8`, `fp8`. The group size must be resolved (not "auto")."""
        if self.method == "int8":
            return "int8-w8a8"
        if self.method == "fp8":
            return "fp8"
        groups = "ch" if self.group_size == -1 else f"g{self.group_size}"
        return f"{self.method}-w{self.bits}{groups}"

    @property
    def min_zero(self) -> int:
        # GPTQ v1 stores zero - 1: asymmetric zeros of 0 are not representable.
        return 1 if self.method in ("rtn", "gptq") else 0


@dataclasses.dataclass(frozen=True)
class W8Weight:
    """int8 or fp8 weight Q [N, K] with weight_scale [N, 1] | [1] and optional input_scale [1]."""

    Q: Tensor
    weight_scale: Tensor
    input_scale: Tensor | None = None


@dataclasses.dataclass
class BlockResults:
    """What `quantize_blocks` returns, on the CPU."""

    linears: dict[str, QuantizedWeight | W8Weight] = dataclasses.field(default_factory=dict)
    # attention module (model.layers.N.self_attn) -> (max |K|, max |V|), fp32 scalars
    kv_absmax: dict[str, tuple[Tensor, Tensor]] = dataclasses.field(default_factory=dict)

    def update(self, other: BlockResults) -> None:
        self.linears.update(other.linears)
        self.kv_absmax.update(other.kv_absmax)


# --------------------------------------------------------------------------------- public API


def quantize_model(
    model_path: str | Path,
    output_dir: str | Path | None = None,
    method: str = "gptq",
    bits: int = 4,
    group_size: int | str = "auto",
    sym: bool = True,
    desc_act: bool = False,
    damp: float = 0.01,
    static_groups: bool = False,
    mse: bool = False,
    act_group_aware: bool = True,
    gptaq: bool | None = None,
    gptaq_alpha: float = 0.25,
    quantize_lm_head: bool = False,
    calib: str | Path | None = None,
    num_samples: int = 128,
    seq_len: int = 512,
    ignore: Iterable[str] = ("lm_head",),
    smooth_alpha: float = 0.5,
    weight_strategy: str = "channel",
    activation_scheme: str = "dynamic",
    gptq_weights: bool | None = None,
    dtype: str | None = None,
    scales_path: str | Path | None = None,
    kv_cache_dtype: str | None = "auto",
    device: str | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
    offload_dir: str | Path | None = None,
    model_name: str | None = None,
    provenance: Mapping[str, Any] | None = None,
) -> Path:
    """Quantize the HF model folder `model_path` into a checkpoint folder `output_dir`.

    `output_dir` None: `./<model_name>-<scheme>` in the current folder (`default_output_dir`;
    `model_name` defaults to the name of `model_path`'s folder). `provenance`: what made the
    checkpoint (the CLI's recipe and options), written as PROVENANCE_FILE inside the checkpoint
    before it is moved into place; by default the settings used.

    `group_size` "auto": the largest of 128, 64, 32 that divides every quantized linear's input
    size (128 for most models, 64 for SmolLM2's hidden size 576).
    `calib`: a .txt / .jsonl file, or None for the bundled Moby-Dick chapters. `ignore`: module
    names (exact, a dotted suffix, or "re:<regex>") left unquantized. `dtype`: of the tensors left
    in floating point (default float16 for GPTQ/AWQ formats, bfloat16 for int8/fp8). AWQ is
    always asymmetric (`sym` is ignored). `scales_path` (awq, int8): where the AWQ/SmoothQuant
    search result is saved, or, if the file exists, replayed from without calibration; the
    result is also saved in the checkpoint as SEARCH_FILE.
    `mse` (gptq): search each group's range (GPTQ's MSE grid) instead of taking min / max.
    `act_group_aware` (gptq without desc_act): visit whole groups in Group Aware Reordering
    order (GPTQModel's default); the checkpoint keeps consecutive groups (no g_idx permutation).
    `gptaq` (gptq; on unless False): GPTAQ's asymmetric calibration: each linear is fitted to
    the full-precision model's output on the full-precision inputs, from the inputs the quantized
    model gives it, with weight `gptaq_alpha` on the correction (0.25, as GPTQModel). False is
    plain GPTQ (GPTQModel's default); the checkpoint format is the same.
    `quantize_lm_head` (rtn, gptq): lm_head is quantized too, by the same method, bits and groups
    (GPTQ on the final-norm hidden states; untied from the embeddings, which stay in floating
    point); the config says "lm_head": true, as GPTQModel writes it and vLLM reads it.
    `gptq_weights` (int8, fp8; on unless False): round the weights with GPTQ's error feedback
    (as llm-compressor's SmoothQuant + GPTQ W8A8 recipe) instead of to nearest; same scales and
    format. It needs calibration data; False makes dynamic fp8 data-free.
    `kv_cache_dtype` fp8_e4m3 | fp8_e5m2: also write calibrated k_scale / v_scale per attention
    layer (every method then needs calibration data); "auto" or None: no KV scales.
    `device`: where each block is calibrated and quantized (cpu, cuda, cuda:N; default cuda when
    available, else cpu). `offload_dir`: keep the decoder blocks on disk instead of in memory,
    reading each from the checkpoint's safetensors when it is calibrated; a temporary folder
    inside `offload_dir` (created if missing) holds the quantized blocks until export and is
    removed at the end, even on error. Returns the output folder.
    """
    from transformers import AutoConfig, AutoTokenizer

    settings = QuantizeSettings(
        method=method,
        bits=bits,
        group_size=group_size,
        sym=sym if method != "awq" else False,
        desc_act=desc_act,
        damp=damp,
        static_groups=static_groups,
        mse=mse,
        act_group_aware=act_group_aware,
        gptaq=gptaq,
        gptaq_alpha=gptaq_alpha,
        quantize_lm_head=quantize_lm_head,
        ignore=tuple(ignore),
        smooth_alpha=smooth_alpha,
        weight_strategy=weight_strategy,
        activation_scheme=activation_scheme,
        gptq_weights=gptq_weights,
        kv_cache_dtype=kv_cache_dtype or "auto",
    )
    working_device = resolve_device(device)
    out_dtype = _out_dtype(dtype, method)
    if not Path(model_path, "config.json").is_file():
        raise QServeError(f"{model_path} is not a model folder (no config.json)", param="model")
    if scales_path is not None and Path(scales_path).is_dir():
        raise QServeError(f"scales file {scales_path} is a folder", param="scales_path")
    config = AutoConfig.from_pretrained(model_path)
    spec = arch_spec(config.model_type)
    skeleton = meta_model(config)
    if settings.group_size == "auto":
        group_size = auto_group_size(skeleton, spec, settings)
        settings = dataclasses.replace(settings, group_size=group_size)
    check_model_tensors(model_path, skeleton)
    if output_dir is None:
        output_dir = default_output_dir(model_name or Path(model_path).name, settings)
    output_dir_rules.check_output_dir(output_dir, overwrite, model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    loaded = _calibration_model(model_path, spec, offload_dir, output_dir, settings, out_dtype)
    with loaded as (model, blocks):
        check_group_size(model, spec, settings)

        searched = settings.searches_scales
        replay = searched and scales_path is not None and Path(scales_path).is_file()
        scales = ScaleResult.load(scales_path) if replay else ScaleResult()
        if replay and blocks is None:
            scales.apply(model, settings.group_size)
        elif replay:
            blocks.set_replay(scales)
        input_ids = None
        if settings.needs_calibration(replay):
            text = load_calibration_text(calib)
            input_ids = calibration_windows(tokenizer, text, num_samples, seq_len)
        results = quantize_blocks(
            model, spec, settings, input_ids, None if replay else scales, progress,
            working_device, blocks,
        )  # fmt: skip
        if searched and scales_path is not None and not replay:
            scales.save(scales_path)

        with output_dir_rules.staging_dir(output_dir, overwrite, model_path) as tmp:
            _write(tmp, model, tokenizer, spec, results, settings, out_dtype, blocks)
            if searched:  # replayable with --scales; a subfolder, so no loader takes it for weights
                (tmp / SEARCH_FILE).parent.mkdir()
                scales.save(tmp / SEARCH_FILE)
            made_by = provenance or {"recipe": None, "effective": dataclasses.asdict(settings)}
            export.write_provenance(tmp, dict(made_by))
    return Path(output_dir)


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
        yield AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval(), None
        return
    checkpoint = offload.SafetensorsCheckpoint(model_path)  # refuses .bin-only before any work
    with offload.offload_folder(offload_dir, output_dir) as folder:
        model = offload.empty_model(model_path, checkpoint, spec.blocks)
        yield model, BlockOffload(model, spec.blocks, checkpoint, folder, settings, dtype)


def check_group_size(model: nn.Module, spec: ArchSpec, settings: QuantizeSettings) -> None:
    """One-line error, before any calibration, when the group size does not divide the input
    size of a linear that would be quantized (the formats have no partial groups)."""
    gs = settings.group_size
    if settings.method not in ("rtn", "gptq", "awq") or gs == -1:
        return
    for b, block in enumerate(model.get_submodule(spec.blocks)):
        for name in spec.linears:
            full = f"{spec.blocks}.{b}.{name}"
            K = block.get_submodule(name).in_features
            if K % gs and not _is_ignored(full, settings.ignore):
                raise _group_size_error(gs, full, K)
    K = model.get_output_embeddings().in_features
    if settings.quantize_lm_head and K % gs:
        raise _group_size_error(gs, "lm_head", K)


def auto_group_size(model: nn.Module, spec: ArchSpec, settings: QuantizeSettings) -> int:
    """The largest of GROUP_SIZES that divides the input size of every linear `settings` would
    quantize in `model` (its `meta_model`: no weights are read)."""
    if settings.method not in ("rtn", "gptq", "awq"):
        return GROUP_SIZES[0]  # int8 / fp8 are per channel or per tensor: not read
    for gs in GROUP_SIZES:
        try:
            check_group_size(model, spec, dataclasses.replace(settings, group_size=gs))
        except QServeError:
            continue
        return gs
    raise QServeError(
        "no group size of 128, 64 or 32 divides every quantized linear's input size; "
        "use --group-size -1 (per channel)",
        param="group_size",
    )


def _group_size_error(group_size: int, name: str, K: int) -> QServeError:
    return QServeError(
        f"group_size {group_size} does not divide {name}'s {K} input features "
        "(choose a group size that does, or -1 for per-channel)",
        param="group_size",
    )


def _write(
    folder: Path,
    model: nn.Module,
    tokenizer: Any,
    spec: ArchSpec,
    results: BlockResults,
    settings: QuantizeSettings,
    dtype: torch.dtype,
    blocks: BlockOffload | None = None,
) -> None:
    """The checkpoint folder: weights, config with quantization_config, tokenizer files.
    Offloaded (`blocks`), the blocks' tensors are copied from their files in the offload folder."""
    if blocks is None:
        tensors, qconfig, extra = _export_tensors(model, spec, results, settings, dtype)
    else:
        tensors, qconfig, extra = _export_outside_blocks(
            model, spec, blocks, results, settings, dtype
        )
    config = model.config.to_dict()
    config["quantization_config"] = qconfig
    config["dtype"] = str(dtype).removeprefix("torch.")
    export.write_checkpoint(folder, tensors, config, extra, blocks.files if blocks else ())
    tokenizer.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)


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
    blocks: nn.ModuleList = model.get_submodule(spec.blocks)
    X, kwargs = (
        _capture_block_inputs(model, blocks[0], input_ids) if input_ids is not None else ([], {})
    )
    X_fp = list(X) if settings.gptaq else None  # GPTAQ: the full-precision model's stream
    results = BlockResults()
    start = time.monotonic()
    for b, block in enumerate(blocks):
        prefix = f"{spec.blocks}.{b}."
        if offloaded is not None:
            offloaded.load(block, prefix)
        with _working_device(block, device):
            X, kwargs = _to_device(X, device), _to_device(kwargs, device)
            reference = None
            if X_fp is not None:
                reference = _Reference.run(block, spec, _to_device(X_fp, device), kwargs)
                X_fp = reference.outputs
            ctx = _BlockContext(block, prefix, spec, settings, X, kwargs, reference)
            done = BlockResults(_to_device(_quantize_block(ctx, scales), "cpu"))
            X, kv_absmax = _block_outputs(ctx, last=b == len(blocks) - 1)
            del ctx, reference
            if kv_absmax is not None:
                done.kv_absmax[prefix + spec.attention] = _to_device(kv_absmax, "cpu")
        if offloaded is None:
            results.update(done)
        else:
            offloaded.save(block, prefix, done)
        if progress is not None:
            elapsed = time.monotonic() - start
            progress(b + 1, len(blocks), elapsed / (b + 1) * (len(blocks) - b - 1))
    if settings.quantize_lm_head:
        X, X_fp = _to_device(X, "cpu"), _to_device(X_fp, "cpu")
        results.linears["lm_head"] = _quantize_lm_head(model, settings, X, X_fp)
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


def _to_device(obj: Any, device: torch.device | str) -> Any:
    """`obj` with every tensor in it (lists, tuples, dicts, result dataclasses) on `device`."""
    if isinstance(obj, Tensor):
        return obj.to(device)
    if type(obj) in (list, tuple):
        return type(obj)(_to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (QuantizedWeight, W8Weight)):
        fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        return dataclasses.replace(obj, **_to_device(fields, device))
    return obj


def _quantize_block(
    ctx: _BlockContext, scales: ScaleResult | None
) -> dict[str, QuantizedWeight | W8Weight]:
    """The AWQ / SmoothQuant search (when `scales` collects it), then the method's quantizer."""
    s = ctx.s
    if scales is not None and s.method == "awq":
        _awq_search(ctx, scales)
    elif scales is not None and s.method == "int8" and s.smooth_alpha > 0:
        _smooth_search(ctx, scales)
    return {ctx.prefix + n: r for n, r in _BLOCK_QUANTIZERS[s.method](ctx).items()}


def _block_outputs(
    ctx: _BlockContext, last: bool
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


# ------------------------------------------------------------------------------ offloaded blocks


@dataclasses.dataclass
class BlockOffload:
    """The decoder blocks of `model` (under `blocks`) kept on disk: each is read from
    `checkpoint` before it is quantized, then written to `folder` and put back on meta.

    A finished block leaves one file in `folder` holding exactly its tensors of the output
    checkpoint (`_checkpoint_tensors` of the block); `quantized` names its quantized linears.
    `replay`: a saved AWQ / SmoothQuant search, folded into each block as it is read.
    """

    model: nn.Module
    blocks: str
    checkpoint: offload.SafetensorsCheckpoint
    folder: Path
    settings: QuantizeSettings
    dtype: torch.dtype
    replay: ScaleResult | None = None
    files: list[Path] = dataclasses.field(default_factory=list)
    quantized: set[str] = dataclasses.field(default_factory=set)

    def set_replay(self, scales: ScaleResult) -> None:
        """Check `scales` against the model now; fold what lies outside the blocks now, the
        rest block by block (folds of different blocks touch different tensors)."""
        modules = dict(self.model.named_modules())
        missing = [n for n in [*scales.scales, *scales.clips] if n not in modules]
        if missing:
            raise QServeError(f"scales do not match the model: it has no module {missing[0]}")
        outside = _select(scales, lambda name: not name.startswith(self.blocks + "."))
        outside.apply(self.model, self.settings.group_size)
        self.replay = scales

    def load(self, block: nn.Module, prefix: str) -> None:
        """Read the block's tensors (fp32) from the checkpoint, and fold the replayed search."""
        tensors = self.checkpoint.read(prefix + n for n in block.state_dict())
        offload.materialize(block, {n.removeprefix(prefix): t for n, t in tensors.items()})
        if self.replay is not None:
            mine = _select(self.replay, lambda name: name.startswith(prefix))
            mine.apply(self.model, self.settings.group_size)

    def save(self, block: nn.Module, prefix: str, done: BlockResults) -> None:
        """Write the block's checkpoint tensors to the offload folder and free the block."""
        state = {k: v.detach() for k, v in block.state_dict(prefix=prefix).items()}
        tensors = _checkpoint_tensors(state, done, self.settings, self.dtype)
        path = self.folder / f"{prefix.rstrip('.')}.safetensors"
        try:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
        except OSError as e:
            raise QServeError(f"cannot write {path}: {e.strerror or e}", "offload_dir") from None
        self.files.append(path)
        self.quantized.update(done.linears)
        offload.release(block)


def _select(scales: ScaleResult, keep: Callable[[str], bool]) -> ScaleResult:
    """The entries of `scales` whose module name `keep` accepts, in their order."""
    return ScaleResult(
        scales={k: v for k, v in scales.scales.items() if keep(k)},
        linears={k: v for k, v in scales.linears.items() if keep(k)},
        clips={k: v for k, v in scales.clips.items() if keep(k)},
    )


# ------------------------------------------------------------------------- one block per method


REPLAY_CACHE_BYTES = 1 << 30  # a block keeps its attention's final outputs up to this


@dataclasses.dataclass
class _BlockContext:
    """One decoder block with its calibration inputs X (one [1, T, hidden] per sample)."""

    block: nn.Module
    prefix: str
    spec: ArchSpec
    s: QuantizeSettings
    X: list[Tensor]
    kwargs: dict[str, Any]
    reference: _Reference | None = None  # GPTAQ: the full-precision model's side
    finished: set[str] = dataclasses.field(default_factory=set)  # linears quantized so far
    attention_outputs: list[Any] | None = None  # per sample, once every attention linear is

    @property
    def names(self) -> list[str]:
        """The block's linears to quantize (not ignored)."""
        return [n for n in self.spec.linears if not _is_ignored(self.prefix + n, self.s.ignore)]

    def finish(self, names: Iterable[str]) -> None:
        """Mark the named linears quantized (their weights are final)."""
        self.finished.update(names)

    def _in_attention(self, name: str) -> bool:
        return name.startswith(self.spec.attention + ".")

    @contextlib.contextmanager
    def attention_replay(self, reads_attention: bool = False) -> Iterator[None]:
        """Passes of X through the block inside reuse the attention's outputs once they are
        final (every linear in it quantized): the first such pass records them, later ones
        return them instead of recomputing projections and attention. `reads_attention`: the
        pass needs the attention itself to run (hooks inside it), so nothing is replayed."""
        attention_linears = [n for n in self.names if self._in_attention(n)]
        final = all(n in self.finished for n in attention_linears)
        fits = sum(x.numel() for x in self.X) * 4 <= REPLAY_CACHE_BYTES
        if reads_attention or not final or not fits:
            yield
            return
        attention = self.block.get_submodule(self.spec.attention)
        if self.attention_outputs is None:
            outputs: list[Any] = []
            handle = attention.register_forward_hook(lambda m, a, out: outputs.append(out))
            try:
                yield
            finally:
                handle.remove()
            self.attention_outputs = outputs if len(outputs) == len(self.X) else None
            return
        replayed = iter(self.attention_outputs)
        own = attention.__dict__.get("forward")  # a forward already patched onto the instance
        attention.forward = lambda *args, **kw: next(replayed)  # instance attribute: shadows
        try:
            yield
        finally:
            if own is None:
                del attention.forward
            else:
                attention.forward = own
        if next(replayed, None) is not None:
            raise RuntimeError(f"{self.prefix}{self.spec.attention}: a pass skipped a sample")

    def linear(self, name: str) -> nn.Linear:
        return self.block.get_submodule(name)

    def _owners(self, names: Iterable[str]) -> dict[str, str]:
        """Each linear -> the first of its sequential group (the group's linears share inputs)."""
        return {n: next(g for g in self.spec.sequential if n in g)[0] for n in names}

    def collect(self, names: Iterable[str], step: Callable[[Any, Tensor], Any]) -> dict[str, Any]:
        """Accumulate the inputs of the named linears over X with `step`. Linears of one
        sequential group read the same input: it is accumulated once, for the first of them."""
        owner = self._owners(names)
        if not owner:
            return {}
        modules = {o: self.linear(o) for o in set(owner.values())}
        with self.attention_replay(any(self._in_attention(o) for o in modules)):
            acc = _collect(self.block, modules, self.X, self.kwargs, step)
        return {n: acc[o] for n, o in owner.items()}

    def collect_paired(
        self, names: Iterable[str], step: Callable[[Any, Tensor, Tensor], Any]
    ) -> dict[str, Any]:
        """As `collect`, with each input paired with the full-precision model's input to the
        same linear at the same tokens (`reference` must be set)."""
        assert self.reference is not None
        owner = self._owners(names)
        if not owner:
            return {}
        owners = set(owner.values())
        modules = {o: self.linear(o) for o in owners}
        acc: dict[str, Any] = dict.fromkeys(owners)
        with self.attention_replay(any(self._in_attention(o) for o in owners)):
            for i, x in enumerate(self.X):
                native = self.reference.inputs(i, owners)

                def paired(name: str, a: Any, v: Tensor, native: dict[str, Tensor] = native) -> Any:
                    return step(a, v, native[name])

                acc = _collect(self.block, modules, [x], self.kwargs, None, acc, paired)
        return {n: acc[o] for n, o in owner.items()}


REFERENCE_CACHE_BYTES = 1 << 30  # GPTAQ keeps the float inputs of a block's linears up to this


@dataclasses.dataclass
class _Reference:
    """GPTAQ's full-precision side of one block: a copy of the block before quantization, its
    inputs X from the float model, its outputs (the next block's X), and the inputs of the
    block's linears (one dict per sample; kept when they fit REFERENCE_CACHE_BYTES, else
    recomputed per sequential group)."""

    block: nn.Module
    X: list[Tensor]
    kwargs: dict[str, Any]
    outputs: list[Tensor]
    cached: list[dict[str, Tensor]] | None

    @classmethod
    def run(
        cls, block: nn.Module, spec: ArchSpec, X: list[Tensor], kwargs: dict[str, Any]
    ) -> _Reference:
        """One float pass over X that gives the outputs and, within budget, the inputs."""
        fp_block = copy.deepcopy(block)
        owners = {g[0]: fp_block.get_submodule(g[0]) for g in spec.sequential}
        width = sum(m.weight.shape[1] for m in owners.values())
        keep = sum(x.numel() // x.shape[-1] for x in X) * width * 4 <= REFERENCE_CACHE_BYTES
        cached: list[dict[str, Tensor]] = []
        seen: dict[str, Tensor] = {}

        def hook(name: str) -> Callable[..., None]:
            def fn(module: nn.Module, args: tuple[Tensor, ...]) -> None:
                seen[name] = args[0].detach()

            return fn

        handles = [m.register_forward_pre_hook(hook(n)) for n, m in owners.items()] if keep else []
        outputs = []
        try:
            for x in X:
                outputs.append(fp_block(x, **kwargs))
                if keep:
                    cached.append(dict(seen))
        finally:
            for h in handles:
                h.remove()
        return cls(fp_block, X, kwargs, outputs, cached if keep else None)

    def inputs(self, i: int, owners: Iterable[str]) -> dict[str, Tensor]:
        """The float inputs of the named linears for sample i."""
        if self.cached is not None:
            return self.cached[i]
        modules = {o: self.block.get_submodule(o) for o in owners}
        return _collect(self.block, modules, [self.X[i]], self.kwargs, lambda _, v: v)


def _gptq_block(ctx: _BlockContext) -> dict[str, QuantizedWeight]:
    """GPTQ, true-sequential: each group's Hessian is taken after earlier groups are quantized."""
    s, out = ctx.s, {}
    for group in ctx.spec.sequential:
        group = [n for n in group if n in ctx.names]
        if ctx.reference is not None:
            stats = ctx.collect_paired(group, _gptaq_step)
        else:
            stats = {n: (h, None) for n, h in ctx.collect(group, _hessian_step).items()}
        for n, ((H, _), dxxt) in stats.items():
            W = ctx.linear(n).weight.data
            qw = gptq_quantize(
                W, H, s.bits, s.group_size, s.sym, s.damp,
                desc_act=s.desc_act, static_groups=s.static_groups, min_zero=s.min_zero,
                mse=s.mse, act_group_aware=s.act_group_aware,
                dXXT=dxxt[0] if dxxt is not None else None, gptaq_alpha=s.gptaq_alpha,
            )  # fmt: skip
            out[n] = _set_weight(ctx.linear(n), qw)
        ctx.finish(group)
    return out


def _rtn_block(ctx: _BlockContext) -> dict[str, QuantizedWeight]:
    """RTN on the (AWQ-scaled and clipped, for awq) weights."""
    s, out = ctx.s, {}
    for n in ctx.names:
        qw = rtn_quantize(ctx.linear(n).weight.data, s.bits, s.group_size, s.sym, s.min_zero)
        out[n] = _set_weight(ctx.linear(n), qw)
    ctx.finish(out)
    return out


def _w8_block(ctx: _BlockContext) -> dict[str, W8Weight]:
    """int8 / fp8 weights (rounded to nearest, or with GPTQ true-sequentially); static
    activation scales from the inputs of the quantized block."""
    s = ctx.s
    int8 = s.method == "int8"
    quant, dequant = (quantize_int8, dequantize_int8) if int8 else (quantize_fp8, dequantize_fp8)
    out = {}
    for group in ctx.spec.sequential:
        group = [n for n in group if n in ctx.names]
        if s.gptq_weights:
            hessians = ctx.collect(group, _hessian_step).items()
            W = {n: ctx.linear(n).weight.data for n in group}
            results = {
                n: gptq_w8_quantize(W[n], H, s.method, s.weight_strategy, s.damp)
                for n, (H, _) in hessians
            }
        else:
            results = {n: quant(ctx.linear(n).weight.data, s.weight_strategy) for n in group}
        for n, (Q, scale) in results.items():
            ctx.linear(n).weight.data.copy_(dequant(Q, scale))
            out[n] = W8Weight(Q, scale)
        ctx.finish(group)
    if s.activation_scheme == "static":
        to_scale = int8_input_scale if int8 else fp8_input_scale
        for n, absmax in ctx.collect(ctx.names, _absmax_step).items():
            out[n] = dataclasses.replace(out[n], input_scale=to_scale(absmax))
    return out


_BLOCK_QUANTIZERS: dict[str, Callable[[_BlockContext], dict[str, Any]]] = {
    "rtn": _rtn_block,
    "gptq": _gptq_block,
    "awq": _rtn_block,
    "int8": _w8_block,
    "fp8": _w8_block,
}


def _set_weight(linear: nn.Linear, qw: QuantizedWeight) -> QuantizedWeight:
    """Round the scales to fp16 (as stored on disk) and put the dequantized weight back."""
    qw = dataclasses.replace(qw, scales=qw.scales.to(torch.float16).float())
    linear.weight.data.copy_(qw.dequantize())
    return qw


def _foldable(ctx: _BlockContext, m: ScaleMapping) -> bool:
    prev, first = ctx.block.get_submodule(m.prev), ctx.linear(m.linears[0])
    # grouped-query attention: v_proj's rows do not line up with o_proj's columns
    return not isinstance(prev, nn.Linear) or prev.weight.shape[0] == first.weight.shape[1]


def _awq_search(ctx: _BlockContext, result: ScaleResult) -> None:
    """AWQ on the float block: scale search + fold for each mapping, then the clip search."""
    s = ctx.s
    stats = {n: (abs_sum / n_tok, H) for n, ((H, n_tok), abs_sum) in
             ctx.collect(ctx.spec.linears, _awq_stats_step).items()}  # fmt: skip
    for m in filter(lambda m: _foldable(ctx, m), ctx.spec.mappings):
        lins = [ctx.linear(n) for n in m.linears]
        x_mean, H = stats[m.linears[0]]
        scale, _, _ = search_scale(x_mean, H, [w.weight.data for w in lins], s.bits, s.group_size)
        apply_scales(ctx.block.get_submodule(m.prev), lins, scale)
        stats.update(dict.fromkeys(m.linears, rescale_stats(x_mean, H, scale)))
        result.scales[ctx.prefix + m.prev] = scale.cpu()
        result.linears[ctx.prefix + m.prev] = [ctx.prefix + n for n in m.linears]
    for n in ctx.names:
        if n.endswith(("q_proj", "k_proj")):
            continue  # the softmax hides their error; AutoAWQ skips them too
        W = ctx.linear(n).weight.data
        max_val = search_clip(stats[n][1], W, s.bits, s.group_size)
        W.copy_(clip_weight(W, max_val, s.group_size))
        result.clips[ctx.prefix + n] = max_val.cpu()


def _smooth_search(ctx: _BlockContext, result: ScaleResult) -> None:
    """SmoothQuant: fold s = max|X|^a / max|W|^(1-a) into each norm -> linears mapping."""
    maps = [m for m in ctx.spec.mappings if m.smooth and _foldable(ctx, m)]
    absmax = ctx.collect([m.linears[0] for m in maps], _absmax_step)
    for m in maps:
        lins = [ctx.linear(n) for n in m.linears]
        W = [w.weight.data for w in lins]
        scale = smooth_scales(absmax[m.linears[0]], W, ctx.s.smooth_alpha)
        apply_scales(ctx.block.get_submodule(m.prev), lins, scale)
        result.scales[ctx.prefix + m.prev] = scale.cpu()
        result.linears[ctx.prefix + m.prev] = [ctx.prefix + n for n in m.linears]


# ------------------------------------------------------------------------------ hooks and steps


def _hessian_step(acc: tuple[Tensor | None, int] | None, x: Tensor) -> tuple[Tensor, int]:
    H, n = acc if acc is not None else (None, 0)
    return accumulate_hessian(H, n, x)


def _gptaq_step(acc: Any, x: Tensor, x_fp: Tensor) -> tuple[tuple[Tensor, int], tuple[Tensor, int]]:
    """((H, tokens), (dXXT, tokens)): GPTAQ's statistics of a linear's inputs."""
    (H, n), (D, _) = acc if acc is not None else ((None, 0), (None, 0))
    return accumulate_hessian(H, n, x), accumulate_dxxt(D, n, x, x_fp)


def _absmax_step(acc: Tensor | None, x: Tensor) -> Tensor:
    m = activation_absmax(x)
    return m if acc is None else torch.maximum(acc, m)


def _awq_stats_step(acc: Any, x: Tensor) -> tuple[tuple[Tensor, int], Tensor]:
    """((H, tokens), sum |x|): what AWQ's searches need of a linear's inputs."""
    (H, n), abs_sum = acc if acc is not None else ((None, 0), 0.0)
    x = x.reshape(-1, x.shape[-1]).float()
    return accumulate_hessian(H, n, x), abs_sum + x.abs().sum(dim=0)


def _collect(
    block: nn.Module,
    linears: dict[str, nn.Module],
    X: list[Tensor],
    kwargs: dict[str, Any],
    step: Callable[[Any, Tensor], Any] | None,
    start: dict[str, Any] | None = None,
    named_step: Callable[[str, Any, Tensor], Any] | None = None,
) -> dict[str, Any]:
    """Run X through `block`, folding each linear's inputs into an accumulator with `step`
    (or `named_step`, which is also given the linear's name), starting from `start`.

    The forward of a sample stops as soon as every hooked linear has seen its input (the rest
    of the block is not needed): pre-hooks, so a linear's own matmul is skipped too.
    """
    acc: dict[str, Any] = dict(start) if start is not None else dict.fromkeys(linears)
    seen: set[str] = set()
    fold = named_step if named_step is not None else (lambda _, a, v: step(a, v))

    def hook(name: str) -> Callable[..., None]:
        def fn(module: nn.Module, args: tuple[Tensor, ...]) -> None:
            acc[name] = fold(name, acc[name], args[0].detach())
            seen.add(name)
            if len(seen) == len(linears):
                raise _StopForward

        return fn

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
    try:
        for x in X:
            seen.clear()
            try:
                block(x, **kwargs)
            except _StopForward:
                pass
    finally:
        for h in handles:
            h.remove()
    return acc


class _StopForward(Exception):
    pass


def _capture_block_inputs(
    model: nn.Module, block0: nn.Module, input_ids: Tensor
) -> tuple[list[Tensor], dict[str, Any]]:
    """Hidden states entering block 0, one [1, T, hidden] per sample, and the block's kwargs
    (position embeddings, mask), which are the same for every sample of one length."""
    X: list[Tensor] = []
    kwargs: dict[str, Any] = {}

    def pre_hook(module: nn.Module, args: tuple[Any, ...], kw: dict[str, Any]) -> None:
        X.append((args[0] if args else kw["hidden_states"]).detach())
        kwargs.update({k: v for k, v in kw.items() if k != "hidden_states"})
        raise _StopForward

    handle = block0.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        for ids in input_ids:
            try:
                model(input_ids=ids[None], use_cache=False)
            except _StopForward:
                pass
    finally:
        handle.remove()
    for k in ("cache", "past_key_values", "past_key_value"):
        kwargs.pop(k, None)
    kwargs["use_cache"] = False
    return X, kwargs


# ------------------------------------------------------------------------------------- export


def _is_ignored(name: str, ignore: Iterable[str]) -> bool:
    for pattern in ignore:
        if pattern.startswith("re:"):
            if re.fullmatch(pattern[3:], name):
                return True
        elif name == pattern or name.endswith("." + pattern):
            return True
    return False


def _out_dtype(dtype: str | None, method: str) -> torch.dtype:
    if dtype is None:
        return torch.float16 if method in ("rtn", "gptq", "awq") else torch.bfloat16
    choices = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
    if dtype not in choices:
        raise QServeError(f"dtype must be one of {', '.join(choices)}, got {dtype!r}", "dtype")
    return choices[dtype]


def _export_tensors(
    model: nn.Module,
    spec: ArchSpec,
    results: BlockResults,
    s: QuantizeSettings,
    dtype: torch.dtype,
) -> tuple[dict[str, Tensor], dict[str, Any], dict[str, dict[str, Any]]]:
    """(tensors, quantization_config, extra JSON files) of the checkpoint."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    tensors = _checkpoint_tensors(state, results, s, dtype)
    return tensors, *_quantization_config(model, spec, set(results.linears), s)


def _checkpoint_tensors(
    state: dict[str, Tensor], results: BlockResults, s: QuantizeSettings, dtype: torch.dtype
) -> dict[str, Tensor]:
    """The checkpoint's tensors for the float `state` (cast to `dtype`) and the `results`
    quantized from it: a quantized linear's weight becomes the tensors of its format."""
    tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    to_tensors = {
        "rtn": export.gptq_tensors,
        "gptq": export.gptq_tensors,
        "awq": export.awq_tensors,
    }.get(s.method, lambda r: export.compressed_tensors(r.Q, r.weight_scale, r.input_scale))
    for name, r in results.linears.items():
        del tensors[f"{name}.weight"]
        tensors.update({f"{name}.{k}": v for k, v in to_tensors(r).items()})
    for attention, (k_absmax, v_absmax) in results.kv_absmax.items():
        k_scale, v_scale = (kv_scale(m, s.kv_cache_dtype) for m in (k_absmax, v_absmax))
        tensors.update(export.kv_scale_tensors(attention, k_scale, v_scale))
    return tensors


def _export_outside_blocks(
    model: nn.Module,
    spec: ArchSpec,
    blocks: BlockOffload,
    results: BlockResults,
    s: QuantizeSettings,
    dtype: torch.dtype,
) -> tuple[dict[str, Tensor], dict[str, Any], dict[str, dict[str, Any]]]:
    """`_export_tensors` when the blocks are offloaded: the tensors outside the blocks (the
    blocks' own are in `blocks.files`; `results` holds a quantized lm_head, if any) and the
    configs."""
    state = {k: v.detach() for k, v in model.state_dict().items() if not v.is_meta}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    tensors = _checkpoint_tensors(state, results, s, dtype)
    return tensors, *_quantization_config(model, spec, blocks.quantized | set(results.linears), s)


@torch.no_grad()
def _quantize_lm_head(
    model: nn.Module, s: QuantizeSettings, X: list[Tensor], X_fp: list[Tensor] | None = None
) -> QuantizedWeight:
    """lm_head [vocab, hidden] quantized like the blocks' linears: GPTQ (with the Hessian of the
    final-norm hidden states of the calibration samples, the last block's outputs X; GPTAQ's
    statistics too when the float model's X_fp are given) or RTN.
    It is untied from the input embeddings first: those stay in floating point, and the config
    then says tie_word_embeddings false."""
    head = model.get_output_embeddings()
    if getattr(model.config, "tie_word_embeddings", False):
        head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)
        model.config.tie_word_embeddings = False
    if not s.lm_head_needs_inputs:
        return _set_weight(head, rtn_quantize(head.weight, s.bits, s.group_size, s.sym, s.min_zero))
    norm = model.get_decoder().norm
    H, D, n = None, None, 0
    for i, x in enumerate(X):
        if X_fp is not None:
            D, _ = accumulate_dxxt(D, n, norm(x), norm(X_fp[i]))
        H, n = accumulate_hessian(H, n, norm(x))
    qw = gptq_quantize(
        head.weight, H, s.bits, s.group_size, s.sym, s.damp,
        desc_act=s.desc_act, static_groups=s.static_groups, min_zero=s.min_zero,
        mse=s.mse, act_group_aware=s.act_group_aware, dXXT=D, gptaq_alpha=s.gptaq_alpha,
    )  # fmt: skip
    return _set_weight(head, qw)


def _quantization_config(
    model: nn.Module, spec: ArchSpec, quantized: set[str], s: QuantizeSettings
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(config.json["quantization_config"], extra JSON files), naming the unquantized linears."""
    skipped = [
        n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in quantized
    ]
    if s.method == "awq":
        return export.awq_config(s.group_size, [n for n in skipped if n != "lm_head"]), {}
    if s.method in ("int8", "fp8"):
        kind = "int" if s.method == "int8" else "float"
        static = s.activation_scheme == "static"
        # compressed-tensors' 8-bit float is E4M3: e5m2 scales are written but not declared
        kv = export.kv_cache_scheme() if s.kv_cache_dtype == "fp8_e4m3" else None
        qconfig = export.compressed_tensors_config(kind, s.weight_strategy, static, skipped, kv)
        return qconfig, {}
    gptq = s.method == "gptq"  # rtn writes the same format, with natural order and no Hessian
    qconfig = export.gptq_config(
        s.bits, s.group_size, s.sym, s.desc_act and gptq, s.damp, s.static_groups and gptq,
        true_sequential=gptq,
    )  # fmt: skip
    if "lm_head" in quantized:
        qconfig["lm_head"] = True
    block0 = f"{spec.blocks}.0."
    if any(n.startswith(block0) for n in skipped):
        # optimum/GPTQModel's way of naming the linears that carry quantized tensors
        qconfig["modules_in_block_to_quantize"] = [
            [n for n in group if block0 + n in quantized] for group in spec.sequential
        ]
    return qconfig, {"quantize_config.json": qconfig}
