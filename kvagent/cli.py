"""The ``kvagent`` command line: demo, models (later issues add skills, bench, serve)."""

from __future__ import annotations

import logging
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from kvagent.bench.common import RESULTS_DIR
from kvagent.errors import KVAgentError

app = typer.Typer(help="kvagent: a KV cache kept alive across an agent's turns.", no_args_is_help=True)
console = Console()


@app.callback()
def main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log kvagent's debug messages.")) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


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


bench_app = typer.Typer(help="Benchmarks: write JSON and a plot to bench/results/.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
edits_app = typer.Typer(help="Edit strategies: calibration of the selective edit.", no_args_is_help=True)
app.add_typer(edits_app, name="edits")


def _print_table(title: str, columns: tuple[str, ...], rows: list[list[str]]) -> None:
    table = Table(title=title)
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*row)
    console.print(table)


def _models(model: str | None) -> list[str]:
    from kvagent.models import REGISTRY

    return [model] if model else list(REGISTRY)


@bench_app.command("edit")
def bench_edit(
    model: str = typer.Option(None, help="One model (default: every registry model)."),
    quick: bool = typer.Option(False, help="A few cases per template (about 3 minutes)."),
    cases: int = typer.Option(100, help="Cases per template and model (ignored with --quick)."),
    json_path: Path = typer.Option(None, "--json", help="Where to write the JSON (default bench/results/edit.json)."),
) -> None:
    """Every edit strategy against a full recompute: recovery on flips, edit-to-first-token vs re-prefill."""
    import sys

    from rich.progress import Progress

    from kvagent.bench import edit

    json_path = json_path or (RESULTS_DIR / ("edit-quick.json" if quick else "edit.json"))
    n_cases, latency_tokens, reps = (6, 1000, 1) if quick else (cases, 2000, 3)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("edit benchmark", total=None)
        rows = edit.run(
            _models(model), n_cases, latency_tokens, reps, json_path, " ".join(["kvagent", *sys.argv[1:]]),
            progress=lambda msg: progress.update(task, description=msg),
        )
    plot_path = json_path.with_suffix(".png")
    edit.plot(rows, plot_path)
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    _print_table(
        f"edit strategies vs full recompute ({json_path}, {plot_path})",
        ("model", "template", "strategy", "cases", "flips", "recovery", "clear flips", "recovery (clear)",
         "accuracy", "edit->token s", "re-prefill s", "speedup"),
        [[r["model"], r["template"], r["strategy"], str(r["n_cases"]), fmt(r["n_flips"], "d"),
          fmt(r["recovery"], ".2f"), fmt(r.get("n_clear_flips"), "d"), fmt(r.get("recovery_clear"), ".2f"),
          fmt(r.get("accuracy"), ".2f"), f"{r['edit_to_token_s']:.3f}", f"{r['reprefill_s']:.3f}",
          f"{r['speedup']:.1f}x"] for r in rows],
    )


@bench_app.command("compose")
def bench_compose(
    model: str = typer.Option(None, help="One model (default: every registry model)."),
    quick: bool = typer.Option(False, help="Skills of 256-2k tokens, seams 0 and 4 (about 3 minutes)."),
    json_path: Path = typer.Option(None, "--json", help="Where to write the JSON (default bench/results/compose.json)."),
    skills_dir: Path = typer.Option(Path("skills"), help="Skill files the benchmark texts are built from."),
) -> None:
    """Skill transplants vs full prefill: cosine, top-1, greedy agreement, TTFT speedup, transplant vs memcpy."""
    import sys
    import tempfile

    from kvagent.bench import compose

    json_path = json_path or (RESULTS_DIR / ("compose-quick.json" if quick else "compose.json"))
    sizes, seams = ([256, 1024, 2048], [0, 4]) if quick else ([256, 1024, 2048, 4096, 8192], [0, 1, 4, 16])
    with tempfile.TemporaryDirectory() as store, console.status("compose benchmark") as status:
        rows = compose.run(_models(model), sizes, seams, skills_dir, Path(store), json_path,
                           " ".join(["kvagent", *sys.argv[1:]]), progress=lambda m: status.update(m))
    compose.plot(rows, json_path.with_suffix(".png"))
    _print_table(
        f"skill transplant vs full prefill ({json_path})",
        ("model", "case", "tokens", "seam", "cosine", "top-1", "greedy", "TTFT transplant s", "TTFT prefill s",
         "speedup", "transplant ms", "memcpy ms"),
        [[r["model"], r["case"], str(r["skill_tokens"]), str(r["seam"]), f"{r['cosine']:.4f}",
          "yes" if r["top1_agree"] else "no", f"{r['greedy_agree']:.2f}", f"{r['ttft_transplant_s']:.3f}",
          f"{r['ttft_prefill_s']:.2f}", f"{r['speedup']:.1f}x", f"{r['transplant_s'] * 1e3:.1f}",
          f"{r['memcpy_s'] * 1e3:.1f}"] for r in rows],
    )


