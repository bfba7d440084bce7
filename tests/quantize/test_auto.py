"""--method auto (issue 21): exact bytes, the allocators against brute force, and the whole run on
the tiny Llama (measure, allocate, GPTQ with dynamic rules, verify on held-out text, write)."""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from qserve.cli import cli
from qserve.errors import QServeError
from qserve.quantize.auto import blocks as blocks_module
from qserve.quantize.auto import budget, run, verify
from qserve.quantize.auto import measure as measure_module
from qserve.quantize.auto.budget import Unit, candidate_schemes, linear_bytes, reference_scheme
from qserve.quantize.auto.measure import measure
from qserve.quantize.auto.tail import Tail
from qserve.quantize.dynamic import Scheme
from qserve.quantize.export import gptq_tensors
from qserve.quantize.rtn import rtn_quantize
from qserve.quantize.settings import QuantizeSettings


@pytest.mark.parametrize(
    "scheme",
    [Scheme(4, 32), Scheme(4, 128), Scheme(4, -1), Scheme(8, -1), Scheme(3, 64), Scheme(3, 128)],
    ids=str,
)
def test_linear_bytes_are_the_gptq_tensors_bytes(scheme: Scheme) -> None:
    W = torch.randn(192, 256)
    tensors = gptq_tensors(rtn_quantize(W, scheme.bits, scheme.group_size, True, 1))
    stored = sum(t.numel() * t.element_size() for t in tensors.values())
    assert linear_bytes(192, 256, scheme) == stored
    assert linear_bytes(192, 256, Scheme(16)) == 192 * 256 * 2


def test_candidates_are_the_group_sizes_dividing_every_k() -> None:
    unit = Unit("u", ("a", "b"), ((64, 1024), (64, 1536)))
    candidates = candidate_schemes(unit)
    assert [s.name for s in candidates] == [
        "bf16", "w8ch", "w4g128", "w4g64", "w4g32", "w3g128", "w3g64", "w3g32"
    ]  # fmt: skip
    measured = budget.directly_measured(candidates[1:])
    assert measured == [Scheme(4, 128), Scheme(3, 128)]
    assert budget.anchor(Scheme(3, 32), measured) == Scheme(3, 128)  # W3 from W3
    assert budget.anchor(Scheme(8, -1), measured) == Scheme(4, 128)  # the rest from the reference
    # 576 = 4.5 * 128: W4 per channel is the one W4 candidate smaller than g64, and measured
    unit = Unit("u", ("a", "b"), ((64, 576), (64, 1536)))
    candidates = candidate_schemes(unit)
    assert [s.name for s in candidates] == ["bf16", "w8ch", "w4g64", "w4g32", "w4ch", "w3g64",
                                            "w3g32"]  # fmt: skip
    assert reference_scheme(candidates) == Scheme(4, 64)
    assert budget.directly_measured(candidates[1:]) == [Scheme(4, 64), Scheme(4, -1), Scheme(3, 64)]
    no_w3 = Unit("u", ("a",), ((48, 256),))  # 48 output channels: no whole run of 32 codes
    assert [s.bits for s in candidate_schemes(no_w3)] == [16, 8, 4, 4, 4]
    odd = Unit("u", ("a",), ((64, 200),))  # no group size divides 200
    assert [s.name for s in candidate_schemes(odd)] == ["bf16", "w8ch", "w4ch"]
    assert reference_scheme(candidate_schemes(odd)) == Scheme(4, -1)
    assert budget.directly_measured(candidate_schemes(odd)[1:]) == [Scheme(4, -1)]


def _instance(seed: int) -> tuple[list[Unit], list[dict[Scheme, float]]]:
    rng = random.Random(seed)
    units = [Unit(f"u{i}", (f"l{i}",), ((64 * rng.randint(1, 4), 256),)) for i in range(4)]
    errors = []
    for u in units:
        scale = rng.uniform(0.1, 10)
        errors.append({s: 0.0 if s.dense else scale * rng.uniform(0.5, 1.5) / s.bits**2 *
                       (s.group_size if s.group_size > 0 else 512) / 64
                       for s in candidate_schemes(u)})  # fmt: skip
    return units, errors


