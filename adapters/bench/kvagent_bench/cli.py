"""``kvagent bench ...``: the benchmarks (:mod:`kvagent_bench`), each writing JSON and a plot.

Registered on ``kvagent`` as the ``bench`` group through the ``kvagent.cli`` entry points
(``adapters/bench/pyproject.toml``). Commands import their benchmark inside their bodies, so ``kvagent --help``
stays fast; the server benchmarks' commands are in :mod:`kvagent_bench.server.cli`.
"""

from __future__ import annotations

from pathlib import Path

import typer

from kvagent.cli.common import command_line, console, model_names, print_table
from kvagent.results import RESULTS_DIR
from kvagent_bench.server import cli as server_cli

app = typer.Typer(help="Benchmarks: write JSON and a plot to bench/results/.", no_args_is_help=True)


@app.command("edit")
def bench_edit(
    model: str = typer.Option(None, help="One model (default: every registry model)."),
    quick: bool = typer.Option(False, help="6 cases per calibration template and format, 12 per held-out one (20+ "
                               "held-out flips per model), 2 long ones, latency at 1k tokens."),
    cases: int = typer.Option(100, help="Cases per template, split, format and model (ignored with --quick)."),
    json_path: Path = typer.Option(None, "--json", help="Where to write the JSON (default bench/results/edit.json)."),
    split: str = typer.Option("both", "--split", help="Templates: calibration (the ones calibrations use), test (the "
                              "held-out ones, kvagent_bench.edit_heldout) or both."),
    formats: str = typer.Option("plain,chat", "--formats", help="Prompt formats, comma-separated: plain, chat."),
    downstream: str = typer.Option("short", "--downstream", help="Held-out downstream lengths, comma-separated: "
                                   "short (four sentences after the record), long (about 2,000 tokens)."),
    long_cases: int = typer.Option(8, help="Cases per held-out template and format with the long downstream."),
    latency_tokens: int = typer.Option(2700, help="Context of the latency rows (0: none; 1,000 with --quick)."),
    strategies: str = typer.Option(",".join(("erratum", "field_only", "selective", "combined", "auto", "implicit",
                                             "recompute")), "--strategies",
                                   help="Edit strategies, comma-separated (recompute, the oracle, always runs)."),
) -> None:
    """Every edit strategy against a full recompute: recovery on flips, edit-to-first-token vs re-prefill."""
    from rich.progress import Progress

    from kvagent_bench import edit

    splits = {"both": ["calibration", "test"], "calibration": ["calibration"], "test": ["test"]}.get(split)
    if splits is None:
        console.print(f"[red]error:[/] unknown split {split!r}: use calibration, test or both")
        raise typer.Exit(2)
    fmts = [f.strip() for f in formats.split(",") if f.strip()]
    if not fmts or set(fmts) - {"plain", "chat"}:
        console.print(f"[red]error:[/] unknown formats {formats!r}: use plain, chat or both comma-separated")
        raise typer.Exit(2)
    json_path = json_path or (RESULTS_DIR / ("edit-quick.json" if quick else "edit.json"))
    downstreams = [d.strip() for d in downstream.split(",") if d.strip()]
    if not downstreams or set(downstreams) - {"short", "long"}:
        console.print(f"[red]error:[/] unknown downstream {downstream!r}: use short, long or both comma-separated")
        raise typer.Exit(2)
    chosen = [s.strip() for s in strategies.split(",") if s.strip()]
    if set(chosen) - set(edit.STRATEGIES):
        console.print(f"[red]error:[/] unknown strategies {strategies!r}: use {', '.join(edit.STRATEGIES)}")
        raise typer.Exit(2)
    chosen = [s for s in edit.STRATEGIES if s in chosen or s == "recompute"]
    n_cases, latency_tokens, reps = (6, min(latency_tokens, 1000), 1) if quick else (cases, latency_tokens, 3)
    test_cases, long_cases = (12, min(long_cases, 2)) if quick else (None, long_cases)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("edit benchmark", total=None)
        rows = edit.run(
            model_names(model), n_cases, latency_tokens, reps, json_path, command_line(),
            progress=lambda msg: progress.update(task, description=msg), splits=splits, formats=fmts,
            downstreams=downstreams, long_cases=long_cases, test_cases=test_cases, strategies=chosen,
        )
    plot_path = json_path.with_suffix(".png")
    edit.plot(rows, plot_path)
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    print_table(
        f"edit strategies vs full recompute ({json_path}, {plot_path})",
        ("model", "split", "format", "downstream", "template", "strategy", "cases", "flips", "recovery", "clear flips",
         "recovery (clear)", "accuracy", "edit->token s", "re-prefill s", "speedup"),
        [[r["model"], r.get("split", "-"), r.get("format", "-"), r.get("downstream", "-"), r["template"], r["strategy"], str(r["n_cases"]),
          fmt(r["n_flips"], "d"),
          fmt(r["recovery"], ".2f"), fmt(r.get("n_clear_flips"), "d"), fmt(r.get("recovery_clear"), ".2f"),
          fmt(r.get("accuracy"), ".2f"), f"{r['edit_to_token_s']:.3f}", f"{r['reprefill_s']:.3f}",
          f"{r['speedup']:.1f}x"] for r in rows],
    )


