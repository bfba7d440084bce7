"""User-facing errors: one line, no traceback, non-zero exit."""


class QServeError(ValueError):
    """An error caused by user input (bad path, bad option, malformed file or request).

    The CLI prints `error: <message>` and exits with status 2; the server maps it to a 400
    whose OpenAI error body names `param` when one is given.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