def _all_allocations(units, errors):
    for combo in itertools.product(*[list(e) for e in errors]):
        size = sum(u.bytes(s) for u, s in zip(units, combo))
        yield size, sum(e[s] for e, s in zip(errors, combo))


@pytest.mark.parametrize("seed", range(5))
def test_min_bytes_meets_the_budget_with_the_fewest_bytes(seed: int) -> None:
    units, errors = _instance(seed)
    max_error = sum(max(e.values()) for e in errors) * 0.3
    bins = 4000
    found = budget.min_bytes(units, errors, max_error, bins)
    assert found is not None and found.error <= max_error
    assert found.bytes == sum(u.bytes(found.schemes[u.name]) for u in units)
    # optimal up to the rounding of each unit's error up to a bin: no allocation within the
    # budget less that slack is smaller
    slack = len(units) * max_error / bins
    best = min(b for b, e in _all_allocations(units, errors) if e <= max_error - slack)
    assert found.bytes <= best


@pytest.mark.parametrize("seed", range(5))
def test_min_error_fits_the_size_with_the_least_error(seed: int) -> None:
    units, errors = _instance(seed)
    max_bytes = int(sum(u.bytes(Scheme(4, 64)) for u in units) * 1.3)
    found = budget.min_error(units, errors, max_bytes, bins=4000)
    assert found is not None and found.bytes <= max_bytes
    slack = len(units) * max_bytes / 4000
    best = min(e for b, e in _all_allocations(units, errors) if b <= max_bytes - slack)
    assert found.error <= best + 1e-12


def test_floor_only_upgrades() -> None:
    units, errors = _instance(0)
    floor = {u.name: Scheme(8, -1) for u in units}
    found = budget.min_bytes(units, errors, 1e9, floor=floor)
    assert found is not None and set(found.schemes.values()) == {Scheme(8, -1)}


def test_start_c_predicts_the_measured_mix() -> None:
    c = budget.start_c({"increase": 0.12, "kl": 0.05}, error=0.3)
    predicted = budget.predicted(0.3, c)
    assert predicted["increase"] == pytest.approx(0.12) and predicted["kl"] == pytest.approx(0.05)
    assert budget.start_c({"increase": 0.0, "kl": 0.0}, error=0.3) == {"ppl": 1.0, "kl": 1.0}


# ---------------------------------------------------------------------------- the whole run

SETTINGS = dict(method="auto", measure_samples=2, num_samples=4, seq_len=64)


def test_measurement_is_cached_and_predicts_each_unit(tiny_llama: Path, tmp_path: Path) -> None:
    settings = QuantizeSettings(max_ppl_increase="1%", **SETTINGS)
    first = measure(tiny_llama, settings, tmp_path)
    assert [u.name for u in first.units[:4]] == [
        "model.layers.0.self_attn.q_proj+k_proj+v_proj",
        "model.layers.0.self_attn.o_proj",
        "model.layers.0.mlp.gate_proj+up_proj",
        "model.layers.0.mlp.down_proj",
    ]
    for errors, kl in zip(first.errors, first.reference_kl):
        assert errors[Scheme(16)] == 0 and kl > 0
        w4 = [e for s, e in errors.items() if s.bits == 4]
        assert errors[Scheme(8, -1)] < min(w4)
        assert errors[reference_scheme(list(errors))] == kl  # measured at the coarsest groups
    # additive to within 20% on this model: every unit at once against the sum
    assert first.additivity["measured"] == pytest.approx(first.additivity["sum"], rel=0.2)
    assert first.tokens == 2 * 64  # the KL windows: measure_samples, besides the 4 fit windows
    assert first.heldout["tokens"] > 0 and first.heldout["kl"] > 0
    (cached,) = tmp_path.glob("*.json")
    again = measure(tiny_llama, settings, tmp_path)
    assert again.to_json() == first.to_json() == json.loads(cached.read_text())


