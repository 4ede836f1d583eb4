"""Eviction policies: score every cached token, the cycle keeps the highest ("Back from the Future", Gould and
van den Hengel, 2026; docs/papers.md).

A policy is a small class with one method, :meth:`EvictionPolicy.score`: ``CacheView -> [n]`` scores,
higher = keep. The cycle (:mod:`kvagent.eviction`) never asks a policy about pinned positions' fate:
pinned segments (policy, fields, errata, pinned skills) and the last token are always kept. Policies
compose by wrapping (:class:`KeepSinks` keeps the first tokens whatever the inner policy says).
Stateful policies (H2O's accumulated attention, the full surprise pass's mirror cache) are one
instance per session and learn what was kept through :meth:`EvictionPolicy.kept`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class CacheView:
    """What a policy may look at, for the ``n`` cells a session's sequence holds, in position order.

    ``tokens, positions: [n]`` int64; ``pinned: [n]`` bool; ``new: [n]`` bool, True for tokens decoded
    since the previous cycle; ``hidden: [n, n_embd]`` float32 penultimate-layer hidden states
    (input of the last layer, captured from llama.cpp) or None when the engine captures nothing;
    ``model_path`` the GGUF the engine runs (policies that compute in torch load from it).

    Filled by the :class:`~kvagent.eviction.Evictor` (None when built elsewhere): ``query_hidden: [n,
    n_embd]`` the hidden state recorded at position ``p - 1`` of each cell (NaN where none), kept by the
    Evictor even after ``p - 1`` was evicted, so the counter-causal pass can score ``x_p`` from the
    state that predicts it; ``previous: [n]`` int64 the token at ``p - 1`` (-1 where unknown);
    ``texts``: each cell's token text (UTF-8, invalid bytes replaced), for span-level policies; ``budget``: the
    cells the cycle keeps (J); ``labels``: each cell's segment label (:func:`kvagent.segments.segment_label`:
    ``"tool"``, ``"memory"``, ``"user"``, ...), for per-segment budgets; ``layers``: ``{layer: [n, n_embd]}`` the
    input hidden state of each layer the policy asked for (:meth:`EvictionPolicy.input_layers`; NaN rows where
    none was captured); ``probe(tokens, prompt="")``: for a policy that ``needs_probe``, decodes ``prompt``'s tokens
    then ``tokens`` after the cache in a throwaway copy of the sequence (positions ``positions[-1] + 1, ...``; the
    session's cells are not touched) and returns ``{layer: [n_prompt + len(tokens), n_embd]}`` their input hidden
    states of the same layers (None where the engine lends no scratch sequence).
    """

    tokens: np.ndarray
    positions: np.ndarray
    pinned: np.ndarray
    new: np.ndarray
    hidden: np.ndarray | None
    model_path: Path
    query_hidden: np.ndarray | None = None
    previous: np.ndarray | None = None
    texts: tuple[str, ...] | None = None
    budget: int | None = None
    labels: tuple[str, ...] | None = None
    layers: Mapping[int, np.ndarray] | None = None
    probe: Callable[[Sequence[int], str], Mapping[int, np.ndarray]] | None = None

    def __len__(self) -> int:
        return int(self.tokens.size)


class EvictionPolicy:
    """Scores cached tokens; subclasses implement :meth:`score`. ``needs_hidden``: the policy reads
    ``view.hidden`` (the engine must capture the penultimate layer); ``needs_probe``: it calls ``view.probe``."""

    name = "policy"
    needs_hidden = False
    needs_probe = False

    def score(self, view: CacheView) -> np.ndarray:  # pragma: no cover - abstract
        """``[len(view)]`` float scores, higher = keep."""
        raise NotImplementedError

    def kept(self, positions: np.ndarray) -> None:
        """Told after each cycle which positions survived (ascending); stateful policies prune here."""

    def input_layers(self, n_layer: int, model_path: Path) -> tuple[int, ...]:
        """Layers ``1 .. n_layer - 1`` whose input hidden states the policy reads in ``view.layers`` (and gets from
        ``view.probe``); the Evictor captures them. None by default."""
        return ()

    def state(self) -> dict[str, np.ndarray]:
        """What the policy carries from one cycle to the next, as named numeric arrays (saved with the session's KV,
        so that a restored session scores its cells as the saved one would). ``{}``: nothing (a stateless policy)."""
        return {}

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        """Replace the policy's state by what :meth:`state` returned; ``ValueError`` (and nothing changed) for
        arrays it would not have written."""
        if state:
            raise ValueError(f"policy {self.name!r} keeps no state between cycles, the blob has {sorted(state)[:4]}")

    def __repr__(self) -> str:
        return self.name


class Wrapper(EvictionPolicy):
    """A policy around ``inner``: same name, needs and layers; told what was kept. Subclasses change the scores."""

    def __init__(self, inner: EvictionPolicy, name: str | None = None) -> None:
        self.inner = inner
        self.name = name or inner.name
        self.needs_hidden = inner.needs_hidden
        self.needs_probe = inner.needs_probe

    def score(self, view: CacheView) -> np.ndarray:
        return np.asarray(self.inner.score(view), dtype=np.float64)

    def kept(self, positions: np.ndarray) -> None:
        self.inner.kept(positions)

    def input_layers(self, n_layer: int, model_path: Path) -> tuple[int, ...]:
        return self.inner.input_layers(n_layer, model_path)

    def state(self) -> dict[str, np.ndarray]:
        return self.inner.state()

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        self.inner.load_state(state)


class KeepSinks(Wrapper):
    """Wraps a policy and always keeps the first ``n`` cached positions (attention sinks, StreamingLLM)."""

    def __init__(self, inner: EvictionPolicy, n: int = 4) -> None:
        super().__init__(inner)
        self.n = n

    def score(self, view: CacheView) -> np.ndarray:
        scores = np.asarray(self.inner.score(view), dtype=np.float64).copy()
        scores[: self.n] = np.inf
        return scores


class PositionTable(EvictionPolicy):
    """A policy whose running state is one value per cached position (H2O's accumulated attention, a cell's
    self-information): forgotten when its cell is evicted, saved as the ``{table}.pos`` / ``{table}.value`` arrays."""

    table = "values"

    def __init__(self) -> None:
        self._values: dict[int, float] = {}  # position -> value

    def kept(self, positions: np.ndarray) -> None:
        keep = set(positions.tolist())
        self._values = {p: v for p, v in self._values.items() if p in keep}

    def state(self) -> dict[str, np.ndarray]:
        return values_state(self._values, self.table)

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        if set(state) != {f"{self.table}.pos", f"{self.table}.value"}:
            raise ValueError(f"not {self.name}'s state: {sorted(state)[:4]}")
        self._values = values_from_state(state, self.table)


class KeepMarkers(Wrapper):
    """Wraps a policy and always keeps the chat format's markers: control tokens (turn starts and ends, whose text is
    empty: llama.cpp renders no piece for them) and, with ``lines``, every token holding a line break. Other attention
    sinks than the first tokens (models put attention mass on delimiters; Xiao et al., 2023, observe the first tokens,
    later work finds sinks at separators too), and what tells the model whose turn a kept sentence belongs to. Needs
    the view's ``texts`` (the Evictor fills them); without them it is the inner policy."""

    def __init__(self, inner: EvictionPolicy, lines: bool = False, name: str | None = None) -> None:
        super().__init__(inner, name)
        self.lines = lines

    def score(self, view: CacheView) -> np.ndarray:
        scores = np.asarray(self.inner.score(view), dtype=np.float64).copy()
        if view.texts is not None:
            marks = np.fromiter((t == "" or (self.lines and "\n" in t) for t in view.texts), bool, len(view))
            scores[marks] = np.inf
        return scores


