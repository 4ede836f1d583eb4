"""``kvagent serve``: the OpenAI-compatible HTTP server (package ``kvagent-server``, in ``adapters/server``).

The server package is imported inside the command, so ``kvagent --help`` works without it installed.
"""

from __future__ import annotations

from pathlib import Path

import typer

from kvagent.cli.common import console


def serve(
    host: str = typer.Option("127.0.0.1", help="Address to listen on (loopback by default)."),
    port: int = typer.Option(8000, help="Port to listen on."),
    model: str = typer.Option("smollm2-135m", help="Registry name or path of a local .gguf file."),
    n_ctx: int = typer.Option(16384, help="KV pool shared by all live sessions (tokens)."),
    n_seq_max: int = typer.Option(32, help="Sessions held live at once; idle ones beyond are parked."),
    api_key: str = typer.Option(None, envvar="KVAGENT_API_KEY", help="Require 'Authorization: Bearer KEY' "
                                "(or set KVAGENT_API_KEY, which keeps the key out of the process list)."),
    skills: Path = typer.Option(None, "--skills", help="Folder of skill files sessions may include by name."),
    threads: int = typer.Option(0, help="llama.cpp threads (0 = all cores)."),
    flash_attn: bool = typer.Option(True, "--flash-attn/--no-flash-attn", help="Flash attention (on: many "
                                    "sessions share one pool, see README)."),
    park_dir: Path = typer.Option(None, help="Where parked sessions' KV is written (default: a temporary folder)."),
    log_level: str = typer.Option("info", help="uvicorn's log level."),
) -> None:
    """Serve OpenAI-compatible chat completions whose sessions keep their KV cache alive."""
    try:
        from kvagent_server import ServerConfig
        from kvagent_server import serve as run
    except ImportError as exc:
        console.print(f"[red]error:[/] the server package is not installed ({exc}): run "
                      "`pip install -e adapters/server` (make installs it)")
        raise typer.Exit(1) from exc
    config = ServerConfig(model=model, host=host, port=port, n_ctx=n_ctx, n_seq_max=n_seq_max, n_threads=threads,
                          flash_attn=flash_attn, api_key=api_key or None, skills_dir=skills, park_dir=park_dir)
    run(config, log_level=log_level)
