"""Text bundled with qserve: Herman Melville's Moby-Dick (1851, public domain).

Two files, split so that nothing is calibrated on the text it is scored on (sources in README.md
here):

    moby_dick_eval.txt    chapters 1-10     `qserve eval`'s built-in data, the tests' text
    moby_dick_calib.txt   chapters 11-135   `qserve quantize`'s default calibration text

Each file is a '# ' header, then the chapters one after another, each starting with its
"CHAPTER N." line. `moby_dick(first, last)` gives chapters back exactly as published in the
source package (one paragraph per line, each chapter ending in one newline).
"""

from __future__ import annotations

import functools
import re
from importlib import resources

__all__ = ["CALIBRATION_FILE", "EVAL_FILE", "EVAL_CHAPTERS", "read_text", "moby_dick"]

EVAL_FILE = "moby_dick_eval.txt"
CALIBRATION_FILE = "moby_dick_calib.txt"
EVAL_CHAPTERS = range(1, 11)
CALIBRATION_CHAPTERS = range(11, 136)
_CHAPTER_START = re.compile(r"^CHAPTER (\d+)\.", re.MULTILINE)


def read_text(name: str) -> str:
    """A bundled file's text, its '# ' header (and the blank lines after it) left out."""
    text = resources.files(__name__).joinpath(name).read_text(encoding="utf-8")
    lines = text.splitlines()
    while lines and (lines[0].startswith("# ") or not lines[0].strip()):
        lines.pop(0)
    return "\n".join(lines)


def moby_dick(first: int = 1, last: int = 10) -> list[str]:
    """Chapters first..last (1-135), each as its own string."""
    if not 1 <= first <= last <= CALIBRATION_CHAPTERS[-1]:
        raise ValueError(f"Moby-Dick has chapters 1-135, asked for {first}-{last}")
    chapters = _chapters()
    return [chapters[i] for i in range(first, last + 1)]


@functools.cache
def _chapters() -> dict[int, str]:
    chapters: dict[int, str] = {}
    for name in (EVAL_FILE, CALIBRATION_FILE):
        text = read_text(name)
        starts = list(_CHAPTER_START.finditer(text))
        ends = [m.start() for m in starts[1:]] + [len(text)]
        for m, end in zip(starts, ends):
            chapters[int(m.group(1))] = text[m.start() : end].rstrip("\n") + "\n"
    return chapters