@app.command("compose")
def bench_compose(
    model: str = typer.Option(None, help="One model (default: every registry model)."),
    quick: bool = typer.Option(False, help="Skills of 256-2k tokens, seams 0 and 4 (about 3 minutes)."),
    json_path: Path = typer.Option(None, "--json", help="Where to write the JSON (default bench/results/compose.json)."),
    skills_dir: Path = typer.Option(Path("skills"), help="Skill files the benchmark texts are built from."),
    prompts: bool = typer.Option(False, help="Only the fidelity of the shipped skills in 14 prompts the tests never "
                                 "use (policies, fields, memories, questions; about 3 minutes a model)."),
) -> None:
    """Skill transplants vs full prefill: cosines, KL, top-1, greedy agreement, TTFT speedup, transplant vs memcpy."""
    import tempfile

    from kvagent_bench import compose

    if prompts:
        json_path = json_path or RESULTS_DIR / "compose-prompts.json"
        with tempfile.TemporaryDirectory() as store, console.status("compose prompts") as status:
            rows = compose.run_prompts(model_names(model), skills_dir, Path(store), json_path, command_line(),
                                       progress=lambda m: status.update(m))
        print_table(f"transplant vs full prefill, held-out prompts ({json_path})",
                    ("model", "prompt", "skills", "cosine", "shift-inv. cosine", "KL", "top-1"),
                    [[r["model"], str(r["prompt"]), ", ".join(r["skills"]), f"{r['cosine']:.4f}",
                      f"{r['logit_cosine']:.4f}", f"{r['kl']:.4f}", "yes" if r["top1_agree"] else "no"] for r in rows])
        return
    json_path = json_path or (RESULTS_DIR / ("compose-quick.json" if quick else "compose.json"))
    sizes, seams = ([256, 1024, 2048], [0, 4]) if quick else ([256, 1024, 2048, 4096, 8192], [0, 1, 4, 16])
    with tempfile.TemporaryDirectory() as store, console.status("compose benchmark") as status:
        rows = compose.run(model_names(model), sizes, seams, skills_dir, Path(store), json_path,
                           command_line(), progress=lambda m: status.update(m))
    compose.plot(rows, json_path.with_suffix(".png"))
    print_table(
        f"skill transplant vs full prefill ({json_path})",
        ("model", "case", "tokens", "seam", "cosine", "shift-inv. cosine", "KL", "top-1", "greedy", "TTFT transplant s",
         "TTFT prefill s", "speedup", "transplant ms", "memcpy ms"),
        [[r["model"], r["case"], str(r["skill_tokens"]), str(r["seam"]), f"{r['cosine']:.4f}", f"{r['logit_cosine']:.4f}",
          f"{r['kl']:.4f}",
          "yes" if r["top1_agree"] else "no", f"{r['greedy_agree']:.2f}", f"{r['ttft_transplant_s']:.3f}",
          f"{r['ttft_prefill_s']:.2f}", f"{r['speedup']:.1f}x", f"{r['transplant_s'] * 1e3:.1f}",
          f"{r['memcpy_s'] * 1e3:.1f}"] for r in rows],
    )


@app.command("backend")
def bench_backend(
    model: str = typer.Option(None, help="One model (default: every registry model)."),
    prompt_tokens: int = typer.Option(1000, help="Prompt length to prefill."),
    decode_tokens: int = typer.Option(64, help="Tokens to decode after it."),
    reps: int = typer.Option(3, help="Repetitions (medians are reported)."),
    json_path: Path = typer.Option(None, "--json", help="Where to write the JSON (default bench/results/backend.json)."),
) -> None:
    """Prefill and decode throughput with flash attention off and on."""
    from kvagent_bench import backend

    json_path = json_path or backend.DEFAULT_JSON
    with console.status("backend benchmark") as status:
        rows = backend.run(model_names(model), prompt_tokens, decode_tokens, reps, json_path,
                           command_line(), progress=lambda m: status.update(m))
    backend.plot(rows, json_path.with_suffix(".png"))
    print_table(
        f"llama.cpp backend throughput ({json_path})",
        ("model", "flash_attn", "prompt tokens", "prefill s", "prefill tok/s", "decode tok/s"),
        [[r["model"], str(r["flash_attn"]), str(r["prompt_tokens"]), f"{r['prefill_s']:.2f}",
          f"{r['prefill_tok_s']:.0f}", f"{r['decode_tok_s']:.1f}"] for r in rows],
    )


@app.command("capture")
def bench_capture(
    model: str = typer.Option(None, help="One model (default: every registry model)."),
    prompt_tokens: int = typer.Option(256, help="Prompt length to prefill."),
    decode_tokens: int = typer.Option(64, help="One-token decode steps after it."),
    reps: int = typer.Option(3, help="Repetitions (medians are reported)."),
    threads: int = typer.Option(1, help="llama.cpp threads (0 = all cores; 1 is steadiest on a shared machine)."),
    json_path: Path = typer.Option(None, "--json", help="Where to write the JSON (default bench/results/capture.json)."),
) -> None:
    """Prefill and decode throughput with activation capture (cb_eval) off, in Python and native."""
    from kvagent_bench import capture

    json_path = json_path or capture.DEFAULT_JSON
    with console.status("capture benchmark") as status:
        rows = capture.run(model_names(model), prompt_tokens, decode_tokens, reps, json_path,
                           command_line(), threads, progress=lambda m: status.update(m))
    capture.plot(rows, json_path.with_suffix(".png"))
    print_table(
        f"activation capture throughput ({json_path})",
        ("model", "capture", "prefill tok/s", "prefill overhead", "decode tok/s", "decode overhead", "graph nodes"),
        [[r["model"], r["capture"], f"{r['prefill_tok_s']:.0f}", f"{r['prefill_overhead']:.1%}",
          f"{r['decode_tok_s']:.1f}", f"{r['decode_overhead']:.1%}", str(r["graph_nodes"] or "-")] for r in rows],
    )


