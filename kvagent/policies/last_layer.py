"""The last transformer layer in torch, fed by the penultimate hidden states captured from llama.cpp.

Shared by the policies that need attention or a scoring pass but not the whole model: the fast
counter-causal surprise ("Back from the Future", Gould and van den Hengel, 2026: "store H^(L-1) during the
forward pass, compute Q from them
and run the counter-causal pass in the last layer only"), H2O and TOVA (last-layer attention). The
last layer's K and V are recomputed from H^(L-1) (attention norm, projections, RoPE at the original
positions): the same vectors llama.cpp cached, without reading its buffers. Only the last block, the
final norm and the (tied) output embedding are loaded from the GGUF.
"""

from __future__ import annotations

import logging
import weakref
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from kvagent.transformer.weights import load_weights

if TYPE_CHECKING:  # torch is imported where the policy runs, not when kvagent is imported
    import torch

log = logging.getLogger(__name__)


@lru_cache(maxsize=4)
def last_layer_model(path: Path) -> object:
    """A :class:`~kvagent.transformer.model.Transformer` holding only the last block (cached per file)."""
    from kvagent.transformer.model import Transformer

    return Transformer.load(path, layers=[-1])


@lru_cache(maxsize=8)
def model_args(path: Path) -> object:
    """The model's :class:`~kvagent.transformer.weights.ModelArgs` (read from the GGUF, no weights; cached per file)."""
    return load_weights(path, layers=[], with_embeddings=False).args


