"""GGUF surgery with the ``gguf`` package (the ``torch`` extra): a layer-truncated copy of a model.

A model cut to its first few transformer blocks keeps the real tokenizer, chat template, embeddings, head
and the shape of every KV cell (heads, head size, RoPE), so every KV operation kvagent relies on (sequence
remove / copy / shift, per-sequence state save and restore, captures) runs on it exactly as on the full
model, in a fraction of the memory and file size: what a GPU check on a machine with little room for
copied files needs (``kvagent gpu truncate``, ``scripts/gpu_check.sh``). Its text is not meant to be good.

``embedding_type`` can re-quantise the token embedding, the largest tensor of a small model (SmolLM2-135M:
30 MB of Q8_0 beside 2.2 MB per block), to Q4_0 or Q4_1 to halve it; only the file size matters there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvagent.errors import KVAgentError

_BLOCK = re.compile(r"^blk\.(\d+)\.")
_REQUANTISABLE = ("q4_0", "q4_1", "q8_0")


@dataclass(frozen=True)
class TruncateResult:
    path: Path
    architecture: str
    layers: int  # kept
    layers_before: int
    tensors: int  # written
    bytes: int  # file size


def _gguf():  # type: ignore[no-untyped-def]
    try:
        import gguf
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise KVAgentError("the gguf package is needed: pip install 'gguf>=0.10' (kvagent's torch extra)") from exc
    return gguf


def truncate_gguf(src: Path, dst: Path, layers: int, *, embedding_type: str | None = None,
                  name_suffix: str | None = None) -> TruncateResult:
    """Write ``dst``: ``src`` with only its first ``layers`` blocks (``blk.0`` .. ``blk.{layers-1}``).

    ``{arch}.block_count`` is set to ``layers``; per-layer metadata arrays (one value per block) are cut to
    match; every other key (tokenizer, chat template, hyper-parameters) and tensor is copied byte for byte,
    except the token embedding when ``embedding_type`` (``q4_0``, ``q4_1``, ``q8_0``) asks to re-quantise it.
    ``general.name`` gets ``name_suffix`` (default `` (first N layers)``).
    """
    gguf = _gguf()
    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise KVAgentError(f"{src} is not a file: give the path of a .gguf model (or a registry name to the CLI)")
    if src.resolve() == dst.resolve():
        raise KVAgentError("the output would overwrite the input: give another --out")
    if embedding_type is not None and embedding_type.lower() not in _REQUANTISABLE:
        raise KVAgentError(f"embedding type {embedding_type!r}: use one of {', '.join(_REQUANTISABLE)}")
    reader = gguf.GGUFReader(src, "r")
    arch_field = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    if arch_field is None:
        raise KVAgentError(f"{src} has no general.architecture: not a model GGUF")
    arch = str(arch_field.contents())
    count_key = f"{arch}.block_count"
    count_field = reader.get_field(count_key)
    if count_field is None:
        raise KVAgentError(f"{src} has no {count_key}")
    before = int(count_field.contents())
    if not 1 <= layers <= before:
        raise KVAgentError(f"--layers {layers}: the model has {before} blocks; keep between 1 and {before}")

    writer = gguf.GGUFWriter(dst, arch, endianess=reader.endianess)
    try:
        for field in reader.fields.values():
            if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
                continue  # the writer adds these
            val_type = field.types[0]
            sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
            value = field.contents()
            if field.name == count_key:
                value = layers
            elif field.name == gguf.Keys.General.NAME:
                value = f"{value}{name_suffix if name_suffix is not None else f' (first {layers} layers)'}"
            elif (val_type == gguf.GGUFValueType.ARRAY and field.name.startswith(f"{arch}.")
                  and isinstance(value, list) and len(value) == before):
                value = value[:layers]  # one value per block (e.g. per-layer head counts)
            writer.add_key_value(field.name, value, val_type, sub_type=sub_type)

        kept = []
        for tensor in reader.tensors:
            m = _BLOCK.match(tensor.name)
            if m is not None and int(m.group(1)) >= layers:
                continue
            data, qtype = tensor.data, tensor.tensor_type
            if embedding_type is not None and tensor.name == "token_embd.weight":
                target = gguf.GGMLQuantizationType[embedding_type.upper()]
                if target != qtype:
                    values = gguf.dequantize(np.asarray(data), qtype).astype(np.float32)
                    data, qtype = gguf.quantize(values, target), target
            kept.append((tensor.name, data, qtype))
        for name, data, qtype in kept:
            writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for _name, data, _qtype in kept:
            writer.write_tensor_data(data, tensor_endianess=reader.endianess)
    finally:
        writer.close()
    return TruncateResult(dst, arch, layers, before, len(kept), dst.stat().st_size)
