"""``kvagent probe ...``: causal probes on the torch reference model (:mod:`kvagent_bench.probe_notes`)."""

from __future__ import annotations

from pathlib import Path

import typer

from kvagent.cli.common import command_line, console, model_names, print_table
from kvagent.errors import KVAgentError

app = typer.Typer(help="Causal probes of 'Models Take Notes at Prefill' (arXiv:2606.17107) on the float32 torch "
                       "reference model.", no_args_is_help=True)


@app.command("notes")
def probe_notes(
    model: str = typer.Option(None, help="One model (default: every registry model)."),
    template: list[str] = typer.Option(None, help="lookup, derived or multi; repeat for several (default: all)."),
    cases: int = typer.Option(6, help="Flipped cases per template (drawn from the edit suite until found)."),
    json_path: Path = typer.Option(None, "--json", help="Where to write the JSON (default bench/results/probe-notes-<model>.json)."),
    save_calibration: bool = typer.Option(False, help="Store the offset ranking for the selective edit (source: reference-probes)."),
    threads: int = typer.Option(1, help="torch threads (0 = torch's default; 1 is steadiest on a shared machine)."),
) -> None:
    """Field share, locality patching, suffix concentration and knockout of the 'notes' (arXiv:2606.17107) on
    edit-suite cases."""
    from kvagent.edits.suite import TEMPLATES
    from kvagent_bench import probe_notes as pn

    names = template or list(TEMPLATES)
    unknown = [t for t in names if t not in TEMPLATES]
    if unknown:
        console.print(f"[red]error:[/] unknown template(s) {', '.join(unknown)}: use {', '.join(TEMPLATES)}")
        raise typer.Exit(2)
    try:
        with console.status("probing") as status:
            summaries = pn.run(model_names(model), names, cases, json_path, command_line(),
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
            print_table(
                f"{s['model']} {name}: top notes (field + position; effect = increment over the field-only edit)",
                ("offset", "token", "mean effect", "n", "| alone: offset", "token", "mean restored"),
                [[str(a["offset"]), repr(a["text"]), f"{a['mean_effect']:+.4f}", str(a["n"]), str(b["offset"]),
                  repr(b["text"]), f"{b['mean_restored']:+.4f}"] for a, b in zip(g["top_offsets"], g["top_offsets_alone"])],
            )
            print_table(
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
