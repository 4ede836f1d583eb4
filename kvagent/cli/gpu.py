"""``kvagent gpu ...``: what the llama.cpp build can offload to, and a small model for GPU checks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer

from kvagent.backends.registry import device_report
from kvagent.cli.common import console
from kvagent.engine import EngineSettings, auto_gpu_layers
from kvagent.errors import KVAgentError
from kvagent.gguf_tools import truncate_gguf
from kvagent.models import resolve_model

app = typer.Typer(help="GPU offload: the devices llama.cpp sees; a layer-truncated model for KV checks.",
                  no_args_is_help=True)


def gpu_info() -> dict[str, object]:
    """What ``kvagent gpu info`` prints: the build, its GPUs, and what the engine's settings resolve to."""
    return {
        **device_report(),
        "auto_n_gpu_layers": auto_gpu_layers(),
        "flash_attn_default": EngineSettings().backend_config().flash_attn,
        "env": {k: os.environ[k] for k in ("KVAGENT_GPU_LAYERS", "KVAGENT_FLASH_ATTN", "CUDA_VISIBLE_DEVICES")
                if k in os.environ},
    }


@app.command("info")
def info(json_path: Path = typer.Option(None, "--json", help="Also write the facts as JSON here.")) -> None:
    """Whether this llama-cpp-python build can offload (CUDA: `make setup GPU=cuda`), the GPUs it sees, and the
    n_gpu_layers an engine gets by default (-1 = all with a GPU, else 0; $KVAGENT_GPU_LAYERS overrides)."""
    facts = gpu_info()
    devices: list[dict] = facts["devices"]  # type: ignore[assignment]
    backends: list[str] = facts["backends"]  # type: ignore[assignment]
    gpu_backends = [b for b in backends if b not in ("CPU", "BLAS", "RPC")]
    note = "" if gpu_backends else " [yellow](a CPU build: `make setup GPU=cuda` builds one for CUDA)[/]"
    console.print(f"llama-cpp-python {facts['llama_cpp_python']}, backends: {', '.join(backends)}{note}")
    for dev in devices:
        console.print(f"  {dev['name']}: {dev['description']} ({dev['kind']}), "
                      f"{dev['free_bytes'] / 2**30:.1f} of {dev['total_bytes'] / 2**30:.1f} GiB free")
    if gpu_backends and not devices:
        console.print(f"  [yellow]no GPU found[/] by {', '.join(gpu_backends)} (driver? CUDA_VISIBLE_DEVICES? see "
                      "`kvagent -v gpu info`): layers stay on the CPU")
    console.print(f"default n_gpu_layers: {facts['auto_n_gpu_layers']}; flash attention by default: "
                  f"{facts['flash_attn_default']}")
    console.print(f"system info: {facts['system_info']}")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(facts, indent=2) + "\n")
        console.print(str(json_path))


@app.command("truncate")
def truncate(
    model: str = typer.Argument("smollm2-135m", help="Registry name or path of a local .gguf file."),
    layers: int = typer.Option(4, help="How many transformer blocks to keep (the first ones)."),
    out: Path = typer.Option(..., help="Where to write the truncated .gguf."),
    embedding_type: str = typer.Option(None, help="Re-quantise the token embedding (q4_0, q4_1, q8_0) to shrink "
                                       "the file; default: copied as it is."),
) -> None:
    """A copy of MODEL with only its first LAYERS blocks (the `gguf` package): same tokenizer, chat template, KV
    shapes and RoPE, so the KV mechanics can be checked where the full model does not fit (its text is poor)."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        result = truncate_gguf(resolve_model(model).path, out, layers, embedding_type=embedding_type)
    except KVAgentError as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from exc
    console.print(f"{result.path}: {result.architecture}, {result.layers} of {result.layers_before} blocks, "
                  f"{result.tensors} tensors, {result.bytes / 2**20:.1f} MiB")
