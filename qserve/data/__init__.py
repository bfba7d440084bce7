"""Text bundled with qserve (sources and licences in README.md here).

    moby_dick_eval.txt    Moby-Dick chapters 1-10     `qserve eval`'s built-in data, the tests'
    moby_dick_calib.txt   Moby-Dick chapters 11-135   calibration source (fiction)
    calib_shakespeare.txt three plays                 calibration source (drama, dialogue)
    calib_britannica.txt  a 1911 encyclopedia article calibration source (non-fiction)
    calib_python_docs.txt Python language reference   calibration source (documentation)
    calib_python_code.txt Python standard library     calibration source (code)
    heldout_sotu.txt      State of the Union 2010-20  held-out evaluation (speeches): no
                                                      calibration source is of this kind

`calibration_text()` is `qserve quantize --calib mixed`: the calibration sources interleaved a
block at a time, so that any stretch of it samples every source evenly (the default is still
`moby_dick_calib.txt` alone).
`heldout_text()` scores what quantization does to text unlike its calibration.

Each file is a '# ' header, then the chapters one after another, each starting with its
"CHAPTER N." line. `moby_dick(first, last)` gives chapters back exactly as published in the
source package (one paragraph per line, each chapter ending in one newline).
"""

from __future__ import annotations

import functools
import re
from importlib import resources

__all__ = [
    "CALIBRATION_FILE",
    "CALIBRATION_SOURCES",
    "EVAL_FILE",
    "EVAL_CHAPTERS",
    "HELDOUT_FILE",
    "calibration_text",
    "heldout_text",
    "read_text",
    "moby_dick",
]

EVAL_FILE = "moby_dick_eval.txt"
CALIBRATION_FILE = "moby_dick_calib.txt"
# source -> file; `calibration_text` takes a block from each in turn, in this order
CALIBRATION_SOURCES = {
    "fiction": CALIBRATION_FILE,
    "drama": "calib_shakespeare.txt",
    "non-fiction": "calib_britannica.txt",
    "documentation": "calib_python_docs.txt",
    "code": "calib_python_code.txt",
}
HELDOUT_FILE = "heldout_sotu.txt"
BLOCK_CHARS = 2000  # a block: whole paragraphs, about this many characters (~500 tokens)
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


@functools.cache
def calibration_text() -> str:
    """The calibration sources interleaved: a block (whole paragraphs, about BLOCK_CHARS) of
    each in turn, until the shortest one runs out; blocks separated by a blank line."""
    sources = [_blocks(read_text(name)) for name in CALIBRATION_SOURCES.values()]
    rounds = min(len(blocks) for blocks in sources)
    return "\n\n".join(blocks[i] for i in range(rounds) for blocks in sources)


def heldout_text() -> str:
    """The held-out evaluation text (no calibration source is of its kind)."""
    return read_text(HELDOUT_FILE)


def _blocks(text: str) -> list[str]:
    """`text` cut at blank lines into blocks of about BLOCK_CHARS (a longer paragraph stays
    whole)."""
    blocks: list[str] = []
    current: list[str] = []
    size = 0
    for paragraph in text.split("\n\n"):
        current.append(paragraph)
        size += len(paragraph) + 2
        if size >= BLOCK_CHARS:
            blocks.append("\n\n".join(current).strip("\n"))
            current, size = [], 0
    if current:
        blocks.append("\n\n".join(current).strip("\n"))
    return [b for b in blocks if b.strip()]


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