@lru_cache(maxsize=1)
def fast_bf16() -> bool:
    """Whether this CPU has native bfloat16 dot products (AVX512-BF16 or AMX-BF16, as Linux lists its flags), where
    torch's bf16 matrix product is several times faster than float32's; False where that cannot be read."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


# id(head) -> (a weak reference to it, its copies by dtype); a tensor cannot key a WeakKeyDictionary (== is elementwise)
_OUTPUTS: "dict[int, tuple[weakref.ref[torch.Tensor], dict[str, torch.Tensor]]]" = {}


def output_in(output: "torch.Tensor", dtype: str) -> "torch.Tensor":
    """The vocabulary head ``output [vocab, n_embd]`` in ``dtype`` ("float32" or "bfloat16"), converted once per
    head and shared by every session's policy (Gemma-3's: 335 MB in bfloat16 beside its 671 MB in float32)."""
    import torch

    if dtype == "float32":
        return output
    for key in [k for k, (ref, _) in _OUTPUTS.items() if ref() is None]:
        del _OUTPUTS[key]  # the model was unloaded: so is its copy
    entry = _OUTPUTS.get(id(output))
    if entry is None or entry[0]() is not output:
        entry = _OUTPUTS[id(output)] = (weakref.ref(output), {})
    if dtype not in entry[1]:
        entry[1][dtype] = output.to(getattr(torch, dtype))
    return entry[1][dtype]


def present_rows(hidden: np.ndarray) -> np.ndarray:
    """``[n]`` bool: rows with a captured hidden state (missing rows, e.g. transplanted skills, are NaN)."""
    return ~np.isnan(hidden[:, 0])


def score_captured(view: object, policy: str, score_rows: "Callable[[np.ndarray], np.ndarray]") -> np.ndarray:
    """``[n]`` scores: ``score_rows(rows)`` for the cells with a captured hidden state (``rows``: their
    indices), +inf (kept) for the others, and for every cell when fewer than two were captured."""
    rows = captured_rows(view.hidden, policy)  # type: ignore[attr-defined]
    scores = np.full(len(view), np.inf)  # type: ignore[arg-type]
    if rows.size >= 2:
        scores[rows] = score_rows(rows)
    return scores


def captured_rows(hidden: np.ndarray | None, policy: str) -> np.ndarray:
    """Indices of the cells with a captured hidden state; ``ValueError`` when nothing was captured."""
    if hidden is None:
        raise ValueError(f"{policy} needs captured hidden states")
    return np.flatnonzero(present_rows(hidden))


def attention(path: Path, hidden: np.ndarray, positions: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """Causal last-layer attention of the rows ``queries`` (indices) over all rows: ``[heads, q, n]``."""
    import torch

    from kvagent.transformer.model import causal_mask

    model = last_layer_model(Path(path))
    block = model.blocks[model.args.n_layer - 1]
    pos = torch.from_numpy(positions.astype(np.int64))
    with torch.no_grad():
        q, k, v = block.qkv(torch.from_numpy(hidden), pos)
        qi = torch.from_numpy(queries.astype(np.int64))
        mask = model.window_mask(block, causal_mask(pos[qi], pos), pos[qi], pos)
        _, probs = block.attend(q[:, qi], k, v, mask, None, True)
    return probs.numpy()


def counter_causal_queries(positions: "torch.Tensor", query: str) -> tuple["torch.Tensor", "torch.Tensor"]:
    """Which rows query, and the ``[q, n]`` counter-causal mask, for scoring each token ``x_i`` of a
    *contiguous* run of cells (positions ``p, p+1, ...``; see :func:`previous_rows` for cells with holes).

    ``query="self"``: row i itself queries keys at rows j > i (the paper's wording). Its residual
    stream already holds x_i, so "predicting" x_i there mostly measures how strongly the embedding of
    x_i survives to the last layer (measured: function words and punctuation then look surprising).
    ``query="previous"``: row i-1 queries keys at rows j > i and its output scores x_i, so x_i's
    own embedding is in neither the query nor the keys; the first row is never scored (a sink).
    Returns ``(query_rows [q], mask [q, n])``; query row r scores token ``r + offset`` (0 or 1).
    """
    import torch

    n = positions.numel()
    if query == "self":
        return torch.arange(n), torch.arange(n)[None, :] > torch.arange(n)[:, None]
    rows = torch.arange(n - 1)
    return rows, torch.arange(n)[None, :] > (rows[:, None] + 1)


def previous_rows(rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """``[n, ...]``: for each cell, ``rows`` of the cell at position ``p - 1`` when the cell before it
    in the view holds that position, else NaN (or -1 for integer rows).

    After an eviction cycle the cell before a kept token is often not its predecessor: the state at
    position ``p' < p - 1`` predicts ``x_{p'+1}``, not ``x_p``. Scoring ``x_p`` from it (the old
    "previous row" pass) gave every token whose predecessor was evicted a spuriously low probability,
    so surprise kept scattered leftovers and dropped contiguous facts."""
    out = np.full(rows.shape, -1 if rows.dtype.kind in "iu" else np.nan, dtype=rows.dtype)
    if positions.size > 1:
        follows = np.flatnonzero(np.diff(positions) == 1) + 1
        out[follows] = rows[follows - 1]
    return out


def counter_causal_scores(
    path: Path, hidden: np.ndarray, positions: np.ndarray, tokens: np.ndarray, query: str = "previous",
    proxy: str = "logprob", query_hidden: np.ndarray | None = None, direction: str = "counter-causal",
) -> np.ndarray:
    """``[n]``: log P (``proxy="logprob"``) or the raw logit (``"logit"``, the paper's proxy) of each
    cell's token under the counter-causal mask (keys at positions after the token's), from the last
    layer only. ``query="self"``: the cell's own state queries. ``query="previous"``: the state of
    position ``p - 1`` queries at position ``p - 1``: ``query_hidden[i]`` (NaN where none was recorded;
    default: :func:`previous_rows`, i.e. only cells whose predecessor is cached are scored). The
    predecessor need not be cached: its key is masked anyway. Cells that are not scored get -inf (the
    most surprising: kept). ``direction="causal"``: the keys at positions before the token's instead (the ordinary
    forward mask: log P(x_p | the cached x_<p), the token's self-information), with ``query="previous"`` only."""
    import torch

    if direction not in ("counter-causal", "causal") or (direction == "causal" and query == "self"):
        raise ValueError(f"direction must be 'counter-causal' or 'causal' (with query='previous'), got {direction!r}")

    model = last_layer_model(Path(path))
    block = model.blocks[model.args.n_layer - 1]
    pos = torch.from_numpy(positions.astype(np.int64))
    h = torch.from_numpy(hidden)
    if query == "self":
        rows = torch.arange(len(tokens))
        qh, q_pos = h, pos
    else:
        if query_hidden is None:
            query_hidden = previous_rows(hidden, positions)
        rows = torch.from_numpy(np.flatnonzero(~np.isnan(query_hidden[:, 0])))
        qh, q_pos = torch.from_numpy(np.ascontiguousarray(query_hidden[rows.numpy()])), pos[rows] - 1
    result = np.full(len(tokens), -np.inf)
    if rows.numel() == 0:
        return result
    if direction == "causal":  # keys strictly before the scored token: what predicted it
        mask = pos[None, :] < pos[rows][:, None]
    else:  # keys strictly after the scored token
        mask = pos[None, :] > pos[rows][:, None]
    with torch.no_grad():
        q, k, v = block.qkv(h, pos)
        if query != "self":
            q = block.qkv(qh, q_pos)[0]
        mask = model.window_mask(block, mask, q_pos, pos)
        out, _ = block.attend(q, k, v, mask, None, False)
        normed = model.head(block.finish(qh, out))
        target = torch.from_numpy(tokens.astype(np.int64))[rows]
        score = (normed * model.output[target]).sum(-1)
        if proxy == "logprob":
            score = score - logsumexp_rows(normed, model.output)
    result[rows.numpy()] = score.numpy()
    return result


def logsumexp_rows(normed: "torch.Tensor", output: "torch.Tensor", chunk: int = 256) -> "torch.Tensor":
    """``[n]`` log-sum-exp of ``normed [n, d] @ output.T [d, V]`` row by row, in chunks of rows (the
    ``[n, V]`` logits never exist at once: 1 GB for Gemma-3's vocabulary at n=1024)."""
    import torch

    parts = [torch.logsumexp(normed[s : s + chunk] @ output.T, dim=-1) for s in range(0, normed.shape[0], chunk)]
    return torch.cat(parts)
