"""``kvagent chat``: the local desktop agent (Textual), registered on ``kvagent`` through the ``kvagent.cli`` entry
points (``adapters/langchain/pyproject.toml``). The chat model and the app load inside the command."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape

from kvagent.cli.common import console
from kvagent.errors import KVAgentError

app = typer.Typer(help="The local desktop agent: chat with a model and watch its KV cache (span table, reuse "
                       "per turn).")

INSTALL = "pip install -e 'adapters/langchain[desktop]'"


@app.callback(invoke_without_command=True)
def chat(
    model: str = typer.Option("smollm2-135m", help="Registry name or path of a local .gguf file."),
    skills: Path = typer.Option(None, help="Folder (or file) of skill YAML files for /skill NAME (compiled on "
                                           "first use)."),
    field: list[str] = typer.Option(None, help="A declared field NAME=INITIAL for /set (repeatable; default: the "
                                               "support desk's customer and order_status)."),
    policy: str = typer.Option(None, help="System prompt (default: the Northwind Outdoor support policy)."),
    max_tokens: int = typer.Option(128, help="Most tokens per reply."),
    n_ctx: int = typer.Option(4096, help="KV cache size in tokens."),
    capture: str = typer.Option("none", help="Activation capture (none, native, python): needed by /evict surprise."),
    auto_tools: str = typer.Option("each_once", help="How tool_choice auto is decoded: each_once (a model too small "
                                   "to choose, as the default SmolLM2), once (a tool-trained model such as "
                                   "qwen2.5-coder-0.5b: no tool twice per request), or free."),
) -> None:
    """Open the desktop agent (needs the LangChain adapter's desktop extra)."""
    try:
        from langchain_kvagent.desktop import parse_fields, run_desktop
    except ImportError as exc:
        console.print(f"[red]error:[/] the desktop agent needs the LangChain adapter with its desktop extra "
                      f"({escape(str(exc.name or exc))} is missing): run `{escape(INSTALL)}`")
        raise typer.Exit(1) from exc
    from kvagent.demo import POLICY
    from langchain_kvagent import ChatKVAgent

    try:
        fields = parse_fields(field or ["customer=Alice Moreau", "order_status=processing"])
        agent = ChatKVAgent(model=model, policy=policy or POLICY, fields=fields, max_tokens=max_tokens, n_ctx=n_ctx,
                            skill_dirs=[str(skills)] if skills else [], compile_skills=True, capture=capture,
                            auto_tools=auto_tools)
        agent.skill_catalog()  # a bad skills folder is reported here, before the app starts
    except (KVAgentError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from exc
    run_desktop(agent)
