import json

import pytest
import torch

from qserve.errors import QServeError
from qserve.quantize.calibration import calibration_windows, load_calibration_text


class _CharTokenizer:
    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": self.encode(text)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]  # nothing before a text


def test_default_text_is_bundled() -> None:
    text = load_calibration_text()
    assert text.startswith("CHAPTER 11.") and "CHAPTER 135." in text
    assert len(text) > 1_000_000 and "# " not in text.splitlines()[0]


def test_mixed_text_is_bundled() -> None:
    """`mixed`: Moby-Dick first, then the other sources in turn."""
    text = load_calibration_text("mixed")
    assert text.startswith("CHAPTER 11.") and "CHAPTER 20." in text
    assert "TWELFTH NIGHT" in text and "def " in text and "Stratford" in text
    assert len(text) > 400_000 and "# " not in text.splitlines()[0]


def test_txt_and_jsonl(tmp_path) -> None:
    (tmp_path / "a.txt").write_text("hello world")
    assert load_calibration_text(tmp_path / "a.txt") == "hello world"
    rows = [json.dumps({"text": "one"}), "", json.dumps("two")]
    (tmp_path / "b.jsonl").write_text("\n".join(rows))
    assert load_calibration_text(tmp_path / "b.jsonl") == "one\n\ntwo"
    (tmp_path / "c.jsonl").write_text('{"nope": 1}\n')
    with pytest.raises(QServeError, match="c.jsonl:1"):
        load_calibration_text(tmp_path / "c.jsonl")
    with pytest.raises(QServeError, match="does not exist"):
        load_calibration_text(tmp_path / "missing.txt")
    (tmp_path / "d.csv").write_text("x")
    with pytest.raises(QServeError, match=".txt or .jsonl"):
        load_calibration_text(tmp_path / "d.csv")


def test_windows() -> None:
    text = "".join(chr(65 + i % 26) for i in range(100))
    ids = calibration_windows(_CharTokenizer(), text, num_samples=4, seq_len=10)
    assert ids.shape == (4, 10) and ids.dtype == torch.long
    assert ids[:, 0].tolist() == [65, 75, 85, 69]  # non-overlapping, from the start
    ids = calibration_windows(_CharTokenizer(), text, num_samples=20, seq_len=10)
    assert ids.shape == (20, 10) and ids[-1, -1] == ord(text[-1])  # spread over the text
    with pytest.raises(QServeError, match="fewer than seq_len"):
        calibration_windows(_CharTokenizer(), text, num_samples=1, seq_len=101)
