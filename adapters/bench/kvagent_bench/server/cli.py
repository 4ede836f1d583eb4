"""The server benchmarks' commands, registered in the ``kvagent bench`` group by :mod:`kvagent_bench.cli`:
``kvagent bench load``, ``kvagent bench peer`` and ``kvagent bench peer-decisions``.

Only typer is imported here: the server (FastAPI, uvicorn) and the benchmark load inside the commands, so
``kvagent --help`` stays fast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from kvagent.cli.common import command_line, console, print_table


def bench_load(
    quick: bool = typer.Option(False, help="6 agents per rate, a 1-turn warm-up, points cut at 80 s (about 4 minutes)."),
    json_path: Path = typer.Option(None, "--json", help="Where to write the JSON (default bench/results/load.json; "
                                   "load-quick.json with --quick, load-remote*.json for --target remote)."),
    target: str = typer.Option("serve", help="serve: `kvagent serve`; remote: llama-cpp-python's server through "
                               "kvagent's remote sessions; llama-server: llama.cpp's own server (`make llama-server`) "
                               "through kvagent's remote sessions; vllm: vLLM's CPU build (`make vllm`), a plain chat "
                               "client straight to it (inplace) and through `kvagent serve --upstream` (erratum)."),
    slots: int = typer.Option(4, min=1, max=64, help="llama-server only: its slots (-np)."),
    affinity: bool = typer.Option(True, "--affinity/--no-affinity", help="llama-server only: pin each agent to slot "
                                  "agent % slots with id_slot (off: the server picks a slot by prompt similarity)."),
    cache_reuse: int = typer.Option(0, min=0, help="llama-server only: --cache-reuse N (0: off, its default)."),
    doc_chars: int = typer.Option(None, min=100, help="vllm only: the document's length in characters (default: "
                                  "the same ~1,200-token document as the other targets)."),
    start_rate: float = typer.Option(None, min=0.001, help="The first point's rate, agents/s (default 0.125)."),
) -> None:
    """The online benchmark of "Models Take Notes at Prefill" (arXiv:2606.17107): errata vs in-prefix edits under Poisson load (hit rate, p90 TTFT,
    throughput as the agent arrival rate doubles), on a server started on 127.0.0.1."""
    from kvagent_bench.server import load

    if target not in load.TARGETS:
        console.print(f"[red]error:[/] unknown target {target!r}: use one of {', '.join(load.TARGETS)}")
        raise typer.Exit(2)
    options = {"slots": slots, "affinity": affinity, "cache_reuse": cache_reuse} if target == "llama-server" else {}
    if target == "vllm" and doc_chars is not None:
        options = {"doc_chars": doc_chars}
    if target in ("llama-server", "vllm"):
        from importlib import import_module

        missing = import_module(f"kvagent_bench.server.{target.replace('-', '_')}").missing_reason
        if (reason := missing()) is not None:
            console.print(f"[red]error:[/] {reason}")
            raise typer.Exit(1)
    json_path = json_path or load.default_json(target, quick)
    with console.status("load benchmark") as status:
        factory: Any = None
        if target == "vllm":
            from kvagent_bench.server.load_vllm import VllmTarget

            factory = VllmTarget
        rows = load.run(target, quick, json_path, command_line(), progress=lambda m: status.update(m),
                        factory=factory, start_rate=start_rate, **options)
    plot_path = json_path.with_suffix(".png")
    load.plot(rows, plot_path)
    fmt = lambda v, spec: "-" if v is None or v != v else format(v, spec)  # noqa: E731
    print_table(
        f"errata vs in-prefix edits under Poisson load, {target} ({json_path}, {plot_path})",
        ("arm", "agents/s", "offered/s", "done/s", "p50 TTFT", "p90 TTFT", "hit", "by", "turns", "err", "cut"),
        [[r["arm"], f"{r['rate']:g}", fmt(r["offered_rps"], ".2f"), fmt(r["throughput_rps"], ".2f"),
          fmt(r["ttft_p50_s"], ".2f"), fmt(r["ttft_p90_s"], ".2f"), fmt(r["hit_rate"], ".3f"),
          {"server": "server", "vllm-metrics": "vLLM"}.get(r["hit_rate_source"], "client"), str(r["completed"]), str(r["errors"]),
          str(r["censored"])] for r in rows],
    )
    console.print("offered/s, done/s: turns per second offered and completed; TTFT in seconds; hit: prompt tokens "
                  "not computed in their turn, as reported by the server or estimated by the client; cut: turns "
                  "still running when the point was cut (their wait counts as a lower bound)")
    summary = load.compare(rows)
    ratio = summary.get("ttft_p90_ratio")
    console.print(f"at {summary.get('rate', '-')} agents/s (the highest rate both arms ran): p90 TTFT inplace / "
                  f"erratum = {fmt(ratio, '.1f')}x; saturated throughput erratum / inplace = "
                  f"{fmt(summary.get('throughput_ratio'), '.1f')}x")


def bench_peer(
    quick: bool = typer.Option(False, help="1 conversation of 4 turns per arm and policy, 2 cold repeats, no load sweep."),
    models: str = typer.Option("smollm2-135m,gemma3-270m", help="Comma-separated registry models."),
    json_path: Path = typer.Option(None, "--json", help="Where to write the JSON (default bench/results/peer.json; "
                                   "peer-quick.json with --quick)."),
    full_load: bool = typer.Option(False, help="The load sweep's full plan (16 agents a point, up to 7 points, about "
                                   "an hour a model on 2 cores) instead of its quick one (6 agents, 4 points)."),
    parts: str = typer.Option("turns,cold,load", help="Parts to run, comma-separated; the JSON keeps the other "
                              "parts' rows."),
) -> None:
    """kvagent serve against llama.cpp's own llama-server (`make llama-server`) on the same agent conversations:
    per-turn TTFT and prompt tokens computed after a state change, cold prefill on the same prompt, and the Poisson
    load of "Models Take Notes at Prefill" (arXiv:2606.17107)."""
    from kvagent_bench.server import peer
    from kvagent_bench.server.llama_server import missing_reason

    chosen = [m.strip() for m in models.split(",") if m.strip()]
    unknown = [m for m in chosen if m not in peer.MODELS]
    if unknown or not chosen:
        console.print(f"[red]error:[/] unknown model {unknown[0] if unknown else '(none)'!r}: use "
                      f"{', '.join(peer.MODELS)}")
        raise typer.Exit(2)
    if (reason := missing_reason()) is not None:
        console.print(f"[red]error:[/] {reason}")
        raise typer.Exit(1)
    json_path = json_path or peer.default_json(quick)
    with console.status("peer benchmark") as status:
        try:
            rows = peer.run(chosen, quick, json_path, command_line(), progress=lambda m: status.update(m),
                            full_load=full_load, parts=[p.strip() for p in parts.split(",") if p.strip()])
        except ValueError as exc:
            console.print(f"[red]error:[/] {exc}")
            raise typer.Exit(2) from exc
    plot_path = json_path.with_suffix(".png")
    peer.plot(rows, plot_path)
    summary = peer.summarise(rows)
    table = []
    for model, entry in summary.items():
        for size, arms in entry["turns"].items():
            for arm, v in arms.items():
                ratio = "-" if arm == peer.KVAGENT or v["ttft_ratio"] is None else f"{v['ttft_ratio']:.1f}x"
                table.append([model, size, arm, f"{v['ttft_s'] * 1000:.0f}", f"{v['computed']:.0f}", ratio])
    print_table(f"after a state change: median TTFT and prompt tokens computed per turn ({json_path}, {plot_path})",
                ("model", "policy", "arm", "TTFT ms", "computed", "TTFT / kvagent's"), table)
    for model, entry in summary.items():
        cold = entry["cold_tokens_per_s"]
        line = f"{model}: cold prefill " + ", ".join(f"{arm} {v:.0f} tok/s" for arm, v in cold.items())
        if entry.get("cold_ratio") is not None:
            line += f" ({entry['cold_ratio']:.2f}x llama-server's)"
        if entry.get("throughput_ratio") is not None:
            line += f"; saturated throughput {entry['throughput_ratio']:.1f}x llama-server's"
        console.print(line)


def bench_proxy(
    target: str = typer.Option("vllm", help="The engine: vllm (`make vllm`) or llama-server (`make llama-server`)."),
    turns: int = typer.Option(10, min=2, help="Turns of the held-out agent per arm."),
    pairs: int = typer.Option(50, min=5, help="Request pairs of the overhead measure."),
    doc_chars: int = typer.Option(11000, min=100, help="The system prompt's document, in characters (~2.9k tokens "
                                  "with the default)."),
    json_path: Path = typer.Option(None, "--json", help="Where to write the JSON (default "
                                   "bench/results/proxy-<target>.json)."),
) -> None:
    """A plain openai client whose system prompt changes one line per turn, straight to an engine and through
    `kvagent serve --upstream`; and the proxy's added time on an unchanged request."""
    from importlib import import_module

    from kvagent_bench.server import proxy_bench

    if target not in proxy_bench.TARGETS:
        console.print(f"[red]error:[/] unknown target {target!r}: use one of {', '.join(proxy_bench.TARGETS)}")
        raise typer.Exit(2)
    if (reason := import_module(f"kvagent_bench.server.{target.replace('-', '_')}").missing_reason()) is not None:
        console.print(f"[red]error:[/] {reason}")
        raise typer.Exit(1)
    json_path = json_path or proxy_bench.default_json(target)
    with console.status("proxy benchmark") as status:
        doc = proxy_bench.run(target, json_path, command_line(), turns=turns, pairs=pairs, doc_chars=doc_chars,
                              progress=lambda m: status.update(m))
    plot_path = json_path.with_suffix(".png")
    proxy_bench.plot(doc["rows"], plot_path, f"held-out agent, one line changed per turn: {target} direct vs "
                                              "through kvagent serve --upstream")
    print_table(f"held-out openai client, {target} ({json_path}, {plot_path})",
                ("arm", "turn", "TTFT s", "prompt", "cached", "engine hits / queries"),
                [[r["arm"], str(r["turn"]), f"{r['ttft_s']:.3f}", str(r["prompt_tokens"]), str(r["cached_tokens"]),
                  f"{r['vllm_hits']:.0f} / {r['vllm_queries']:.0f}" if "vllm_queries" in r else "-"]
                 for r in doc["rows"]])
    for arm, v in doc["summary"].items():
        if isinstance(v, dict):
            console.print(f"{arm}: hit rate {v['hit_rate']} ({v['hit_rate_source']}), median TTFT "
                          f"{v['ttft_median_s']:.3f} s after the first turn")
    for where in ("overhead_engine", "overhead_stub"):
        o = doc[where]
        console.print(f"{where}: proxy adds {o['added_median_ms']:.2f} ms median ({o['added_p90_ms']:.2f} p90) over "
                      f"{o['pairs']} pairs; direct {o['direct_median_ms']:.2f} ms, proxied {o['proxy_median_ms']:.2f} ms")


