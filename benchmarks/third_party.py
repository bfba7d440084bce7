"""Third-party quantizers as baselines: gptqmodel 7.6.0 (GPTQ) and autoawq 0.2.9 (AWQ), on CPU.

Each function quantizes a Hugging Face model folder on given calibration token ids [S, T] (in the
benchmarks: the windows qserve's own GPTQ/AWQ used, `qserve.quantize.calibration.
calibration_windows`), writes a checkpoint folder with the tokenizer beside it, and returns the
seconds that took (load, calibrate, pack, save; not the import of the package).

Both tools calibrate the fp32 model, as `qserve.quantize` does (gptqmodel alone would pick bf16
on CPU). What else each tool is given:

    gptqmodel  QuantizeConfig(bits, group_size, desc_act, sym, damp_percent); its other defaults
               stand (act_group_aware when desc_act is off, true_sequential). pack_impl
               "original": the default "cpu" packer JIT-compiles a C++ extension on first use
               (minutes on 2 cores). GPTQMODEL_CPU_WORKERS defaults to 2 (2-core machines need it).
               Unquantized tensors are saved in the dtype the model was calibrated in (fp32).
    autoawq    quant_config {w_bit 4, q_group_size, zero_point, version GEMM}; the S windows go
               in as token-id lists with max_calib_seq_len T and max_calib_samples S, which its
               loader concatenates and cuts back into exactly those windows. autoawq needs
               group_size to divide every in_features. One CPU bug of autoawq 0.2.9 is worked
               around (`cpu_safe_quantizer`); its algorithm is otherwise untouched.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

GPTQMODEL_VERSION = "7.6.0"
AUTOAWQ_VERSION = "0.2.9"

__all__ = [
    "GPTQMODEL_VERSION",
    "AUTOAWQ_VERSION",
    "gptqmodel_quantize",
    "autoawq_quantize",
    "import_gptqmodel",
    "import_autoawq",
]


def import_gptqmodel() -> Any:
    """The gptqmodel module (its import alone takes 10-20 s)."""
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    import gptqmodel

    return gptqmodel


def import_autoawq() -> Any:
    """The awq module, without its deprecation notice."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import awq

    return awq


def gptqmodel_quantize(
    model_dir: str | Path,
    out: str | Path,
    input_ids: torch.Tensor,
    bits: int = 4,
    group_size: int = 128,
    desc_act: bool = False,
    damp: float = 0.01,
    sym: bool = True,
    gptaq: bool = False,
    dynamic: dict | None = None,
) -> float:
    """GPTQ with gptqmodel on calibration ids [S, T]; writes a GPTQ v1 checkpoint to `out`.
    `gptaq`: its GPTAQ variant (alpha 0.25, statistics on the CPU); `dynamic`: its per-module
    overrides ({"[+:|-:]regex": {"bits": 8, ...}})."""
    gptqmodel = import_gptqmodel()
    extra = {}
    if gptaq:
        from gptqmodel.quantization.config import GPTAQConfig

        extra["gptaq"] = GPTAQConfig(alpha=0.25, device="cpu")
    config = gptqmodel.QuantizeConfig(
        bits=bits,
        group_size=group_size,
        desc_act=desc_act,
        sym=sym,
        damp_percent=damp,
        pack_impl="original",
        dynamic=dynamic,
        **extra,
    )
    samples = [{"input_ids": row.tolist(), "attention_mask": [1] * len(row)} for row in input_ids]
    start = time.monotonic()
    model = gptqmodel.GPTQModel.load(str(model_dir), config, dtype=torch.float32)
    model.quantize(samples, batch_size=1)
    model.save(str(out))
    return time.monotonic() - start


def autoawq_quantize(
    model_dir: str | Path,
    out: str | Path,
    input_ids: torch.Tensor,
    group_size: int = 128,
    zero_point: bool = True,
) -> float:
    """4-bit AWQ (GEMM) with autoawq on calibration ids [S, T]; writes the checkpoint to `out`."""
    from transformers import AutoTokenizer

    awq = import_autoawq()
    S, T = input_ids.shape
    quant_config = {"w_bit": 4, "q_group_size": group_size, "zero_point": zero_point}
    start = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    with quiet():
        model = awq.AutoAWQForCausalLM.from_pretrained(
            str(model_dir), torch_dtype=torch.float32, device_map="cpu"
        )
        model.quantize(
            tokenizer,
            quant_config={**quant_config, "version": "GEMM"},
            calib_data=input_ids.tolist(),
            max_calib_samples=S,
            max_calib_seq_len=T,
            quantizer_cls=cpu_safe_quantizer(),
        )
        model.save_quantized(str(out))
    tokenizer.save_pretrained(str(out))
    return time.monotonic() - start


def cpu_safe_quantizer() -> type:
    """autoawq 0.2.9's AwqQuantizer, with its scale search's weight snapshot made a copy.

    `_compute_best_scale` saves the weights as `{k: v.cpu() for k, v in state_dict()}` and
    restores them after each of its 20 grid points. On CPU `.cpu()` returns the tensor itself,
    so the first grid point's in-place `fc.weight.mul_(scales)` rewrites the snapshot: every
    later grid point, and the final weights, carry that stray per-channel scale. On SmolLM2
    (w4g64, 8 x 128 calibration tokens) the result had perplexity 363853 against 80 for the
    fp32 model; with copies it behaves like AWQ. On CUDA `.cpu()` copies and the bug is absent.
    """
    base = importlib.import_module("awq.quantize.quantizer").AwqQuantizer

    class CpuSafeAwqQuantizer(base):
        def _compute_best_scale(self, x, w_mean, x_mean, module2inspect, *args, **kwargs):
            state_dict = module2inspect.state_dict

            def copied(*a: Any, **kw: Any) -> dict[str, torch.Tensor]:
                return {k: v.clone() for k, v in state_dict(*a, **kw).items()}

            module2inspect.state_dict = copied
            try:
                return super()._compute_best_scale(
                    x, w_mean, x_mean, module2inspect, *args, **kwargs
                )
            finally:
                del module2inspect.state_dict  # back to the class's method

    return CpuSafeAwqQuantizer


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """autoawq warns about `torch_dtype` and deprecations on every call."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        yield
