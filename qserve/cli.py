"""The `qserve` command line."""

from __future__ import annotations

import logging
import sys
from typing import Any

import click

from qserve.commands.common import engine_options
from qserve.commands.engine import eval_command, generate, serve
from qserve.commands.quantize import quantize
from qserve.commands.recipes import recipes
from qserve.errors import QServeError

logger = logging.getLogger("qserve")
# Third-party loggers that warn at import about things a qserve user cannot act on: torchao
# (pulled in by transformers where installed) about its optional CUDA libraries, and torch's
# pytree about torchao registering enums the deprecated way. Errors still show.
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")


class _Group(click.Group):
    """Turns QServeError into one line on stderr and exit status 2, never a traceback; any
    other failure is one line too (exit 1), its traceback shown only with -v."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except QServeError as exc:
            click.echo(f"error: {exc}", err=True)
            ctx.exit(2)
        except (click.exceptions.Exit, click.ClickException, click.Abort, KeyboardInterrupt):
            raise
        except Exception as exc:
            if logger.isEnabledFor(logging.DEBUG):  # -v
                raise
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            click.echo(f"error: {type(exc).__name__}: {first} (-v shows where)", err=True)
            ctx.exit(1)


@click.group(cls=_Group)
@click.version_option(package_name="qserve")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def cli(verbose: bool) -> None:
    """Quantize Hugging Face LLMs and serve them on a paged-KV engine."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.DEBUG if verbose else logging.ERROR)


def main() -> None:
    cli(prog_name="qserve")


for _command in (generate, serve, eval_command, quantize, recipes):
    cli.add_command(_command)

# Re-exported: scripts and tests add the engine options to their own commands.
__all__ = ["cli", "main", "engine_options"]

if __name__ == "__main__":
    main()
