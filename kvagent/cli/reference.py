"""``kvagent reference ...``: the torch reference model (oracle) against llama.cpp."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from kvagent.cli.common import console, model_names, print_table
from kvagent.engine import Engine
from kvagent.errors import KVAgentError
from kvagent.models import resolve_model
from kvagent.reference.check import MIN_COSINE, MIN_TOP1, compare, prose_prompts
from kvagent.reference.export import export_f32

app = typer.Typer(help="The torch reference model (oracle) on the same GGUF.", no_args_is_help=True)


@app.command("check")
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
    from kvagent.transformer.model import Transformer  # imports torch, an optional extra: loaded for this command only

    results = []
    for name in model_names(model):
        try:
            with console.status(f"{name}: loading the reference"):
                ref = Transformer.load(resolve_model(name).path)
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
    print_table(
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