@app.command("evict")
def bench_evict(
    model: str = typer.Option(None, help="One model (default: every registry model)."),
    quick: bool = typer.Option(False, help="Fewer cases, policies and sizes (under 4 minutes per model on 2 cores)."),
    cases: int = typer.Option(None, help="Fact-retention cases per policy and budget (default 30; 3 with --quick)."),
    json_path: Path = typer.Option(None, "--json", help="Where to write the JSON (default bench/results/evict.json)."),
    tasks: str = typer.Option("retention,perplexity,overhead,latency",
                              help="Tasks to run, comma-separated; the JSON keeps the other tasks' rows."),
    suite: str = typer.Option("books", help="'books': the shipped books' cloze (the tasks above); 'heldout': agent "
                              "conversations, tool logs and documents in the chat format (kvagent_bench.evict_heldout)."),
    split: str = typer.Option("test", help="Held-out split: 'calibration' (tune on it) or 'test' (quote it)."),
    contexts: int = typer.Option(24, help="Held-out contexts (3 questions each)."),
    dialogues: int = typer.Option(2, help="Held-out long conversations decoded under eviction (3-4 questions each)."),
    policies: str = typer.Option(None, help="Policies, comma-separated. Held-out: default the calibration "
                                 "candidates on --split calibration, the chosen set on test. Books: every task runs these "
                                 "instead of its own list (retention and perplexity beside the full cache, latency "
                                 "beside the prefill), replacing only their rows. NAME/compact: NAME with Eviction(compact=True), "
                                 "the kept cells renumbered 0..k-1 after each cycle (retention, perplexity, held-out)."),
    budgets: str = typer.Option("0.25", help="Held-out budgets (shares of the context), comma-separated."),
    peer: str = typer.Option(None, help="'kvpress': also run NVIDIA kvpress's presses on the same cases "
                             "(pip install -e 'adapters/bench[kvpress]')."),
    start: int = typer.Option(0, help="First held-out context (to split a run)."),
    threads: int = typer.Option(1, help="llama.cpp threads for the held-out suite (1 is fastest on a busy machine)."),
) -> None:
    """Eviction policies: fact retention, streaming perplexity, per-cycle latency, decode overhead (counter-causal
    surprise: "Back from the Future", Gould and van den Hengel, 2026); with --suite heldout, the held-out agent
    cases next to the full cache (and --peer kvpress)."""
    from kvagent_bench import evict, evict_agent

    if suite == "heldout":
        _bench_evict_heldout(model, split, contexts, dialogues, policies, budgets, peer, json_path, start, threads)
        return
    if suite != "books":
        raise typer.BadParameter(f"unknown suite {suite!r}: use books or heldout", param_hint="--suite")
    json_path = json_path or evict.DEFAULT_JSON
    chosen = tuple(t.strip() for t in tasks.split(",") if t.strip())
    if set(chosen) - set(evict.TASKS):
        raise typer.BadParameter(f"unknown task(s) in {tasks!r}: use {', '.join(evict.TASKS)}", param_hint="--tasks")
    picked = tuple(p.strip() for p in policies.split(",") if p.strip()) if policies else None
    if picked:
        known = evict_agent.bench_policy_names(compact=True)
        unknown = [p for p in picked if p not in known]
        if unknown:
            raise typer.BadParameter(f"unknown policies {unknown}: use {', '.join(sorted(known))}",
                                     param_hint="--policies")
    with console.status("eviction benchmark") as status:
        rows = evict.run(model_names(model), quick, json_path, command_line(),
                         progress=lambda m: status.update(m), cases=cases, tasks=chosen, policies=picked)
    evict.plot(rows, json_path.parent, json_path.stem)

    def fmt(r: dict) -> str:
        if r["score"] is None:
            return "-"
        if r["task"] == "overhead":
            return f"{r['score']:+.1%}"
        ci = f" [{r['ci_low']:.2f}, {r['ci_high']:.2f}]" if r.get("ci_low") is not None else ""
        return f"{r['score']:.2f}{ci}"

    print_table(
        f"eviction ({json_path})",
        ("model", "task", "policy", "budget / n", "score [95% CI]", "ms per cycle"),
        [[r["model"], r["task"], r["policy"], str(r["budget"] if r["task"] != "latency" else r["n"]), fmt(r),
          f"{r['cycle_ms']:.1f}" if r.get("cycle_ms") is not None else "-"] for r in rows],
    )


def _bench_evict_heldout(model: str | None, split: str, contexts: int, dialogues: int, policies: str | None,
                         budgets: str, peer: str | None, json_path: Path | None, start: int, threads: int) -> None:
    from kvagent_bench import evict_agent
    from kvagent_bench.common import RESULTS_DIR
    from kvagent_bench.evict_heldout import SPLITS

    if split not in SPLITS:
        raise typer.BadParameter(f"unknown split {split!r}: use {', '.join(SPLITS)}", param_hint="--split")
    if peer not in (None, "kvpress"):
        raise typer.BadParameter(f"unknown peer {peer!r}: use kvpress", param_hint="--peer")
    if peer:
        from kvagent_bench.evict_peer import _kvpress

        _kvpress()  # a missing kvpress is named with its install command before anything runs
    default = evict_agent.CALIBRATION_POLICIES if split == "calibration" else evict_agent.TEST_POLICIES
    chosen = tuple(p.strip() for p in policies.split(",") if p.strip()) if policies else default
    known = evict_agent.bench_policy_names(compact=True)
    unknown = [p for p in chosen if p not in known]
    if unknown:
        raise typer.BadParameter(f"unknown policies {unknown}: use {', '.join(sorted(known))}", param_hint="--policies")
    shares = tuple(float(b) for b in budgets.split(","))
    json_path = json_path or RESULTS_DIR / f"evict-heldout-{split}.json"
    with console.status("held-out eviction benchmark") as status:
        rows = evict_agent.run_heldout(model_names(model), split, contexts, dialogues, chosen, shares, json_path,
                                       command_line(), peer=bool(peer), progress=lambda m: status.update(m),
                                       threads=threads, start=start)
    evict_agent.plot(rows, json_path.with_suffix(".png"))
    print_table(
        f"held-out eviction ({json_path})",
        ("model", "task", "policy", "budget", "accuracy [95% CI]", "x full", "answer kept", "questions"),
        [[r["model"], r["task"], r["policy"], str(r["budget"]), f"{r['score']:.2f} [{r['ci_low']:.2f}, {r['ci_high']:.2f}]",
          f"{r['ratio']:.2f}" if r.get("ratio") is not None else "-",
          f"{r['answer_kept']:.2f}" if r.get("answer_kept") is not None else "-", str(r["n"])] for r in rows],
    )


