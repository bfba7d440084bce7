"""Real public-domain text for tests: Moby-Dick from ../shared/data (CI lays it beside the repo)."""

from __future__ import annotations

from pathlib import Path

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "moby-dick"


def moby_dick(first: int = 1, last: int = 3) -> str:
    """Chapters first..last joined; chapters 1-10 are the evaluation split."""
    files = [SHARED_DATA / f"chapter_{i:03d}.txt" for i in range(first, last + 1)]
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(
            f"test text {missing[0]} is missing: ../shared must sit beside the repo"
        )
    return "\n".join(f.read_text(encoding="utf-8") for f in files)
