"""The root ``kvagent`` app: ``--verbose``, ``demo``, ``models``, and the command groups registered on it."""

from __future__ import annotations

import typer
from rich.table import Table

from kvagent.cli.bench import app as bench_app
from kvagent.cli.common import configure_logging, console
from kvagent.cli.edits import app as edits_app
from kvagent.cli.native import app as native_app
from kvagent.cli.probe import app as probe_app
from kvagent.cli.reference import app as reference_app
from kvagent.cli.skills import app as skills_app
from kvagent.errors import KVAgentError

app = typer.Typer(help="kvagent: a KV cache kept alive across an agent's turns.", no_args_is_help=True)


@app.callback()
def main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log kvagent's debug messages.")) -> None:
    configure_logging(verbose)


@app.command()
def demo(
    model: str = typer.Option("smollm2-135m", help="Registry name or path of a local .gguf file."),
    max_tokens: int = typer.Option(48, help="Most tokens per reply."),
) -> None:
    """Run a small stateful support agent; per turn: tokens reused from cache vs computed, and TTFT."""
    from kvagent.demo import TurnStats, run_demo
    from kvagent.engine import Engine

    try:
        with console.status(f"loading {model}"):
            engine = Engine.load(model, n_ctx=4096, n_seq_max=4)
    except KVAgentError as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from exc
    console.print(f"[bold]kvagent demo[/] on {engine.model.name} ({engine.fingerprint[:12]})")

    def show(row: TurnStats) -> None:
        console.print(f"\n[bold]{row.customer} #{row.turn}:[/] {row.question}\n[green]agent:[/] {row.answer}")
        console.print(
            f"  [dim]reused {row.reused} tokens from cache, computed {row.computed}, "
            f"generated {row.generated}, time to first token {row.ttft_s * 1000:.0f} ms[/]"
        )

    with engine:
        rows = run_demo(engine, max_tokens=max_tokens, on_turn=show)
    table = Table(title="per turn: prompt tokens reused from the KV cache vs computed")
    for col in ("customer", "turn", "reused", "computed", "generated", "TTFT ms"):
        table.add_column(col, justify="right" if col != "customer" else "left")
    for r in rows:
        table.add_row(r.customer, str(r.turn), str(r.reused), str(r.computed), str(r.generated), f"{r.ttft_s * 1000:.0f}")
    console.print(table)
    reused = sum(r.reused for r in rows)
    computed = sum(r.computed for r in rows)
    console.print(f"{reused} of {reused + computed} prompt tokens ({reused / (reused + computed):.0%}) came from the cache.")


@app.command()
def models() -> None:
    """List the registry models and whether their packages are installed."""
    from kvagent.models import REGISTRY, resolve_model

    table = Table(title="kvagent models")
    for col in ("name", "package", "description", "status"):
        table.add_column(col)
    for name, entry in REGISTRY.items():
        try:
            status = f"[green]{resolve_model(name).path}[/]"
        except KVAgentError as exc:
            status = f"[yellow]{exc}[/]"
        table.add_row(name, entry.package, entry.description, status)
    console.print(table)


# command groups, in the order `kvagent --help` lists them (each module defines its own typer app)
app.add_typer(bench_app, name="bench")
app.add_typer(edits_app, name="edits")
app.add_typer(native_app, name="native")
app.add_typer(skills_app, name="skills")
app.add_typer(reference_app, name="reference")
app.add_typer(probe_app, name="probe")