@app.command("concurrency")
def bench_concurrency(
    model: str = typer.Option("smollm2-135m", help="The model to load."),
    quick: bool = typer.Option(False, help="32 tokens per session, 3 TTFT repeats, 1 stall run (under 3 minutes)."),
    json_path: Path = typer.Option(None, "--json", help="Where to write the JSON (default "
                                   "bench/results/concurrency.json)."),
    flash_attn: bool = typer.Option(None, "--flash-attn/--no-flash-attn", help="Flash attention (default: the "
                                    "engine's, off)."),
) -> None:
    """Many sessions at once: decode tokens/s batched vs sequential (1-16 sessions), prefill rate, TTFT
    idle vs beside a long prefill, event-loop stall."""
    from kvagent_bench import concurrency

    json_path = json_path or concurrency.DEFAULT_JSON
    with console.status("concurrency benchmark") as status:
        rows = concurrency.run(model, quick, json_path, command_line(), progress=lambda m: status.update(m),
                               flash_attn=flash_attn)
    plot_path = json_path.with_suffix(".png")
    concurrency.plot(rows, plot_path)
    speedup = concurrency.speedups(rows)
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731

    def notes(r: dict) -> str:
        if r["task"] == "decode":
            extra = f"batch {r['mean_batch']:.1f}, same tokens {r['same_tokens']:.0%}, eos early {r['eos_early']}"
            if r["mode"] == "batched":
                extra = f"{speedup[(r['model'], r['sessions'])]:.2f}x sequential, {extra}"
            return extra
        if r["task"] == "prefill":
            return f"{r['prompt_tokens']} tokens"
        if r["task"] == "ttft" and r["mode"] == "loaded":
            return f"beside a {r['long_prefill_tokens']}-token prefill, overlapped {r['overlapped']}/{r['reps']}"
        if r["task"] == "stall":
            return f"p99 {r['p99_stall_ms']:.1f} ms, {r['ticks']} ticks"
        return ""

    print_table(
        f"concurrency ({json_path}, {plot_path})",
        ("model", "task", "mode", "sessions", "tok/s", "TTFT s", "max stall ms", "chunk", "notes"),
        [[r["model"], r["task"], r["mode"], str(r["sessions"]), fmt(r["tokens_per_s"], ".1f"),
          fmt(r["ttft_s"], ".3f"), fmt(r["max_stall_ms"], ".1f"), fmt(r["prefill_chunk"], "d"), notes(r)]
         for r in rows],
    )


@app.command("tools")
def bench_tools(
    model: str = typer.Option(None, help="One model (default: every registry model)."),
    quick: bool = typer.Option(False, help="6 requests, 2 and 4 tools, 1 repetition, 16 decoded tokens."),
    tasks: str = typer.Option("validity,ttft,decode", help="Tasks to run, comma-separated (validity, ttft, decode, "
                              "agent / agent-test: the agent set's dev / test split against llama-cpp-python and "
                              "llama-server, for a tool-trained model; interleaved: TTFT of fresh conversations and later turns of two "
                              "agents served together, for a tool-trained model); the JSON keeps the other tasks' rows."),
    reps: int = typer.Option(None, help="TTFT repetitions (default 3; 1 with --quick)."),
    requests: int = typer.Option(None, help="Requests of the held-out set to run (default all 60; 6 with --quick)."),
    counts: str = typer.Option(None, help="Tools bound in the TTFT tasks, comma-separated (default 4,16,64; 2,4 "
                               "with --quick)."),
    json_path: Path = typer.Option(None, "--json", help="Where to write the JSON (default bench/results/tools.json)."),
) -> None:
    """Tool calling: valid calls with and without the grammar, tool selection, TTFT with 4-64 tools bound vs
    llama-cpp-python's create_chat_completion(tools=...), per-token cost of constrained decoding."""
    from kvagent_bench import tools

    chosen = tuple(t.strip() for t in tasks.split(",") if t.strip())
    if not chosen or set(chosen) - set(tools.TASKS):
        raise typer.BadParameter(f"unknown task(s) in {tasks!r}: use {', '.join(tools.TASKS)}", param_hint="--tasks")
    try:
        plan = tools.Plan.for_run(quick, reps=reps, requests=requests,
                                  counts=[int(n) for n in counts.split(",") if n.strip()] if counts else None)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    json_path = json_path or (RESULTS_DIR / "tools-quick.json" if quick else tools.DEFAULT_JSON)
    with console.status("tools benchmark") as status:
        rows = tools.run(model_names(model), plan, json_path, command_line(), chosen,
                         progress=lambda m: status.update(m))
    plot_path = json_path.with_suffix(".png")
    if any(r["task"] in tools.OVERVIEW_TASKS for r in rows):  # its panels: validity, selection, TTFT, decode
        tools.plot(rows, plot_path)
    ci = lambda r: f"{r['share']:.2f} [{r['ci_low']:.2f}, {r['ci_high']:.2f}] ({r['successes']}/{r['n']})"  # noqa: E731
    for task in ("agent", "agent-test"):
        if any(r["task"] == task for r in rows):
            agent_plot = json_path.with_name(f"{json_path.stem}-{task}.png")
            tools.plot_agent(rows, agent_plot, task)
            print_table(f"agent set, {'test' if task == 'agent-test' else 'dev'} split ({json_path}, {agent_plot})",
                        ("model", "system", "reading", "metric", "share [95% CI]"),
                        [[r["model"], r["system"], r["reading"], r["mode"], ci(r)] for r in rows if r["task"] == task])
    print_table(f"tool calls ({json_path}, {plot_path})", ("model", "task", "mode", "share [95% CI]", "notes"),
                [[r["model"], r["task"], r["mode"], ci(r),
                  f"{r['attempted']} turns wrote {'<tool_call>'}" if "attempted" in r else ""]
                 for r in rows if r["task"] in ("validity", "selection")])
    print_table("time to first token with tools bound", ("model", "tools", "system", "TTFT ms", "x kvagent's",
                                                         "prompt tokens", "computed", "transplanted", "notes"),
                [[r["model"], str(r["tools"]), r["system"], f"{r['ttft_s'] * 1e3:.0f}", f"{r['speedup_vs']:.1f}",
                  f"{r['prompt_tokens']:.0f}", f"{r['computed']:.0f}", f"{r['transplanted']:.0f}",
                  f"compiled once in {r['compile_s']:.1f} s, grammar {r['grammar_s'] * 1e3:.0f} ms"
                  if "compile_s" in r else ""] for r in rows if r["task"] == "ttft"])
    if any(r["task"] == "interleaved" for r in rows):
        interleaved_plot = json_path.with_name(json_path.stem + "-interleaved.png")
        tools.plot_interleaved(rows, interleaved_plot)
        print_table(f"two agents' conversations interleaved ({interleaved_plot})",
                    ("model", "tools", "turn", "system", "TTFT ms", "x kvagent's", "computed", "reused"),
                    [[r["model"], str(r["tools"]), r["kind"], r["system"], f"{r['ttft_s'] * 1e3:.0f}",
                      f"{r['speedup_vs']:.1f}", f"{r['computed']:.0f}", f"{r['reused']:.0f}"]
                     for r in rows if r["task"] == "interleaved"])
    print_table("per-token cost of constrained decoding", ("model", "mode", "ms/token", "added", "added (mask + "
                                                            "consume)", "mask ms/token", "consume ms/token", "tokens"),
                [[r["model"], r["mode"], f"{r['ms_per_token']:.2f}", f"{r['added_share']:+.1%}",
                  f"{r.get('added_direct_share', 0.0):+.1%}",
                  f"{r['mask_ms_per_token']:.3f}", f"{r['consume_ms_per_token']:.3f}", f"{r['tokens']:.0f}"]
                 for r in rows if r["task"] == "decode"])