def with_prefix(prefix: str, state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``state``'s arrays named ``{prefix}.{name}`` (a composite saves its parts' states side by side)."""
    return {f"{prefix}.{k}": v for k, v in state.items()}


def under_prefix(prefix: str, state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The arrays :func:`with_prefix` put under ``prefix``, the prefix taken off."""
    return {k.removeprefix(f"{prefix}."): v for k, v in state.items() if k.startswith(f"{prefix}.")}


def values_state(values: Mapping[int, float], name: str) -> dict[str, np.ndarray]:
    """A ``{position: value}`` table as two arrays, ``{name}.pos`` (int64) and ``{name}.value`` (float64)."""
    pos = np.fromiter(values.keys(), np.int64, len(values))
    return {f"{name}.pos": pos, f"{name}.value": np.fromiter(values.values(), np.float64, len(values))}


def values_from_state(state: Mapping[str, np.ndarray], name: str) -> dict[int, float]:
    """The table :func:`values_state` wrote; ValueError when its arrays are missing or do not pair up."""
    pos, val = state.get(f"{name}.pos"), state.get(f"{name}.value")
    if pos is None or val is None or pos.ndim != 1 or pos.shape != val.shape or pos.dtype.kind != "i" \
            or val.dtype.kind != "f":
        raise ValueError(f"the state's {name!r} table is missing or malformed")
    return dict(zip(pos.tolist(), val.tolist()))


def rng_state(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A generator's bit-generator state as JSON bytes (``rng``, uint8)."""
    import json

    return {"rng": np.frombuffer(json.dumps(rng.bit_generator.state).encode(), np.uint8).copy()}


def load_rng(rng: np.random.Generator, state: Mapping[str, np.ndarray]) -> None:
    """Set ``rng`` from :func:`rng_state`'s array; ValueError when it is not such a state."""
    import json

    raw = state.get("rng")
    if raw is None or set(state) != {"rng"} or raw.dtype != np.uint8 or raw.ndim != 1:
        raise ValueError(f"not a random generator's state: {sorted(state)[:4]}")
    try:
        rng.bit_generator.state = json.loads(raw.tobytes())
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"not a random generator's state ({exc})") from exc


def select_keep(scores: np.ndarray, pinned: np.ndarray, budget: int, priority: np.ndarray | None = None) -> np.ndarray:
    """Indices (ascending) of the cells to keep: every pinned one, the last one, then by ``priority``
    (``[n]``, segment eviction priority: higher kept first; default all equal), then the highest scores,
    until ``budget`` cells (ties: the later position wins). Pinned cells beyond the budget are kept
    anyway; the caller reports that the budget is too small for the pinned segments."""
    n = scores.size
    forced = pinned.copy()
    if n:
        forced[-1] = True  # the last token has no future to be predicted from: always kept (the surprise paper)
    room = max(budget - int(forced.sum()), 0)
    free = np.flatnonzero(~forced)
    if room and free.size:
        s = np.nan_to_num(np.asarray(scores, dtype=np.float64)[free], nan=-np.inf)
        keys = (free, s) if priority is None else (free, s, np.asarray(priority, dtype=np.float64)[free])
        order = np.lexsort(keys)[::-1]  # by priority, then score, then position, descending
        forced[free[order[:room]]] = True
    return np.flatnonzero(forced)
