"""Chunked eviction cycles for one session ("Back from the Future", Gould and van den Hengel, 2026): infer h
tokens, prune to J.

An :class:`Evictor` belongs to one session. It records the penultimate hidden state of every token the
session decodes (when its policy needs them and the engine captures them), and on :meth:`cycle` scores
the session's cells with its policy and removes the lowest-scored ones with ``seq_rm``. Pinned positions and
the last token are always kept. The session keeps its span table and records which positions were
evicted, so every cached position still knows its segment.

A token's *position* (its index in the session's tokens: what policies, pins and records use) and its *cell*
(the position llama.cpp holds it at) differ once a cycle has compacted (``Eviction.compact``, the default where
the backend can shift cells): after each cycle the session renumbers its kept cells ``0..k-1`` in order
(llama.cpp's K-shift, StreamingLLM's rolling positions), so a token's cell is its position less the evicted
positions before it. llama.cpp's mask is position-based, so holes are fine without it (``compact=False``); with
it, a sliding-window layer (Gemma-3: 512 positions) sees the last 512 *kept* tokens instead of what was kept of
the last 512 positions, and both models kept more facts (docs/benchmarks/eviction.md, "Held-out eviction"). The evictor is told
the cells where they differ (``cells=`` of :meth:`decode` and :meth:`cycle`); the session does the renumbering
(``CachedSequence``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

import kvagent.policies.last_layer as last_layer
from kvagent.errors import EvictionError
from kvagent.kv.compact import position_runs
from kvagent.policies import CacheView, EvictionPolicy, get_policy, select_keep
from kvagent.policies.base import under_prefix, with_prefix

if TYPE_CHECKING:
    from kvagent.backends.base import Backend

log = logging.getLogger(__name__)

# cells kept free above budget + chunk: the closing tokens of a turn always fit
_MARGIN = 16


@dataclass(frozen=True)
class Eviction:
    """How a session forgets: ``policy`` (a name from ``kvagent.policies.POLICIES`` or an instance; default
    ``"contrast"``, the policy that kept the most facts on the held-out agent cases), ``budget`` J cells kept after a
    cycle, ``chunk`` h tokens inferred between cycles. ``compact`` (default): after each cycle the kept cells are
    renumbered ``0..k-1`` where the backend can shift cells (see the module), which kept more facts on both models on
    the held-out split (docs/benchmarks/eviction.md); ``False`` leaves every kept token at its position."""

    policy: str | EvictionPolicy = "contrast"
    budget: int = 1024
    chunk: int = 64
    compact: bool = True


@dataclass(frozen=True)
class CycleReport:
    """One cycle: cells before and after, evicted positions, time scoring and in total (ms)."""

    before: int
    after: int
    evicted: tuple[int, ...]
    score_ms: float
    cycle_ms: float


class Evictor:
    """Scores and prunes one session's sequence. Created by ``Engine.session(eviction=...)``.

    ``scratch`` lends a temporary sequence (the engine's ``SequencePool.scratch``): a policy that ``needs_probe``
    decodes its probe there, on a copy of the session's cells, and gets no probe without one."""

    def __init__(self, config: Eviction, backend: Backend, model_path: Path,
                 scratch: Callable[[], AbstractContextManager[int]] | None = None) -> None:
        if config.budget < 2 or config.chunk < 1:
            raise EvictionError(f"eviction budget must be >= 2 and chunk >= 1, got budget={config.budget}, chunk={config.chunk}")
        if config.budget + config.chunk + _MARGIN > backend.n_ctx:
            raise EvictionError(
                f"budget {config.budget} + chunk {config.chunk} (+{_MARGIN}) exceeds the context of {backend.n_ctx} "
                "cells: lower the budget or the chunk, or load the engine with a larger n_ctx"
            )
        self.config = config
        self.policy = get_policy(config.policy)
        self.budget, self.chunk = config.budget, config.chunk
        self._backend = backend
        self._model_path = model_path
        self._capture = backend.capture
        self._scratch = scratch
        self._layer = backend.layer_output_name(-2)  # output of layer L-2 = input of the last layer
        if not backend.capabilities.positional_kv:
            raise EvictionError("this backend does not keep cells at explicit positions: eviction leaves holes in the "
                                "cache, which it cannot hold; open the session without eviction")
        if self.policy.needs_hidden and (not backend.capabilities.hidden_capture or self._capture is None):
            raise EvictionError(
                f"policy {self.policy.name!r} reads the penultimate layer's hidden states: load the engine "
                "with capture='native' (or 'python'), e.g. Engine.load(model, capture='native')"
            )
        # layers whose input states the policy reads (input of layer l = output of layer l - 1)
        self.layers = tuple(sorted(set(self.policy.input_layers(backend.n_layer, model_path))))
        if any(not 1 <= layer < backend.n_layer for layer in self.layers):
            raise EvictionError(f"policy {self.policy.name!r} asked for layers {self.layers}: use 1 .. {backend.n_layer - 1}")
        if self.layers and self._capture is None:
            raise EvictionError(f"policy {self.policy.name!r} reads hidden states of layers {self.layers}: load the "
                                "engine with capture='native' (or 'python')")
        self._layer_names = {layer: backend.layer_output_name(layer - 1) for layer in self.layers}
        if self.captures and self._capture is not None:
            self._capture.want(self._wanted())
        self._layer_rows: dict[int, dict[int, np.ndarray]] = {layer: {} for layer in self.layers}
        self._hidden: dict[int, np.ndarray] = {}
        self._tokens: dict[int, int] = {}  # token decoded at each position still cached (and at p - 1 of those)
        self._texts: dict[int, str] = {}  # token id -> text
        self._seen: set[int] = set()  # positions already shown to the policy in an earlier cycle
        self.cycles: list[CycleReport] = []

    # -- hidden states ----------------------------------------------------------------------------
    @property
    def captures(self) -> bool:
        """Whether decoding through this evictor captures hidden states (the policy reads some)."""
        return self.policy.needs_hidden or bool(self.layers)

    def _wanted(self) -> list[str]:
        """Graph names to capture: the penultimate layer's output (``needs_hidden``) and the policy's layers' inputs."""
        names = [self._layer] if self.policy.needs_hidden else []
        return list(dict.fromkeys(names + list(self._layer_names.values())))

    def _captured(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[int],
                  outputs: Sequence[bool]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Decode with capture on: the logits and ``{graph name: [len(tokens), n_embd]}`` (names whose row count
        does not match the batch are left out, with a warning)."""
        capture = self._capture
        if capture is None:  # pragma: no cover - __init__ refuses a capturing policy without capture
            raise EvictionError("this engine captures no hidden states")
        capture.clear()
        capture.enabled = True
        try:
            logits = self._backend.decode(tokens, positions, seq_ids, outputs)
        finally:
            capture.enabled = False
        out = {}
        for name, rows in capture.take().items():
            hidden = np.concatenate(rows) if rows else np.zeros((0, 0), np.float32)
            if hidden.shape[0] == len(tokens):
                out[name] = hidden
            else:
                log.warning("captured %d %s rows for %d tokens: not recorded", hidden.shape[0], name, len(tokens))
        return logits, out

    def decode(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[int],
               outputs: Sequence[bool], cells: Sequence[int] | None = None) -> np.ndarray:
        """``Backend.decode`` (same signature, so a sequence decodes through either), recording H^(L-1) rows per
        position when the policy needs them, and the input states of the policy's layers. One evictor belongs to
        one sequence: every id names it. ``cells``: where llama.cpp holds these positions, when they differ
        (a compacted session; see the module)."""
        self._tokens.update(zip((int(p) for p in positions), (int(t) for t in tokens)))
        at = positions if cells is None else cells
        if not self.captures:
            return self._backend.decode(tokens, at, seq_ids, outputs)
        logits, rows = self._captured(tokens, at, seq_ids, outputs)
        pos = [int(p) for p in positions]
        if self.policy.needs_hidden and self._layer in rows:
            self._hidden.update(zip(pos, rows[self._layer]))
        for layer, name in self._layer_names.items():
            if name in rows:
                self._layer_rows[layer].update(zip(pos, rows[name]))
        return logits

    def forget_from(self, position: int) -> None:
        """The sequence was cut at ``position``: drop what was recorded from there on."""
        self._hidden = {p: h for p, h in self._hidden.items() if p < position}
        self._layer_rows = {layer: {p: h for p, h in rows.items() if p < position}
                            for layer, rows in self._layer_rows.items()}
        self._tokens = {p: t for p, t in self._tokens.items() if p < position}
        self._seen = {p for p in self._seen if p < position}

    def _probe(self, seq: int, start: int) -> Callable[[Sequence[int], str], Mapping[int, np.ndarray]] | None:
        """``view.probe`` for a cycle of ``seq`` whose next position is ``start`` (None without a scratch
        sequence or when the policy needs none)."""
        if not self.policy.needs_probe or self._scratch is None:
            return None
        scratch = self._scratch

        def probe(tokens: Sequence[int], prompt: str = "") -> Mapping[int, np.ndarray]:
            ids = (self._backend.tokenize(prompt, special=False) if prompt else []) + [int(t) for t in tokens]
            n = len(ids)
            if not n:
                return {}
            with scratch() as tmp:
                self._backend.seq_cp(seq, tmp, 0, -1)  # the session's cells, shared: the probe adds its own
                _, rows = self._captured(ids, range(start, start + n), [tmp] * n, [False] * (n - 1) + [True])
            return {layer: rows[name] for layer, name in self._layer_names.items() if name in rows}

        return probe

    # -- cycle ------------------------------------------------------------------------------------
    def due(self, cells: int) -> bool:
        """A cycle is due once ``chunk`` tokens have been inferred beyond the budget."""
        return cells >= self.budget + self.chunk

    def cycle(self, seq: int, tokens: Sequence[int], positions: Sequence[int], pinned: Sequence[bool],
              priority: Sequence[int] | None = None, labels: Sequence[str] | None = None,
              cells: Sequence[int] | None = None) -> CycleReport:
        """Prune the cells ``positions`` (ascending, with their ``tokens``) to the budget; returns what went.
        ``priority`` (per cell, default all 0): cells of a lower priority are evicted first, the policy's
        scores ranking cells within one priority; ``labels`` (per cell): its segment's label, for policies with
        per-segment budgets; ``cells`` (per cell): where llama.cpp holds it, when that differs from its position
        (a compacted session)."""
        start = time.perf_counter()
        pos = np.asarray(positions, dtype=np.int64)
        at = pos if cells is None else np.asarray(cells, dtype=np.int64)
        tok = np.asarray(tokens, dtype=np.int64)
        self._tokens.update(zip(pos.tolist(), tok.tolist()))
        view = CacheView(
            tokens=tok,
            positions=pos,
            pinned=np.asarray(pinned, dtype=bool),
            new=np.array([p not in self._seen for p in pos.tolist()]),
            hidden=self.hidden_rows(pos) if self.policy.needs_hidden else None,
            model_path=self._model_path,
            query_hidden=self.hidden_rows(pos - 1) if self.policy.needs_hidden else None,
            previous=np.array([self._tokens.get(p - 1, -1) for p in pos.tolist()], dtype=np.int64),
            texts=self.texts(tok),
            budget=self.budget,
            labels=None if labels is None else tuple(labels),
            layers={layer: self.layer_rows(layer, pos) for layer in self.layers} if self.layers else None,
            probe=self._probe(seq, int(at[-1]) + 1 if at.size else 0),
        )
        scores = np.asarray(self.policy.score(view), dtype=np.float64)
        if scores.shape != (len(view),):
            raise EvictionError(f"policy {self.policy.name!r} returned {scores.shape} scores for {len(view)} cells")
        score_ms = (time.perf_counter() - start) * 1000
        keep = select_keep(scores, view.pinned, self.budget, None if priority is None else np.asarray(priority))
        if keep.size > self.budget:
            log.warning("pinned segments hold %d cells, more than the eviction budget %d", int(view.pinned.sum()), self.budget)
        kept = np.zeros(len(view), dtype=bool)
        kept[keep] = True
        gone = pos[~kept]
        for first, last in position_runs(at[~kept].tolist()):
            self._backend.seq_rm(seq, first, last + 1)
        # keep what a later cycle reads: the cached cells' states and tokens, and those of the position
        # just before each cached cell (the query that scores it in the counter-causal pass)
        wanted = set(pos[kept].tolist())
        wanted |= {p - 1 for p in wanted}
        self._hidden = {p: h for p, h in self._hidden.items() if p in wanted}
        self._layer_rows = {layer: {p: h for p, h in rows.items() if p in wanted} for layer, rows in self._layer_rows.items()}
        self._tokens = {p: t for p, t in self._tokens.items() if p in wanted}
        self._seen = set(pos[kept].tolist())
        self.policy.kept(pos[kept])
        report = CycleReport(len(view), int(kept.sum()), tuple(gone.tolist()), score_ms, (time.perf_counter() - start) * 1000)
        self.cycles.append(report)
        log.debug("eviction cycle (%s): %d -> %d cells, %.1f ms", self.policy.name, report.before, report.after, report.cycle_ms)
        return report

    def texts(self, tokens: np.ndarray) -> tuple[str, ...]:
        """Each token's text (UTF-8, invalid bytes replaced; a token split inside a character reads as
        U+FFFD), cached per token id."""
        out = []
        for t in tokens.tolist():
            text = self._texts.get(t)
            if text is None:
                try:
                    text = self._backend.token_bytes(t).decode("utf-8", "replace")
                except Exception:  # a backend without token texts: spans fall back to blocks
                    text = ""
                self._texts[t] = text
            out.append(text)
        return tuple(out)

    def hidden_rows(self, positions: np.ndarray) -> np.ndarray:
        """``[n, n_embd]`` recorded H^(L-1) rows for ``positions``; NaN rows where none was recorded."""
        return _rows(self._hidden, positions)

    def layer_rows(self, layer: int, positions: np.ndarray) -> np.ndarray:
        """``[n, n_embd]`` recorded input states of ``layer`` (one of :attr:`layers`) for ``positions``; NaN rows
        where none was recorded."""
        return _rows(self._layer_rows[layer], positions)

    # -- saved state ------------------------------------------------------------------------------
    def state(self) -> dict[str, np.ndarray]:
        """What the next cycle reads besides the KV cells, as named arrays (saved in the session's blob): the
        recorded hidden rows ``hidden.pos`` / ``hidden.rows`` ``[n, n_embd]`` and each read layer's inputs
        (``layer{l}.*``), the tokens at recorded positions (``tokens.pos`` / ``tokens.ids``), the positions the policy
        has already seen (``seen``) and the policy's own state (``policy.*``, :meth:`EvictionPolicy.state`)."""
        out: dict[str, np.ndarray] = {}
        tables = {"hidden": self._hidden} if self.policy.needs_hidden else {}
        tables.update({f"layer{layer}": rows for layer, rows in self._layer_rows.items()})
        for name, table in tables.items():
            pos = sorted(table)
            out[f"{name}.pos"] = np.array(pos, np.int64)
            out[f"{name}.rows"] = (np.stack([table[p] for p in pos]).astype(np.float32, copy=False) if pos
                                   else np.zeros((0, 0), np.float32))
        pos = sorted(self._tokens)
        out["tokens.pos"], out["tokens.ids"] = np.array(pos, np.int64), np.array([self._tokens[p] for p in pos], np.int64)
        out["seen"] = np.array(sorted(self._seen), np.int64)
        out.update(with_prefix("policy", self.policy.state()))
        return out

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        """Replace what this evictor recorded (and its policy's state) by :meth:`state`'s arrays from a session saved
        with the same policy. Everything is checked first; ``ValueError`` leaves the evictor as it was."""
        tables = (["hidden"] if self.policy.needs_hidden else []) + [f"layer{layer}" for layer in self.layers]
        wanted = {f"{t}.{part}" for t in tables for part in ("pos", "rows")} | {"tokens.pos", "tokens.ids", "seen"}
        mine = {k for k in state if not k.startswith("policy.")}
        if mine != wanted:
            raise ValueError(f"the saved eviction state has {sorted(mine ^ wanted)[:4]} where this evictor "
                             f"({self.policy.name}) expects {sorted(wanted)[:4]}")

        def positions(name: str) -> list[int]:
            a = state[name]
            if a.ndim != 1 or a.dtype.kind != "i" or (a.size and (a.min() < 0 or not (np.diff(a) > 0).all())):
                raise ValueError(f"saved eviction state {name!r} is not ascending positions")
            return a.tolist()

        width = last_layer.model_args(Path(self._model_path)).n_embd if tables else 0  # type: ignore[attr-defined]
        loaded: dict[str, dict[int, np.ndarray]] = {}
        for t in tables:
            pos, rows = positions(f"{t}.pos"), state[f"{t}.rows"]
            if rows.dtype != np.float32 or rows.ndim != 2 or rows.shape[0] != len(pos) or (pos and rows.shape[1] != width):
                raise ValueError(f"saved eviction state {t!r}: rows {rows.dtype} {rows.shape} for {len(pos)} positions "
                                 f"of {width} values")
            loaded[t] = dict(zip(pos, np.array(rows)))
        tok_pos, ids = positions("tokens.pos"), state["tokens.ids"]
        if ids.shape != (len(tok_pos),) or ids.dtype.kind != "i":
            raise ValueError("saved eviction state: tokens do not pair with their positions")
        seen = set(positions("seen"))
        self.policy.load_state(under_prefix("policy", state))
        self._hidden = loaded.get("hidden", {})
        self._layer_rows = {layer: loaded[f"layer{layer}"] for layer in self.layers}
        self._tokens = dict(zip(tok_pos, ids.tolist()))
        self._seen = seen

    def adopt(self, other: Evictor) -> None:
        """Take over what ``other`` recorded (hidden states, layer inputs, tokens, token texts; shallow copies of
        its dicts), for a sequence that got ``other``'s cells by ``seq_cp``: the benchmark decodes a prefix shared
        by several policies once. Cycles, seen positions and the policy's state are not copied."""
        self._hidden = dict(other._hidden)
        self._layer_rows = {layer: dict(other._layer_rows.get(layer, {})) for layer in self.layers}
        self._tokens = dict(other._tokens)
        self._texts = dict(other._texts)


def _rows(recorded: Mapping[int, np.ndarray], positions: np.ndarray) -> np.ndarray:
    """``[n, width]`` the rows ``recorded`` holds for ``positions``; NaN rows where it holds none."""
    rows = [recorded.get(p) for p in positions.tolist()]
    width = next((r.shape[0] for r in rows if r is not None), 0)
    if not width:
        return np.full((len(rows), 1), np.nan, dtype=np.float32)
    out = np.full((len(rows), width), np.nan, dtype=np.float32)
    for i, r in enumerate(rows):
        if r is not None:
            out[i] = r
    return out