@app.command("memory")
def bench_memory(
    model: str = typer.Option(None, help="One model (default: every registry model)."),
    quick: bool = typer.Option(False, help="1 persona, a conversation of about 500 tokens (structure only)."),
    personas: int = typer.Option(3, help="Personas per model, 14 questions each (ignored with --quick)."),
    tokens: int = typer.Option(2000, help="Conversation length in tokens (ignored with --quick)."),
    recompiled_timed: int = typer.Option(1, help="Edits of the recompiled way timed one by one (the rest in one "
                                         "recompile)."),
    json_path: Path = typer.Option(None, "--json", help="Where to write the JSON (default bench/results/memory.json)."),
) -> None:
    """Memory edits three ways (head blocks edited by auto, Letta's recompiled prompt, memory after the trajectory
    transplanted): tokens computed and edit-to-first-token per edit, QA accuracy of each vs a full recompute."""
    import tempfile

    from kvagent_bench import memory

    n_personas, n_tokens = (1, 500) if quick else (personas, tokens)
    json_path = json_path or (RESULTS_DIR / ("memory-quick.json" if quick else "memory.json"))
    with console.status("memory benchmark") as status, tempfile.TemporaryDirectory() as store:
        rows = memory.run(model_names(model), n_personas, n_tokens, json_path, command_line(), Path(store),
                          progress=lambda m: status.update(m), recompiled_timed=recompiled_timed)
    plot_path = json_path.with_suffix(".png")
    memory.plot(rows, plot_path)
    ci = lambda r, k: f"{r[k]:.2f} [{r[k + '_ci'][0]:.2f}, {r[k + '_ci'][1]:.2f}]"  # noqa: E731
    print_table(f"memory edits three ways ({json_path}, {plot_path})",
                ("model", "way", "questions", "tokens/edit", "edit->token s", "x fewer tokens", "x sooner",
                 "accuracy [95%]", "full recompute [95%]", "agreement", "McNemar p"),
                [[r["model"], r["way"], str(r["n_questions"]), f"{r['edit_tokens']:.0f}", f"{r['edit_to_token_s']:.3f}",
                  f"{r['tokens_ratio_vs_recompiled']:.1f}" if "tokens_ratio_vs_recompiled" in r else "-",
                  f"{r['ttft_speedup_vs_recompiled']:.1f}" if "ttft_speedup_vs_recompiled" in r else "-",
                  ci(r, "accuracy"), ci(r, "oracle_accuracy"), f"{r['agreement']:.2f}", f"{r['mcnemar_p']:.3f}"]
                 for r in rows])


@app.command("recompute")
def bench_recompute(
    model: str = typer.Option(None, help="One model (default: every registry model)."),
    quick: bool = typer.Option(False, help="One prompt (refund-policy alone), fractions 0 and 10%."),
    json_path: Path = typer.Option(None, "--json", help="Where to write the JSON (default bench/results/recompute.json)."),
    skills_dir: Path = typer.Option(Path("skills"), help="The shipped skill files."),
) -> None:
    """Selective recompute of transplanted skills: next-token logit cosine vs a cold prefill for 0-10% of the
    positions recomputed (ranked at compile time), single skills and three composed, and its cost."""
    from kvagent_bench import recompute

    json_path = json_path or (RESULTS_DIR / ("recompute-quick.json" if quick else "recompute.json"))
    fractions, chosen = ((0.0, 0.10), recompute.cases()[:1]) if quick else (recompute.FRACTIONS, None)
    with console.status("recompute benchmark") as status:
        rows = recompute.run(model_names(model), json_path, command_line(), skills_dir, fractions, chosen,
                             progress=lambda m: status.update(m))
    plot_path = json_path.with_suffix(".png")
    recompute.plot(rows, plot_path)
    print_table(f"selective recompute vs cold prefill ({json_path}, {plot_path})",
                ("model", "skills", "recomputed", "cases", "cosine (median)", "min", "improved", "extra fresh",
                 "s (median)", "x seam only", "cold s"),
                [[r["model"], r["kind"], f"{r['fraction']:.0%}", str(r["n_cases"]), f"{r['cosine_median']:.5f}",
                  f"{r['cosine_min']:.5f}", f"{r['improved']}/{r['n_cases']}", f"{r['extra_fresh_median']:.0f}",
                  f"{r['seconds_median']:.2f}", f"{r['seconds_vs_seam_only']:.2f}", f"{r['cold_s_median']:.2f}"]
                 for r in rows if r["kind"] != "compile"])


