"""Read a GGUF file into the torch transformer's hyper-parameters and float32 weights.

The same file llama.cpp runs, dequantized with the ``gguf`` package (the reader llama.cpp's own Python
tools use). The architectures: ``llama`` (SmolLM2) and ``gemma3`` (sliding-window layers, sandwich norms, q/k
norms), checked against llama.cpp on the shipped files; ``qwen2`` (Q/K/V biases, NEOX RoPE), checked on
Qwen2.5-Coder-0.5B-Instruct; and, read the way llama.cpp's graph builds them but not checked on a real file here,
``qwen3`` (per-head q/k norms), ``mistral3`` (llama's layout) and ``phi3`` (fused QKV and gate/up projections).
Weight layout follows ``torch.nn.Linear``: ``[out_features, in_features]``.

Facts of llama.cpp's GGUF conversion this relies on (convert_hf_to_gguf.py, llama-model.cpp):
- llama: the Q/K projections are permuted so that RoPE rotates *adjacent* pairs (ggml's NORM mode);
- qwen2, qwen3, phi3: Q/K are not permuted, RoPE rotates halves (NEOX mode), as llama.cpp's
  ``llama_model_rope_type`` says; mistral3 is llama's NORM mode;
- gemma3: norm weights already include Gemma's ``1 +`` shift; RoPE rotates halves (NEOX mode); local
  (sliding) layers use RoPE base 10,000, every 6th layer is global and uses the file's base;
  embeddings are scaled by ``sqrt(n_embd)``; attention scale ``1/sqrt(head_dim)``;
- both tie the output projection to ``token_embd`` when the file has no ``output.weight``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np

from kvagent.errors import UnsupportedModelError
from kvagent.models import cache_dir, fingerprint

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "gemma3", "qwen2", "qwen3", "mistral3", "phi3")
UNCHECKED_ARCHITECTURES = ("qwen3", "mistral3", "phi3")
"""Built from llama.cpp's graph for them, never compared with llama.cpp on a real file here (a warning says so)."""
_ROPE_STYLE = {"llama": "interleaved", "mistral3": "interleaved", "qwen2": "neox", "qwen3": "neox", "phi3": "neox"}
# quantization types the gguf package's numpy dequantizer handles and we have checked on real files
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


@dataclass(frozen=True)
class ModelArgs:
    """Hyper-parameters of one model, read from GGUF metadata.

    ``swa_layers[i]`` is True where layer ``i`` attends within ``sliding_window`` positions;
    ``rope_bases[i]`` is that layer's RoPE base.
    """

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_kv_head: int
    head_dim: int
    n_ff: int
    n_vocab: int
    norm_eps: float
    rope_bases: tuple[float, ...]
    rope_style: str  # "interleaved" (ggml NORM: adjacent pairs) | "neox" (halves)
    sliding_window: int = 0
    swa_layers: tuple[bool, ...] = ()
    embed_scale: float = 1.0
    attn_scale: float = 1.0
    activation: str = "silu"  # "silu" | "gelu_tanh"
    qk_norm: bool = False
    sandwich_norm: bool = False  # gemma: norms after attention and after the FFN as well
    bos_id: int | None = None
    add_bos: bool = False

    def is_swa(self, layer: int) -> bool:
        return bool(self.swa_layers and self.swa_layers[layer])


@dataclass
class Weights:
    """Dequantized float32 weights: ``global_`` by GGUF name (no ``blk.`` prefix), ``layers[i]`` by
    name within block ``i``; ``None`` for blocks that were not loaded."""

    args: ModelArgs
    global_: dict[str, np.ndarray] = field(default_factory=dict)
    layers: list[dict[str, np.ndarray] | None] = field(default_factory=list)


def _field(reader: object, key: str, default: object = None) -> object:
    f = reader.fields.get(key)  # type: ignore[attr-defined]
    if f is None:
        return default
    return f.contents()


