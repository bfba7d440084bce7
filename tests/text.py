"""Real public-domain text for tests: Moby-Dick, from the copy bundled in `qserve.data`."""

from __future__ import annotations

from qserve import data


def moby_dick(first: int = 1, last: int = 3) -> str:
    """Chapters first..last joined; chapters 1-10 are the evaluation split."""
    return "\n".join(data.moby_dick(first, last))
