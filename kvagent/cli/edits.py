"""``kvagent edits ...``: edit strategies (calibration of the selective edit)."""

from __future__ import annotations

import typer

from kvagent.cli.common import console, model_names

app = typer.Typer(help="Edit strategies: calibration of the selective edit.", no_args_is_help=True)


@app.command("calibrate")
def edits_calibrate(
    model: str = typer.Option(None, help="One model (default: every registry model)."),
    patch_cases: int = typer.Option(4, help="Cases per template for activation patching."),
    eval_cases: int = typer.Option(12, help="Held-out cases per template to choose K."),
) -> None:
    """Rank downstream positions by activation patching and pick the selective edit's K per model."""
    from kvagent.edits.calibrate import calibrate

    for name in model_names(model):
        with console.status(f"calibrating {name}") as status:
            result = calibrate(name, patch_cases, eval_cases, progress=lambda msg: status.update(msg))
        console.print(
            f"{name}: K={result['k']} (recovery by K: "
            + ", ".join(f"{k}: {r:.2f}" for k, r in result["recovery_by_k"].items())
            + f"; {result['n_flips']} flips); strongest offsets after the field (offset, mean effect): {result['top_offsets']}"
        )
