"""Where every benchmark's JSON goes: one writer, and the run's arguments to put beside rows."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_results(path: Path, payload: Any, quiet: bool = False) -> None:
    """`payload` as indented JSON at `path` (its folder made if missing), then a line saying so
    (none when `quiet`: a benchmark that writes after every row)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    if not quiet:
        print(f"wrote {path}")


def run_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The command's arguments and the CPU kind torch dispatches for, for the JSON's "args"."""
    import torch

    return vars(args) | {"output": str(args.output), "cpu": torch.backends.cpu.get_cpu_capability()}


def run_and_report(
    argv: list[str] | None,
    parse_args: Callable[[list[str] | None], argparse.Namespace],
    run: Callable[[argparse.Namespace], dict[str, Any]],
    format_table: Callable[[dict[str, Any]], str],
) -> int:
    """A benchmark's main: parse, run, write the JSON to --output, print the table."""
    args = parse_args(argv)
    summary = run(args)
    write_results(args.output, summary)
    print(format_table(summary))
    return 0
