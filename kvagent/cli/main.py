"""The root ``kvagent`` app: ``--verbose``, ``demo``, ``models``, and the command groups registered on it."""

from __future__ import annotations

import typer
from rich.table import Table

from kvagent.cli.bench import app as bench_app
from kvagent.cli.chat import app as chat_app
from kvagent.cli.common import configure_logging, console
from kvagent.cli.edits import app as edits_app
from kvagent.cli.gpu import app as gpu_app
from kvagent.cli.native import app as native_app
from kvagent.cli.probe import app as probe_app
from kvagent.cli.reference import app as reference_app
from kvagent.cli.serve import serve
from kvagent.cli.skills import app as skills_app
from kvagent.errors import KVAgentError

app = typer.Typer(help="kvagent: a KV cache kept alive across an agent's turns.", no_args_is_help=True)


@app.callback()
def main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log kvagent's debug messages.")) -> None:
    configure_logging(verbose)


@app.command()
def demo(
    model: str = typer.Option("smollm2-135m", help="Registry name or path of a local .gguf file."),
    max_tokens: int = typer.Option(40, help="Most tokens per reply."),
) -> None:
    """One support conversation, side by side: kvagent (compiled skill, erratum, eviction budget) and
    llama-cpp-python's own create_chat_completion; per turn the prompt tokens computed, TTFT and the answer."""
    from kvagent.demo import BUDGET, DemoTurn, run_demo
    from kvagent.engine import Engine

    try:
        with console.status(f"loading {model}"):
            engine = Engine.load(model, n_ctx=2048, n_seq_max=2)
    except KVAgentError as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from exc
    console.print(f"[bold]kvagent demo[/] on {engine.model.name}: a support agent with a policy, a compiled skill "
                  f"(refund-policy), two fields and a long account history, kept within {BUDGET} KV cells; the same "
                  "conversation through llama-cpp-python's Llama.create_chat_completion beside it.")

    def one_line(text: str) -> str:
        return " ".join(text.split()) or "(empty reply)"

    def show(row: DemoTurn) -> None:
        change = ", ".join(f"{k} -> {v}" for k, v in row.changes.items())
        note = (f"  [cyan]{change}: kvagent appends an erratum line; llama-cpp-python's system prompt is rewritten[/]"
                if change else "")
        k, b = row.kvagent, row.baseline
        console.print(f"\n[bold]turn {row.turn}[/]{note}\n[bold]customer:[/] {row.question}")
        transplanted = f", {k.transplanted} transplanted from the compiled skill" if k.transplanted else ""
        console.print(f"  [green]kvagent[/]          computed {k.computed:>5} tokens, TTFT {k.ttft_s * 1000:>6.0f} ms, "
                      f"{k.cells} KV cells{transplanted}\n    {one_line(k.answer)}")
        console.print(f"  [yellow]llama-cpp-python[/] computed {b.computed:>5} tokens, "
                      f"TTFT {b.ttft_s * 1000:>6.0f} ms\n    {one_line(b.answer)}")

    with engine:
        rows = run_demo(engine, max_tokens=max_tokens, on_turn=show)
    table = Table(title="per turn: prompt tokens computed, time to first token (* a field changed)")
    for col in ("turn", "kvagent\ncomputed", "kvagent\nTTFT ms", "llama-cpp-python\ncomputed",
                "llama-cpp-python\nTTFT ms"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(f"{r.turn}{'*' if r.changes else ''}", str(r.kvagent.computed), f"{r.kvagent.ttft_s * 1000:.0f}",
                      str(r.baseline.computed), f"{r.baseline.ttft_s * 1000:.0f}")
    console.print(table)
    ours, theirs = sum(r.kvagent.computed for r in rows), sum(r.baseline.computed for r in rows)
    ttft_ours, ttft_theirs = sum(r.kvagent.ttft_s for r in rows), sum(r.baseline.ttft_s for r in rows)
    console.print(f"kvagent computed {ours} prompt tokens in all, llama-cpp-python {theirs} "
                  f"({theirs / max(ours, 1):.1f}x as many); summed time to first token {ttft_ours:.1f} s vs "
                  f"{ttft_theirs:.1f} s; kvagent held at most {max(r.kvagent.cells for r in rows)} KV cells "
                  f"(budget {BUDGET}).")


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
app.command("serve")(serve)
app.add_typer(chat_app, name="chat")
app.add_typer(gpu_app, name="gpu")
