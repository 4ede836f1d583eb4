"""The server distribution's command, registered on ``kvagent`` through the ``kvagent.cli`` entry points
(``adapters/server/pyproject.toml``): ``kvagent serve``.

Only typer is imported here: the server (FastAPI, uvicorn) loads inside the command, so ``kvagent --help``
stays fast.
"""

from __future__ import annotations

from pathlib import Path

import typer

from kvagent.cli.common import console


def serve(
    host: str = typer.Option("127.0.0.1", help="Address to listen on (loopback by default; another one needs --keys "
                             "or --api-key)."),
    port: int = typer.Option(8000, help="Port to listen on."),
    model: str = typer.Option("smollm2-135m", help="Registry name or path of a local .gguf file."),
    n_ctx: int = typer.Option(16384, help="KV pool shared by all live sessions (tokens)."),
    n_seq_max: int = typer.Option(32, help="Sessions held live at once; idle ones beyond are parked."),
    api_key: str = typer.Option(None, envvar="KVAGENT_API_KEY", help="Require 'Authorization: Bearer KEY' "
                                "(or set KVAGENT_API_KEY, which keeps the key out of the process list): one tenant."),
    keys: Path = typer.Option(None, "--keys", help="JSON file of tenants: hashed API keys and quotas "
                              "(docs/server.md, Tenants)."),
    secret_file: Path = typer.Option(None, help="Secret that signs saved sessions (created, mode 0600, when "
                                     "missing); default: a new secret per process."),
    restore_unsigned: str = typer.Option("refuse", help="A restore whose signature fails: refuse, or text (its "
                                         "texts only, no KV, no token ids)."),
    allow_origin: list[str] = typer.Option([], "--allow-origin", help="A browser origin allowed to call "
                                           "(repeatable); any other Origin is refused."),
    max_tokens: int = typer.Option(4096, help="Largest max_tokens a request may ask."),
    max_body_kb: int = typer.Option(4096, help="Largest JSON body (KiB)."),
    max_sessions: int = typer.Option(1024, help="Sessions per tenant (a keys file may set its own)."),
    max_in_flight: int = typer.Option(64, help="Requests per tenant at once (a keys file may set its own)."),
    max_parked_mb: int = typer.Option(8192, help="Parked KV per tenant on disk, MiB (a keys file may set its own)."),
    cache_scope: str = typer.Option("tenant", help="Whose KV a session starts from: tenant (any of the tenant's, "
                                    "narrowed by a request's cache_salt) or session (its own session key's only: "
                                    "for users sharing a key; a keys file may set its own)."),
    session_idle_s: int = typer.Option(86400, min=0, help="Keyed sessions unused this long are forgotten "
                                       "(seconds; 0: never)."),
    skills: Path = typer.Option(None, "--skills", help="Folder of skill files sessions may include by name."),
    threads: int = typer.Option(0, help="llama.cpp threads (0 = all cores)."),
    flash_attn: bool = typer.Option(True, "--flash-attn/--no-flash-attn", help="Flash attention (on: many "
                                    "sessions share one pool, see README)."),
    park_dir: Path = typer.Option(None, help="Where parked sessions' KV is written (default: a temporary folder)."),
    prefill_chunk_alone: int = typer.Option(512, min=0, help="Tokens a prefill alone on the engine decodes at once, "
                                            "preempted when another request arrives (0: chunks of 64 always)."),
    cache_ram_mb: int = typer.Option(1024, min=0, help="Host memory (MiB) for prefixes the KV pool gave back, "
                                     "restored by later requests of the same tenant (0: none)."),
    cache_disk_mb: int = typer.Option(4096, min=0, help="Disk (MiB) below the host-memory tier, in a private "
                                      "folder removed at shutdown (0: none)."),
    cache_disk_format: str = typer.Option("f16", help="How the disk tier writes a prefix: f16 (exact), q8_0 (about "
                                          "half the bytes, lossy) or deflate (lossless)."),
    auto_tools: str = typer.Option("free", help="tool_choice auto: free, or once (a tool called since the last user "
                                   "message may not be called again; for small models that repeat their call)."),
    upstream: list[str] = typer.Option([], "--upstream", help="An OpenAI-compatible engine to forward to "
                                       "(repeatable: sessions stick to one), e.g. vLLM's http://127.0.0.1:8001/v1; "
                                       "--model then names its tokenizer and --n-ctx its context (docs/remote.md)."),
    upstream_model: str = typer.Option(None, help="The model id the engines serve (default: --model)."),
    upstream_key: str = typer.Option(None, envvar="KVAGENT_UPSTREAM_KEY", help="Key sent to the engines "
                                     "(or set KVAGENT_UPSTREAM_KEY)."),
    erratum_role: str = typer.Option("system", help="Role of erratum messages: system, or user for a chat "
                                     "template that takes a system message first only."),
    upstream_timeout_s: float = typer.Option(600.0, min=0.1, help="With --upstream: how long a request may wait for "
                                             "its engine, and for its session's previous request (seconds)."),
    inplace_tail_chars: int = typer.Option(1024, min=0, help="With --upstream: a change this close to the end of the "
                                           "prompt (characters) is forwarded in place, not as an erratum."),
    log_level: str = typer.Option("info", help="uvicorn's log level."),
) -> None:
    """Serve OpenAI-compatible chat completions whose sessions keep their KV cache alive."""
    from pydantic import ValidationError

    from kvagent_server import ServerConfig
    from kvagent_server import serve as run
    from kvagent_server.tenants import ConfigError

    try:
        config = ServerConfig(model=model, host=host, port=port, n_ctx=n_ctx, n_seq_max=n_seq_max, n_threads=threads,
                              flash_attn=flash_attn, api_key=api_key, keys_file=keys, secret_file=secret_file,
                              restore_unsigned=restore_unsigned, allowed_origins=tuple(allow_origin),
                              max_tokens=max_tokens, max_body_kb=max_body_kb, max_sessions=max_sessions,
                              max_in_flight=max_in_flight, max_parked_mb=max_parked_mb, cache_scope=cache_scope,
                              session_idle_s=session_idle_s, skills_dir=skills,
                              park_dir=park_dir, prefill_chunk_alone=prefill_chunk_alone or None,
                              cache_ram_mb=cache_ram_mb, cache_disk_mb=cache_disk_mb,
                              cache_disk_format=cache_disk_format,
                              auto_tools=auto_tools, upstream=tuple(upstream), upstream_model=upstream_model,
                              upstream_key=upstream_key, erratum_role=erratum_role,
                              inplace_tail_chars=inplace_tail_chars, upstream_timeout_s=upstream_timeout_s)
        run(config, log_level=log_level)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(x) for x in e['loc']) or 'settings'}: {e['msg']}"
                             for e in exc.errors(include_input=False))
        console.print(f"[red]error:[/] {problems}")
        raise typer.Exit(2) from None
    except ConfigError as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None

