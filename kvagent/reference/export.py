"""Write a float32 copy of a quantized GGUF: the same weights, no activation quantization in llama.cpp.

llama.cpp's CPU kernels quantize activations (to Q8) before multiplying them with Q4/Q5/Q6 weights,
which moves logits by up to about one on our models. On a float32 copy of the very same (dequantized)
weights llama.cpp and the torch reference agree to cosine 1.00000 (measured, BENCHMARKS.md), which
separates kernel noise from modelling errors, and gives decision benchmarks a noise-free engine.
The copy is cached under ``cache_dir()/f32/`` by the source file's fingerprint (SmolLM2: 0.5 GB,
Gemma-3: 1.1 GB).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from kvagent.models import ModelRef, cache_dir
from kvagent.transformer.weights import dequantize

log = logging.getLogger(__name__)


def f32_path(model: ModelRef) -> Path:
    """Where the float32 copy of ``model`` lives (it may not exist yet)."""
    return cache_dir() / "f32" / f"{model.name}-{model.fingerprint[:16]}-f32.gguf"


def export_f32(model: ModelRef, force: bool = False) -> Path:
    """Write (once) and return the float32 copy of ``model``; metadata copied, ``file_type`` = ALL_F32."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    dest = f32_path(model)
    if dest.is_file() and not force:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    reader = GGUFReader(str(model.path))
    arch = str(reader.fields["general.architecture"].contents())
    tmp = dest.with_suffix(f".tmp{os.getpid()}")
    writer = GGUFWriter(str(tmp), arch)
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the writer adds these itself
        if key == "general.file_type":
            writer.add_uint32(key, 0)  # LLAMA_FTYPE_ALL_F32
        elif f.types[0] == GGUFValueType.ARRAY:
            writer.add_array(key, f.contents())
        else:
            writer.add_key_value(key, f.contents(), f.types[0])
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.ascontiguousarray(dequantize(tensor, model.path)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(dest)  # atomic: a half-written copy is never picked up
    log.info("wrote float32 copy of %s: %s (%.0f MB)", model.name, dest, dest.stat().st_size / 2**20)
    return dest