@bench_app.command("backend")
def bench_backend(
    model: str = typer.Option(None, help="One model (default: every registry model)."),
    prompt_tokens: int = typer.Option(1000, help="Prompt length to prefill."),
    decode_tokens: int = typer.Option(64, help="Tokens to decode after it."),
    reps: int = typer.Option(3, help="Repetitions (medians are reported)."),
    json_path: Path = typer.Option(None, "--json", help="Where to write the JSON (default bench/results/backend.json)."),
) -> None:
    """Prefill and decode throughput with flash attention off and on."""
    import sys

    from kvagent.bench import backend

    json_path = json_path or backend.DEFAULT_JSON
    with console.status("backend benchmark") as status:
        rows = backend.run(_models(model), prompt_tokens, decode_tokens, reps, json_path,
                           " ".join(["kvagent", *sys.argv[1:]]), progress=lambda m: status.update(m))
    backend.plot(rows, json_path.with_suffix(".png"))
    _print_table(
        f"llama.cpp backend throughput ({json_path})",
        ("model", "flash_attn", "prompt tokens", "prefill s", "prefill tok/s", "decode tok/s"),
        [[r["model"], str(r["flash_attn"]), str(r["prompt_tokens"]), f"{r['prefill_s']:.2f}",
          f"{r['prefill_tok_s']:.0f}", f"{r['decode_tok_s']:.1f}"] for r in rows],
    )


@bench_app.command("capture")
def bench_capture(
    model: str = typer.Option(None, help="One model (default: every registry model)."),
    prompt_tokens: int = typer.Option(256, help="Prompt length to prefill."),
    decode_tokens: int = typer.Option(64, help="One-token decode steps after it."),
    reps: int = typer.Option(3, help="Repetitions (medians are reported)."),
    threads: int = typer.Option(1, help="llama.cpp threads (0 = all cores; 1 is steadiest on a shared machine)."),
    json_path: Path = typer.Option(None, "--json", help="Where to write the JSON (default bench/results/capture.json)."),
) -> None:
    """Prefill and decode throughput with activation capture (cb_eval) off, in Python and native."""
    import sys

    from kvagent.bench import capture

    json_path = json_path or capture.DEFAULT_JSON
    with console.status("capture benchmark") as status:
        rows = capture.run(_models(model), prompt_tokens, decode_tokens, reps, json_path,
                           " ".join(["kvagent", *sys.argv[1:]]), threads, progress=lambda m: status.update(m))
    capture.plot(rows, json_path.with_suffix(".png"))
    _print_table(
        f"activation capture throughput ({json_path})",
        ("model", "capture", "prefill tok/s", "prefill overhead", "decode tok/s", "decode overhead", "graph nodes"),
        [[r["model"], r["capture"], f"{r['prefill_tok_s']:.0f}", f"{r['prefill_overhead']:.1%}",
          f"{r['decode_tok_s']:.1f}", f"{r['decode_overhead']:.1%}", str(r["graph_nodes"] or "-")] for r in rows],
    )


