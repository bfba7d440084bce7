"""User-facing errors: one line, no traceback, non-zero exit."""

from __future__ import annotations

import os
from pathlib import Path


class QServeError(ValueError):
    """An error caused by user input (bad path, bad option, malformed file or request).

    The CLI prints `error: <message>` and exits with status 2; the server maps it to a 400
    whose OpenAI error body names `param` when one is given.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def read_user_text(path: str | os.PathLike[str], what: str, param: str | None = None) -> str:
    """A file the user named, as UTF-8 text; unreadable or not text is a one-line QServeError."""
    try:
        return Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise QServeError(f"{what} {path} is not UTF-8 text (byte {exc.start})", param) from None
    except OSError as exc:
        raise QServeError(f"{what} {path}: cannot read it ({exc.strerror})", param) from None


class ContextLengthError(QServeError):
    """A prompt (with the output it asks for) longer than the model's context."""
