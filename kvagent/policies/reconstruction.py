"""Reconstruction scores after KVzip (Kim et al., 2025, "KVzip: Query-Agnostic KV Cache Compression with Context
Reconstruction", https://arxiv.org/abs/2505.23416): keep what the model reads when it repeats its context.

The cached context is replayed behind a "repeat the previous context" prompt; each cached cell is scored by the
largest attention any replay query gives it. As in KVzip (and NVIDIA kvpress's ``KVzipPress``), the replay runs in
chunks: each chunk of cells is replayed behind the prompt (later chunks behind "Repeat the part of the previous
context exactly, starting with" and the previous chunk's last 8 tokens), and its attention is a softmax over the
attention sinks, the chunk's cells and the replay itself.

Here the replay is decoded by llama.cpp in a throwaway copy of the session's sequence (``view.probe``), which
captures the input hidden states of a few layers; the attention of those layers is recomputed in torch from them
(attention norm, projections, RoPE at the original positions: the keys llama.cpp cached), as H2O and TOVA do for
the last layer. A cell's score is the ``reduce`` (max or mean) over those layers and KV heads of the largest
probability over the grouped query heads and replay queries. kvagent evicts a position from every layer at once,
where KVzip prunes each head: one score per cell.

Scores are kept between cycles: a cycle replays only the cells that are new since the last one (the others keep
the score their chunk's replay gave them: a chunk's softmax never sees later cells). Cost: one decode of every
cell once more (plus the prompts), measured in BENCHMARKS.md. Sliding-window layers (Gemma-3's local layers) are
not used: a replay query sits a whole context after the cells it repeats. Shapes: rows ``[T, n_embd]``, ``q:
[heads, R, head_dim]``, ``k: [kv_heads, S, head_dim]``, probabilities ``[heads, R, S]``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path

import numpy as np

import kvagent.policies.last_layer as last_layer
from kvagent.policies.base import CacheView, EvictionPolicy, values_from_state, values_state

log = logging.getLogger(__name__)

FIRST_PROMPT = "\n\nRepeat the previous context exactly."
NEXT_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
OVERLAP = 8  # tokens of the previous chunk after NEXT_PROMPT (kvpress's prev_postfix_size)
REDUCES = ("max", "mean")


@lru_cache(maxsize=4)
def _blocks(path: Path, layers: tuple[int, ...]) -> object:
    from kvagent.transformer.model import Transformer

    return Transformer.load(path, layers=list(layers))


def spread_layers(n_layer: int, swa: tuple[bool, ...], count: int) -> tuple[int, ...]:
    """``count`` layers (inputs 1 .. n_layer - 1) evenly spread over the global-attention ones (``swa[i]`` True:
    layer ``i`` slides); all of them when there are fewer."""
    candidates = [i for i in range(1, n_layer) if not (swa and swa[i])]
    if len(candidates) <= count:
        return tuple(candidates)
    picks = np.linspace(0, len(candidates) - 1, count).round().astype(int)
    return tuple(candidates[i] for i in sorted(set(picks.tolist())))


class Reconstruction(EvictionPolicy):
    """KVzip's reconstruction score from a replay probe (see the module). ``layers``: how many global-attention
    layers score (spread over the depth); ``chunk``: cells replayed per probe; ``sinks``: first cells every chunk's
    softmax also sees (and that are kept); ``reduce``: over layers and KV heads. ``replayed`` counts the tokens
    its probes decoded (prompts included)."""

    needs_hidden = True  # reads states captured while decoding (the context's layer inputs)
    needs_probe = True

    def __init__(self, layers: int = 8, chunk: int = 512, sinks: int = 4, reduce: str = "max",
                 name: str = "kvzip") -> None:
        if reduce not in REDUCES:
            raise ValueError(f"unknown reconstruction reduce {reduce!r}: use one of {', '.join(REDUCES)}")
        if layers < 1 or chunk < 1 or sinks < 0:
            raise ValueError(f"need layers >= 1, chunk >= 1, sinks >= 0, got {layers}, {chunk}, {sinks}")
        self.n_layers, self.chunk, self.sinks, self.reduce, self.name = layers, chunk, sinks, reduce, name
        self._scores: dict[int, float] = {}  # position -> score from its chunk's replay
        self.replayed = 0  # tokens decoded by probes so far (prompts included)

    def input_layers(self, n_layer: int, model_path: Path) -> tuple[int, ...]:
        args = last_layer.model_args(Path(model_path))
        return spread_layers(n_layer, tuple(args.swa_layers), self.n_layers)  # type: ignore[attr-defined]

    def kept(self, positions: np.ndarray) -> None:
        keep = set(positions.tolist())
        self._scores = {p: s for p, s in self._scores.items() if p in keep}

    def state(self) -> dict[str, np.ndarray]:
        return {**values_state(self._scores, "scores"), "replayed": np.array([self.replayed], np.int64)}

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        replayed = state.get("replayed")
        if set(state) != {"scores.pos", "scores.value", "replayed"} or replayed is None or replayed.shape != (1,) \
                or replayed.dtype.kind != "i":
            raise ValueError(f"not {self.name}'s state: {sorted(state)[:4]}")
        self._scores, self.replayed = values_from_state(state, "scores"), int(replayed[0])

    # -- scoring ----------------------------------------------------------------------------------
    def score(self, view: CacheView) -> np.ndarray:
        if view.probe is None or view.layers is None:
            raise ValueError(f"{self.name} replays the context: it needs a probe and the layers' captured states "
                             "(an Evictor built with the engine's scratch sequences, as Engine.session builds it)")
        n = len(view)
        captured = np.all([~np.isnan(rows[:, 0]) for rows in view.layers.values()], axis=0)
        todo = np.flatnonzero(captured & np.array([int(p) not in self._scores for p in view.positions.tolist()]))
        for start in range(0, todo.size, self.chunk):
            self._score_chunk(view, todo[start : start + self.chunk])
        out = np.array([self._scores.get(int(p), np.inf) for p in view.positions.tolist()])
        out[: min(self.sinks, n)] = np.inf
        return out

    def _score_chunk(self, view: CacheView, idx: np.ndarray) -> None:
        """Replay the cells ``idx`` (indices into the view, ascending) behind the prompt; store their scores."""
        before = view.tokens[max(0, idx[0] - OVERLAP) : idx[0]].tolist() if idx[0] else []
        tokens = before + view.tokens[idx].tolist()
        rows = view.probe(tokens, NEXT_PROMPT if before else FIRST_PROMPT)  # type: ignore[misc]
        replay = len(next(iter(rows.values())))  # prompt tokens + tokens
        self.replayed += replay
        for p, s in zip(view.positions[idx].tolist(), self._attention(view, idx, rows, replay).tolist()):
            self._scores[int(p)] = float(s)

    def _attention(self, view: CacheView, idx: np.ndarray, rows: dict[int, np.ndarray], replay: int) -> np.ndarray:
        """``[len(idx)]``: per cell of the chunk, the ``reduce`` over layers and KV heads of the largest attention a
        replay query (``rows``: ``{layer: [replay, n_embd]}`` at the positions after the cache) gives it, the softmax
        running over the sinks, the chunk and the replay (causal)."""
        import torch

        start = int(view.positions[-1]) + 1
        r_pos = torch.arange(start, start + replay)
        sink_idx = np.arange(min(self.sinks, len(view)))
        sink_idx = sink_idx[~np.isin(sink_idx, idx)]
        key_idx = np.concatenate([sink_idx, idx])
        k_pos = torch.from_numpy(view.positions[key_idx].astype(np.int64))
        layers = sorted(rows)
        model = _blocks(view.model_path, tuple(layers))
        causal = torch.ones(replay, replay, dtype=torch.bool).tril()
        mask = torch.cat([torch.ones(replay, key_idx.size, dtype=torch.bool), causal], 1)
        per_layer = []
        with torch.no_grad():
            for layer in layers:
                block = model.blocks[layer]  # type: ignore[attr-defined]
                a = block.args
                ctx = torch.from_numpy(np.ascontiguousarray(view.layers[layer][key_idx]))  # type: ignore[index]
                _, k_ctx, _ = block.qkv(ctx, k_pos)
                q, k_rep, _ = block.qkv(torch.from_numpy(np.ascontiguousarray(rows[layer])), r_pos)
                group = a.n_head // a.n_kv_head
                k = torch.cat([k_ctx, k_rep], 1).repeat_interleave(group, 0)  # [H, S, hd]
                logits = (q @ k.transpose(1, 2)) * a.attn_scale  # [H, R, S]
                probs = torch.softmax(logits.masked_fill(~mask[None], float("-inf")), -1)
                cells = probs[:, :, sink_idx.size : key_idx.size]  # [H, R, chunk]
                per_layer.append(cells.amax(1).view(a.n_kv_head, group, -1).amax(1))  # [KVH, chunk]
        stacked = torch.cat(per_layer, 0)  # [layers * KVH, chunk]
        return (stacked.amax(0) if self.reduce == "max" else stacked.mean(0)).numpy()