@bench_app.command("evict")
def bench_evict(
    model: str = typer.Option(None, help="One model (default: every registry model)."),
    quick: bool = typer.Option(False, help="Fewer cases, policies and sizes (about 3 minutes per model)."),
    cases: int = typer.Option(None, help="Fact-retention cases per policy and budget (default 5; 2 with --quick)."),
    json_path: Path = typer.Option(None, "--json", help="Where to write the JSON (default bench/results/evict.json)."),
) -> None:
    """Eviction policies: fact retention, streaming perplexity, per-cycle latency (source paper B)."""
    import sys

    from kvagent.bench import evict

    json_path = json_path or evict.DEFAULT_JSON
    with console.status("eviction benchmark") as status:
        rows = evict.run(_models(model), quick, json_path, " ".join(["kvagent", *sys.argv[1:]]),
                         progress=lambda m: status.update(m), cases=cases)
    evict.plot(rows, json_path.parent)

    def fmt(r: dict) -> str:
        if r["task"] == "retention":
            return f"{r['score']:.2f}"
        return f"{r['score']:.2f}" if r["score"] is not None else "-"

    _print_table(
        f"eviction ({json_path})",
        ("model", "task", "policy", "budget / n", "score", "ms per cycle"),
        [[r["model"], r["task"], r["policy"], str(r["budget"] if r["task"] != "latency" else r["n"]), fmt(r),
          f"{r['cycle_ms']:.1f}" if r.get("cycle_ms") is not None else "-"] for r in rows],
    )


native_app = typer.Typer(help="The native activation-capture library (native/kvcapture.c).", no_args_is_help=True)
app.add_typer(native_app, name="native")


@native_app.command("build")
def native_build(force: bool = typer.Option(False, help="Rebuild even when the library is up to date.")) -> None:
    """Compile the native capture library for the installed llama-cpp-python; exits 0 with a warning if it
    cannot (captures then use the slower Python callback)."""
    from kvagent.native import build_native

    try:
        path = build_native(force)
    except KVAgentError as exc:
        console.print(f"[yellow]warning:[/] native capture not built, the Python fallback will be used: {exc}")
        return
    console.print(str(path))


@edits_app.command("calibrate")
def edits_calibrate(
    model: str = typer.Option(None, help="One model (default: every registry model)."),
    patch_cases: int = typer.Option(4, help="Cases per template for activation patching."),
    eval_cases: int = typer.Option(12, help="Held-out cases per template to choose K."),
) -> None:
    """Rank downstream positions by activation patching and pick the selective edit's K per model."""
    from kvagent.bench.calibrate import calibrate

    for name in _models(model):
        with console.status(f"calibrating {name}") as status:
            result = calibrate(name, patch_cases, eval_cases, progress=lambda msg: status.update(msg))
        console.print(
            f"{name}: K={result['k']} (recovery by K: "
            + ", ".join(f"{k}: {r:.2f}" for k, r in result["recovery_by_k"].items())
            + f"; {result['n_flips']} flips); strongest offsets after the field (offset, mean effect): {result['top_offsets']}"
        )


skills_app = typer.Typer(help="Skills: compile YAML skills to KV once per model, list what is compiled.", no_args_is_help=True)
app.add_typer(skills_app, name="skills")


