"""The backend protocol: batched decode at chosen positions and per-sequence KV operations.

A backend holds one loaded model and one context whose KV cache is shared by several *sequences*
(one per session). Positions are explicit everywhere because kvagent decides where tokens live (prefix
reuse, transplants, eviction leave holes). Shapes: logits are ``[n_outputs, n_vocab]`` float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np


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


class Backend(Protocol):
    """What kvagent needs from an engine. ``llama_cpp.LlamaCppBackend`` is the product backend."""

    n_ctx: int
    n_vocab: int
    n_seq_max: int
    n_batch: int
    format: str  # identifies the layout of saved sequence bytes; part of every blob's key

    def tokenize(self, text: str, *, special: bool) -> list[int]: ...
    def token_bytes(self, token: int) -> bytes: ...
    def is_eog(self, token: int) -> bool: ...
    @property
    def bos_ids(self) -> list[int]: ...
    def decode(
        self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[int], outputs: Sequence[bool]
    ) -> np.ndarray: ...
    def seq_rm(self, seq: int, p0: int, p1: int) -> None: ...
    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None: ...
    def seq_keep(self, seq: int) -> None: ...
    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None: ...
    def seq_pos_range(self, seq: int) -> tuple[int, int]: ...
    def seq_save(self, seq: int) -> bytes: ...
    def seq_restore(self, seq: int, data: bytes) -> None: ...
    @property
    def can_shift(self) -> bool: ...
    def close(self) -> None: ...
