"""Eviction logic without a model: which cells a cycle keeps, runs of removed positions, the sink wrapper,
policy names, and the Evictor's checks of its settings (against a tiny fake backend: pure logic only)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvagent.errors import EvictionError
from kvagent.eviction import _MARGIN, Eviction, Evictor, _runs
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


# --- _runs ---------------------------------------------------------------------------------------------
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
    assert _runs(positions) == runs


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
    """Only what the Evictor reads for its checks and a cycle: n_ctx, capture, layer names, seq_rm."""

    n_layer = 30

    def __init__(self, n_ctx: int = 1024, capture: FakeCapture | None = None) -> None:
        self.n_ctx, self.capture = n_ctx, capture
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


@pytest.mark.parametrize("name", HIDDEN)
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
