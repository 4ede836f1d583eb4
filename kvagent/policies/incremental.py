"""Incremental counter-causal surprise: a cycle pays only for what changed ("Back from the Future", Gould and
van den Hengel, 2026).

:class:`~kvagent.policies.surprise.FastSurprise` recomputes the whole last-layer counter-causal pass at
every cycle: ``n x n`` attention and an ``[n, vocab]`` head, although between two cycles only ``h`` tokens
were added and ``n_evicted`` removed. :class:`IncrementalSurprise` scores the same quantity from state it
keeps between cycles (one instance per session, as every stateful policy):

- **Attention as an online softmax.** For every scored cell ``i`` (query: the state at ``p_i - 1``, see
  :func:`~kvagent.policies.last_layer.counter_causal_queries`) it keeps, per head, the running max ``m``,
  the sum ``l = sum_j exp(s_ij - m)`` and the weighted values ``acc = sum_j exp(s_ij - m) v_j`` over the
  keys it sees (cached cells at positions after ``p_i``), in float64. New keys are folded in
  (``n x h`` work); an evicted key is subtracted exactly (its score ``s_ij`` is recomputed from the same
  ``q``, ``k``); a row whose remaining mass would be a tiny difference of large numbers (``l`` shrinks by
  more than 1e-8) is recomputed from scratch. New cells get a full row (``h x n``).
- **The vocabulary head** (``log Z = logsumexp(W normed)``, the cost of the pass: ``n x vocab x
  n_embd``) is recomputed only for rows whose final normed state moved by more than ``drift`` (relative L2)
  since it was last computed; the others use the first-order update ``log Z(n') ~ log Z(n0) + mu0 . (n' - n0)``
  with ``mu0 = E_softmax[w]``, the gradient of ``log Z`` at ``n0``, summed over the 512 most probable
  entries (its error is second order in the move; measured in BENCHMARKS.md). At most ``refresh`` rows
  per cycle are recomputed (new rows and large moves first), so a cycle's cost does not grow with n. ``drift=0`` recomputes every row: the scores then equal a from-scratch pass
  within float error (tested to 2e-5 on both models).

Cells whose token or captured state changed (the session rewrote its tail) are treated as removed and
added again. State shapes: ``k, v: [kv_heads, n, head_dim]`` float32; ``q: [heads, n, head_dim]``;
``m, l: [heads, n]`` and ``acc: [heads, n, head_dim]`` float64; ``normed0, mu0: [n, n_embd]``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

import kvagent.policies.last_layer as last_layer
from kvagent.policies.base import CacheView, EvictionPolicy

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# a row whose softmax mass falls below this share of what it was is recomputed (cancellation)
_CANCEL = 1e-8
# rows per chunk of the vocabulary head (the [rows, vocab] logits never exist at once)
_HEAD_CHUNK = 256
# vocabulary entries the first-order term's mean embedding mu is summed over (the most probable ones)
_MU_TOP = 512
# the default cap on the head's rows per cycle: 128 rows of a vocabulary of up to 131,072 entries, fewer beyond
# (Gemma-3's 262,144: 64, a cycle's new rows at chunk 64), so a cycle's head costs at most about the same
_HEAD_WORK = 128 * 131_072
# precisions of the vocabulary head's product (``head``; "auto": "mixed" where the CPU computes bfloat16 natively)
HEADS = ("auto", "float32", "bfloat16", "mixed")


@dataclass
class CycleStats:
    """What the last :meth:`IncrementalSurprise.score` did: cells scored, rows added / recomputed /
    whose vocabulary head was refreshed, keys folded in / subtracted."""

    cells: int = 0
    new_rows: int = 0
    recomputed: int = 0
    head_refreshed: int = 0
    keys_added: int = 0
    keys_removed: int = 0


class IncrementalSurprise(EvictionPolicy):
    """Counter-causal surprise in the last layer (as :class:`~kvagent.policies.surprise.FastSurprise`,
    ``query="previous"`` or ``"self"``, ``proxy="logprob"`` or ``"logit"``), kept up to date between cycles.

    ``log Z`` refresh schedule, by each row's *move* (L2 change of its final normed state since its
    ``log Z`` was last computed, relative to that state's norm): rows that moved more than ``max_drift``
    (and new rows) always; then the rows that moved more than ``drift``, largest first, until ``refresh``
    rows per cycle (the head costs ``rows x vocab x n_embd``: the cap keeps a cycle's cost flat in n; default
    128, or ``128 x 131,072 / vocab`` where the vocabulary is larger: 64 on Gemma-3). ``head``: the precision of
    the head's product: ``"float32"``; ``"mixed"`` (the product in bfloat16, its 512 largest logits, which carry
    most of the softmax mass and the first-order term, recomputed in float32 and log Z corrected by them: 0.7x
    Gemma-3's cycle, scores within ~5e-3 of float32); ``"bfloat16"`` (all of log Z from the bfloat16 product:
    faster still, but its rounding turns float noise into ranking flips, so the kept cells depend on the cell
    layout); ``"auto"`` (default): ``"mixed"`` where the CPU has native bf16 dot products and ``drift > 0``,
    ``"float32"`` otherwise. The scored token's own logit is float32 in every mode.
    ``drift=0``: every row, every cycle (exact). Only cells with a captured hidden state are keys and rows (transplanted skills are kept, +inf),
    as in the from-scratch pass.
    """

    needs_hidden = True

    def __init__(self, query: str = "previous", proxy: str = "logprob", drift: float = 0.05, max_drift: float = 0.25,
                 refresh: int | None = None, name: str = "surprise", head: str = "auto") -> None:
        if query not in ("previous", "self") or proxy not in ("logprob", "logit"):
            raise ValueError(f"query must be 'previous' or 'self' and proxy 'logprob' or 'logit', got {query!r}, {proxy!r}")
        if not 0 <= drift <= max_drift or (refresh is not None and refresh < 0):
            raise ValueError(f"need 0 <= drift <= max_drift and refresh >= 0, got {drift}, {max_drift}, {refresh}")
        if head not in HEADS:
            raise ValueError(f"head must be one of {', '.join(HEADS)}, got {head!r}")
        self.query, self.proxy, self.name = query, proxy, name
        self.drift, self.max_drift, self.refresh = drift, max_drift, refresh
        # bfloat16 makes the head's product ~4x faster where the CPU has bf16 dot products, but its rounding turns
        # float noise into ranking flips: the same session in other cells then keeps other cells
        # (tests/integration/test_evict_bench.py fails with it). "mixed" recomputes the entries where that rounding
        # matters (the largest logits) and passes that test, so "auto" uses it; never in the exact mode (drift=0)
        self.head = ("mixed" if drift > 0 and last_layer.fast_bf16() else "float32") if head == "auto" else head
        self.stats = CycleStats()
        self._path: Path | None = None
        self._empty()

    # -- state ------------------------------------------------------------------------------------
    def _empty(self) -> None:
        import torch

        self.pos = np.zeros(0, dtype=np.int64)  # [n] ascending cached positions held in the state
        self.tok = np.zeros(0, dtype=np.int64)
        self.hid = np.zeros((0, 0), dtype=np.float32)  # [n, d] the captured state of each cell (change check)
        self.qhid = np.zeros((0, 0), dtype=np.float32)  # [n, d] the query's state (NaN: the cell is not scored)
        self.k = self.v = self.q = torch.zeros(0)
        self.m = self.l = self.acc = torch.zeros(0, dtype=torch.float64)
        self.normed0 = self.mu0 = torch.zeros(0)
        self.logz0 = torch.zeros(0, dtype=torch.float64)

    # what state() saves: name -> (dtype, role of each axis: n cells, d embedding, H heads, G kv heads, h head dim)
    _STATE = {"pos": ("<i8", "n"), "tok": ("<i8", "n"), "hid": ("<f4", "nd"), "qhid": ("<f4", "nd"),
              "k": ("<f4", "Gnh"), "v": ("<f4", "Gnh"), "q": ("<f4", "Hnh"), "m": ("<f8", "Hn"), "l": ("<f8", "Hn"),
              "acc": ("<f8", "Hnh"), "normed0": ("<f4", "nd"), "mu0": ("<f4", "nd"), "logz0": ("<f8", "n")}

    def state(self) -> dict[str, np.ndarray]:
        """The running state over the cached cells (``n`` of them): positions, tokens, their captured and query
        states ``[n, d]``, keys / values ``[G, n, hd]``, queries ``[H, n, hd]``, the online-softmax state ``m``,
        ``l`` ``[H, n]`` and ``acc`` ``[H, n, hd]``, and each row's head refresh point; ``{}`` before any cycle."""
        if not self.pos.size:
            return {}
        out = {}
        for name in self._STATE:
            value = getattr(self, name)
            out[name] = value if isinstance(value, np.ndarray) else value.numpy()
        return out

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        """Replace the state by :meth:`state`'s arrays, checked for names, dtypes and agreeing shapes first."""
        import torch

        if not state:
            self._empty()
            return
        if set(state) != set(self._STATE):
            raise ValueError(f"not {self.name}'s state: {sorted(set(state) ^ set(self._STATE))[:4]} differ")
        sizes: dict[str, int] = {}
        for name, (dtype, axes) in self._STATE.items():
            a = state[name]
            if a.dtype.str != dtype or a.ndim != len(axes):
                raise ValueError(f"{self.name} state {name!r}: {a.dtype} {a.shape}, expected {dtype} over {axes}")
            for axis, size in zip(axes, a.shape):
                if sizes.setdefault(axis, size) != size:
                    raise ValueError(f"{self.name} state {name!r}: shape {a.shape} disagrees with the other arrays")
        pos = state["pos"]
        if pos.size and not (np.diff(pos) > 0).all():
            raise ValueError(f"{self.name} state: positions are not ascending")
        for name in self._STATE:
            a = np.array(state[name])  # a copy the state owns
            setattr(self, name, a if name in ("pos", "tok", "hid", "qhid") else torch.from_numpy(a))

    def _model(self, path: Path) -> tuple[object, object]:
        model = last_layer.last_layer_model(Path(path))
        if self._path != Path(path):
            if self._path is not None:
                self._empty()
            self._path = Path(path)
        return model, model.blocks[model.args.n_layer - 1]  # type: ignore[attr-defined]

    def kept(self, positions: np.ndarray) -> None:
        """Nothing to do here: the next :meth:`score` subtracts every cell the view no longer holds."""

    # -- scoring ----------------------------------------------------------------------------------
    def score(self, view: CacheView) -> np.ndarray:
        rows = last_layer.captured_rows(view.hidden, self.name)
        result = np.full(len(view), np.inf)
        if rows.size < 2:
            return result
        model, block = self._model(view.model_path)
        pos, tok = view.positions[rows].astype(np.int64), view.tokens[rows].astype(np.int64)
        hid = np.ascontiguousarray(view.hidden[rows], dtype=np.float32)  # type: ignore[index]
        if self.query == "self":
            qhid = hid
        else:
            qh = view.query_hidden if view.query_hidden is not None else last_layer.previous_rows(view.hidden, view.positions)
            qhid = np.ascontiguousarray(qh[rows], dtype=np.float32)
        self.stats = CycleStats(cells=int(rows.size))
        self._sync(block, pos, tok, hid, qhid)
        result[rows] = -self._scores(model, block)
        return result

    def _sync(self, block: object, pos: np.ndarray, tok: np.ndarray, hid: np.ndarray, qhid: np.ndarray) -> None:
        """Bring the state to the view's cells: subtract the keys (and drop the rows) of cells that went or
        changed, then fold in the new cells as keys and give them full rows."""
        same = np.zeros(pos.size, dtype=bool)  # view cells the state already holds unchanged
        if self.pos.size and self.hid.shape[1] == hid.shape[1] and self._fits(block):
            idx = np.searchsorted(self.pos, pos).clip(max=self.pos.size - 1)
            hit = self.pos[idx] == pos
            j = idx[hit]
            ok = (self.tok[j] == tok[hit]) & (self.hid[j] == hid[hit]).all(1)
            ok &= ((self.qhid[j] == qhid[hit]) | (np.isnan(self.qhid[j]) & np.isnan(qhid[hit]))).all(1)
            same[np.flatnonzero(hit)[ok]] = True
            keep_state = np.zeros(self.pos.size, dtype=bool)
            keep_state[j[ok]] = True
        else:
            self._empty()
            keep_state = np.zeros(0, dtype=bool)
        if keep_state.size and not keep_state.all():
            self._remove(block, ~keep_state)
        new = ~same
        if new.any():
            self._add(block, pos[new], tok[new], hid[new], qhid[new])
        # the state's cells are now exactly the view's (both ascending)
        if not np.array_equal(self.pos, pos):  # pragma: no cover - bookkeeping invariant
            raise RuntimeError("incremental surprise state does not match the view's cells")

    def _fits(self, block: object) -> bool:
        """Whether the held state has this layer's head shapes (a loaded state from another model does not)."""
        a = block.args  # type: ignore[attr-defined]
        fits = tuple(self.q.shape[::2]) == (a.n_head, a.head_dim) and self.k.shape[0] == a.n_kv_head
        if not fits:
            log.warning("%s: the saved state does not fit this model's attention heads; scoring from scratch", self.name)
        return fits

    def _visible(self, q_pos: np.ndarray, row_pos: np.ndarray, key_pos: np.ndarray, block: object) -> "torch.Tensor":
        """``[rows, keys]`` bool: key after the scored token (and inside the layer's window of the query)."""
        import torch

        mask = key_pos[None, :] > row_pos[:, None]
        window = getattr(block, "window", 0)
        if window:
            mask &= np.abs(q_pos[:, None] - key_pos[None, :]) < window
        return torch.from_numpy(mask)

    def _q_pos(self, pos: np.ndarray) -> np.ndarray:
        return pos - 1 if self.query == "previous" else pos

    def _logits(self, q: "torch.Tensor", k: "torch.Tensor", block: object) -> "torch.Tensor":
        """``q: [H, r, hd]``, ``k: [KVH, s, hd]`` -> ``[H, r, s]`` scaled scores in float64 (the same
        numbers whenever the same pair is scored: added and subtracted keys cancel)."""
        a = block.args  # type: ignore[attr-defined]
        group = a.n_head // a.n_kv_head
        return (q.double() @ k.double().repeat_interleave(group, 0).transpose(1, 2)) * a.attn_scale

    def _remove(self, block: object, gone: np.ndarray) -> None:
        """Drop the cells ``gone`` (``[n]`` bool over the state): rows deleted, keys subtracted."""
        import torch

        a = block.args  # type: ignore[attr-defined]
        group = a.n_head // a.n_kv_head
        stay = ~gone
        g, s = torch.from_numpy(np.flatnonzero(gone)), torch.from_numpy(np.flatnonzero(stay))
        self.stats.keys_removed += int(g.numel())
        rpos = self.pos[stay]
        kept_q = self.q[:, s]
        vis = self._visible(self._q_pos(rpos), rpos, self.pos[gone], block)  # [rows, gone]
        m, l, acc = self.m[:, s], self.l[:, s], self.acc[:, s]
        redo = np.zeros(rpos.size, dtype=bool)
        if vis.any():
            sc = self._logits(kept_q, self.k[:, g], block)  # [H, rows, gone]
            w = torch.exp(sc - m[..., None]).masked_fill(~vis[None], 0.0).nan_to_num(0.0)
            before = l.clone()
            l = l - w.sum(-1)
            acc = acc - w @ self.v[:, g].double().repeat_interleave(group, 0)
            lost = (l <= before * _CANCEL) & vis.any(1)[None]
            redo = lost.any(0).numpy()
        self.pos, self.tok = rpos, self.tok[stay]
        self.hid, self.qhid = self.hid[stay], self.qhid[stay]
        self.k, self.v, self.q = self.k[:, s], self.v[:, s], kept_q
        self.m, self.l, self.acc = m, l, acc
        self.normed0, self.mu0, self.logz0 = self.normed0[s], self.mu0[s], self.logz0[s]
        if redo.any():
            self._full_rows(block, np.flatnonzero(redo))
            self.stats.recomputed += int(redo.sum())

    def _add(self, block: object, pos: np.ndarray, tok: np.ndarray, hid: np.ndarray, qhid: np.ndarray) -> None:
        """New cells: their keys folded into the existing rows' states, their own rows computed in full."""
        import torch

        a = block.args  # type: ignore[attr-defined]
        group = a.n_head // a.n_kv_head
        with torch.no_grad():
            _, k_new, v_new = block.qkv(torch.from_numpy(hid), torch.from_numpy(pos))  # type: ignore[attr-defined]
            has_q = ~np.isnan(qhid[:, 0])
            q_new = torch.zeros(a.n_head, pos.size, a.head_dim)
            if has_q.any():
                qrows = torch.from_numpy(np.flatnonzero(has_q))
                q_new[:, qrows] = block.qkv(torch.from_numpy(qhid[has_q]), torch.from_numpy(self._q_pos(pos)[has_q]))[0]  # type: ignore[attr-defined]
        self.stats.keys_added += int(pos.size)
        n_old = self.pos.size
        if n_old:  # fold the new keys into the old rows (n_old x h)
            vis = self._visible(self._q_pos(self.pos), self.pos, pos, block)
            if vis.any():
                sc = self._logits(self.q, k_new, block).masked_fill(~vis[None], float("-inf"))
                m_new = torch.maximum(self.m, sc.max(-1).values)
                live = torch.isfinite(m_new)
                keep = torch.where(live, torch.exp(self.m - m_new), torch.zeros_like(m_new)).nan_to_num(0.0)
                w = torch.where(live[..., None], torch.exp(sc - m_new[..., None]), torch.zeros_like(sc)).nan_to_num(0.0)
                self.l = self.l * keep + w.sum(-1)
                self.acc = self.acc * keep[..., None] + w @ v_new.double().repeat_interleave(group, 0)
                self.m = torch.where(live, m_new, self.m)
        d = hid.shape[1]
        H, hd = a.n_head, a.head_dim
        order = np.argsort(np.concatenate([self.pos, pos]), kind="stable")
        o = torch.from_numpy(order)

        def cat(old: torch.Tensor, new: torch.Tensor, dim: int) -> torch.Tensor:
            return torch.cat([old, new], dim).index_select(dim, o)

        self.pos = np.concatenate([self.pos, pos])[order]
        self.tok = np.concatenate([self.tok, tok])[order]
        self.hid = np.concatenate([self.hid.reshape(-1, d), hid])[order]
        self.qhid = np.concatenate([self.qhid.reshape(-1, d), qhid])[order]
        kvh = a.n_kv_head
        self.k = cat(self.k.reshape(kvh, n_old, hd), k_new, 1)
        self.v = cat(self.v.reshape(kvh, n_old, hd), v_new, 1)
        self.q = cat(self.q.reshape(H, n_old, hd), q_new, 1)
        h = pos.size
        self.m = cat(self.m.reshape(H, n_old), torch.full((H, h), float("-inf"), dtype=torch.float64), 1)
        self.l = cat(self.l.reshape(H, n_old), torch.zeros(H, h, dtype=torch.float64), 1)
        self.acc = cat(self.acc.reshape(H, n_old, hd), torch.zeros(H, h, hd, dtype=torch.float64), 1)
        self.normed0 = cat(self.normed0.reshape(n_old, d), torch.full((h, d), float("nan")), 0)
        self.mu0 = cat(self.mu0.reshape(n_old, d), torch.zeros(h, d), 0)
        self.logz0 = cat(self.logz0.reshape(n_old), torch.zeros(h, dtype=torch.float64), 0)
        fresh = np.flatnonzero(np.isin(self.pos, pos))
        self._full_rows(block, fresh)
        self.stats.new_rows += int(fresh.size)

    def _full_rows(self, block: object, rows: np.ndarray) -> None:
        """Recompute the online-softmax state of ``rows`` (indices into the state) over every visible key,
        ``_HEAD_CHUNK`` rows at a time (``[heads, chunk, n]`` float64 scores)."""
        import torch

        a = block.args  # type: ignore[attr-defined]
        group = a.n_head // a.n_kv_head
        v = self.v.double().repeat_interleave(group, 0)
        for s in range(0, rows.size, _HEAD_CHUNK):
            part = rows[s : s + _HEAD_CHUNK]
            r = torch.from_numpy(part.astype(np.int64))
            vis = self._visible(self._q_pos(self.pos[part]), self.pos[part], self.pos, block)
            sc = self._logits(self.q[:, r], self.k, block).masked_fill(~vis[None], float("-inf"))
            m = sc.max(-1).values
            live = torch.isfinite(m)
            w = torch.where(live[..., None], torch.exp(sc - m[..., None]), torch.zeros_like(sc)).nan_to_num(0.0)
            self.m[:, r] = m
            self.l[:, r] = w.sum(-1)
            self.acc[:, r] = w @ v
            self.normed0[r] = float("nan")  # the head is recomputed for these rows

    def _scores(self, model: object, block: object) -> np.ndarray:
        """``[n]`` log P (or the logit) of each cell's token under its counter-causal state; -inf for cells
        that are not scored (no query state: kept)."""
        import torch

        a = block.args  # type: ignore[attr-defined]
        scored = ~np.isnan(self.qhid[:, 0])
        out = np.full(self.pos.size, -np.inf)
        if not scored.any():
            return out
        r = torch.from_numpy(np.flatnonzero(scored))
        with torch.no_grad():
            l = self.l[:, r]
            attn = torch.where(l[..., None] > 0, self.acc[:, r] / l[..., None].clamp_min(1e-300), torch.zeros_like(self.acc[:, r]))
            attn = attn.float().transpose(0, 1).reshape(r.numel(), a.n_head * a.head_dim)
            normed = model.head(block.finish(torch.from_numpy(self.qhid[scored]), attn))  # type: ignore[attr-defined]
            W = model.output  # type: ignore[attr-defined]
            score = (normed * W[torch.from_numpy(self.tok[scored])]).sum(-1).double()
            if self.proxy == "logprob":
                score = score - self._log_z(normed, r, W)
        out[scored] = score.numpy()
        return out

    def _log_z(self, normed: "torch.Tensor", r: "torch.Tensor", W: "torch.Tensor") -> "torch.Tensor":
        """``[rows]`` log Z of each scored row: exact where the row moved by more than ``drift`` (relative) since its
        head was last computed (or never was), first-order from the stored ``log Z``, ``mu`` otherwise."""
        import torch

        n0 = self.normed0[r]
        move = ((normed - n0).norm(dim=-1) / n0.norm(dim=-1)).nan_to_num(float("inf"))
        if self.drift == 0:
            redo = torch.ones_like(move, dtype=torch.bool)
        else:  # every row past max_drift (new rows: inf), then the largest moves past drift, up to `refresh` rows
            redo = move > self.max_drift
            cap = self.refresh if self.refresh is not None else min(128, _HEAD_WORK // W.shape[0])
            room = cap - int(redo.sum())
            if room > 0:
                cand = torch.nonzero((move > self.drift) & ~redo).flatten()
                redo[cand[torch.argsort(move[cand], descending=True)[:room]]] = True
        logz = self.logz0[r] + ((normed - n0).nan_to_num(0.0) * self.mu0[r]).sum(-1).double()
        idx = torch.nonzero(redo).flatten()
        self.stats.head_refreshed += int(idx.numel())
        Wh = last_layer.output_in(W, "float32" if self.head == "float32" else "bfloat16")
        for s in range(0, idx.numel(), _HEAD_CHUNK):
            part = idx[s : s + _HEAD_CHUNK]
            lse, values, ids = _head_lse(normed[part], W, Wh, self.head)
            # mu = E_softmax[w] over the top entries only: the softmax is concentrated, and the full
            # [rows, vocab] @ [vocab, n_embd] product would double the head's cost (Gemma-3: 262k entries)
            mu = _weighted_rows(torch.exp(values - lse.float()[:, None]), ids, W)
            rows = r[part]
            self.normed0[rows], self.mu0[rows], self.logz0[rows] = normed[part], mu, lse
            logz[part] = lse
        return logz


def _head_lse(normed: "torch.Tensor", W: "torch.Tensor", Wh: "torch.Tensor", head: str) -> "tuple[torch.Tensor, torch.Tensor, torch.Tensor]":
    """``(log Z [rows] float64, top logits [rows, k] float32, their vocabulary ids [rows, k])`` of ``normed [rows,
    n_embd]`` under the head ``W [vocab, n_embd]`` (``Wh``: its copy in the head's dtype), ``k = _MU_TOP``.
    ``"mixed"``: the product in bfloat16, then the top entries (most of the softmax mass, and what the first-order
    term uses) recomputed in float32 over the union of the rows' top ids, and log Z corrected by their difference."""
    import torch

    k = min(_MU_TOP, W.shape[0])
    logits = (normed.to(Wh.dtype) @ Wh.T).float()
    top = logits.topk(k, dim=-1)
    lse = torch.logsumexp(logits, dim=-1).double()
    if head != "mixed":
        return lse, top.values, top.indices
    union, inverse = torch.unique(top.indices, return_inverse=True)
    exact = (W[union] @ normed.T).T.gather(1, inverse)  # [rows, k] as the float32 head gives them
    # Z = Z_approx - sum(top, approx) + sum(top, exact), relative to Z_approx (the top is most of it: no cancellation)
    shift = (torch.exp(exact.double() - lse[:, None]) - torch.exp(top.values.double() - lse[:, None])).sum(-1)
    return lse + torch.log1p(shift), exact, top.indices


def _weighted_rows(weights: "torch.Tensor", indices: "torch.Tensor", W: "torch.Tensor") -> "torch.Tensor":
    """``[rows, n_embd]``: ``sum_k weights[r, k] * W[indices[r, k]]`` as one sparse product (``weights``, ``indices``:
    ``[rows, k]``), without the ``[rows, k, n_embd]`` gather (168 MB at 128 rows of Gemma-3's head)."""
    import torch

    rows, k = indices.shape
    at = torch.stack([torch.arange(rows).repeat_interleave(k), indices.flatten()])
    sparse = torch.sparse_coo_tensor(at, weights.flatten(), (rows, W.shape[0]), check_invariants=False)
    return torch.sparse.mm(sparse, W)
