"""`--calib generated`: sequences the float model samples itself (through the engine), cached,
alternating with windows of the default text."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from qserve.quantize import generated
from qserve.quantize.calibration import (
    calibration_ids,
    calibration_windows,
    load_calibration_text,
    text_prefix,
)
from qserve.quantize.driver import quantize_model
from qserve.quantize.settings import QuantizeSettings


def test_generated_ids_are_sampled_once_and_cached(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = generated.generated_ids(tiny_llama, 3, 24, tmp_path)
    assert ids.shape == (3, 24) and ids.dtype == torch.long
    assert int(ids[:, 0].max()) < generated.START_TOKENS
    assert len({tuple(r) for r in ids.tolist()}) == 3  # a seed per sequence
    (cached,) = tmp_path.glob("*.pt")
    assert torch.equal(torch.load(cached), ids)

    def resample(*args: object) -> None:
        raise AssertionError("sampled again")

    monkeypatch.setattr(generated, "_sample", resample)
    assert torch.equal(generated.generated_ids(tiny_llama, 3, 24, tmp_path), ids)
    monkeypatch.undo()
    # the same seed reproduces the sequences without the cache
    assert torch.equal(generated.generated_ids(tiny_llama, 3, 24, tmp_path / "other"), ids)


def test_a_larger_count_samples_only_the_rows_past_the_cached_ones(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = generated.generated_ids(tiny_llama, 2, 24, tmp_path)
    asked: list[tuple[int, int]] = []
    sample = generated._sample

    def spy(model_path: Path, start: int, stop: int, *args: object) -> torch.Tensor:
        asked.append((start, stop))
        return sample(model_path, start, stop, *args)

    monkeypatch.setattr(generated, "_sample", spy)
    more = generated.generated_ids(tiny_llama, 4, 24, tmp_path)
    assert asked == [(2, 4)] and torch.equal(more[:2], first)
    assert len({tuple(r) for r in more.tolist()}) == 4
    assert torch.equal(generated.generated_ids(tiny_llama, 3, 24, tmp_path), more[:3])
    assert asked == [(2, 4)]  # a smaller count reads the first rows: nothing sampled
    (cached,) = tmp_path.glob("*.pt")
    assert torch.equal(torch.load(cached), more)
    # sequence i starts from the i-th draw of SEED whatever the count
    alone = generated.generated_ids(tiny_llama, 4, 24, tmp_path / "other")
    start = len(text_prefix(AutoTokenizer.from_pretrained(tiny_llama)))
    assert torch.equal(alone[:, start], more[:, start])


def test_generated_windows_alternate_with_the_default_text(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QSERVE_CACHE_DIR", str(tmp_path))  # not the user's cache
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    ids = calibration_ids(tiny_llama, tokenizer, "generated", 5, 32)
    gen = generated.generated_ids(tiny_llama, 3, 32)
    text = calibration_windows(tokenizer, load_calibration_text(), 2, 32)
    assert torch.equal(ids, torch.stack([gen[0], text[0], gen[1], text[1], gen[2]]))
    assert torch.equal(calibration_ids(tiny_llama, tokenizer, "generated", 1, 32), gen[:1])


def test_the_measurement_pass_windows_begin_with_the_quantization_ones(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--method auto's pass takes num_samples + measure_samples windows, its quantization the
    first num_samples: one sampling serves both."""
    monkeypatch.setenv("QSERVE_CACHE_DIR", str(tmp_path))
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    measured = calibration_ids(tiny_llama, tokenizer, "generated", 8, 32)
    monkeypatch.setattr(generated, "_sample", lambda *a: pytest.fail("sampled again"))
    assert torch.equal(calibration_ids(tiny_llama, tokenizer, "generated", 4, 32), measured[:4])


def test_gptq_calibrates_on_generated_text(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QSERVE_CACHE_DIR", str(tmp_path / "cache"))
    settings = QuantizeSettings(method="gptq", calib="generated", num_samples=4, seq_len=32)
    out = quantize_model(tiny_llama, tmp_path / "out", settings)
    assert (out / "config.json").is_file()
    assert len(list((tmp_path / "cache" / "calibration").glob("*.pt"))) == 1


def _with_a_bos(tiny_llama: Path, folder: Path) -> Path:
    """The tiny Llama with a tokenizer that starts every text with a special token (as Gemma's
    puts <bos>); the token is the tokenizer's eos, so the vocabulary stays the model's."""
    from tokenizers import processors

    shutil.copytree(tiny_llama, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    eos = tokenizer.eos_token
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{eos} $A", pair=f"{eos} $A $B", special_tokens=[(eos, tokenizer.eos_token_id)]
    )
    tokenizer.save_pretrained(folder)
    return folder


def test_windows_start_as_the_tokenizer_starts_a_text(tiny_llama: Path, tmp_path: Path) -> None:
    model = _with_a_bos(tiny_llama, tmp_path / "bos")
    tokenizer = AutoTokenizer.from_pretrained(model)
    bos = tokenizer.eos_token_id
    assert tokenizer.encode("a")[0] == bos
    text = load_calibration_text()
    windows = calibration_windows(tokenizer, text, 3, 32)
    assert windows.shape == (3, 32) and windows[:, 0].tolist() == [bos] * 3
    plain = calibration_windows(AutoTokenizer.from_pretrained(tiny_llama), text, 3, 31)
    assert torch.equal(windows[:, 1:], plain)  # the same text windows, one token shorter
    sampled = generated.generated_ids(model, 2, 24, tmp_path / "cache")
    assert sampled.shape == (2, 24) and sampled[:, 0].tolist() == [bos] * 2
    assert bos not in sampled[:, 1].tolist()  # the random first token follows it