@app.command("disk-formats")
def bench_disk_formats(
    model: str = typer.Option(None, help="One model (default: every registry model)."),
    json_path: Path = typer.Option(None, "--json", help="Where to write the JSON (default "
                                   "bench/results/disk-formats.json)."),
    skills_dir: Path = typer.Option(Path("skills"), help="The shipped skill files (the product manual)."),
) -> None:
    """The disk tier's formats (f16, q8_0, deflate) on saved prefixes: bytes, write, read and restore time, and the
    fidelity of what is decoded on top against the f16 file's."""
    from kvagent_bench import disk_formats

    json_path = json_path or (RESULTS_DIR / "disk-formats.json")
    with console.status("disk formats benchmark") as status:
        rows = disk_formats.run(model_names(model), json_path, command_line(), skills_dir,
                                progress=lambda m: status.update(m))
    plot_path = json_path.with_suffix(".png")
    disk_formats.plot(rows, plot_path)
    print_table(f"the disk tier's formats ({json_path}, {plot_path})",
                ("model", "prompt", "tokens", "format", "KiB/token", "vs f16", "write ms", "read ms", "restore ms",
                 "cosine min", "top-1", "greedy agree"),
                [[r["model"], r["prompt"], str(r["tokens"]), r["format"], f"{r['bytes_per_token'] / 1024:.1f}",
                  f"{r['size_vs_f16']:.3f}", f"{r['write_s'] * 1000:.0f}", f"{r['read_s'] * 1000:.0f}",
                  f"{r['restore_s_median'] * 1000:.0f}", f"{r['cosine_min']:.6f}",
                  f"{r['top1_agree']}/{r['questions']}", f">= {r['greedy_agree_min']}/{r['greedy_tokens']}"]
                 for r in rows])


@app.command("agents")
def bench_agents(
    model: str = typer.Option("smollm2-135m", help="Registry model: smollm2-135m, gemma3-270m or qwen2.5-coder-0.5b."),
    targets: str = typer.Option(None, help="Engines, comma-separated: kvagent (kvagent serve, keyed by "
                                "prompt_cache_key), kvagent-keyless (kvagent serve, no session key), "
                                "kvagent-small-pool (the same with a pool of two sequences, with and without the "
                                "tiers), llama-server "
                                "(llama.cpp's server, `make llama-server`; two arms: prompt cache, and --cache-reuse "
                                "256), llama-cpp-python (in process) [default: all]. With --langchain: middleware, "
                                "chat-model, recompute, llama-server [default: all]."),
    traces: str = typer.Option(None, help="Agent traces, comma-separated [default: clock,memory,cleared,summary,tools,"
                               "conversations,fleet; "
                               "with --langchain: dynamic,context,summary,tools]."),
    turns: int = typer.Option(8, min=1, max=8, help="Turns of each trace (the first is cold); with --framework, the "
                              "number of agent tasks."),
    langchain: bool = typer.Option(False, "--langchain", help="LangChain v1 agents (create_agent) with their own "
                                   "middlewares, on kvagent with and without KVCacheMiddleware and on llama-server "
                                   "(ChatOpenAI), and a thread resumed from KVCheckpointer."),
    framework: str = typer.Option(None, help="An agent framework driving kvagent serve with no session key: "
                                  "openai-agents (the OpenAI Agents SDK: `pip install kvagent-bench[agents]`); prompt "
                                  "and cached tokens per request, wall time per task."),
    json_path: Path = typer.Option(None, "--json", help="Where to write the JSON (default "
                                   "bench/results/agents-<model>.json, or agents-langchain-<model>.json; rows of other "
                                   "arms and traces are kept)."),
    replot: bool = typer.Option(False, "--replot", help="Only draw the plot again from the JSON's rows (nothing "
                                "runs)."),
) -> None:
    """Agents that change their own prompt between turns (the time line, a memory block, cleared tool results, a
    summary, the tools bound), sent through the openai client: prompt tokens each engine computes and TTFT per turn."""
    from kvagent.models import REGISTRY
    from kvagent_bench import agent_traces, agents

    if model not in REGISTRY:
        console.print(f"[red]error:[/] unknown model {model!r}: use {', '.join(REGISTRY)}")
        raise typer.Exit(2)
    names = lambda text: [x.strip() for x in text.split(",") if x.strip()]  # noqa: E731
    if replot and (framework or langchain):
        console.print("[red]error:[/] --replot draws the agents' traces (kvagent bench agents --replot): leave out "
                      "--langchain and --framework")
        raise typer.Exit(2)
    if framework:
        _bench_framework_agents(model, framework, turns, json_path)
        return
    if langchain:
        _bench_langchain_agents(model, names(targets or ",".join(lc_arms())), names(traces or ",".join(lc_traces())),
                                json_path)
        return
    targets = targets or ",".join(agents.TARGETS)
    traces = traces or ",".join(agent_traces.TRACES)
    json_path = json_path or agents.default_json(model)
    if replot:
        from kvagent_bench.common import read_results

        rows = read_results(json_path).get("rows")
        if not rows:
            console.print(f"[red]error:[/] --replot draws {json_path}'s rows, and it has none: run the benchmark first "
                          "(or name the JSON with --json)")
            raise typer.Exit(2)
        agents.plot(rows, json_path.with_suffix(".png"), model)
        console.print(f"plot: {json_path.with_suffix('.png')}")
        return
    with console.status("agents benchmark") as status:
        try:
            doc = agents.run(model, names(targets), names(traces), turns, json_path, command_line(),
                             progress=lambda m: status.update(m), log=lambda m: console.print(m))
        except ValueError as exc:
            console.print(f"[red]error:[/] {exc}")
            raise typer.Exit(2) from exc
    plot_path = json_path.with_suffix(".png")
    agents.plot(doc["rows"], plot_path, model)
    fmt = lambda v, spec: "-" if v is None or v != v else format(v, spec)  # noqa: E731
    table = [[arm, name, " ".join(str(c) for c in v["computed_per_turn"]), fmt(v["computed_median"], ".0f"),
              fmt(v.get("hit_rate"), ".2f"), fmt(v["ttft_s_median"] * 1e3, ".0f"),
              fmt(v.get("ttft_vs_kvagent"), ".1f"), fmt(v["cold_ttft_s"] * 1e3 if v["cold_ttft_s"] else None, ".0f")]
             for arm, per in doc["summary"].items() for name, v in per.items() if name != "all"]
    print_table(f"tokens computed and TTFT per turn, {model} ({json_path}, {plot_path})",
                ("arm", "trace", "computed per turn", "median computed", "hit rate", "TTFT ms",
                 "TTFT / kvagent's", "cold TTFT ms"), table)
    console.print("medians over the changed turns (1 on); computed = prompt_tokens - cached_tokens as each engine "
                  "reports them; hit rate = cached / prompt tokens over the changed turns")
    for key, message in doc["errors"].items():
        console.print(f"[red]{key}:[/] {message[:300]}")


