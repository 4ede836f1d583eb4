"""What the command groups share: the console, tables, the model list, the command line, logging."""

from __future__ import annotations

import logging
import sys

from rich.console import Console
from rich.table import Table

from kvagent.models import REGISTRY

console = Console()


def configure_logging(verbose: bool) -> None:
    """Log kvagent's messages to stderr: debug and up with ``verbose``, else warnings and up."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


def print_table(title: str, columns: tuple[str, ...], rows: list[list[str]]) -> None:
    """Print ``rows`` (already formatted cells) as a table with these column headers."""
    table = Table(title=title)
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*row)
    console.print(table)


def model_names(model: str | None) -> list[str]:
    """``[model]`` when one is given, else every registry model."""
    return [model] if model else list(REGISTRY)


def command_line() -> str:
    """The command as typed (``kvagent ...``), recorded in the JSON a measurement writes."""
    return " ".join(["kvagent", *sys.argv[1:]])
