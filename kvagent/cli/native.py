"""``kvagent native ...``: the native activation-capture library."""

from __future__ import annotations

import typer

from kvagent.cli.common import console
from kvagent.errors import KVAgentError
from kvagent.native import build_native

app = typer.Typer(help="The native activation-capture library (native/kvcapture.c).", no_args_is_help=True)


@app.command("build")
def native_build(force: bool = typer.Option(False, help="Rebuild even when the library is up to date.")) -> None:
    """Compile the native capture library for the installed llama-cpp-python; exits 0 with a warning if it
    cannot (captures then use the slower Python callback)."""
    try:
        path = build_native(force)
    except KVAgentError as exc:
        console.print(f"[yellow]warning:[/] native capture not built, the Python fallback will be used: {exc}")
        return
    console.print(str(path))
