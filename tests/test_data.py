"""The bundled text: whole chapters, split so nothing is calibrated on what it is scored on."""

from __future__ import annotations

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
    calibration = load_calibration_text()
    assert calibration.startswith("CHAPTER 11. Nightgown.")
    assert calibration == "\n".join(data.moby_dick(11, 135)).rstrip("\n")
    assert not set(eval_text.splitlines()[:50]) & set(calibration.splitlines()) - {""}


def test_chapters_out_of_range_are_refused() -> None:
    for first, last in ((0, 3), (5, 4), (130, 136)):
        with pytest.raises(ValueError, match="chapters 1-135"):
            data.moby_dick(first, last)
