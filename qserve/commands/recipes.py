"""`qserve recipes list | show | check`."""

from __future__ import annotations

from typing import Any

import click

from qserve.errors import QServeError


@click.group()
def recipes() -> None:
    """Hardware recipes: one YAML per target for quantize and serve (--recipe NAME|PATH|auto)."""


@recipes.command("list")
def recipes_list() -> None:
    """One line per shipped recipe: name, target, method, KV cache dtype, description."""
    from qserve.recipe import shipped_recipes

    for recipe in shipped_recipes():
        click.echo(recipe.summary())


@recipes.command("show")
@click.argument("name")
def recipes_show(name: str) -> None:
    """Print the YAML of recipe NAME (a shipped name or a path)."""
    from qserve.recipe import find_recipe

    click.echo(find_recipe(name).path.read_text(), nl=False)


@recipes.command("check")
@click.argument("name", default="auto")
@click.pass_context
def recipes_check(ctx: click.Context, name: str) -> None:
    """Whether this machine meets NAME's `requires:`, and which recipe `--recipe auto` picks.

    Exits 1 when the machine does not meet NAME's requirements (auto: when nothing fits)."""
    from qserve.recipe import AUTO, detect_hardware, find_recipe, unmet_requirements

    hardware = detect_hardware()
    click.echo(f"this machine: {hardware.describe()}")
    picked = _auto_pick(hardware)
    if name == AUTO:
        ctx.exit(0 if picked is not None else 1)
    recipe = find_recipe(name)
    reasons = unmet_requirements(recipe.requires, hardware)
    verdict = "meets" if not reasons else "does not meet: " + "; ".join(reasons)
    click.echo(f"{recipe.name} ({recipe.spec.hardware}): {verdict}")
    if reasons or picked is None:
        ctx.exit(1)


def _auto_pick(hardware: Any) -> Any:
    """Print and return the recipe `--recipe auto` would pick (None when nothing fits)."""
    from qserve.recipe import select_recipe, shipped_recipes

    try:
        recipe = select_recipe(shipped_recipes(), hardware)
    except QServeError as exc:
        click.echo(f"--recipe auto: {exc}")
        return None
    click.echo(f"--recipe auto picks: {recipe.name} ({recipe.spec.description})")
    return recipe