def bench_peer_decisions(
    models: str = typer.Option("smollm2-135m,gemma3-270m", help="Comma-separated registry models."),
    formats: str = typer.Option("plain,chat", help="Prompt formats of the held-out templates: plain, chat."),
    downstream: str = typer.Option("short", help="What follows the record: short (four sentences of notes), long "
                                   "(about 2,000 tokens of log entries), or both, comma-separated."),
    cases: int = typer.Option(10, help="Cases per template and format with short notes."),
    long_cases: int = typer.Option(2, help="Cases per template and format with long notes."),
    json_path: Path = typer.Option(None, "--json", help="Where to write the JSON (default "
                                   "bench/results/peer-decisions.json; rows of other models and downstreams kept)."),
) -> None:
    """Decisions after a state change through llama-server's prompt reuse (cache_prompt, --cache-reuse, the state
    changed in place or moved after the notes) and through kvagent's auto edit, on the held-out decision templates:
    how often each recovers the decision of a cold prompt."""
    from kvagent_bench.server import peer_decisions
    from kvagent_bench.server.llama_server import missing_reason

    if (reason := missing_reason()) is not None:
        console.print(f"[red]error:[/] {reason}")
        raise typer.Exit(1)

    def names(text: str) -> list[str]:
        return [x.strip() for x in text.split(",") if x.strip()]

    json_path = json_path or peer_decisions.default_json()
    with console.status("peer decisions") as status:
        try:
            peer_decisions.run(names(models), names(formats), names(downstream), cases, long_cases, json_path,
                               command_line(), progress=lambda m: status.update(m))
        except ValueError as exc:
            console.print(f"[red]error:[/] {exc}")
            raise typer.Exit(2) from exc
    data = json.loads(json_path.read_text())
    plot_path = json_path.with_suffix(".png")
    peer_decisions.plot(data["summary"], plot_path)
    table = [[r["model"], r["arm"], str(r["cases"]), f"{r['recovered']}/{r['flips']}",
              "-" if r["recovery"] is None else f"{r['recovery']:.2f}", f"{r['clear_recovered']}/{r['clear_flips']}",
              "-" if r["shifted_mean"] is None else f"{r['shifted_mean']:.0f}"]
             for r in data["summary"] if r["template"] == "all"]
    print_table(f"recovery of the cold decision after a change ({json_path}, {plot_path})",
                ("model", "arm", "cases", "recovered/flips", "recovery", "clear", "tokens shifted"), table)
    for v in data["verdicts"]:
        parts = []
        for suffix, what in (("", "all flips"), ("_clear", "clear flips")):
            ours, best = v[f"kvagent{suffix}"], v[f"best_peer{suffix}"]
            met = v[f"met{suffix}"]
            parts.append(f"{what}: kvagent auto {ours[0]}/{ours[1]}, best llama-server arm "
                         f"{best[0] if best else '-'}/{best[1] if best else '-'} "
                         f"({'met' if met else 'missed' if met is False else 'no flips'})")
        console.print(f"{v['model']} {v['template']}: " + "; ".join(parts))