@skills_app.command("compile")
def skills_compile(
    paths: list[Path] = typer.Argument(None, help="Skill files or folders (default: skills/)."),
    model: str = typer.Option("smollm2-135m", help="Registry name or path of a local .gguf file."),
    plain: bool = typer.Option(False, help="Compile for plain-text sessions (chat=False) instead of chat ones."),
) -> None:
    """Prefill each skill once for MODEL and store its KV (content-addressed; unchanged skills are skipped)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from kvagent.engine import Engine
    from kvagent.skills.spec import load_skills

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
                skill, entry = engine.skills.compile(spec, renderer)
            except KVAgentError as exc:
                console.print(f"[red]error:[/] {spec.name}: {exc}")
                raise typer.Exit(1) from exc
            state = f"{entry.bytes / 1e6:.1f} MB" if entry else "already compiled"
            progress.console.print(f"{spec.name}: {len(skill.tokens)} tokens, {state}")
            progress.advance(task)


@skills_app.command("list")
def skills_list() -> None:
    """Show compiled skills: name, version, model, tokens, size on disk."""
    from kvagent.skills.store import SkillStore

    store = SkillStore()
    table = Table(title=f"compiled skills in {store.root}")
    for col in ("name", "version", "model", "tokens", "size", "compiled", "key"):
        table.add_column(col)
    for e in store.entries():
        table.add_row(e.name, e.version, e.model, str(e.n_tokens), f"{e.bytes / 1e6:.1f} MB", e.created, e.key[:12])
    console.print(table)


reference_app = typer.Typer(help="The torch reference model (oracle) on the same GGUF.", no_args_is_help=True)
app.add_typer(reference_app, name="reference")


@reference_app.command("check")
def reference_check(
    model: str = typer.Option(None, help="One model (default: every registry model)."),
    prompts: int = typer.Option(3, help="512-token prompts (one per shipped public-domain book)."),
    length: int = typer.Option(512, help="Tokens per prompt."),
    f32: bool = typer.Option(False, "--f32", help="Also compare on a float32 copy of the GGUF (written once, cached)."),
    json_path: Path = typer.Option(None, "--json", help="Also write the figures as JSON here."),
) -> None:
    """Compare next-token logits of the reference and llama.cpp; exit 1 below cosine 0.999 / top-1 95%.

    With --f32 the same comparison runs on a float32 copy of the weights, where llama.cpp does not
    quantize activations: what remains there is modelling error, not kernel noise."""
    import json

    from kvagent.engine import Engine
    from kvagent.reference.check import MIN_COSINE, MIN_TOP1, compare, prose_prompts
    from kvagent.models import resolve_model
    from kvagent.reference.export import export_f32
    from kvagent.reference.model import ReferenceModel

    results = []
    for name in _models(model):
        try:
            with console.status(f"{name}: loading the reference"):
                ref = ReferenceModel.load(resolve_model(name).path)
            targets = [name]
            if f32:
                with console.status(f"{name}: writing its float32 copy"):
                    targets.append(str(export_f32(resolve_model(name))))
            for target in targets:
                with console.status(f"{Path(target).name}: comparing logits"):
                    engine = Engine.load(target, n_ctx=max(1024, length), n_seq_max=2)
                    with engine:
                        results.append(compare(engine, ref, prose_prompts(engine, prompts, length)))
        except KVAgentError as exc:
            console.print(f"[red]error:[/] {exc}")
            raise typer.Exit(2) from exc
    _print_table(
        f"reference vs llama.cpp: next-token logits (targets: mean cosine >= {MIN_COSINE}, top-1 >= {MIN_TOP1:.0%})",
        ("model", "positions", "mean cos", "p5 cos", "min cos", "top-1", "top-1 (margin>=1)", "llama tok/s", "ref tok/s", "pass"),
        [[r.model, str(r.positions), f"{r.mean_cosine:.5f}", f"{r.p5_cosine:.5f}", f"{r.min_cosine:.5f}",
          f"{r.top1:.1%}", f"{r.clear_top1:.1%}", f"{r.llama_tok_s:.0f}", f"{r.reference_tok_s:.0f}",
          "yes" if r.passed else "[red]no[/]"] for r in results],
    )
    if json_path:
        json_path.write_text(json.dumps([r.as_dict() for r in results], indent=2))
    if not all(r.passed for r in results):
        raise typer.Exit(1)


probe_app = typer.Typer(help="Causal probes of source paper A on the float32 torch reference model.", no_args_is_help=True)
app.add_typer(probe_app, name="probe")


@probe_app.command("notes")
def probe_notes(
    model: str = typer.Option(None, help="One model (default: every registry model)."),
    template: list[str] = typer.Option(None, help="lookup, derived or multi; repeat for several (default: all)."),
    cases: int = typer.Option(6, help="Flipped cases per template (drawn from the edit suite until found)."),
    json_path: Path = typer.Option(None, "--json", help="Where to write the JSON (default bench/results/probe-notes-<model>.json)."),
    save_calibration: bool = typer.Option(False, help="Store the offset ranking for the selective edit (source: reference-probes)."),
    threads: int = typer.Option(1, help="torch threads (0 = torch's default; 1 is steadiest on a shared machine)."),
) -> None:
    """Field share, locality patching, suffix concentration and knockout of paper A's "notes" on edit-suite cases."""
    import sys

    from kvagent.bench import probe_notes as pn
    from kvagent.bench.edit_suite import TEMPLATES

    names = template or list(TEMPLATES)
    unknown = [t for t in names if t not in TEMPLATES]
    if unknown:
        console.print(f"[red]error:[/] unknown template(s) {', '.join(unknown)}: use {', '.join(TEMPLATES)}")
        raise typer.Exit(2)
    try:
        with console.status("probing") as status:
            summaries = pn.run(_models(model), names, cases, json_path, " ".join(["kvagent", *sys.argv[1:]]),
                               save_calibration, threads, progress=lambda m: status.update(m))
    except KVAgentError as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from exc
    for s in summaries:
        for name in [*names, "all"]:
            g = s.get(name)
            if not g:
                continue
            ks = list(g["top_k"])
            console.print(
                f"[bold]{s['model']} {name}[/]: {g['n_cases']} flipped cases ({g['n_both_correct']} right both times); "
                f"field share (value K/V only) mean {g['field_share_mean']:.3f}, median {g['field_share_median']:.3f}; "
                f"field segment {g['segment_share_mean']:.3f}; downstream without the field {g['downstream_share_mean']:.3f}; "
                f"10% nearest the question carry {g['near_share_mean']:.1%} of |effects|"
            )
            _print_table(
                f"{s['model']} {name}: top notes (field + position; effect = increment over the field-only edit)",
                ("offset", "token", "mean effect", "n", "| alone: offset", "token", "mean restored"),
                [[str(a["offset"]), repr(a["text"]), f"{a['mean_effect']:+.4f}", str(a["n"]), str(b["offset"]),
                  repr(b["text"]), f"{b['mean_restored']:+.4f}"] for a, b in zip(g["top_offsets"], g["top_offsets_alone"])],
            )
            _print_table(
                f"{s['model']} {name}: suffix concentration (restored) and knockout (share of the old margin lost, "
                f"{g['n_knockout']} cases with a margin >= 0.5; logits lost over all cases)",
                ("k", "field + top-k", "field + last-k", "KO top-k", "KO random k", "KO top-k logits",
                 "KO random logits", "KO top-k flips"),
                [[str(k), f"{g['top_k'][k]:.3f}", f"{g['last_k'][k]:.3f}", f"{g['knockout_top'][k]:.3f}",
                  f"{g['knockout_random'][k]:.3f}", f"{g['knockout_top_logits'][k]:+.2f}",
                  f"{g['knockout_random_logits'][k]:+.2f}", f"{g['knockout_top_flips'][k]:.0%}"] for k in ks],
            )
            console.print(
                f"  knockout (share of old margin / logits): field {g['knockout_field']:.3f} / "
                f"{g['knockout_field_logits']:+.2f}, all downstream {g['knockout_downstream']:.3f} / "
                f"{g['knockout_downstream_logits']:+.2f}, field + downstream {g['knockout_all']:.3f} / "
                f"{g['knockout_all_logits']:+.2f} (mean old margin {g['margin_old_mean']:.2f} logits)"
            )
        cal = s["calibration"]
        console.print(
            f"{s['model']}: selective on the reference with the pooled ranking ({', '.join(cal['templates'])}, in-sample): "
            + ", ".join(f"K={k}: {r:.2f}" for k, r in cal["selective_recovery_by_k"].items())
            + f"; K={cal['k']}" + (" [green]saved to the calibration store[/]" if cal["saved"] else "")
            + f"; dropped: {s['dropped']}; JSON: {s['json']}"
        )


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


if __name__ == "__main__":
    app()
