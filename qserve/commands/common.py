"""What the commands share: the engine's options (one per EngineConfig field, plus MODEL and
--recipe), the server's request limits, and settings from the command line over a recipe."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import click

from qserve.errors import QServeError
from qserve.options import click_options, given_values

logger = logging.getLogger("qserve")
RECIPE_HELP = "Recipe name, YAML path"


def engine_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Options shared by every command that runs the engine (generate, serve, eval): MODEL,
    --recipe and one option per EngineConfig field."""
    from qserve.config import EngineConfig

    func = click_options(EngineConfig, skip=("model",))(func)  # MODEL is an argument
    func = click.option(
        "--recipe", default=None, help=RECIPE_HELP + " or auto; explicit flags win."
    )(func)
    return click.argument("model", required=False)(func)


class _Bytes(click.ParamType):
    """A size such as 8MiB, 512MB or 1048576 (bytes)."""

    name = "size"

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        from qserve.config import parse_memory

        try:
            return value if isinstance(value, int) else parse_memory(value)
        except QServeError as exc:
            self.fail(str(exc), param, ctx)


def limit_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """`qserve serve`'s request limits, one option per RequestLimits field (flag, help and
    default from the field), so a new limit is written once."""
    from qserve.server.limits import RequestLimits

    types = {"count": click.IntRange(1), "bytes": _Bytes()}
    for f in reversed(fields(RequestLimits)):
        meta = f.metadata
        shown = f"{f.default // 2**20}MiB" if meta["kind"] == "bytes" else True
        func = click.option(meta["flag"], f.name, default=f.default, show_default=shown,
                            type=types[meta["kind"]], help=meta["help"])(func)  # fmt: skip
    return func


def engine_config(**kw: Any) -> Any:
    """EngineConfig from the command's options, merged with `--recipe` (explicit flags win)."""
    from qserve.config import EngineConfig

    config, _ = settings_from_cli(EngineConfig, kw, "serve")
    return config


def settings_from_cli(cls: type, kw: dict[str, Any], section: str) -> tuple[Any, Any]:
    """(`cls` from the options the command line gave, over the `section` of the recipe named by
    kw["recipe"], if any, over the field defaults; the recipe or None). Logs what the recipe set."""
    from qserve.recipe import format_settings, merge_settings, resolve_recipe

    given = given_values(cls, kw)
    recipe = resolve_recipe(kw["recipe"]) if kw.get("recipe") else None
    settings, origin = merge_settings(cls, given, recipe, section)
    if recipe is not None:
        shown = format_settings({k: getattr(settings, k) for k in origin}, origin)
        logger.info("recipe %s; effective settings: %s", recipe.name, shown)
    return settings, recipe