def test_measurement_fits_and_scores_on_different_windows(
    tiny_llama: Path, tmp_path: Path, monkeypatch
) -> None:
    """The Hessians come from the quantization's num_samples windows, the KLs from
    measure_samples more: calibration ids are asked for both, and the KLs see only the last."""
    asked: list[torch.Tensor] = []
    real = blocks_module.calibration_ids

    def spy(*args):
        asked.append(real(*args))
        return asked[-1]

    monkeypatch.setattr(blocks_module, "calibration_ids", spy)
    seen: list[list[torch.Tensor]] = []
    real_kl = Tail.kl_sums

    def kl_sums(self, b, X, swap):
        seen.append(X)
        return real_kl(self, b, X, swap)

    monkeypatch.setattr(Tail, "kl_sums", kl_sums)
    measure(tiny_llama, QuantizeSettings(max_ppl_increase="1%", **SETTINGS), None)
    assert len(asked) == 1 and asked[0].shape == (4 + 2, 64)
    assert all(len(X) == 2 for X in seen)


@pytest.mark.parametrize("mse", [True, False])
def test_measurement_quantizes_its_reference_with_the_runs_gptq_options(
    tiny_llama: Path, monkeypatch, mse: bool
) -> None:
    """The weights a unit's KL and the reference mix are measured with are GPTQ's as the run
    makes them: the groups' ranges by MSE search unless --no-mse (on by default for auto), at
    the reference and at the W3 anchor, the two schemes whose KL is measured here. The proxy
    errors of every scheme skip the search (one call per linear and scheme; with --no-mse the
    measured schemes' proxy weights are the KL's weights too, not made twice)."""
    asked: list[tuple[int, int, bool]] = []
    real = blocks_module.gptq_quantize

    def spy(W, *args, **kwargs):
        asked.append((args[1], args[2], kwargs["mse"]))  # (bits, group size, mse)
        return real(W, *args, **kwargs)

    monkeypatch.setattr(blocks_module, "gptq_quantize", spy)
    extra = {} if mse else {"mse": False}
    settings = QuantizeSettings(max_ppl_increase="1%", **SETTINGS, **extra)
    m = measure(tiny_llama, settings, None)
    linears = sum(len(u.linears) for u in m.units)
    searched = [(b, g) for b, g, used in asked if used]
    assert len(searched) == (2 * linears if mse else 0)
    assert set(searched) <= {(4, 128), (3, 128)}  # the coarsest groups (the tiny model's K)
    plain = [g for _, g, used in asked if not used]
    schemes_per_linear = sum(len(e) - 1 for e, u in zip(m.errors, m.units) for _ in u.linears)
    assert len(plain) == schemes_per_linear  # --no-mse: the reference's proxy weights reused