def _bench_framework_agents(model: str, framework: str, tasks: int, json_path: Path | None) -> None:
    import importlib.util

    from kvagent_bench import oa_agents

    if framework not in oa_agents.FRAMEWORKS:
        console.print(f"[red]error:[/] unknown framework {framework!r}: use {', '.join(oa_agents.FRAMEWORKS)}")
        raise typer.Exit(2)
    if importlib.util.find_spec("agents") is None:
        console.print("[red]error:[/] the OpenAI Agents SDK is not installed: pip install 'kvagent-bench[agents]'")
        raise typer.Exit(2)
    json_path = json_path or oa_agents.default_json(model)
    with console.status("openai-agents benchmark") as status:
        try:
            doc = oa_agents.run(model, tasks, json_path, command_line(), progress=lambda m: status.update(m))
        except ValueError as exc:
            console.print(f"[red]error:[/] {exc}")
            raise typer.Exit(2) from exc
    fmt = lambda v, spec: "-" if v is None or v != v else format(v, spec)  # noqa: E731
    print_table(f"OpenAI Agents SDK on kvagent serve, no session key, {model} ({json_path})",
                ("task", "call", "messages", "prompt", "cached", "computed", "X-KVAgent-Cache", "resumed", "wall ms"),
                [[*(str(r[k]) for k in ("task", "call", "messages", "prompt_tokens", "cached", "computed", "how")),
                  fmt(r["resumed"], "d"), fmt(r["wall_s"] * 1e3, ".0f")] for r in doc["rows"]])
    s = doc["summary"]
    console.print(f"after the first request: median computed {fmt(s['computed_median'], '.0f')} of "
                  f"{fmt(s['prompt_median'], '.0f')} prompt tokens, hit rate {fmt(s['hit_rate'], '.2f')}, median "
                  f"request {fmt(s['request_wall_s_median'] * 1e3, '.0f')} ms; median task "
                  f"{fmt(s['task_wall_s_median'], '.1f')} s; tasks ended {', '.join(s['ended'])}; any request keyed: "
                  f"{s['any_keyed']}")


def lc_arms() -> tuple[str, ...]:
    from kvagent_bench.lc_agents import ARMS

    return ARMS


def lc_traces() -> tuple[str, ...]:
    from kvagent_bench.lc_agents import TRACES

    return TRACES


def _bench_langchain_agents(model: str, arms: list[str], traces: list[str], json_path: Path | None) -> None:
    from kvagent_bench import lc_agents

    unknown = sorted({*arms} - set(lc_agents.ARMS)) + sorted({*traces} - set(lc_agents.TRACES))
    if unknown:
        console.print(f"[red]error:[/] unknown arms or traces {', '.join(unknown)}: arms {', '.join(lc_agents.ARMS)}, "
                      f"traces {', '.join(lc_agents.TRACES)}")
        raise typer.Exit(2)
    json_path = json_path or lc_agents.default_json(model)
    with console.status("LangChain agents benchmark") as status:
        doc = lc_agents.run(model, arms, traces, json_path, command_line(), log=lambda m: status.update(m))
    plot_path = json_path.with_suffix(".png")
    lc_agents.plot(doc["rows"], doc["summary"], plot_path, model)
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    print_table(f"LangChain create_agent, {model} ({json_path}, {plot_path})",
                ("arm / trace", "calls", "median prompt", "median computed", "max computed", "median TTFT ms",
                 "run wall s", "x llama-server", "x chat model", "answers = recompute"),
                [[key, str(v["calls"]), f"{v['prompt_median']:.0f}", f"{v['computed_median']:.0f}",
                  str(v["computed_max"]), f"{v['ttft_s_median'] * 1e3:.0f}", f"{v['wall_s']:.1f}",
                  fmt(v.get("wall_x_vs_llama-server"), ".1f"), fmt(v.get("wall_x_vs_chat-model"), ".1f"),
                  fmt(v["answers_equal_recompute"], ".2f")] for key, v in doc["summary"].items()])
    resumed = doc.get("resume")
    if resumed:
        console.print(f"resume at {resumed['held_tokens']} tokens: first call TTFT "
                      f"{resumed['checkpointer']['first_call']['ttft_s'] * 1e3:.0f} ms from the checkpointer vs "
                      f"{resumed['cold']['first_call']['ttft_s'] * 1e3:.0f} ms cold ({resumed['ttft_x']:.1f}x); "
                      f"logits equal: {resumed['logits_equal']}")
    for key, message in doc["errors"].items():
        console.print(f"[red]{key}:[/] {message[:300]}")


