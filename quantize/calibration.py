"""Calibration data: windows of token ids from a named source or a .txt / .jsonl file.

    moby-dick  chapters 11-135 of Moby-Dick (public domain), bundled as
               `qserve/data/moby_dick_calib.txt`; the default of awq, int8 and fp8
    generated  half text the model samples itself, half moby-dick (`qserve.quantize.generated`);
               the default of gptq and auto: calibrated on one book, GPTQ fits that book and
               loses most of its gain on other text (issue 27)
    mixed      the bundled mix of five kinds of public-domain / permissively licensed English
               (fiction, drama, encyclopedia prose, Python documentation, Python code;
               `qserve.data.calibration_text`, sources in qserve/data/README.md), interleaved
               so every window count samples each source evenly

`QuantizeSettings` resolves a method's default (`CALIB_DEFAULTS`); here None is moby-dick.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qserve.data import CALIBRATION_FILE, calibration_text, read_text
from qserve.errors import QServeError, read_user_text
from qserve.quantize.generated import GENERATED, generated_ids, mixed_with_generated

__all__ = ["MOBY_DICK", "MIXED", "NAMED", "load_calibration_text", "calibration_windows",
           "calibration_ids", "text_prefix"]  # fmt: skip

MOBY_DICK, MIXED = "moby-dick", "mixed"
NAMED = (MOBY_DICK, GENERATED, MIXED)  # the sources `--calib` takes by name


def load_calibration_text(calib: str | Path | None = None) -> str:
    """Text of a .txt file, of a .jsonl file (field "text" of each line, or a bare string per
    line), of the bundled Moby-Dick chapters when `calib` is None, "moby-dick" or "generated"
    (its text half), or of the bundled mix of five sources when it is "mixed"."""
    if calib is None or str(calib) in (MOBY_DICK, GENERATED):
        return read_text(CALIBRATION_FILE)
    if str(calib) == MIXED:
        return calibration_text()
    path = Path(calib)
    if not path.is_file():
        raise QServeError(f"calibration file {path} does not exist", param="calib")
    if path.suffix == ".jsonl":
        return "\n\n".join(_jsonl_texts(path))
    if path.suffix == ".txt":
        return read_user_text(path, "calibration file", "calib")
    raise QServeError(f"calibration file must be .txt or .jsonl, got {path.name}", param="calib")


def _jsonl_texts(path: Path) -> list[str]:
    texts = []
    text = read_user_text(path, "calibration file", "calib")
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row: Any = json.loads(line)
        except json.JSONDecodeError as e:
            raise QServeError(f"{path}:{lineno}: not JSON ({e.msg})", param="calib") from None
        if isinstance(row, dict) and isinstance(row.get("text"), str):
            texts.append(row["text"])
        elif isinstance(row, str):
            texts.append(row)
        else:
            raise QServeError(f'{path}:{lineno}: expected {{"text": ...}} or a string', "calib")
    if not texts:
        raise QServeError(f"calibration file {path} holds no text", param="calib")
    return texts


def calibration_windows(tokenizer: Any, text: str, num_samples: int, seq_len: int) -> Tensor:
    """Token ids [num_samples, seq_len]: non-overlapping windows of the tokenized text, evenly
    spaced (overlapping only when the text is too short for that many). Each window starts the
    way the tokenizer starts a text (Gemma's <bos>; nothing for SmolLM2), as a prompt does when
    the model serves: without it Gemma's activations are unlike any it sees in use."""
    if num_samples < 1 or seq_len < 1:
        raise QServeError("num_samples and seq_len must be positive", param="num_samples")
    prefix = text_prefix(tokenizer)
    if seq_len <= len(prefix):
        raise QServeError(f"seq_len={seq_len} leaves no room for text", param="seq_len")
    windows = _text_windows(tokenizer, text, num_samples, seq_len - len(prefix))
    if not prefix:
        return windows
    return torch.cat([torch.tensor(prefix).expand(num_samples, -1), windows], dim=1)


def _text_windows(tokenizer: Any, text: str, num_samples: int, seq_len: int) -> Tensor:
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    T = ids.numel()
    if T < seq_len:
        raise QServeError(
            f"calibration text has {T} tokens, fewer than seq_len={seq_len}", param="calib"
        )
    if T >= num_samples * seq_len:
        starts = [i * seq_len for i in range(num_samples)]
    else:
        stride = (T - seq_len) / max(1, num_samples - 1)
        starts = [round(i * stride) for i in range(num_samples)]
    return torch.stack([ids[s : s + seq_len] for s in starts])


def calibration_ids(
    model_path: Path, tokenizer: Any, calib: str | Path | None, num_samples: int, seq_len: int
) -> Tensor:
    """The calibration windows [num_samples, seq_len] of `calib` for the model at `model_path`:
    windows of a text, or for "generated" half sampled from the model, half of Moby-Dick,
    alternating."""
    if str(calib) != GENERATED:
        return calibration_windows(tokenizer, load_calibration_text(calib), num_samples, seq_len)
    generated = generated_ids(model_path, (num_samples + 1) // 2, seq_len)
    if num_samples == 1:
        return generated
    text = calibration_windows(tokenizer, load_calibration_text(), num_samples // 2, seq_len)
    return mixed_with_generated(generated, text)


def text_prefix(tokenizer: Any) -> list[int]:
    """The special tokens the tokenizer puts before a text (e.g. [<bos>]; [] for most)."""
    with_special = tokenizer.encode("a", add_special_tokens=True)
    without = tokenizer.encode("a", add_special_tokens=False)
    cut = len(with_special) - len(without)
    if cut < 0 or with_special[cut:] != without:
        return []
    return with_special[:cut]
