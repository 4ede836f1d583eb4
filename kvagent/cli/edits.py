"""``kvagent edits ...``: edit strategies (calibration of the selective edit and of the auto edit)."""

from __future__ import annotations

from pathlib import Path

import typer

from kvagent.cli.common import console, model_names
from kvagent.edits.calibrate import ENGINE_SETTINGS, calibrate, calibrate_auto
from kvagent.engine import Engine

app = typer.Typer(help="Edit strategies: calibration of the selective and auto edits.", no_args_is_help=True)


@app.command("calibrate")
def edits_calibrate(
    model: str = typer.Option(None, help="One model (default: every registry model)."),
    patch_cases: int = typer.Option(4, help="Cases per template for activation patching."),
    eval_cases: int = typer.Option(12, help="Held-out cases per template to choose K."),
    auto: bool = typer.Option(False, "--auto", help="Calibrate the auto edit instead: measure field_only, selective, "
                              "combined and every erratum rendering on the calibration split, per prompt format, and "
                              "write the choice table (run after the selective calibration to include selective)."),
    auto_cases: int = typer.Option(12, help="With --auto: cases per calibration template and format."),
    formats: str = typer.Option("plain,chat", "--formats", help="With --auto: prompt formats, comma-separated."),
    out: Path = typer.Option(None, help="With --auto: the table to write (default: the one shipped in the package, "
                             "kvagent/edits/data/auto.json)."),
) -> None:
    """Rank downstream positions by activation patching and pick the selective edit's K per model; with
    --auto, choose the auto edit's strategy per model, format and situation."""
    if auto:
        fmts = tuple(f.strip() for f in formats.split(",") if f.strip())
        for name in model_names(model):
            with console.status(f"calibrating the auto edit on {name}") as status, \
                    Engine.load(name, **ENGINE_SETTINGS) as engine:
                result = calibrate_auto(engine, auto_cases, fmts, out=str(out) if out else None,
                                        progress=lambda msg: status.update(msg))
            for fmt, entry in result["formats"].items():
                rows = ", ".join(
                    f"{key}: {m['recovery'] if m['recovery'] is None else format(m['recovery'], '.2f')}"
                    f"/{m['accuracy']:.2f}" for key, m in entry["measured"].items())
                borrowed = f" (borrowed from {entry['borrowed_from']})" if entry.get("borrowed_from") else ""
                console.print(f"{name} ({fmt}): exact -> {entry['exact']}{borrowed}, inexact -> {entry['inexact']} "
                              f"(rendering {entry['rendering']}); recovery/accuracy on "
                              f"{entry['measured']['recompute']['n_flips']} flips: {rows}")
            console.print(f"written to {result['path']}")
        return
    for name in model_names(model):
        with console.status(f"calibrating {name}") as status, Engine.load(name, **ENGINE_SETTINGS) as engine:
            result = calibrate(engine, patch_cases, eval_cases, progress=lambda msg: status.update(msg))
        console.print(
            f"{name}: K={result['k']} (recovery by K: "
            + ", ".join(f"{k}: {r:.2f}" for k, r in result["recovery_by_k"].items())
            + f"; {result['n_flips']} flips); strongest offsets after the field (offset, mean effect): {result['top_offsets']}"
        )