def read_args(reader: object, path: Path) -> ModelArgs:
    """Hyper-parameters from GGUF metadata; :class:`UnsupportedModelError` for another architecture."""
    arch = str(_field(reader, "general.architecture", "?"))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path.name}: architecture {arch!r} is not supported by the torch transformer (kvagent.transformer); "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)} (the llama.cpp backend runs it; the torch eviction policies need it)"
        )

    def hp(key: str, default: object = None) -> object:
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise UnsupportedModelError(f"{path.name}: GGUF metadata {arch}.{key} is missing")
        return value

    n_layer, n_embd, n_head = int(hp("block_count")), int(hp("embedding_length")), int(hp("attention.head_count"))
    n_kv_head = int(hp("attention.head_count_kv", n_head))
    head_dim = int(hp("attention.key_length", n_embd // n_head))
    base = float(hp("rope.freq_base", 10000.0))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    n_vocab = int(hp("vocab_size", len(tokens) if tokens is not None else 0))
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    common = dict(
        arch=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_kv_head=n_kv_head,
        head_dim=head_dim,
        n_ff=int(hp("feed_forward_length")),
        n_vocab=n_vocab,
        norm_eps=float(hp("attention.layer_norm_rms_epsilon")),
        bos_id=None if bos is None else int(bos),
        add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
    )
    if arch in _ROPE_STYLE:
        scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
        n_rot = int(hp("rope.dimension_count", head_dim))
        if scaling not in ("none", None) or n_rot != head_dim or _field(reader, f"{arch}.attention.sliding_window"):
            raise UnsupportedModelError(
                f"{path.name}: {arch} with RoPE scaling {scaling!r}, {n_rot} of {head_dim} dimensions rotated or a "
                "sliding window is not supported by the torch transformer (the llama.cpp backend runs it)")
        if arch in UNCHECKED_ARCHITECTURES:
            log.warning("%s: the torch transformer for %s follows llama.cpp's graph but was not checked against "
                        "llama.cpp on a real file; run `kvagent reference check --model %s`", path.name, arch, path)
        return ModelArgs(**common, rope_bases=(base,) * n_layer, rope_style=_ROPE_STYLE[arch],
                         attn_scale=1.0 / math.sqrt(head_dim), qk_norm=arch == "qwen3")
    # gemma3 (llama-model.cpp): swa pattern 6 -> layers with i % 6 < 5 slide; local RoPE base 10k
    swa = tuple(i % 6 < 5 for i in range(n_layer))
    return ModelArgs(
        **common,
        rope_bases=tuple(10000.0 if s else base for s in swa),
        rope_style="neox",
        sliding_window=int(hp("attention.sliding_window")),
        swa_layers=swa,
        embed_scale=math.sqrt(n_embd),
        attn_scale=1.0 / math.sqrt(head_dim),
        activation="gelu_tanh",
        qk_norm=True,
        sandwich_norm=True,
    )


def dequantize(tensor: object, path: Path) -> np.ndarray:
    from gguf import quants  # optional dependency, imported with the torch transformer

    qtype = tensor.tensor_type.name  # type: ignore[attr-defined]
    if qtype not in SUPPORTED_TYPES:
        raise UnsupportedModelError(
            f"{path.name}: tensor {tensor.name} has quantization type {qtype}, which the torch transformer "  # type: ignore[attr-defined]
            f"dequantizer does not handle; supported: {', '.join(SUPPORTED_TYPES)}"
        )
    data = np.asarray(tensor.data)  # type: ignore[attr-defined]
    if qtype in ("F32", "F16"):
        return data.astype(np.float32, copy=True)
    return np.ascontiguousarray(quants.dequantize(data, tensor.tensor_type), dtype=np.float32)  # type: ignore[attr-defined]


def _cache_dir(path: Path) -> Path:
    return cache_dir() / "reference" / fingerprint(path)[:16]


def _from_cache(path: Path, wanted: set[int] | None, with_embeddings: bool) -> Weights | None:
    """Weights from the dequantized cache (one memory-mapped ``.npy`` per tensor), if every one is there."""
    import json

    root = _cache_dir(path)
    try:
        args = ModelArgs(**{k: tuple(v) if isinstance(v, list) else v for k, v in json.loads((root / "args.json").read_text()).items()})
        names = json.loads((root / "tensors.json").read_text())
    except (OSError, ValueError, TypeError):
        return None
    layers = set(range(args.n_layer)) if wanted is None else {i % args.n_layer for i in wanted}
    weights = Weights(args, {}, [None] * args.n_layer)
    for name in names:
        if name.startswith("blk."):
            _, index, rest = name.split(".", 2)
            if int(index) not in layers:
                continue
            target = weights.layers[int(index)] if weights.layers[int(index)] is not None else {}
            weights.layers[int(index)] = target
            key = rest
        elif name == "token_embd.weight" and not with_embeddings:
            continue
        else:
            target, key = weights.global_, name
        try:
            target[key] = np.load(root / f"{name}.npy", mmap_mode="c")  # copy-on-write: torch wants writable
        except (OSError, ValueError):
            return None
    return weights


def _to_cache(path: Path, args: ModelArgs, arrays: dict[str, np.ndarray]) -> None:
    """Write every dequantized tensor once (atomic per file; names listed last, so a partial cache is
    never read)."""
    import dataclasses
    import json
    import os

    root = _cache_dir(path)
    root.mkdir(parents=True, exist_ok=True)
    for name, array in arrays.items():
        tmp = root / f"{name}.tmp{os.getpid()}.npy"
        np.save(tmp, array)
        tmp.replace(root / f"{name}.npy")
    # atomic too: another process (a second test worker) may read the cache while this one writes it
    listed = (("args.json", json.dumps(dataclasses.asdict(args))), ("tensors.json", json.dumps(sorted(arrays))))
    for name, text in listed:
        tmp = root / f"{name}.tmp{os.getpid()}"
        tmp.write_text(text)
        tmp.replace(root / name)


def load_weights(path: Path, layers: Iterable[int] | None = None, with_embeddings: bool = True) -> Weights:
    """Dequantize the file's tensors to float32. ``layers`` limits which blocks are read (the fast
    surprise pass needs only the last one; negative indices count from the end); ``with_embeddings=False``
    skips the token embedding. The first load dequantizes every tensor into ``cache_dir()/reference/``
    (keyed by the file's fingerprint; SmolLM2 0.5 GB, Gemma-3 1.1 GB); later loads memory-map it
    (reading Gemma-3's GGUF metadata alone takes ~20 s: its 262k-token vocabulary)."""
    path = Path(path)
    wanted = None if layers is None else set(layers)
    cached = _from_cache(path, wanted, with_embeddings)
    if cached is not None:
        return cached
    try:
        from gguf import GGUFReader
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise UnsupportedModelError(
            "the torch transformer needs the optional extra: `pip install torch==2.13.0 'kvagent[torch]'`"
        ) from exc
    reader = GGUFReader(str(path))
    args = read_args(reader, path)
    arrays = {tensor.name: dequantize(tensor, path) for tensor in reader.tensors}
    if "output.weight" not in arrays and "token_embd.weight" not in arrays:
        raise UnsupportedModelError(f"{path.name}: neither output.weight nor token_embd.weight is present")
    try:
        _to_cache(path, args, arrays)
    except OSError as exc:  # a read-only or full cache directory only costs speed
        log.warning("could not cache dequantized weights of %s: %s", path.name, exc)
    log.info("torch weights for %s: arch %s, dequantized and cached", path.name, args.arch)
    return _from_cache(path, wanted, with_embeddings) or _assemble(args, arrays, wanted, with_embeddings)


def _assemble(args: ModelArgs, arrays: dict[str, np.ndarray], wanted: set[int] | None, with_embeddings: bool) -> Weights:
    layers = set(range(args.n_layer)) if wanted is None else {i % args.n_layer for i in wanted}
    weights = Weights(args, {}, [None] * args.n_layer)
    for name, array in arrays.items():
        if name.startswith("blk."):
            _, index, rest = name.split(".", 2)
            if int(index) in layers:
                if weights.layers[int(index)] is None:
                    weights.layers[int(index)] = {}
                weights.layers[int(index)][rest] = array  # type: ignore[index]
        elif name != "token_embd.weight" or with_embeddings:
            weights.global_[name] = array
    return weights