# the benchmarks that run kvagent's server (and llama.cpp's) on 127.0.0.1
app.command("load")(server_cli.bench_load)
app.command("peer")(server_cli.bench_peer)
app.command("peer-decisions")(server_cli.bench_peer_decisions)
app.command("proxy")(server_cli.bench_proxy)


@app.command("proxy-fidelity")
def bench_proxy_fidelity(
    models: str = typer.Option(",".join(("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b")),
                               help="Registry models, comma-separated."),
    cases: int = typer.Option(8, min=1, help="Cases per held-out template (and downstream)."),
    downstreams: str = typer.Option("short", help="Downstream notes: short, long, or both comma-separated."),
    role: str = typer.Option("system", help="The erratum message's role: system or user."),
    json_path: Path = typer.Option(None, "--json", help="Where to write the JSON (default "
                                   "bench/results/proxy-fidelity.json)."),
) -> None:
    """Decisions after a change forwarded in the proxy's erratum layout against the same change recomputed in place,
    on the held-out decision templates, per model."""
    from kvagent.models import REGISTRY
    from kvagent_bench import proxy_fidelity

    chosen = [m.strip() for m in models.split(",") if m.strip()]
    unknown = [m for m in chosen if m not in REGISTRY]
    parts = [d.strip() for d in downstreams.split(",") if d.strip()]
    if not chosen or unknown or not parts or set(parts) - {"short", "long"} or role not in ("system", "user"):
        console.print(f"[red]error:[/] models from {', '.join(REGISTRY)}; downstreams short,long; role system|user")
        raise typer.Exit(2)
    json_path = json_path or proxy_fidelity.default_json()
    with console.status("proxy fidelity") as status:
        doc = proxy_fidelity.run(chosen, cases, parts, json_path, command_line(), role=role,
                                 progress=lambda m: status.update(m))
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    print_table(f"the proxy's erratum layout vs the change recomputed in place ({json_path})",
                ("model", "template", "cases", "flips", "recovered", "agree", "oracle right", "proxy right"),
                [[r["model"], r["template"], str(r["cases"]), str(r["flips"]), str(r["recovered"]), fmt(r["agree"]),
                  fmt(r["oracle_right"]), fmt(r["proxy_right"])] for r in doc["summary"]])


@app.command("implicit")
def bench_implicit(
    model: str = typer.Option("smollm2-135m", help="Registry model: smollm2-135m, gemma3-270m or qwen2.5-coder-0.5b."),
    traces: str = typer.Option("clock,memory,cleared,summary,tools", help="Agent traces, comma-separated."),
    json_path: Path = typer.Option(None, "--json", help="Where to write the JSON (default "
                                   "bench/results/implicit-<model>.json)."),
    parts: str = typer.Option("diff,crossover,fidelity", help="Parts, comma-separated: diff (its cost on 100k "
                              "characters), crossover (splice vs recompute), fidelity; the JSON keeps the others."),
) -> None:
    """Implicit edits in process: fidelity on the agents traces against a cold prefill next to the cache's own noise
    floor (turns 2 and 5), splice vs recompute as the changed share grows, and the diff's cost on 100k characters."""
    from kvagent.models import REGISTRY
    from kvagent_bench import implicit

    if model not in REGISTRY:
        console.print(f"[red]error:[/] unknown model {model!r}: use {', '.join(REGISTRY)}")
        raise typer.Exit(2)
    chosen = [x.strip() for x in traces.split(",") if x.strip()]
    if not chosen or set(chosen) - set(implicit.TRACES):
        console.print(f"[red]error:[/] unknown traces {traces!r}: use {', '.join(implicit.TRACES)}")
        raise typer.Exit(2)
    chosen_parts = [x.strip() for x in parts.split(",") if x.strip()]
    if not chosen_parts or set(chosen_parts) - set(implicit.PARTS):
        console.print(f"[red]error:[/] unknown parts {parts!r}: use {', '.join(implicit.PARTS)}")
        raise typer.Exit(2)
    json_path = json_path or implicit.default_json(model)
    with console.status("implicit edits") as status:
        doc = implicit.run(model, chosen, json_path, command_line(), progress=lambda m: status.update(m),
                           parts=chosen_parts)
    print_table(f"implicit edits vs a cold prefill, {model} ({json_path})",
                ("trace", "measured turns", "median cosine", "median noise floor", "median - floor", "min cosine",
                 "top-1 agrees"),
                [[name, str(v["n"]), f"{v['cosine_median']:.5f}", f"{v['noise_floor_median']:.5f}",
                  f"{v['median_minus_floor']:+.5f}", f"{v['cosine_min']:.5f}", f"{v['top1_agreement']:.2f}"]
                 for name, v in doc["summary"].items()])
    print_table("splice vs recompute as the changed share of what follows grows",
                ("changed share", "splice s", "recompute s", "splice computed", "recompute computed"),
                [[f"{r['share']:.2f}", f"{r['splice_s']:.3f}", f"{r['recompute_s']:.3f}", str(r["splice_computed"]),
                  str(r["recompute_computed"])] for r in doc["crossover"] or []])
    cost = doc["diff_cost"]
    if cost:
        console.print(f"diff of a {cost['chars']:,}-character prompt ({cost['old_tokens']:,} tokens): "
                      f"{cost['hunks']} regions in {cost['align_s'] * 1e3:.0f} ms; a cold prefill of "
                      f"{cost['prefill_tokens']:,} tokens: {cost['prefill_s']:.1f} s")
