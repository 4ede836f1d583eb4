"""``kvagent skills ...``: compile YAML skills to KV, list what is compiled."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from kvagent.cli.common import console
from kvagent.engine import Engine
from kvagent.errors import KVAgentError
from kvagent.skills.spec import load_skills
from kvagent.skills.store import SkillStore

app = typer.Typer(help="Skills: compile YAML skills to KV once per model, list what is compiled.", no_args_is_help=True)


@app.command("compile")
def skills_compile(
    paths: list[Path] = typer.Argument(None, help="Skill files or folders (default: skills/)."),
    model: str = typer.Option("smollm2-135m", help="Registry name or path of a local .gguf file."),
    plain: bool = typer.Option(False, help="Compile for plain-text sessions (chat=False) instead of chat ones."),
) -> None:
    """Prefill each skill once for MODEL and store its KV (content-addressed; unchanged skills are skipped)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    try:
        specs = load_skills(paths or [Path("skills")])
        engine = Engine.load(model, n_ctx=16384, n_seq_max=2)
    except KVAgentError as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from exc
    with engine, Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                          TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task(f"compiling for {engine.model.name}", total=len(specs))
        renderer = engine.renderer(not plain)
        for spec in specs:
            progress.update(task, description=f"{spec.name}")
            try:
                if spec.tools:  # its tools' segments, as binding them would compile them
                    segments = engine.tool_segments(spec.toolset(), chat=not plain)
                    n = sum(len(renderer.segment_tokens(s)) for s in segments)
                    progress.console.print(f"{spec.name}: {len(segments) - 1} tools, {n} tokens")
                else:
                    skill, entry = engine.skills.compile(spec, renderer)
                    state = f"{entry.bytes / 1e6:.1f} MB" if entry else "already compiled"
                    progress.console.print(f"{spec.name}: {len(skill.tokens)} tokens, {state}")
            except KVAgentError as exc:
                console.print(f"[red]error:[/] {spec.name}: {exc}")
                raise typer.Exit(1) from exc
            progress.advance(task)


@app.command("list")
def skills_list() -> None:
    """Show compiled skills: name, version, model, tokens, size on disk."""
    store = SkillStore()
    table = Table(title=f"compiled skills in {store.root}")
    for col in ("name", "version", "model", "tokens", "size", "compiled", "key"):
        table.add_column(col)
    for e in store.entries():
        table.add_row(e.name, e.version, e.model, str(e.n_tokens), f"{e.bytes / 1e6:.1f} MB", e.created, e.key[:12])
    console.print(table)
