"""`qserve quantize`: one option per QuantizeSettings field, then the run's own options."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from qserve.commands.common import RECIPE_HELP, settings_from_cli
from qserve.options import click_options


def quantize_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """MODEL, one option per QuantizeSettings field, then the options of the run itself."""
    from qserve.quantize.settings import QuantizeSettings

    run_options = [
        click.option("-o", "--output", default=None, type=click.Path(file_okay=False),
                     help="Checkpoint folder to write. [default: ./MODEL-METHOD-wBITSgGROUP, e.g. "
                     "smollm2-135m-gptq-w4g64; int8: MODEL-int8-w8a8, fp8: MODEL-fp8]"),
        click.option("--scales", default=None, type=click.Path(dir_okay=False),
                     help="awq/int8: save the searched scales here, or replay them if the file "
                     "exists."),
        click.option("--device", default=None, help="Calibrate block by block on cpu, cuda or "
                     "cuda:N. [default: cuda if available, else cpu]"),
        click.option("--offload-dir", default=None, type=click.Path(file_okay=False),
                     help="Keep decoder blocks on disk (read one at a time from the checkpoint's "
                     "safetensors), so models larger than memory quantize; a temporary subfolder "
                     "is removed at the end."),
        click.option("--overwrite", is_flag=True, help="Replace a non-empty output folder."),
        click.option("--dry-run", is_flag=True, help="auto: print the allocation (unit, scheme, "
                     "bytes, predicted error) without quantizing."),
        click.option("-q", "--quiet", is_flag=True, help="No progress bar."),
        click.option("--recipe", default=None, help=RECIPE_HELP + "; explicit flags win."),
    ]  # fmt: skip
    for option in reversed(run_options):
        func = option(func)
    func = click_options(QuantizeSettings)(func)
    return click.argument("model", required=False)(func)


@click.command()
@quantize_options
def quantize(
    model: str | None,
    output: str | None,
    scales: str | None,
    device: str | None,
    offload_dir: str | None,
    overwrite: bool,
    dry_run: bool,
    quiet: bool,
    **kw: Any,
) -> None:
    """Quantize MODEL (default smollm2-135m) into a checkpoint that transformers, vLLM and
    qserve load."""
    import dataclasses
    import time

    from transformers.utils import logging as hf_logging

    from qserve.model.builtin import DEFAULT_MODEL
    from qserve.model.resolve import resolve_model
    from qserve.quantize.driver import quantize_model
    from qserve.quantize.settings import QuantizeSettings
    from qserve.recipe import provenance

    hf_logging.disable_progress_bar()  # ours shows blocks done and time left
    settings, recipe = settings_from_cli(QuantizeSettings, kw, "quantize")
    if dry_run:
        _dry_run(resolve_model(model), settings, quiet)
        return
    start = time.monotonic()
    folder = quantize_model(
        resolve_model(model),
        output,
        settings,
        scales=scales,
        device=device,
        offload_dir=offload_dir,
        overwrite=overwrite,
        progress=None if quiet else _progress_bar,
        model_name=model or DEFAULT_MODEL,
        provenance=provenance(recipe, dataclasses.asdict(settings)),
    )
    if not quiet:
        click.echo("", err=True)
    click.echo(f"wrote {folder} ({settings.method}, {time.monotonic() - start:.0f} s)")


def _dry_run(model_path: Any, settings: Any, quiet: bool) -> None:
    """Measure (or read the cached measurement) and print the allocation; nothing is written."""
    from pathlib import Path

    from qserve.errors import QServeError
    from qserve.quantize.auto.run import format_allocation, plan_auto
    from qserve.quantize.driver import auto_cache_dir

    if settings.method != "auto":
        raise QServeError("--dry-run: only --method auto plans before it quantizes", "dry_run")
    m, allocation = plan_auto(
        Path(model_path), settings, auto_cache_dir(), None if quiet else _progress_bar
    )
    if not quiet:
        click.echo("", err=True)
    click.echo(format_allocation(m, allocation))


def _progress_bar(done: int, total: int, seconds_left: float) -> None:
    width = 30
    filled = width * done // max(total, 1)
    bar = "#" * filled + "-" * (width - filled)
    click.echo(f"\rblocks [{bar}] {done}/{total}, ~{seconds_left:.0f} s left", nl=False, err=True)