def test_w4_per_channel_and_w3_are_measured_not_carried(tiny_llama: Path, monkeypatch) -> None:
    """Where per channel is a candidate beside groups (here: no 512 divides the tiny model's
    K (128, 256), so its coarsest groups are 64), its KL is measured as the reference's is, on
    the first RATIO_WINDOWS KL windows, and carried by its ratio to the reference's there; so
    is the coarsest W3 groups' (g64), which the finer W3 groups are carried from by the ratio
    of their proxy errors."""
    monkeypatch.setattr(budget, "W4_GROUPS", (512, 64, 32))
    monkeypatch.setattr(measure_module, "RATIO_WINDOWS", 1)  # of the 2 KL windows
    calls: list[list[float]] = []  # per call: the KL summed over each window
    real = Tail.kl_sums
    proxies: list[float] = []
    real_proxy = measure_module.unit_proxy

    def spy(self, *args):
        calls.append(real(self, *args))
        return calls[-1]

    def spy_proxy(*args):
        proxies.append(real_proxy(*args))
        return proxies[-1]

    monkeypatch.setattr(Tail, "kl_sums", spy)
    monkeypatch.setattr(measure_module, "unit_proxy", spy_proxy)
    m = measure(tiny_llama, QuantizeSettings(max_ppl_increase="1%", **SETTINGS), None)
    calls.pop()  # the check of additivity: every unit at once
    assert len(calls) == 3 * len(m.units)  # the reference's KL, per channel's, W3 g64's
    assert [len(c) for c in calls] == [2, 1, 1] * len(m.units)
    # proxies in candidate order: w8ch, w4g64 (the reference), w4g32, w3g64, w3g32
    assert len(proxies) == 5 * len(m.units)
    for i, errors in enumerate(m.errors):
        ref, ch, w3 = calls[3 * i : 3 * i + 3]
        p8, p64, p32, p3_64, p3_32 = proxies[5 * i : 5 * i + 5]
        kl = sum(ref) / (2 * 64)  # per token: 2 windows of 64
        assert errors[Scheme(4, 64)] == m.reference_kl[i] == pytest.approx(kl, rel=1e-12)
        assert errors[Scheme(4, -1)] == pytest.approx(kl * ch[0] / ref[0], rel=1e-12)
        assert errors[Scheme(3, 64)] == pytest.approx(kl * w3[0] / ref[0], rel=1e-12)
        assert errors[Scheme(3, 32)] == pytest.approx(errors[Scheme(3, 64)] * p3_32 / p3_64)
        assert errors[Scheme(4, 32)] == pytest.approx(kl * p32 / p64, rel=1e-12)
        assert errors[Scheme(4, -1)] != errors[Scheme(4, 64)]
        assert set(errors) == {Scheme(16), Scheme(8, -1), Scheme(4, 64), Scheme(4, 32),
                               Scheme(4, -1), Scheme(3, 64), Scheme(3, 32)}  # fmt: skip
        assert errors[Scheme(4, 32)] < errors[Scheme(4, 64)] < errors[Scheme(3, 64)]
        assert errors[Scheme(4, -1)] > 0


