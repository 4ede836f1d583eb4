"""Counter-causal surprise ("Back from the Future" (Gould, van den Hengel, 2026)): keep what the future cannot predict.

Surprise ``s_i = 1 - P(x_i | x_{i+1..t})`` from a scoring pass in the original token order with an
upper-triangular mask (position i attends only to j > i), reusing the cached K/V and recomputing Q at
the original positions. As in the paper, the logit of ``x_i`` is the monotone proxy: score = -logit.

- :class:`FastSurprise`: the paper's single-layer approximation. The penultimate hidden states
  H^(L-1) captured from llama.cpp's decode feed the last layer only (O(n^2) instead of O(L n^2)).
- :class:`FullSurprise`: every layer, on the torch transformer (:mod:`kvagent.transformer`). It keeps a mirror of the session's
  cache (``[layers, kv_heads, n, head_dim]``, extended with the tokens decoded since the last cycle,
  then pruned like the real one), because llama.cpp does not expose its KV tensors (and keeps only a
  window of the sliding-window layers' state).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

import kvagent.policies.last_layer as last_layer
from kvagent.policies.base import CacheView, EvictionPolicy

log = logging.getLogger(__name__)


class FastSurprise(EvictionPolicy):
    """Counter-causal surprise in the last layer from captured H^(L-1). Rows without a captured state
    (e.g. a transplanted skill) are kept and left out of the pass. ``query`` and ``proxy``: see
    :func:`kvagent.policies.last_layer.counter_causal_queries`; ``query="self", proxy="logit"`` is
    the paper's literal recipe (policy ``surprise-paper``)."""

    name = "surprise"
    needs_hidden = True

    def __init__(self, query: str = "previous", proxy: str = "logprob", name: str = "surprise") -> None:
        self.query, self.proxy, self.name = query, proxy, name

    def score(self, view: CacheView) -> np.ndarray:
        def surprise(rows: np.ndarray) -> np.ndarray:
            hidden = view.hidden[rows]  # type: ignore[index]
            query_hidden = None if view.query_hidden is None else view.query_hidden[rows]
            return -last_layer.counter_causal_scores(
                view.model_path, hidden, view.positions[rows], view.tokens[rows], self.query, self.proxy, query_hidden
            )

        return last_layer.score_captured(view, self.name, surprise)


class FullSurprise(EvictionPolicy):
    """Counter-causal surprise through all layers of the torch transformer (the paper's full pass),
    with the same ``query`` / ``proxy`` choices as :class:`FastSurprise`."""

    name = "surprise-full"

    def __init__(self, query: str = "previous", proxy: str = "logprob") -> None:
        self.query, self.proxy = query, proxy
        self._model: object | None = None
        self._path: Path | None = None
        self._mirror: object | None = None  # transformer.model.KVCache of the kept cells
        self._tokens: list[int] = []  # the token of each mirror cell

    def _load(self, path: Path) -> object:
        from kvagent.transformer.model import KVCache, Transformer

        if self._model is None or self._path != path:
            self._model, self._path = Transformer.load(path), path
            self._mirror = KVCache.empty(self._model.args)  # type: ignore[attr-defined]
        return self._model

    def update_mirror(self, view: CacheView) -> object:
        """Bring the mirror cache to the view's cells. From the first cell the mirror lacks (or holds
        with another token: the session rewrote its tail), cells are run causally against the rest,
        as llama.cpp decoded them."""
        import torch

        model = self._load(view.model_path)
        mirror = self._mirror
        held = dict(zip(mirror.positions.tolist(), self._tokens))  # type: ignore[attr-defined]
        view_pos, view_tok = view.positions.tolist(), view.tokens.tolist()
        first = next((i for i, (p, t) in enumerate(zip(view_pos, view_tok)) if held.get(p) != t), len(view_pos))
        keep_pos = set(view_pos[:first])
        idx = [i for i, p in enumerate(mirror.positions.tolist()) if p in keep_pos]  # type: ignore[attr-defined]
        mirror = mirror.select(torch.tensor(idx, dtype=torch.long))  # type: ignore[attr-defined]
        if first < len(view_pos):
            model.forward(  # type: ignore[attr-defined]
                torch.tensor(view_tok[first:], dtype=torch.long),
                torch.tensor(view_pos[first:], dtype=torch.long),
                cache=mirror,
                logits="none",
            )
        if mirror.positions.tolist() != view_pos:  # type: ignore[attr-defined]
            raise ValueError("the surprise-full mirror cache does not match the session's cells")
        self._mirror, self._tokens = mirror, list(view_tok)
        return mirror

    def score(self, view: CacheView) -> np.ndarray:
        """As :func:`~kvagent.policies.last_layer.counter_causal_scores`, through every layer: with
        ``query="previous"`` the token at ``p - 1`` (``view.previous``, cached or not) queries at
        position ``p - 1`` the cached keys after ``p``."""
        import torch

        mirror = self.update_mirror(view)
        pos = torch.from_numpy(view.positions.astype(np.int64))
        tokens = torch.from_numpy(view.tokens.astype(np.int64))
        if self.query == "self":
            rows = torch.arange(len(view))
            q_tok, q_pos = tokens, pos
        else:
            prev = (view.previous if view.previous is not None
                    else last_layer.previous_rows(view.tokens.astype(np.int64), view.positions))
            rows = torch.from_numpy(np.flatnonzero(np.asarray(prev) >= 0))
            q_tok, q_pos = torch.from_numpy(np.asarray(prev, dtype=np.int64))[rows], pos[rows] - 1
        result = np.full(len(view), np.inf)
        if rows.numel() == 0:
            return result
        mask = pos[None, :] > pos[rows][:, None]
        out = self._model.forward(  # type: ignore[attr-defined]
            q_tok, q_pos, cache=mirror, mask=mask, append=False, logits="none", gather=tokens[rows]
        )
        score = out.token_logits
        if self.proxy == "logprob":
            score = score - last_layer.logsumexp_rows(out.hidden, self._model.output)  # type: ignore[attr-defined]
        result[rows.numpy()] = -score.numpy()
        return result

    def kept(self, positions: np.ndarray) -> None:
        if self._mirror is None:
            return
        import torch

        keep = set(positions.tolist())
        idx = [i for i, p in enumerate(self._mirror.positions.tolist()) if p in keep]  # type: ignore[attr-defined]
        self._mirror = self._mirror.select(torch.tensor(idx, dtype=torch.long))  # type: ignore[attr-defined]
        self._tokens = [self._tokens[i] for i in idx]
