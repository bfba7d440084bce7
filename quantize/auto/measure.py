"""The measurement pass of `--method auto`: each unit's error at each candidate scheme, cached
on disk so that solving for another budget costs nothing.

Two sets of calibration windows: the quantization's own `num_samples` (the Hessians) and
`measure_samples` more, not among them (the KLs), so each unit's KL is taken on text its
quantization did not see, as the held-out scoring does. Measured on the windows its Hessians
came from (4 x 512 tokens, up to version 1), a unit's error is that of a fit to those very
tokens: on Gemma-3-270M such KLs were 2.1x (q/k/v, K = 640) to 4.3x (o_proj, K = 1024) below
the unseen windows' (down_proj, K = 2048: 3.9x), unevenly enough to misdirect the allocation.

For each block b, on the float model's inputs of both sets:

    1. the Hessian H of each linear's input (as GPTQ takes it, on the `num_samples` windows),
       every linear's of the block in the one forward that also makes block b + 1's inputs
       (the weights are float throughout: a forward per group, as GPTQ needs, and one more
       for the next inputs took 2.1x as long on SmolLM2-135M's block 0, 128 x 512 tokens);
    2. for each unit u and candidate scheme s: W_s = GPTQ(W, H, s) for the unit's linears and the
       proxy error d_u(s) = sum tr((W - W_s) H (W - W_s)^T) (the layer-wise loss GPTQ
       minimizes), without the MSE range search (it costs 6-9x a GPTQ call; only the ratios
       between schemes are used, and it lowers every scheme's by about as much: 14-16%);
    3. the KL(p_float || p) of the final logits on the `measure_samples` windows with only unit
       u quantized, at its reference scheme r (the coarsest W4 groups that fit it), with the
       quantization's own options (the MSE range search unless --no-mse): block b runs with
       W_r, the later blocks float (over the tokens holding 99% of p_float's mass at some
       position of the window, `tail.Head`: on Gemma-3-270M a quarter of the vocabulary);
    4. e_u(s) = KL_u(r) * d_u(s) / d_u(r): the measured KL, carried to the other schemes by the
       ratio of their proxy errors (16-bit: 0); W4 per channel, where it is a candidate beside
       groups (`budget.candidate_schemes`), and the coarsest W3 groups have their KL measured
       as r's is, on the first RATIO_WINDOWS of the KL windows only, e_u(m) = KL_u(r) * KL_u(m)
       / KL_u(r) on those windows; the finer W3 groups are carried from the coarsest W3's
       (`budget.anchor`) as the others are from r's. On SmolLM2-135M a unit's KL varied
       between windows 1.6x to 6x, where per channel's ratio to g64's on one window was mostly
       within 20% of its ratio on 8 (at worst -28% / +45%), and two sets of 4 windows agreed
       on it within 10%; the proxy ratio misjudged it by more, and by unit kind
       (`budget.directly_measured`). Measured on all the windows (version 6), its KL was a
       second partial forward for 3 of SmolLM2's 4 units.

One KL per unit keeps the pass to about one partial forward per unit; the proxy ratio assumes
the output's sensitivity to the unit's error is the same at every scheme (quantization noise
is close to white). `additivity` records, as a check of the additive prediction
(`budget.predicted_increase`), the KL measured with every unit at its reference scheme at once
beside the sum of the units' KLs.

`heldout` is that same mix (every unit at its reference scheme) scored on the start of the
held-out text the run verifies on (START_FIT_TOKENS of `qserve.data.heldout_text`; the run
verifies on VERIFY_TOKENS): its perplexity increase and KL against the float model. The
calibration windows are not that text, and a KL there is not a perplexity increase there; the
prediction's constant c starts fitted to this one measured mix (`budget.start_c`) instead of
at 1.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qserve.model.resolve import model_files_stamp
from qserve.quantize.auto.blocks import BlockStep, FloatWalk, unit_gptq, unit_proxy
from qserve.quantize.auto.budget import (
    DENSE,
    Unit,
    anchor,
    candidate_schemes,
    directly_measured,
)
from qserve.quantize.auto.tail import Swap, swapped
from qserve.quantize.calibration import NAMED, text_prefix
from qserve.quantize.dynamic import Scheme
from qserve.quantize.settings import QuantizeSettings

__all__ = [
    "MEASURE_VERSION",
    "Measurement",
    "START_FIT_TOKENS",
    "VERIFY_TOKENS",
    "VERIFY_WINDOW",
    "heldout_tokens",
    "heldout_windows",
    "measure",
    "measurement_key",
]

logger = logging.getLogger("qserve")
MEASURE_VERSION = 9  # bump when what is measured changes: old cache entries are not read
# held-out tokens scored per verification: on SmolLM2-135M a 10% budget verified at +9.70% on
# the first 4096 scored +10.32% on the first 8192 (a 2-core AVX-512 EPYC)
VERIFY_TOKENS = 16384
START_FIT_TOKENS = 4096  # held-out tokens the reference mix is scored on (c's start only)
VERIFY_WINDOW = 512  # tokens per window (fewer when the model's context is shorter)
RATIO_WINDOWS = 2  # KL windows a directly measured scheme's ratio to the reference's is taken on


@dataclasses.dataclass
class Measurement:
    units: list[Unit]
    errors: list[dict[Scheme, float]]  # per unit: predicted KL of each candidate scheme
    reference_kl: list[float]  # per unit: the KL measured at its reference scheme
    tokens: int
    seconds: float
    additivity: dict[str, float]  # {"sum": sum of reference KLs, "measured": all at once}
    heldout: dict[str, float]  # the reference mix on held-out text: increase, kl, tokens

    def to_json(self) -> dict[str, Any]:
        return {
            "version": MEASURE_VERSION,
            "tokens": self.tokens,
            "seconds": self.seconds,
            "additivity": self.additivity,
            "heldout": self.heldout,
            "units": [
                {
                    "name": u.name,
                    "linears": list(u.linears),
                    "shapes": [list(s) for s in u.shapes],
                    "reference_kl": kl,
                    "errors": {s.name: e for s, e in errs.items()},
                }
                for u, errs, kl in zip(self.units, self.errors, self.reference_kl)
            ],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Measurement:
        units = [
            Unit(u["name"], tuple(u["linears"]), tuple(tuple(s) for s in u["shapes"]))
            for u in data["units"]
        ]
        errors = [{Scheme.parse(k): v for k, v in u["errors"].items()} for u in data["units"]]
        kls = [u["reference_kl"] for u in data["units"]]
        return cls(
            units, errors, kls, data["tokens"], data["seconds"], data["additivity"],
            data["heldout"],
        )  # fmt: skip


def measurement_key(model_path: Path, settings: QuantizeSettings) -> str:
    """What a cached measurement depends on: the model's config and weight files (names, sizes,
    modification times), the calibration, the tokens a window starts with and the GPTQ options
    that shape each scheme."""
    stats = model_files_stamp(model_path)
    calib = settings.calib
    if calib not in (None, *NAMED):
        path = Path(calib)
        calib = [str(path.resolve()), path.stat().st_size, int(path.stat().st_mtime)]
    what = [
        MEASURE_VERSION, stats, calib, settings.measure_samples, settings.num_samples,
        settings.seq_len, settings.sym,
        settings.damp, settings.act_group_aware, settings.mse, list(settings.ignore),
    ]  # fmt: skip
    from transformers import AutoTokenizer

    prefix = text_prefix(AutoTokenizer.from_pretrained(model_path))  # Gemma's <bos>
    what += [prefix] if prefix else []  # the keys of models without one predate it
    return hashlib.sha256(json.dumps(what, default=str).encode()).hexdigest()[:16]


def measure(
    model_path: Path,
    settings: QuantizeSettings,
    cache_dir: Path | None,
    progress: Callable[[int, int, float], None] | None = None,
) -> Measurement:
    """The measurement of `model_path` (from `cache_dir` when there, else measured and saved
    there; None: no cache)."""
    key = measurement_key(model_path, settings)
    path = None if cache_dir is None else cache_dir / f"{key}.json"
    if path is not None and path.is_file():
        data = json.loads(path.read_text())
        if data.get("version") == MEASURE_VERSION:
            logger.info("measurement of %s read from %s", model_path, path)
            return Measurement.from_json(data)
    result = _measure(model_path, settings, progress)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(result.to_json(), indent=1) + "\n")
        tmp.replace(path)  # atomic: a reader sees all of it or nothing
    return result


@torch.no_grad()
def _measure(
    model_path: Path, settings: QuantizeSettings, progress: Callable[[int, int, float], None] | None
) -> Measurement:
    start = time.monotonic()
    walk = FloatWalk(model_path, settings)
    units, errors, kls, swaps = [], [], [], []
    for step in walk:
        for names in step.groups:
            unit, errs, kl, swap = _measure_unit(walk, step, names)
            units.append(unit)
            errors.append(errs)
            kls.append(kl)
            swaps.append(swap)
        if progress is not None:
            n, elapsed = len(walk.blocks), time.monotonic() - start
            progress(step.b + 1, n, elapsed / (step.b + 1) * (n - step.b - 1))
    additivity = {"sum": sum(kls), "measured": walk.tail.all_at_once(walk.kl_inputs[0], swaps)}
    model = walk.model
    heldout = _heldout_score(model, heldout_windows(walk.tokenizer, model.config), swaps)
    seconds = time.monotonic() - start
    return Measurement(units, errors, kls, walk.kl_tokens, seconds, additivity, heldout)


def _measure_unit(
    walk: FloatWalk, step: BlockStep, names: list[str]
) -> tuple[Unit, dict[Scheme, float], float, Swap]:
    """The unit of linears `names` of block b = step.b: its KL at the reference scheme (from
    X, block b's KL-window inputs); at the other `directly_measured` schemes by their ratio to
    it on the first windows; at the rest carried from their `anchor`'s by the ratio of proxy
    errors (Hessians of the fit windows)."""
    ctx, hessians, tail, b, X = step.ctx, step.hessians, walk.tail, step.b, step.kl_inputs
    s, linears, unit = ctx.s, [ctx.linear(n) for n in names], walk.unit(step, names)
    schemes = [sc for sc in candidate_schemes(unit) if not sc.dense]
    measured = directly_measured(schemes)
    anchors = {sc: anchor(sc, measured) for sc in schemes}
    carried = [sc for sc in schemes if anchors[sc] != sc]
    proxied = [sc for sc in schemes if sc in carried or sc in {anchors[c] for c in carried}]
    weights = {sc: unit_gptq(ctx, names, hessians, sc, mse=False) for sc in proxied}
    proxy = {sc: unit_proxy(ctx, names, hessians, w) for sc, w in weights.items()}
    reuse = {} if s.mse else weights  # --no-mse: the run's own GPTQ is the plain one, made once
    run = {sc: reuse.get(sc) or unit_gptq(ctx, names, hessians, sc, mse=s.mse) for sc in measured}
    ref = measured[0]
    swap = list(zip(linears, run[ref]))
    sums = tail.kl_sums(b, X, swap)
    kl = sum(sums) / tail.tokens(len(X))
    errs = {DENSE: 0.0, ref: kl}
    n = min(RATIO_WINDOWS, len(X))
    base = sum(sums[:n])  # the reference's KL on the first n windows
    for sc in measured[1:]:
        part = sum(tail.kl_sums(b, X[:n], list(zip(linears, run[sc]))))
        errs[sc] = kl * part / base if base > 0 else 0.0
    for sc in carried:
        a = anchors[sc]
        errs[sc] = errs[a] * proxy[sc] / proxy[a] if proxy[a] > 0 else 0.0
    return unit, {sc: errs[sc] for sc in [DENSE, *schemes]}, kl, swap


def heldout_tokens(tokenizer: Any, max_len: int) -> tuple[list[int], list[int], int]:
    """(held-out token ids, the tokens a text starts with, window): what the verification
    scores, in windows of VERIFY_WINDOW tokens (fewer where the model's context is shorter)."""
    from qserve.data import heldout_text

    ids = tokenizer.encode(heldout_text(), add_special_tokens=False)
    return ids, text_prefix(tokenizer), min(VERIFY_WINDOW, max_len - 1)


def heldout_windows(tokenizer: Any, config: Any) -> list[list[int]]:
    """The first START_FIT_TOKENS of the held-out text in its windows, each starting as the
    tokenizer starts a text."""
    from qserve.eval import windows

    ids, prefix, window = heldout_tokens(tokenizer, config.max_position_embeddings)
    return [[*prefix, *w] for w in windows(ids, window - len(prefix), START_FIT_TOKENS)]


def _heldout_score(model: nn.Module, windows: list[list[int]], swaps: list[Swap]) -> dict:
    """{"increase": perplexity increase, "kl": mean KL per token, "tokens"} of the model with
    every swap in place against the float model, over the windows (each position that predicts
    the next token counts)."""
    nll_p = nll_q = kl = 0.0
    count = 0
    for window in windows:
        ids = torch.tensor([window])
        log_p = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0, :-1].float(), -1)
        with swapped([pair for swap in swaps for pair in swap]):
            logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        log_q = torch.log_softmax(logits, -1)
        target = ids[0, 1:, None]
        nll_p -= float(log_p.gather(1, target).sum())
        nll_q -= float(log_q.gather(1, target).sum())
        kl += float((log_p.exp() * (log_p - log_q)).sum())
        count += target.shape[0]
        del log_p, log_q, logits
    return {"increase": math.expm1((nll_q - nll_p) / count), "kl": kl / count, "tokens": count}