def test_heldout_score_of_the_float_model_is_zero(tiny_llama: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    windows = measure_module.heldout_windows(tokenizer, model.config)[:2]
    with torch.no_grad():
        none = measure_module._heldout_score(model, windows, [])
        proj = model.model.layers[0].mlp.down_proj
        noisy = [[(proj, proj.weight.data + 0.05 * torch.randn_like(proj.weight))]]
        score = measure_module._heldout_score(model, windows, noisy)
    assert none["increase"] == 0 and none["kl"] == 0 and none["tokens"] == score["tokens"]
    assert score["kl"] > 0 and score["tokens"] == sum(len(w) - 1 for w in windows)


def auto_args(model: Path, budget: list[str]) -> list[str]:
    """`qserve quantize MODEL -m auto BUDGET` with a small measurement and calibration."""
    return ["quantize", str(model), "-m", "auto", *budget, "-q", "--measure-samples", "2",
            "--num-samples", "4", "--seq-len", "64"]  # fmt: skip


def run_auto(model: Path, out: Path, budget: list[str], monkeypatch) -> dict:
    """Run it into `out` (caching under a temporary folder); the checkpoint's auto record."""
    monkeypatch.setenv("QSERVE_CACHE_DIR", str(out.parent / "cache"))
    result = CliRunner().invoke(cli, [*auto_args(model, budget), "-o", str(out)])
    assert result.exit_code == 0, result.output
    return json.loads((out / "qserve_recipe.json").read_text())["auto"]


def test_auto_meets_its_budget_on_held_out_text(
    tiny_llama: Path, tmp_path: Path, monkeypatch
) -> None:
    out, args = tmp_path / "auto", ["--max-ppl-increase", "0.1%"]
    record = run_auto(tiny_llama, out, args, monkeypatch)
    assert record["met"] and record["measured"]["increase"] <= 0.001
    assert record["measured"]["tokens"] > 1000
    schemes = {a["scheme"] for a in record["allocation"]}
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "gptq"
    assert bool(qc.get("dynamic")) == (len(schemes) > 1)  # a mix: dynamic rules
    # what was verified is what the engine serves: score it again
    scorer = verify.HeldOut(tiny_llama)
    assert scorer.increase(out) == pytest.approx(record["measured"]["increase"], abs=1e-9)
    dry = CliRunner().invoke(cli, [*auto_args(tiny_llama, args), "--dry-run"])
    assert dry.exit_code == 0 and "predicted perplexity" in dry.output
    assert "model.layers.1.mlp.down_proj" in dry.output


def test_auto_writes_its_mix_as_compressed_tensors(
    tiny_llama: Path, tmp_path: Path, monkeypatch
) -> None:
    out = tmp_path / "auto-ct"
    args = ["--target-bits", "6", "--format", "compressed-tensors"]
    record = run_auto(tiny_llama, out, args, monkeypatch)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    schemes = {a["scheme"] for a in record["allocation"]} - {"bf16"}
    assert len(schemes) > 1 and len(qc["config_groups"]) == len(schemes)  # a group per scheme
    bits = {g["weights"]["num_bits"] for g in qc["config_groups"].values()}
    assert bits == {int(s[1]) for s in schemes}
    scorer = verify.HeldOut(tiny_llama)  # the engine serves what was verified
    assert scorer.increase(out) == pytest.approx(record["measured"]["increase"], abs=1e-9)


def test_w3_is_left_out_of_compressed_tensors_allocations() -> None:
    """compressed-tensors is written at 4 and 8 bits: an allocation for it never takes W3, and
    a size only W3 reaches is refused there, met in the GPTQ format."""
    from qserve.errors import QServeError
    from qserve.quantize.auto.measure import Measurement

    unit = Unit("u", ("a",), ((256, 256),))
    errors = [{s: 0.0 if s.dense else 1.0 / s.bits for s in candidate_schemes(unit)}]
    m = Measurement([unit], errors, [0.25], 64, 1.0, {"sum": 0.25, "measured": 0.25},
                    {"increase": 0.01, "kl": 0.01, "tokens": 64})  # fmt: skip
    bits = 8 * unit.bytes(Scheme(3, 128)) / unit.weights + 0.01  # W3 g128 fits, W4 does not
    gptq = QuantizeSettings(method="auto", target_bits=bits)
    assert run.allocate(run._writable(m, gptq), gptq, run.start_c(m)).schemes["u"].bits == 3
    ct = QuantizeSettings(method="auto", target_bits=bits, format="compressed-tensors")
    assert all(s.bits != 3 for s in run._writable(m, ct).errors[0])
    w4 = math.ceil(8000 * unit.bytes(Scheme(4, 128)) / unit.weights) / 1000  # the figure named
    with pytest.raises(QServeError, match=f"below the smallest scheme .*: {w4:.3f} bits per"):
        run.allocate(run._writable(m, ct), ct, run.start_c(m))


def test_auto_writes_nothing_when_no_attempt_meets_the_budget(
    tiny_llama: Path, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("QSERVE_CACHE_DIR", str(tmp_path / "cache"))  # not the user's cache
    monkeypatch.setattr(run, "MAX_ATTEMPTS", 2)
    monkeypatch.setattr(verify.HeldOut, "measure", measured_as([0.012] * 2))  # always +1.2%
    settings = QuantizeSettings(max_ppl_increase="1%", **SETTINGS)
    from qserve.quantize.driver import quantize_model

    out = tmp_path / "never"
    with pytest.raises(QServeError, match=r"no checkpoint met \+1% perplexity in 2 attempts"):
        quantize_model(tiny_llama, out, settings)
    assert not out.exists() and not list(tmp_path.glob(".never*"))


def measured_as(increases: list[float], margin: float = 0.0):
    """A stand-in for `HeldOut.measure` that measures `increases` in turn, each bound `margin`
    above."""
    values = iter(increases)

    def measure(self, folder: Path, with_kl: bool = False) -> dict[str, float]:
        value = next(values)
        return {"increase": value, "increase_bound": value + margin}

    return measure


def test_a_budget_is_held_to_the_bound_not_the_mean(
    tiny_llama: Path, tmp_path: Path, monkeypatch
) -> None:
    """+0.8% against 1%, but +1.1% at the bound: not met, and the retry is re-fitted to the
    bound (more bytes)."""
    monkeypatch.setenv("QSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(run, "MAX_ATTEMPTS", 2)
    monkeypatch.setattr(verify.HeldOut, "measure", measured_as([0.008, 0.004], margin=0.003))
    out = tmp_path / "bound"
    record = run_auto(tiny_llama, out, ["--max-ppl-increase", "1%"], monkeypatch)
    first, second = record["attempts"]
    assert first["measured_increase_bound"] == pytest.approx(0.011)
    assert second["bytes"] > first["bytes"] and record["met"]
    assert record["measured"]["increase"] == 0.004 and record["measured"]["confidence"] == 0.95


def test_refit_after_two_misses_follows_the_line_through_them() -> None:
    goal = budget.Goal("ppl", 0.005)
    first = (1.0, {"increase": 0.008, "increase_bound": 0.009})
    second = (0.6, {"increase": 0.0045, "increase_bound": 0.0055})  # less error, less measured
    proportional = budget.SAFETY * math.log1p(0.0055) / 0.6
    assert goal.refit([second]) == pytest.approx(proportional)
    v0, v1, target = math.log1p(0.009), math.log1p(0.0055), math.log1p(0.005) / budget.SAFETY
    aimed = 0.6 + (target - v1) * (1.0 - 0.6) / (v0 - v1)
    c = goal.refit([first, second])
    assert c > proportional and goal.max_error(c) == pytest.approx(aimed)
    # the line only where the measured value fell with the error, and only after a miss
    worse = (0.6, {"increase": 0.009, "increase_bound": 0.0095})
    assert goal.refit([first, worse]) == pytest.approx(budget.SAFETY * math.log1p(0.0095) / 0.6)
    met = (0.6, {"increase": 0.004, "increase_bound": 0.0045})
    assert goal.refit([first, met]) == pytest.approx(budget.SAFETY * math.log1p(0.0045) / 0.6)


def test_a_met_and_a_smaller_miss_are_bisected_in_bytes() -> None:
    """Once one attempt met the budget and a smaller one missed, the next is the least error
    at the bytes halfway between them, whatever the re-fitted prediction says; none once they
    are within BRACKET_BITS per weight."""
    from qserve.quantize.auto.measure import Measurement

    units, errors = _instance(3)
    m = Measurement(units, errors, [0.1] * 4, 64, 1.0, {"sum": 1.0, "measured": 1.0},
                    {"increase": 0.01, "kl": 0.01, "tokens": 64})  # fmt: skip
    goal = budget.Goal("ppl", 0.01)
    small = budget.min_error(units, errors, sum(u.bytes(Scheme(4, 64)) for u in units))
    large = budget.min_error(units, errors, sum(u.bytes(Scheme(8, -1)) for u in units))
    assert small is not None and large is not None and small.bytes < large.bytes
    c = {"ppl": 1.0, "kl": 1.0}
    miss, met = {"increase": 0.02}, {"increase": 0.005}
    tried = [run._Tried(large, c, met), run._Tried(small, c, miss)]
    best = run._Met(large, c, met, Path("unused"))
    found = run._next_allocation(m, goal, 1e-9, tried, best)  # c asks for all 16-bit: ignored
    halfway = (small.bytes + large.bytes) // 2
    assert found is not None and small.bytes < found.bytes <= halfway
    assert found == budget.min_error(units, errors, halfway)
    close = budget.min_error(units, errors, large.bytes - 1)  # a miss 1 byte below the met
    assert close is not None
    near = [run._Tried(large, c, met), run._Tried(close, c, miss)]
    assert run._next_allocation(m, goal, 1.0, near, best) is None


def test_upper_bound_is_students_t() -> None:
    samples = [0.01, 0.03, 0.02, 0.05, 0.0, 0.04]
    mean, upper = budget.upper_bound(samples)
    sd = (sum((x - 0.025) ** 2 for x in samples) / 5) ** 0.5
    assert mean == pytest.approx(0.025)
    assert upper == pytest.approx(0.025 + 2.015 * sd / 6**0.5, rel=1e-3)  # t(0.95, 5) = 2.015
    assert budget.upper_bound([0.02] * 8) == (pytest.approx(0.02), pytest.approx(0.02))
    assert budget.upper_bound([0.02])[1] == float("inf")  # one window bounds nothing
    assert budget.t_quantile(0.95, 31) == pytest.approx(1.6955, rel=1e-4)
    assert budget.t_quantile(0.95, 10**6) == pytest.approx(1.6449, rel=1e-4)


@pytest.mark.parametrize("second, written", [(0.0004, 2), (0.002, 1)])
def test_auto_met_with_room_to_spare_tries_smaller(
    tiny_llama: Path, tmp_path: Path, monkeypatch, second: float, written: int
) -> None:
    """+0.01% against a 0.05% budget: a second, smaller attempt under the re-fitted prediction;
    written is the smaller one when it meets the budget too, else the first (after attempts
    halfway between the two)."""
    measured = [0.0001, second, 0.002, 0.002]  # a third and fourth attempt, if any, miss
    monkeypatch.setattr(verify.HeldOut, "measure", measured_as(measured))
    out = tmp_path / "shrunk"
    record = run_auto(tiny_llama, out, ["--max-ppl-increase", "0.05%"], monkeypatch)
    first, smaller = record["attempts"][:2]
    assert smaller["bytes"] < first["bytes"] and smaller["measured_increase"] == second
    if written == 1:  # the second missed: the third is halfway between it and the first
        third = record["attempts"][2]["bytes"]
        assert smaller["bytes"] < third <= (smaller["bytes"] + first["bytes"]) // 2
    kept = record["attempts"][written - 1]
    assert record["met"] and record["measured"]["increase"] == kept["measured_increase"]
    assert sum(a["bytes"] for a in record["allocation"]) == kept["bytes"]
    assert not [p for p in out.iterdir() if p.name.startswith(".attempt")]


@pytest.mark.parametrize(
    "extra, message",
    [
        ([], "needs one budget"),
        (["--max-ppl-increase", "abc"], "percentage"),
        (["--max-ppl-increase", "1", "--target-bits", "4"], "got 2"),
        (["--max-kl", "0.01", "--target-bits", "4"], "got 2"),
        (["--max-kl", "0"], "not in the range x>0"),
        (["--max-kl", "x"], "max-kl"),
        (["--target-bits", "1"], "target-bits"),
        (["-m", "gptq", "--dry-run"], "only --method auto"),
        (["-m", "gptq", "--target-bits", "4"], "only auto uses it"),
    ],
)
def test_auto_option_errors_are_one_line(tiny_llama: Path, extra: list[str], message: str) -> None:
    method = [] if "-m" in extra else ["-m", "auto"]
    result = CliRunner().invoke(cli, ["quantize", str(tiny_llama), *method, *extra])
    assert result.exit_code == 2 and message in result.output, result.output
    assert "Traceback" not in result.output
