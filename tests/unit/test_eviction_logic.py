"""Eviction logic without a model: which cells a cycle keeps, runs of removed positions, the sink wrapper,
policy names, and the Evictor's checks of its settings (against a tiny fake backend: pure logic only)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvagent.errors import EvictionError
from kvagent.backends.base import Capabilities
from kvagent.eviction import _MARGIN, Eviction, Evictor
from kvagent.kv.compact import position_runs
from kvagent.policies import POLICIES, CacheView, EvictionPolicy, KeepSinks, get_policy, select_keep
from kvagent.policies.simple import Recency

NAN = float("nan")


# --- select_keep ---------------------------------------------------------------------------------------
# (id, scores, pinned indices, budget, expected kept indices)
SELECT_CASES = [
    ("highest-scores", [5, 1, 4, 2, 3, 0], [], 3, [0, 2, 5]),
    ("last-always-kept", [9, 8, 7, 6, 5, -100], [], 2, [0, 5]),
    ("last-kept-at-budget-1", [9, 8, 7, 1], [], 1, [3]),
    ("ties-later-position-wins", [1, 1, 1, 1, 1, 1], [], 3, [3, 4, 5]),
    ("ties-after-higher", [2, 1, 1, 2, 1, 0], [], 4, [0, 3, 4, 5]),
    ("pinned-kept-within-budget", [0, 0, 9, 9, 9, 9, 0], [0, 1], 4, [0, 1, 5, 6]),
    ("pinned-kept-over-budget", [0, 0, 0, 9, 9, 0], [0, 1, 2, 3], 2, [0, 1, 2, 3, 5]),
    ("pinned-and-last-fill-budget", [0, 9, 9, 0], [0], 2, [0, 3]),
    ("nan-lowest", [NAN, 1, NAN, 2, 0, 5], [], 4, [1, 3, 4, 5]),
    ("nan-ties-with-minus-inf-later-position-wins", [NAN, -np.inf, NAN, 0], [], 3, [1, 2, 3]),
    ("inf-kept-first", [np.inf, 1, 2, np.inf, 3, 0], [], 3, [0, 3, 5]),
    ("budget-above-cells", [3, 2, 1], [], 10, [0, 1, 2]),
    ("budget-zero-keeps-last-and-pinned", [3, 2, 1, 0], [1], 0, [1, 3]),
    ("empty", [], [], 4, []),
]


@pytest.mark.parametrize(("scores", "pinned", "budget", "expected"), [c[1:] for c in SELECT_CASES],
                         ids=[c[0] for c in SELECT_CASES])
def test_select_keep(scores: list[float], pinned: list[int], budget: int, expected: list[int]) -> None:
    s = np.array(scores, dtype=np.float64)
    mask = np.zeros(s.size, dtype=bool)
    mask[pinned] = True
    before = mask.copy()
    keep = select_keep(s, mask, budget)
    assert keep.tolist() == expected
    assert np.all(np.diff(keep) > 0)  # ascending, no duplicates
    assert np.array_equal(mask, before)  # the caller's pinned mask is not modified



# (id, scores, priority, pinned, budget, expected kept): lower-priority cells go first whatever their scores;
# scores rank within one priority; pinned and the last cell are kept whatever their priority
PRIORITY_CASES = [
    ("low-priority-evicted-first", [9, 9, 1, 1, 0], [0, 0, 1, 1, 0], [], 3, [2, 3, 4]),
    ("scores-within-a-priority", [9, 1, 5, 2, 0], [1, 1, 1, 0, 0], [], 3, [0, 2, 4]),
    ("pinned-beats-priority", [9, 9, 1, 1, 0], [0, 0, 1, 1, 0], [0], 3, [0, 3, 4]),  # tie: later wins
    ("equal-priorities-are-plain-scores", [5, 1, 4, 2, 3, 0], [2, 2, 2, 2, 2, 2], [], 3, [0, 2, 5]),
    ("negative-priority", [9, 1, 1, 1, 0], [-1, 0, 0, 0, 0], [], 4, [1, 2, 3, 4]),
]


@pytest.mark.parametrize(("scores", "priority", "pinned", "budget", "expected"),
                         [c[1:] for c in PRIORITY_CASES], ids=[c[0] for c in PRIORITY_CASES])
def test_select_keep_with_segment_priority(scores: list[float], priority: list[int], pinned: list[int], budget: int,
                                           expected: list[int]) -> None:
    mask = np.zeros(len(scores), dtype=bool)
    mask[pinned] = True
    keep = select_keep(np.array(scores, dtype=np.float64), mask, budget, np.array(priority))
    assert keep.tolist() == expected



@pytest.mark.parametrize("seed", range(5))
def test_select_keep_respects_the_budget(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, budget = 200, 37
    scores = rng.normal(size=n)
    pinned = np.zeros(n, dtype=bool)
    pinned[rng.choice(n - 1, 10, replace=False)] = True
    keep = select_keep(scores, pinned, budget)
    assert keep.size == budget
    assert set(np.flatnonzero(pinned)) | {n - 1} <= set(keep.tolist())
    free_kept = [i for i in keep.tolist() if not pinned[i] and i != n - 1]
    free_dropped = [i for i in range(n - 1) if not pinned[i] and i not in set(keep.tolist())]
    assert min(scores[free_kept]) > max(scores[free_dropped])  # the kept free cells are the best ones


# --- position_runs ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("positions", "runs"),
    [
        ([], []),
        ([7], [(7, 7)]),
        ([0, 1, 2, 3], [(0, 3)]),
        ([1, 2, 3, 7, 8, 10], [(1, 3), (7, 8), (10, 10)]),
        ([0, 2, 4], [(0, 0), (2, 2), (4, 4)]),
        ([5, 6, 100, 101, 102], [(5, 6), (100, 102)]),
    ],
)
def test_runs(positions: list[int], runs: list[tuple[int, int]]) -> None:
    assert position_runs(positions) == runs


# --- KeepSinks -----------------------------------------------------------------------------------------
def view(n: int, *, hidden: np.ndarray | None = None, pinned: list[int] = ()) -> CacheView:  # type: ignore[assignment]
    mask = np.zeros(n, dtype=bool)
    mask[list(pinned)] = True
    return CacheView(
        tokens=np.arange(100, 100 + n, dtype=np.int64), positions=np.arange(n, dtype=np.int64) * 2, pinned=mask,
        new=np.ones(n, dtype=bool), hidden=hidden, model_path=Path("unused.gguf"),
    )


class Constant(EvictionPolicy):
    name = "constant"
    needs_hidden = True

    def __init__(self) -> None:
        self.told: list[list[int]] = []

    def score(self, v: CacheView) -> np.ndarray:
        return -v.positions.astype(np.float64)  # prefers the oldest: the opposite of a window

    def kept(self, positions: np.ndarray) -> None:
        self.told.append(positions.tolist())


@pytest.mark.parametrize(("n_cells", "sinks"), [(10, 4), (10, 0), (3, 4), (10, 10)])
def test_keep_sinks_forces_the_first_n(n_cells: int, sinks: int) -> None:
    inner = Constant()
    wrapped = KeepSinks(inner, sinks)
    scores = wrapped.score(view(n_cells))
    k = min(sinks, n_cells)
    assert np.all(np.isposinf(scores[:k]))
    assert np.array_equal(scores[k:], inner.score(view(n_cells))[k:])
    assert (wrapped.name, wrapped.needs_hidden) == ("constant", True)
    wrapped.kept(np.array([0, 4]))
    assert inner.told == [[0, 4]]


def test_keep_sinks_survive_a_window_selection() -> None:
    scores = KeepSinks(Recency(), 4).score(view(20))
    keep = select_keep(scores, np.zeros(20, dtype=bool), 8)
    assert keep.tolist() == [0, 1, 2, 3, 16, 17, 18, 19]


@pytest.mark.parametrize(
    ("texts", "lines", "kept"),
    [
        (("", "user", "\n", " Hi", ".", "", "\n"), False, [0, 5]),  # control tokens render as ""
        (("", "user", "\n", " Hi", ".", "", "\n"), True, [0, 2, 5, 6]),
        ((" a", " b.\n\n", " c"), False, []),
        ((" a", " b.\n\n", " c"), True, [1]),
        (None, True, []),  # no token texts: the inner policy's scores
    ],
)
def test_keep_markers_forces_control_tokens_and_line_breaks(texts: tuple[str, ...] | None, lines: bool,
                                                            kept: list[int]) -> None:
    from dataclasses import replace

    from kvagent.policies.base import KeepMarkers

    v = replace(view(len(texts) if texts else 4), texts=texts)
    inner = Constant()
    scores = KeepMarkers(inner, lines).score(v)
    assert np.flatnonzero(np.isposinf(scores)).tolist() == kept
    rest = ~np.isposinf(scores)
    assert np.array_equal(scores[rest], inner.score(v)[rest])


# --- policy names --------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["nope", "", "Surprise", "h2o ", "window,random"])
def test_unknown_policy_lists_every_valid_name(bad: str) -> None:
    with pytest.raises(EvictionError) as err:
        get_policy(bad)
    message = str(err.value)
    assert repr(bad) in message
    for name in POLICIES:
        assert name in message


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_registered_name_gives_a_fresh_policy_of_that_name(name: str) -> None:
    a, b = get_policy(name), get_policy(name)
    assert isinstance(a, EvictionPolicy)
    assert a is not b  # stateful policies must not be shared between sessions
    assert a.name == name


def test_a_policy_instance_is_used_as_given() -> None:
    policy = Constant()
    assert get_policy(policy) is policy


# --- Evictor settings (fake backend) -------------------------------------------------------------------
class FakeCapture:
    def __init__(self) -> None:
        self.wanted: list[list[str]] = []

    def want(self, names: list[str]) -> None:
        self.wanted.append(list(names))


class FakeBackend:
    """Only what the Evictor reads for its checks and a cycle: n_ctx, capture, capabilities, layer names, seq_rm."""

    n_layer = 30

    def __init__(self, n_ctx: int = 1024, capture: FakeCapture | None = None, positional_kv: bool = True) -> None:
        self.n_ctx, self.capture = n_ctx, capture
        self.capabilities = Capabilities(positional_kv=positional_kv, shift=True, state_save=True,
                                         hidden_capture=capture is not None)
        self.removed: list[tuple[int, int, int]] = []

    def layer_output_name(self, i: int) -> str:
        return f"l_out-{i % self.n_layer}"

    def seq_rm(self, seq: int, p0: int, p1: int) -> None:
        self.removed.append((seq, p0, p1))


# (budget, chunk, n_ctx, accepted)
SETTINGS = [
    (256, 64, 1024, True),
    (1024 - 64 - _MARGIN, 64, 1024, True),  # exactly fills the context
    (1024 - 64 - _MARGIN + 1, 64, 1024, False),
    (2000, 64, 1024, False),
    (256, 800, 1024, False),
    (2, 1, 32, True),
]


def test_eviction_needs_positional_cells_and_captured_states_where_the_policy_reads_them() -> None:
    with pytest.raises(EvictionError, match="explicit positions"):
        Evictor(Eviction("window", budget=256), FakeBackend(positional_kv=False), Path("m.gguf"))  # type: ignore[arg-type]
    with pytest.raises(EvictionError, match="capture='native'"):
        Evictor(Eviction("surprise", budget=256), FakeBackend(), Path("m.gguf"))  # type: ignore[arg-type]


@pytest.mark.parametrize(("budget", "chunk", "n_ctx", "accepted"), SETTINGS)
def test_budget_chunk_and_margin_must_fit_the_context(budget: int, chunk: int, n_ctx: int, accepted: bool) -> None:
    config = Eviction("window", budget=budget, chunk=chunk)
    if accepted:
        ev = Evictor(config, FakeBackend(n_ctx), Path("m.gguf"))  # type: ignore[arg-type]
        assert (ev.budget, ev.chunk) == (budget, chunk)
        return
    with pytest.raises(EvictionError) as err:
        Evictor(config, FakeBackend(n_ctx), Path("m.gguf"))  # type: ignore[arg-type]
    message = str(err.value)
    assert f"budget {budget}" in message and f"chunk {chunk}" in message and str(n_ctx) in message
    assert "lower the budget or the chunk" in message and "larger n_ctx" in message


@pytest.mark.parametrize(("budget", "chunk"), [(1, 64), (0, 64), (-5, 64), (256, 0), (256, -1)])
def test_degenerate_budget_or_chunk_is_refused(budget: int, chunk: int) -> None:
    with pytest.raises(EvictionError, match="budget must be >= 2 and chunk >= 1"):
        Evictor(Eviction("window", budget=budget, chunk=chunk), FakeBackend(), Path("m.gguf"))  # type: ignore[arg-type]


HIDDEN = sorted(n for n, make in POLICIES.items() if make().needs_hidden)
NO_HIDDEN = sorted(n for n, make in POLICIES.items() if not make().needs_hidden)


def test_the_registry_has_both_kinds() -> None:
    assert {"surprise", "h2o", "tova", "importance"} <= set(HIDDEN)
    assert {"window", "random", "surprise-full"} <= set(NO_HIDDEN)


@pytest.mark.parametrize("name", HIDDEN)
def test_hidden_state_policy_without_capture_names_the_fix(name: str) -> None:
    with pytest.raises(EvictionError) as err:
        Evictor(Eviction(name, budget=256, chunk=64), FakeBackend(capture=None), Path("m.gguf"))  # type: ignore[arg-type]
    message = str(err.value)
    assert repr(name) in message and "capture='native'" in message


@pytest.mark.parametrize("name", [n for n in HIDDEN if not POLICIES[n]().needs_probe])  # replays read more layers
def test_hidden_state_policy_asks_the_capture_for_the_penultimate_layer(name: str) -> None:
    capture = FakeCapture()
    Evictor(Eviction(name, budget=256, chunk=64), FakeBackend(capture=capture), Path("m.gguf"))  # type: ignore[arg-type]
    assert capture.wanted == [[f"l_out-{FakeBackend.n_layer - 2}"]]


@pytest.mark.parametrize("name", NO_HIDDEN)
def test_policies_without_hidden_states_need_no_capture(name: str) -> None:
    ev = Evictor(Eviction(name, budget=256, chunk=64), FakeBackend(capture=None), Path("m.gguf"))  # type: ignore[arg-type]
    assert ev.policy.name == name


def test_unknown_policy_is_refused_by_the_evictor() -> None:
    with pytest.raises(EvictionError, match="use one of"):
        Evictor(Eviction("nope", budget=256, chunk=64), FakeBackend(), Path("m.gguf"))  # type: ignore[arg-type]


# --- one cycle on the fake backend ---------------------------------------------------------------------
@pytest.mark.parametrize(("cells", "due"), [(319, False), (320, True), (400, True), (0, False)])
def test_a_cycle_is_due_after_chunk_tokens_beyond_the_budget(cells: int, due: bool) -> None:
    ev = Evictor(Eviction("window", budget=256, chunk=64), FakeBackend(), Path("m.gguf"))  # type: ignore[arg-type]
    assert ev.due(cells) is due


def test_window_cycle_removes_runs_keeps_sinks_pinned_and_recent() -> None:
    backend = FakeBackend()
    ev = Evictor(Eviction("window", budget=10, chunk=4), backend, Path("m.gguf"))  # type: ignore[arg-type]
    positions = [0, 1, 2, 3, 4, 5, 6, 9, 10, 11, 12, 13, 14, 15, 16, 17]  # 7, 8 evicted earlier
    pinned = [p in (5, 6) for p in positions]
    report = ev.cycle(3, [1000 + p for p in positions], positions, pinned)
    # sinks 0-3, pinned 5-6, then the most recent 4 (14-17)
    assert (report.before, report.after) == (16, 10)
    assert report.evicted == (4, 9, 10, 11, 12, 13)
    assert backend.removed == [(3, 4, 5), (3, 9, 14)]  # one seq_rm per run, end exclusive
    assert ev.cycles == [report]


class WrongShape(EvictionPolicy):
    name = "wrong-shape"

    def score(self, v: CacheView) -> np.ndarray:
        return np.zeros(len(v) + 1)


def test_a_policy_returning_the_wrong_number_of_scores_is_refused_before_anything_is_removed() -> None:
    backend = FakeBackend()
    ev = Evictor(Eviction(WrongShape(), budget=4, chunk=2), backend, Path("m.gguf"))  # type: ignore[arg-type]
    with pytest.raises(EvictionError, match="wrong-shape"):
        ev.cycle(0, list(range(8)), list(range(8)), [False] * 8)
    assert backend.removed == [] and ev.cycles == []


# --- span-level eviction: pure selection logic ----------------------------------------------
from kvagent.policies.last_layer import previous_rows  # noqa: E402
from kvagent.policies.spans import Spans, cut_spans, ends_span, reduce_spans, span_ranks  # noqa: E402

# (text, unit, ends)
ENDS_CASES = [
    (".", "sentence", True), ("!", "sentence", True), ("?", "sentence", True), (";", "sentence", True),
    ('."', "sentence", True), (".)", "sentence", True), ("?\u201d", "sentence", True), (". ", "sentence", True),
    ("\n", "sentence", True), ("\n\n", "sentence", True), ("word\n", "sentence", True),
    (",", "sentence", False), (",", "clause", True), (":", "clause", True), (":", "sentence", False),
    (" the", "sentence", False), ("", "sentence", False), (" ", "sentence", False), ('"', "sentence", False),
    ("4", "sentence", False), ("Mr", "sentence", False),
]


@pytest.mark.parametrize(("text", "unit", "ends"), ENDS_CASES, ids=[f"{c[1]}-{c[0]!r}" for c in ENDS_CASES])
def test_ends_span(text: str, unit: str, ends: bool) -> None:
    assert ends_span(text, unit) is ends


# (id, texts, positions, pinned indices, unit, block, max_len, expected span ids)
CUT_CASES = [
    ("two-sentences", ["The", " code", " is", " 4", ".", " It", " rains", "."], range(8), [], "sentence", 16, 64,
     [0, 0, 0, 0, 0, 1, 1, 1]),
    ("newline-ends", ["a", "\n", "b", "c", "\n\n", "d"], range(6), [], "sentence", 16, 64, [0, 0, 1, 1, 1, 2]),
    ("comma-clause", ["a", ",", "b", ".", "c"], range(5), [], "clause", 16, 64, [0, 0, 1, 1, 2]),
    ("comma-not-sentence", ["a", ",", "b", ".", "c"], range(5), [], "sentence", 16, 64, [0, 0, 0, 0, 1]),
    ("max-len", ["a"] * 7, range(7), [], "sentence", 16, 3, [0, 0, 0, 1, 1, 1, 2]),
    ("pinned-boundary", ["a", "b", "c", "d", "."], range(5), [1, 2], "sentence", 16, 64, [0, 1, 1, 2, 2]),
    ("blocks-by-position", ["."] * 6, [0, 1, 4, 5, 6, 9], [], "block", 4, 64, [0, 0, 1, 1, 1, 2]),
    ("blocks-pinned", ["x"] * 4, [0, 1, 2, 3], [2], "block", 4, 64, [0, 0, 1, 2]),
    ("empty", [], [], [], "sentence", 16, 64, []),
]


@pytest.mark.parametrize(("texts", "positions", "pinned", "unit", "block", "max_len", "expected"),
                         [c[1:] for c in CUT_CASES], ids=[c[0] for c in CUT_CASES])
def test_cut_spans(texts: list[str], positions: range, pinned: list[int], unit: str, block: int, max_len: int,
                   expected: list[int]) -> None:
    pos = np.asarray(list(positions), dtype=np.int64)
    mask = np.zeros(pos.size, dtype=bool)
    mask[pinned] = True
    assert cut_spans(pos, tuple(texts), mask, unit, block, max_len).tolist() == expected


def test_cut_spans_without_texts_falls_back_to_blocks() -> None:
    pos = np.arange(10, dtype=np.int64)
    assert cut_spans(pos, None, np.zeros(10, bool), "sentence", 4).tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]


# (id, scores, spans, reduce, k, expected aggregate per span)
REDUCE_CASES = [
    ("max", [1, 5, 2, 0, 3], [0, 0, 0, 1, 1], "max", 4, [5, 3]),
    ("mean", [1, 5, 3, 0, 3], [0, 0, 0, 1, 1], "mean", 4, [3, 1.5]),
    ("topk-2", [1, 5, 3, 0, 4], [0, 0, 0, 1, 1], "topk", 2, [4, 2]),
    ("topk-k-above-size", [1, 5], [0, 0], "topk", 9, [3]),
    ("inf-and-nan-ignored", [np.inf, 2, NAN, 4], [0, 0, 1, 1], "max", 4, [2, 4]),
    ("no-finite-score", [np.inf, NAN, 1], [0, 0, 1], "mean", 4, [-np.inf, 1]),
]


@pytest.mark.parametrize(("scores", "spans", "reduce", "k", "expected"), [c[1:] for c in REDUCE_CASES],
                         ids=[c[0] for c in REDUCE_CASES])
def test_reduce_spans(scores: list[float], spans: list[int], reduce: str, k: int, expected: list[float]) -> None:
    got = reduce_spans(np.array(scores, float), np.array(spans), reduce, k)
    assert got.tolist() == pytest.approx(expected)


# (id, scores, spans, pinned, budget, reduce, expected kept indices) through select_keep (last cell forced)
SPAN_SELECT_CASES = [
    # span 1 (max 9) whole, then span 0 (max 5) whole; the last cell is forced and ends span 2
    ("whole-spans", [1, 5, 1, 0, 9, 0, 2, 2], [0, 0, 0, 1, 1, 1, 2, 2], [], 7, "max", [0, 1, 2, 3, 4, 5, 7]),
    # budget 5: last cell (forced), span 1 (3 cells), then one more: the best cell of span 0 (the cut span)
    ("last-span-cut-keeps-its-best", [1, 5, 1, 0, 9, 0, 2, 2], [0, 0, 0, 1, 1, 1, 2, 2], [], 5, "max",
     [1, 3, 4, 5, 7]),
    # by mean span 0 (2.33) beats span 1 (3.0)? no: span 1 wins
    ("mean-ranks-differently", [1, 5, 1, 3, 3, 3, 0, 0], [0, 0, 0, 1, 1, 1, 2, 2], [], 4, "mean", [3, 4, 5, 7]),
    ("max-ranks-the-peak", [1, 5, 1, 3, 3, 3, 0, 0], [0, 0, 0, 1, 1, 1, 2, 2], [], 4, "max", [0, 1, 2, 7]),
    ("ties-later-span-first", [1, 1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 2, 2, 3], [], 3, "max", [4, 5, 6]),
    ("inf-cell-kept-alone", [np.inf, 0, 0, 5, 5, 0], [0, 0, 0, 1, 1, 2], [], 4, "max", [0, 3, 4, 5]),
    ("pinned-count-toward-budget", [0, 0, 9, 9, 1, 1, 0], [0, 0, 1, 1, 2, 2, 3], [0, 1], 5, "max",
     [0, 1, 2, 3, 6]),
]


@pytest.mark.parametrize(("scores", "spans", "pinned", "budget", "reduce", "expected"),
                         [c[1:] for c in SPAN_SELECT_CASES], ids=[c[0] for c in SPAN_SELECT_CASES])
def test_span_selection(scores: list[float], spans: list[int], pinned: list[int], budget: int, reduce: str,
                        expected: list[int]) -> None:
    mask = np.zeros(len(scores), dtype=bool)
    mask[pinned] = True
    ranked = span_ranks(np.array(scores, float), np.array(spans), reduce)
    assert select_keep(ranked, mask, budget).tolist() == expected


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("reduce", ["max", "mean", "topk"])
def test_spans_are_kept_whole_but_one_and_the_budget_is_exact(seed: int, reduce: str) -> None:
    rng = np.random.default_rng(seed)
    n, budget = 300, 101
    spans = np.cumsum(rng.random(n) < 0.15)
    spans -= spans[0]
    scores = rng.normal(size=n)
    keep = select_keep(span_ranks(scores, spans, reduce), np.zeros(n, bool), budget)
    assert keep.size == budget
    kept = np.zeros(n, bool)
    kept[keep] = True
    kept_free = kept.copy()
    kept_free[-1] = False  # the forced last cell may split the last span
    partial = [j for j in np.unique(spans) if 0 < kept_free[spans == j].sum() < (spans == j).sum()]
    assert len(partial) <= 2  # the span cut at the budget (and the last span, split by the forced cell)


def test_spans_wrapper_names_and_hidden_follow_the_inner_policy() -> None:
    inner = Constant()
    wrapped = Spans(inner, "block", "max", block=2)
    assert (wrapped.name, wrapped.needs_hidden) == ("constant-block", True)
    scores = wrapped.score(view(6))  # positions 0, 2, ..., 10 -> blocks of 2 positions: one cell each
    assert np.argsort(scores).tolist() == [5, 4, 3, 2, 1, 0]  # Constant prefers the oldest
    wrapped.kept(np.array([0, 2]))
    assert inner.told == [[0, 2]]
    with pytest.raises(ValueError, match="unit"):
        Spans(inner, "paragraph")
    with pytest.raises(ValueError, match="reduce"):
        Spans(inner, reduce="median")


# --- the counter-causal query row of each cell: the state at p - 1, not the previous cached cell's -----------
# (positions, expected index of the row that holds position p - 1 in the view, -1 when not cached)
PREVIOUS_CASES = [
    ([0, 1, 2, 3], [-1, 0, 1, 2]),
    ([0, 1, 5, 6, 9], [-1, 0, -1, 2, -1]),  # after evictions the previous cell is not the predecessor
    ([3], [-1]),
    ([], []),
]


@pytest.mark.parametrize(("positions", "expected"), PREVIOUS_CASES)
def test_previous_rows_only_where_the_predecessor_is_cached(positions: list[int], expected: list[int]) -> None:
    pos = np.array(positions, dtype=np.int64)
    assert previous_rows(np.arange(pos.size, dtype=np.int64), pos).tolist() == expected
    hidden = np.arange(pos.size * 2, dtype=np.float32).reshape(pos.size, 2)
    got = previous_rows(hidden, pos)
    for i, j in enumerate(expected):
        assert np.isnan(got[i]).all() if j < 0 else np.array_equal(got[i], hidden[j])


class Recording(EvictionPolicy):
    name = "recording"
    needs_hidden = True

    def __init__(self) -> None:
        self.views: list[CacheView] = []

    def score(self, v: CacheView) -> np.ndarray:
        self.views.append(v)
        return v.positions.astype(np.float64)  # a window


class RecordingCapture(FakeCapture):
    enabled = False

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[np.ndarray] = []

    def clear(self) -> None:
        self.rows = []

    def take(self) -> dict[str, list[np.ndarray]]:
        return {f"l_out-{FakeBackend.n_layer - 2}": self.rows}


class DecodingBackend(FakeBackend):
    """Decode records one hidden row per token (its position in both columns); token texts known."""

    n_vocab = 8

    def decode(self, tokens: list[int], positions: list[int], seqs: list[int], outputs: list[bool]) -> np.ndarray:
        self.capture.rows.append(np.array([[p, p] for p in positions], dtype=np.float32))  # type: ignore[union-attr]
        return np.zeros((sum(outputs), self.n_vocab), np.float32)

    def token_bytes(self, token: int) -> bytes:
        return b"." if token % 5 == 4 else f" t{token}".encode()


def test_the_evictor_keeps_the_query_state_of_an_evicted_predecessor() -> None:
    capture = RecordingCapture()
    backend = DecodingBackend(capture=capture)  # type: ignore[arg-type]
    policy = Recording()
    ev = Evictor(Eviction(policy, budget=6, chunk=4), backend, Path("m.gguf"))  # type: ignore[arg-type]
    ev.decode(list(range(100, 110)), list(range(10)), [0] * 10, [False] * 10)
    ev.cycle(0, list(range(100, 110)), list(range(10)), [p in (2,) for p in range(10)])  # keeps 2, 5..9
    ev.decode([110, 111], [10, 11], [0, 0], [False, True])
    cells = [2, 5, 6, 7, 8, 9, 10, 11]
    ev.cycle(0, [100 + p for p in cells], cells, [False] * len(cells))
    v = policy.views[-1]
    assert v.positions.tolist() == cells
    # the state at p - 1 of every cell, cached (6..10) or evicted (1, 4): all but none are recorded
    assert v.query_hidden is not None
    assert [None if np.isnan(r[0]) else int(r[0]) for r in v.query_hidden] == [1, 4, 5, 6, 7, 8, 9, 10]
    assert v.previous is not None and v.previous.tolist() == [101, 104, 105, 106, 107, 108, 109, 110]
    assert v.texts == (" t102", " t105", " t106", " t107", " t108", ".", " t110", " t111")


# --- blobs record evicted positions ---------------------------------------------------------------------
def test_a_blob_records_evicted_positions_and_refuses_impossible_ones() -> None:
    import json
    import struct

    from kvagent.errors import KVBlobError
    from kvagent.kvblob import MAGIC, KVBlob

    blob = KVBlob("m", "f", (1, 2, 3, 4), b"payload", b"", (1, 2)).to_bytes()
    assert KVBlob.from_bytes(blob, model_fingerprint="m", backend_format="f").evicted == (1, 2)
    plain = KVBlob("m", "f", (1, 2), b"p").to_bytes()
    assert b"evicted" not in plain  # blobs without eviction keep the old header
    assert KVBlob.from_bytes(plain, model_fingerprint="m", backend_format="f").evicted == ()
    (hlen,) = struct.unpack("<I", blob[4:8])
    header = json.loads(blob[8 : 8 + hlen])
    header["evicted"] = [7]
    raw = json.dumps(header).encode()
    with pytest.raises(KVBlobError, match="corrupt"):
        KVBlob.from_bytes(MAGIC + struct.pack("<I", len(raw)) + raw + blob[8 + hlen:], model_fingerprint="m",
                          backend_format="f")
