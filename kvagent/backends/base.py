"""The backend protocol: batched decode at chosen positions and per-sequence KV operations.

A backend holds one loaded model and one context whose KV cache is shared by several *sequences*
(one per session). Positions are explicit everywhere because kvagent decides where tokens live (prefix
reuse, transplants, eviction leave holes). Shapes: logits are ``[n_outputs, n_vocab]`` float32.

Everything kvagent calls on a backend is declared here; what a backend can do beyond plain decoding is
in its :class:`Capabilities`, so callers ask (``backend.capabilities.shift``) instead of probing.
Backends are created by name through ``kvagent.backends.registry`` (``llama.cpp`` is the product backend).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from kvagent.native import Capture


@dataclass(frozen=True)
class BackendConfig:
    """Context settings of a backend (validated at the edge by ``engine.EngineSettings``).

    ``n_ctx`` is the KV pool shared by all sequences (``kv_unified``): one sequence may use all of it.
    ``n_gpu_layers`` offloads layers (and their KV) to a GPU where llama.cpp was built with one.
    """

    n_ctx: int = 4096
    n_batch: int = 512
    n_ubatch: int = 512
    n_seq_max: int = 8
    n_threads: int = 0  # 0 = all cores
    n_gpu_layers: int = 0
    flash_attn: bool = False
    swa_full: bool = True  # Gemma 3: keep every position so sequence operations stay exact
    capture: str = "none"  # activation capture through cb_eval: "none" | "native" | "python" (kvagent.native)


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do beyond decoding tokens in order.

    ``positional_kv``: cells live at explicit positions and may leave holes (eviction, transplants).
    ``shift``: ``seq_add`` moves cells and re-rotates their keys (RoPE K-shift); needed to transplant.
    ``state_save``: ``seq_save`` / ``seq_restore`` of one sequence (skills, ``Session.save``).
    ``hidden_capture``: hidden states can be captured during decode (``backend.capture``).
    ``swa_keeps_all``: a sliding-window model's cache keeps every cell of a sequence, also behind the window,
    and ``seq_save`` saves them all, so a splice or a restore behind the window is exact (vacuous without
    sliding-window layers: a backend without them reports true, so callers test this flag alone). llama.cpp
    needs ``swa_full`` and kvagent's patch (``native/patches``) for it.
    """

    positional_kv: bool
    shift: bool
    state_save: bool
    hidden_capture: bool
    swa_keeps_all: bool = True


@dataclass(frozen=True)
class RopeLayout:
    """How a model's saved keys are rotated (:meth:`Backend.rope_layout`; ``kvagent.kv.rotate`` re-rotates them).

    ``caches[c][j]``: (RoPE base, frequency scale) of the ``j``-th layer stored in the state's ``c``-th KV cache
    block. ``style``: ``"norm"`` (adjacent pairs) or ``"neox"`` (halves). Each key row is ``n_head_kv`` heads of
    ``head_dim`` values, the first ``n_rot`` of each head rotated.
    """

    style: str
    head_dim: int
    n_rot: int
    caches: tuple[tuple[tuple[float, float], ...], ...]


@runtime_checkable
class Backend(Protocol):
    """What kvagent needs from an engine. ``llama_cpp.LlamaCppBackend`` is the product backend."""

    n_ctx: int
    n_vocab: int
    n_seq_max: int
    n_batch: int
    format: str  # identifies the layout of saved sequence bytes; part of every blob's key
    capture: Capture | None  # the activation hook when hidden_capture is on, else None

    @property
    def capabilities(self) -> Capabilities: ...
    @property
    def architecture(self) -> str: ...
    @property
    def chat_template(self) -> str | None: ...
    @property
    def n_swa(self) -> int: ...
    @property
    def n_layer(self) -> int: ...
    @property
    def bos_ids(self) -> list[int]: ...
    @property
    def bos_id(self) -> int: ...
    @property
    def can_shift(self) -> bool: ...
    def meta(self, key: str) -> str | None: ...
    def layer_output_name(self, i: int) -> str: ...
    def tokenize(self, text: str, *, special: bool) -> list[int]: ...
    def token_bytes(self, token: int) -> bytes: ...
    def is_eog(self, token: int) -> bool: ...
    def token_table(self) -> list[bytes]: ...
    def decode(
        self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[int], outputs: Sequence[bool]
    ) -> np.ndarray: ...
    def seq_rm(self, seq: int, p0: int, p1: int) -> None: ...
    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None: ...
    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None: ...
    def seq_pos_range(self, seq: int) -> tuple[int, int]: ...
    def seq_positions(self, seq: int) -> list[int]: ...
    def seq_save(self, seq: int) -> bytes: ...
    def seq_save_writable(self, seq: int) -> bytearray: ...
    def seq_restore(self, seq: int, data: bytes | bytearray) -> None: ...
    def rope_layout(self) -> RopeLayout | None: ...
    def clear_memory(self) -> None: ...
    def close(self) -> None: ...
