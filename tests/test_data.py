"""The bundled text: whole chapters, split so nothing is calibrated on what it is scored on; the
calibration mix samples every source, and the held-out text is none of them."""

from __future__ import annotations

from pathlib import Path

import pytest

from qserve import data
from qserve.eval import BUILTIN_EVAL_DATA, load_eval_text
from qserve.quantize.calibration import load_calibration_text


def test_every_chapter_once_in_order() -> None:
    chapters = data.moby_dick(1, 135)
    assert len(chapters) == 135
    for number, text in enumerate(chapters, 1):
        assert text.startswith(f"CHAPTER {number}.")
        assert text.endswith("\n") and not text.endswith("\n\n")
        assert text.count("\nCHAPTER ") == 0  # nothing of the next chapter
    assert chapters[0].startswith("CHAPTER 1. Loomings.\n\nCall me Ishmael.")


def test_eval_and_calibration_splits() -> None:
    eval_text = load_eval_text(BUILTIN_EVAL_DATA)
    assert eval_text == "\n".join(data.moby_dick(1, 10))
    assert load_calibration_text() == data.read_text(data.CALIBRATION_FILE)
    calibration = load_calibration_text("mixed")
    assert calibration == data.calibration_text()
    assert calibration.startswith("CHAPTER 11. Nightgown.")
    assert data.read_text(data.CALIBRATION_FILE) == "\n".join(data.moby_dick(11, 135)).rstrip()
    lines = set(calibration.splitlines()) - {""}
    assert not set(eval_text.splitlines()) & lines - {"CHAPTER 1.", "CHAPTER 2."}
    held = [ln for ln in data.heldout_text().splitlines() if len(ln) > 80]
    assert held and not set(held) & lines


def test_calibration_interleaves_every_source_evenly() -> None:
    """Any stretch of the mixed text (such as the first windows) samples each source."""
    text = data.calibration_text()
    blocks = text.split("\n\n")
    first = {name: data.read_text(f)[:200] for name, f in data.CALIBRATION_SOURCES.items()}
    for name, start in first.items():
        assert start.split("\n\n")[0][:100] in text, name
    head = text[: len(text) // 8]
    for name, f in data.CALIBRATION_SOURCES.items():
        paragraphs = [p for p in data.read_text(f).split("\n\n")[:40] if len(p) > 60]
        assert any(p in head for p in paragraphs), f"{name} missing from the first eighth"
    assert len(blocks) > 5 * 30
    shares = [len(data._blocks(data.read_text(f))) for f in data.CALIBRATION_SOURCES.values()]
    assert min(shares) >= 30  # rounds: the shortest source decides


def test_bundled_files_are_small_and_have_headers() -> None:
    names = [*data.CALIBRATION_SOURCES.values(), data.HELDOUT_FILE, data.EVAL_FILE]
    total = 0
    for name in names:
        raw = (Path(data.__file__).parent / name).read_text(encoding="utf-8")
        assert raw.startswith("# "), name
        assert data.read_text(name) and not data.read_text(name).startswith("# ")
        total += len(raw.encode())
    assert total < 4_000_000


def test_chapters_out_of_range_are_refused() -> None:
    for first, last in ((0, 3), (5, 4), (130, 136)):
        with pytest.raises(ValueError, match="chapters 1-135"):
            data.moby_dick(first, last)
