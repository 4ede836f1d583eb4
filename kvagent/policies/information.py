"""Self-information: keep what the past could not predict (Selective Context, Li et al., 2023, "Compressing Context
to Enhance Inference Efficiency of Large Language Models", https://arxiv.org/abs/2310.06201).

The score of the cell holding ``x_p`` is its self-information ``-log P(x_p | x_<p)`` under the model, the forward
twin of counter-causal surprise: a code, a name or an amount stated once is unpredictable from what came before it,
while the words around it, and a reply that paraphrases the question, are not. Selective Context computes it with a
causal LM and drops the least informative phrases or sentences; here it comes from the last layer over the
penultimate states captured from llama.cpp's decode (the query at ``p - 1``, the keys the cache held before ``p``),
the same single-layer pass as :class:`~kvagent.policies.surprise.FastSurprise` with the causal mask. Wrap it in
:class:`~kvagent.policies.spans.Spans` for sentence units.

A cell is scored once, at the first cycle that sees it: its past then is the cache it was decoded with (evictions
happen only at cycles), and later cycles only take cells from that past. So a cycle pays the vocabulary head for
the new cells only (the last layer's keys and values are still projected for every cached cell).
"""

from __future__ import annotations

import numpy as np

import kvagent.policies.last_layer as last_layer
from kvagent.policies.base import CacheView, PositionTable


class SelfInformation(PositionTable):
    """``-log P(x_p | x_<p)`` of each cell from the last layer over captured states, computed once per cell (higher =
    keep). A cell whose predecessor's state was never recorded (the first cached token, a transplanted skill) is kept
    (+inf)."""

    name = "selfinfo"
    table = "info"  # position -> self-information (nats)
    needs_hidden = True

    def __init__(self, name: str = "selfinfo") -> None:
        super().__init__()
        self.name = name

    def score(self, view: CacheView) -> np.ndarray:
        rows = last_layer.captured_rows(view.hidden, self.name)
        scores = np.full(len(view), np.inf)
        if rows.size < 2:
            return scores
        hidden = view.hidden[rows]  # type: ignore[index]
        positions = view.positions[rows]
        query = view.query_hidden[rows] if view.query_hidden is not None else last_layer.previous_rows(hidden, positions)
        query = query.copy()
        done = np.array([int(p) in self._values for p in positions.tolist()], dtype=bool)
        query[done] = np.nan  # scored at an earlier cycle: not queried again
        if (~done & ~np.isnan(query[:, 0])).any():
            logp = last_layer.counter_causal_scores(view.model_path, hidden, positions, view.tokens[rows], "previous",
                                                    "logprob", query, direction="causal")
            for p, v in zip(positions[~done].tolist(), logp[~done].tolist()):
                if np.isfinite(v):
                    self._values[p] = -v
        scores[rows] = [self._values.get(int(p), np.inf) for p in positions.tolist()]
        return scores
