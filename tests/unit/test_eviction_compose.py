"""Composed eviction policies without a model: the recent window beside a scoring policy (hybrid), per-segment
budgets, rank mixes, the reconstruction policy's layers and chunked replay (against a fake probe), and the
Evictor's per-layer capture and probe (a fake backend: pure logic)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvagent.backends.base import Capabilities
from kvagent.eviction import Eviction, Evictor
from kvagent.policies import POLICIES, CacheView, EvictionPolicy, RankMix, Recent, Shares, get_policy, select_keep
from kvagent.policies.compose import ranks01, room
from kvagent.policies.reconstruction import FIRST_PROMPT, NEXT_PROMPT, OVERLAP, Reconstruction, spread_layers
from kvagent.segments import Segment, SegmentKind, segment_label


class Fixed(EvictionPolicy):
    """Scores given up front (higher = keep); counts the cycles it saw and what it was told was kept."""

    name = "fixed"

    def __init__(self, scores: list[float]) -> None:
        self.scores = np.array(scores, dtype=np.float64)
        self.seen = 0
        self.told: list[list[int]] = []

    def score(self, view: CacheView) -> np.ndarray:
        self.seen += 1
        return self.scores[: len(view)].copy()

    def kept(self, positions: np.ndarray) -> None:
        self.told.append(positions.tolist())


def view(n: int, budget: int | None, pinned: list[int] = (), labels: list[str] | None = None) -> CacheView:
    mask = np.zeros(n, dtype=bool)
    mask[list(pinned)] = True
    return CacheView(tokens=np.arange(n, dtype=np.int64) + 100, positions=np.arange(n, dtype=np.int64), pinned=mask,
                     new=np.ones(n, dtype=bool), hidden=None, model_path=Path("m.gguf"), budget=budget,
                     labels=None if labels is None else tuple(labels))


def kept(policy: EvictionPolicy, v: CacheView) -> list[int]:
    return select_keep(policy.score(v), v.pinned, int(v.budget or 0)).tolist()


# --- ranks and room ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("scores", "expected"), [
    ([3.0, 1.0, 2.0], [2 / 3, 0.0, 1 / 3]),
    ([1.0, 1.0], [0.0, 0.5]),  # ties: the later cell higher
    ([np.nan, -np.inf, 0.0], [0.0, 1 / 3, 2 / 3]),  # NaN and -inf lowest, NaN first by position
    ([np.inf, 0.0], [np.inf, 0.0]),
])
def test_ranks01(scores: list[float], expected: list[float]) -> None:
    assert ranks01(np.array(scores)).tolist() == pytest.approx(expected)


@pytest.mark.parametrize(("n", "budget", "pinned", "infs", "expected"), [
    (10, 6, [], [], 5),  # the last cell is kept anyway
    (10, 6, [0, 1], [], 3),
    (10, 6, [0], [0, 2], 3),  # a pinned +inf cell counts once
    (10, 2, [0, 1, 2], [], 0),
    (10, None, [], [], 0),
])
def test_room_is_the_budget_less_what_is_kept_anyway(n: int, budget: int | None, pinned: list[int], infs: list[int],
                                                     expected: int) -> None:
    scores = np.zeros(n)
    scores[infs] = np.inf
    assert room(view(n, budget, pinned), scores) == expected


# --- the recent window (hybrid) -------------------------------------------------------------------------
# (id, inner scores, budget, pinned, share, expected kept)
RECENT_CASES = [
    ("share-0-is-the-inner-policy", [9, 8, 7, 0, 0, 0, 0, 0, 0, 1], 4, [], 0.0, [0, 1, 2, 9]),
    ("share-1-is-the-window", [9, 8, 7, 0, 0, 0, 0, 0, 0, 1], 4, [], 1.0, [6, 7, 8, 9]),
    ("half-and-half", [9, 8, 7, 0, 0, 0, 0, 0, 0, 1], 5, [], 0.5, [0, 1, 7, 8, 9]),
    ("pinned-take-room-first", [9, 8, 7, 0, 0, 0, 0, 0, 0, 1], 5, [3], 0.5, [0, 3, 7, 8, 9]),
    ("the-window-holds-free-cells-only", [9, 8, 7, 0, 0, 0, 0, 0, 0, 1], 5, [8], 0.5, [0, 6, 7, 8, 9]),
    ("sinks-stay", [np.inf, 8, 7, 0, 0, 0, 0, 0, 0, 1], 5, [], 0.5, [0, 1, 7, 8, 9]),
]


@pytest.mark.parametrize(("scores", "budget", "pinned", "share", "expected"), [c[1:] for c in RECENT_CASES],
                         ids=[c[0] for c in RECENT_CASES])
def test_recent_window_beside_the_inner_policy(scores: list[float], budget: int, pinned: list[int], share: float,
                                               expected: list[int]) -> None:
    policy = Recent(Fixed(scores), share)
    assert kept(policy, view(len(scores), budget, pinned)) == expected


def test_recent_forwards_kept_and_refuses_a_bad_share() -> None:
    inner = Fixed([1, 2, 3])
    policy = Recent(inner, 0.3)
    policy.kept(np.array([0, 2]))
    assert inner.told == [[0, 2]] and policy.name == "fixed+recent0.3"
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        Recent(inner, 1.5)


# --- per-segment budgets ---------------------------------------------------------------------------------
LABELS = ["policy", "user", "user", "tool", "tool", "tool", "memory", "memory", "user", "user"]
# (id, inner scores, budget, pinned, shares, expected kept)
SHARES_CASES = [
    ("no-shares-is-the-inner-policy", [0, 9, 8, 1, 2, 3, 0, 1, 7, 0], 4, [0], {}, [0, 1, 2, 9]),
    ("tool-share-keeps-its-best", [0, 9, 8, 1, 2, 3, 0, 1, 7, 0], 4, [0], {"tool": 0.5}, [0, 1, 5, 9]),
    ("two-shares", [0, 9, 8, 1, 2, 3, 0, 1, 7, 0], 5, [0], {"tool": 0.34, "memory": 0.34}, [0, 1, 5, 7, 9]),
    ("share-larger-than-the-segment", [0, 9, 8, 1, 2, 3, 0, 1, 7, 0], 6, [0], {"memory": 1.0}, [0, 1, 2, 6, 7, 9]),
]


@pytest.mark.parametrize(("scores", "budget", "pinned", "shares", "expected"), [c[1:] for c in SHARES_CASES],
                         ids=[c[0] for c in SHARES_CASES])
def test_segment_shares(scores: list[float], budget: int, pinned: list[int], shares: dict[str, float],
                        expected: list[int]) -> None:
    v = view(len(scores), budget, pinned, LABELS)
    assert kept(Shares(Fixed(scores), shares), v) == expected


def test_shares_without_labels_rank_by_the_inner_policy_and_bad_shares_are_refused() -> None:
    scores = [0, 9, 8, 1, 2, 3, 0, 1, 7, 0]
    assert kept(Shares(Fixed(scores), {"tool": 0.5}), view(10, 4, [0])) == kept(Fixed(scores), view(10, 4, [0]))
    for bad in ({"tool": -0.1}, {"tool": 0.7, "memory": 0.4}):
        with pytest.raises(ValueError, match="sum to at most 1"):
            Shares(Fixed(scores), bad)


@pytest.mark.parametrize(("segment", "label"), [
    (Segment.user("<tool_response name=\"x\">\n{}\n</tool_response>"), "tool"),
    (Segment.user("hello"), "user"),
    (Segment.assistant("hi"), "assistant"),
    (Segment.memory("Session 1"), "memory"),
    (Segment.policy("Be kind."), "policy"),
    (Segment.field("status", "open"), "field"),
    (Segment(SegmentKind.TURN, "<tool_response>", role="assistant"), "assistant"),
])
def test_segment_labels(segment: Segment, label: str) -> None:
    assert segment_label(segment) == label


# --- rank mixes ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("weight", "expected"), [(1.0, [0, 1, 5]), (0.0, [3, 4, 5]), (0.5, [1, 3, 5])])
def test_rank_mix(weight: float, expected: list[int]) -> None:
    a, b = Fixed([6, 5, 4, 3, 2, 0]), Fixed([0, 3, 1, 5, 4, 0])
    mix = RankMix(a, b, weight)
    assert kept(mix, view(6, 3)) == expected
    mix.kept(np.array([1, 3, 5]))
    assert a.told == b.told == [[1, 3, 5]] and a.seen == b.seen == 1


def test_rank_mix_keeps_what_either_always_keeps() -> None:
    mix = RankMix(Fixed([np.inf, 0, 0, 0]), Fixed([0, 0, np.inf, 0]), 0.5)
    assert np.isposinf(mix.score(view(4, 2))[[0, 2]]).all()


@pytest.mark.parametrize(("weight", "expected"), [(1.0, [0, 3, 5]), (0.5, [0, 1, 5])])
def test_rank_max_interleaves_both_orders(weight: float, expected: list[int]) -> None:
    from kvagent.policies.compose import RankMax

    # a ranks cell 0 first, b cell 3: with equal weight each gets its best cell; b at half weight gets none
    a, b = Fixed([6, 5, 4, 3, 2, 0]), Fixed([0, 3, 1, 5, 4, 0])
    assert kept(RankMax(a, b, weight), view(6, 3)) == expected
    assert np.isposinf(RankMax(Fixed([np.inf, 0, 0, 0]), Fixed([0, 0, np.inf, 0])).score(view(4, 2))[[0, 2]]).all()


# --- registry --------------------------------------------------------------------------------------------
def test_the_new_policies_are_registered_by_name() -> None:
    for name in ("kvzip", "surprise", "surprise-token"):
        assert name in POLICIES and get_policy(name).name == name
    assert get_policy("kvzip").needs_probe and not get_policy("surprise").needs_probe


# --- reconstruction ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("n_layer", "swa", "count", "expected"), [
    (30, (), 8, (1, 5, 9, 13, 17, 21, 25, 29)),
    (30, (), 40, tuple(range(1, 30))),
    (18, tuple(i % 6 < 5 for i in range(18)), 8, (5, 11, 17)),  # Gemma-3: only the global layers
    (4, (), 2, (1, 3)),
])
def test_spread_layers(n_layer: int, swa: tuple[bool, ...], count: int, expected: tuple[int, ...]) -> None:
    assert spread_layers(n_layer, swa, count) == expected


class FakeProbe:
    """Records each replay; returns rows whose layer input makes the replay attend to nothing in particular."""

    def __init__(self, width: int) -> None:
        self.calls: list[tuple[list[int], str]] = []
        self.width = width

    def __call__(self, tokens, prompt=""):  # type: ignore[no-untyped-def]
        self.calls.append((list(tokens), prompt))
        n = len(tokens) + (3 if prompt else 0)
        return {1: np.zeros((n, self.width), np.float32)}


def test_reconstruction_replays_new_cells_in_chunks_behind_the_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of `chunk` new cells; the first behind FIRST_PROMPT, later ones behind NEXT_PROMPT and the 8 cells
    before them; a later cycle replays only the cells it has not scored."""
    scored: list[np.ndarray] = []

    def fake_chunk_scores(self, view, idx, rows, replay):  # type: ignore[no-untyped-def]
        scored.append(idx.copy())
        return np.linspace(0.1, 0.9, idx.size)

    monkeypatch.setattr(Reconstruction, "_attention", fake_chunk_scores)
    policy = Reconstruction(layers=1, chunk=10, sinks=2)
    probe = FakeProbe(4)
    v = CacheView(tokens=np.arange(25) + 100, positions=np.arange(25), pinned=np.zeros(25, bool),
                  new=np.ones(25, bool), hidden=np.zeros((25, 4), np.float32), model_path=Path("m.gguf"),
                  layers={1: np.zeros((25, 4), np.float32)}, probe=probe)
    out = policy.score(v)
    assert [c[1] for c in probe.calls] == [FIRST_PROMPT, NEXT_PROMPT, NEXT_PROMPT]
    assert probe.calls[0][0] == list(range(100, 110))
    assert probe.calls[1][0] == list(range(110 - OVERLAP, 120))
    assert np.isposinf(out[:2]).all() and np.isfinite(out[2:]).all()
    assert policy.replayed == sum(len(t) + 3 for t, _ in probe.calls)
    policy.kept(np.arange(0, 25, 2))
    v2 = CacheView(tokens=np.r_[np.arange(0, 25, 2), 25, 26] + 100, positions=np.r_[np.arange(0, 25, 2), 25, 26],
                   pinned=np.zeros(15, bool), new=np.r_[np.zeros(13, bool), True, True], hidden=np.zeros((15, 4), np.float32),
                   model_path=Path("m.gguf"), layers={1: np.zeros((15, 4), np.float32)}, probe=probe)
    policy.score(v2)
    assert probe.calls[-1][0][-2:] == [125, 126] and len(probe.calls) == 4


def test_reconstruction_without_a_probe_says_what_it_needs() -> None:
    with pytest.raises(ValueError, match="probe"):
        Reconstruction().score(view(5, 3))


# --- the Evictor's layers and probe (fake backend) ---------------------------------------------------------
class Capture:
    def __init__(self) -> None:
        self.wanted: list[list[str]] = []
        self.enabled = False
        self.rows: dict[str, list[np.ndarray]] = {}

    def want(self, names: list[str]) -> None:
        self.wanted.append(list(names))

    def clear(self) -> None:
        self.rows = {}

    def take(self) -> dict[str, list[np.ndarray]]:
        rows, self.rows = self.rows, {}
        return rows


class Backend:
    """Decodes nothing; its capture gets one row per token per wanted name (the row is the position)."""

    n_layer, n_ctx = 6, 4096

    def __init__(self) -> None:
        self.capture = Capture()
        self.capabilities = Capabilities(positional_kv=True, shift=True, state_save=True, hidden_capture=True)
        self.calls: list[tuple[str, tuple]] = []

    def layer_output_name(self, i: int) -> str:
        return f"l_out-{i % self.n_layer}"

    def tokenize(self, text: str, special: bool) -> list[int]:
        return [7] * len(text.split())

    def decode(self, tokens, positions, seq_ids, outputs):  # type: ignore[no-untyped-def]
        self.calls.append(("decode", (tuple(positions), tuple(seq_ids))))
        if self.capture.enabled:
            for name in self.capture.wanted[-1]:
                self.capture.rows.setdefault(name, []).append(np.array([[p] * 3 for p in positions], np.float32))
        return np.zeros((sum(outputs), 10), np.float32)

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        self.calls.append(("seq_cp", (src, dst)))

    def seq_rm(self, seq: int, p0: int, p1: int) -> None:
        self.calls.append(("seq_rm", (seq, p0, p1)))

    def token_bytes(self, t: int) -> bytes:
        return b"x"


class Layered(EvictionPolicy):
    """Reads layers 2 and 4 and probes; scores by position."""

    name, needs_hidden, needs_probe = "layered", True, True

    def __init__(self) -> None:
        self.views: list[CacheView] = []

    def input_layers(self, n_layer: int, model_path: Path) -> tuple[int, ...]:
        return (4, 2)

    def score(self, view: CacheView) -> np.ndarray:
        self.views.append(view)
        return view.positions.astype(np.float64)


def test_the_evictor_captures_the_policys_layers_and_lends_a_probe() -> None:
    from contextlib import contextmanager

    backend = Backend()
    lent: list[int] = []

    @contextmanager
    def scratch():  # type: ignore[no-untyped-def]
        lent.append(9)
        yield 9

    policy = Layered()
    ev = Evictor(Eviction(policy, budget=4, chunk=2), backend, Path("m.gguf"), scratch)  # type: ignore[arg-type]
    assert ev.layers == (2, 4) and backend.capture.wanted == [["l_out-4", "l_out-1", "l_out-3"]]
    ev.decode(list(range(8)), range(8), [0] * 8, [False] * 8)
    report = ev.cycle(0, list(range(8)), list(range(8)), [False] * 8, labels=["user"] * 8)
    v = policy.views[0]
    assert v.budget == 4 and v.labels == ("user",) * 8
    assert v.layers is not None and v.layers[2][:, 0].tolist() == list(range(8)) and set(v.layers) == {2, 4}
    assert report.evicted == (0, 1, 2, 3)
    rows = v.probe([5, 5], "a b")  # type: ignore[misc]
    assert lent == [9] and rows[4][:, 0].tolist() == [8, 9, 10, 11]  # after the cache: positions 8..11
    assert ("seq_cp", (0, 9)) in backend.calls
    assert backend.calls[-1] == ("decode", ((8, 9, 10, 11), (9, 9, 9, 9)))
    # what was recorded for evicted cells is dropped; a copy adopts the rest
    assert ev.layer_rows(2, np.array([0, 5]))[:, 0].tolist()[1] == 5 and np.isnan(ev.layer_rows(2, np.array([0]))).all()
    other = Evictor(Eviction(Layered(), budget=4, chunk=2), backend, Path("m.gguf"))  # type: ignore[arg-type]
    other.adopt(ev)
    assert other.layer_rows(4, np.array([7]))[0, 0] == 7


def test_without_a_scratch_sequence_the_probe_is_none() -> None:
    policy = Layered()
    ev = Evictor(Eviction(policy, budget=2, chunk=1), Backend(), Path("m.gguf"))  # type: ignore[arg-type]
    ev.decode([1, 2, 3], range(3), [0] * 3, [False] * 3)
    ev.cycle(0, [1, 2, 3], [0, 1, 2], [False] * 3)
    assert policy.views[0].probe is None


# --- turn contrast and the future's copies -------------------------------------------------------------
def text_view(texts: list[str], labels: list[str] | None = None, tokens: list[int] | None = None,
              budget: int | None = None) -> CacheView:
    n = len(texts)
    return CacheView(tokens=np.array(tokens if tokens is not None else range(100, 100 + n), dtype=np.int64),
                     positions=np.arange(n, dtype=np.int64), pinned=np.zeros(n, dtype=bool),
                     new=np.ones(n, dtype=bool), hidden=None, model_path=Path("m.gguf"), texts=tuple(texts),
                     budget=budget, labels=None if labels is None else tuple(labels))


@pytest.mark.parametrize(("texts", "labels", "expected"), [
    (["", "user", "\n", "Hi", ".", "", "\n"], None, [0, 0, 0, 0, 0, 1, 1]),  # control tokens open turns
    (["a", "b", "c", "d"], ["user", "user", "tool", "tool"], [0, 0, 1, 1]),  # so do label changes
    (["", "a", "b"], ["user", "user", "user"], [0, 0, 0]),  # the first cell opens nothing
    (None, None, [0, 0, 0]),
])
def test_turn_ids(texts: list[str] | None, labels: list[str] | None, expected: list[int]) -> None:
    from kvagent.policies.spans import turn_ids

    n = len(expected)
    assert turn_ids(None if texts is None else tuple(texts), None if labels is None else tuple(labels),
                    n).tolist() == expected


# two turns of two sentences: turn 1 is dense everywhere (mean 8), turn 2 routine (mean 2) with one line standing out
CONTRAST_TEXTS = ["", " A", " b.", " C", " d.", "", " e", " f.", " G", " 42."]
CONTRAST_SCORES = [np.inf, 9.0, 9.0, 7.0, 7.0, np.inf, 1.0, 1.0, 3.0, 3.0]


@pytest.mark.parametrize(("baseline", "budget", "expected"), [
    # spans: [A b.] 9 -> +1 over its turn's mean 8, [C d.] -1; [e f.] -1, [G 42.] +1 over 2: the two outstanding
    # lines go first, the dense turn's second line does not beat the routine turn's standout
    ("mean", 6, [0, 1, 2, 5, 8, 9]),
    ("median", 6, [0, 1, 2, 5, 8, 9]),
    ("mean", 8, [0, 1, 2, 5, 6, 7, 8, 9]),  # then the later of the tied -1 spans, as Spans breaks ties
])
def test_turn_contrast_keeps_what_stands_out_in_each_turn(baseline: str, budget: int, expected: list[int]) -> None:
    from kvagent.policies.spans import Spans, TurnContrast

    v = text_view(CONTRAST_TEXTS, budget=budget)
    assert kept(TurnContrast(Fixed(CONTRAST_SCORES), reduce="mean", baseline=baseline), v) == expected
    # the plain span mean spends the same room on the dense turn (the last cell is always kept)
    assert kept(Spans(Fixed(CONTRAST_SCORES), "sentence", "mean"), text_view(CONTRAST_TEXTS, budget=6)) == [0, 1, 2, 4, 5, 9]


def test_turn_contrast_refuses_an_unknown_baseline() -> None:
    from kvagent.policies.spans import TurnContrast

    with pytest.raises(ValueError, match="use one of mean, median"):
        TurnContrast(Fixed([0.0]), baseline="max")


@pytest.mark.parametrize(("texts", "tokens", "ngram", "expected"), [
    # a word counts again later whatever its case; the last mention is the one not repeated
    ([" Rice", " and", " rice"], [1, 2, 3], 3, [True, False, False]),
    ([" is", " a", " is"], [1, 2, 1], 3, [False, False, False]),  # under min_len: matched by n-grams, which differ
    # digits are no words: the 3-gram ending at a token must recur ([5, 6, 7] does, [1, 5, 6] does not)
    (["1", "5", "6", "7", "|", "5", "6", "7"], [1, 5, 6, 7, 9, 5, 6, 7], 3, [False] * 3 + [True] + [False] * 4),
    (["1", "5", "6", "7", "|", "5", "6", "7"], [1, 5, 6, 7, 9, 5, 6, 7], 2, [False, False, True, True] + [False] * 4),
    (["1", "5", "6", "7", "|", "5", "6", "7"], [1, 5, 6, 7, 9, 5, 6, 7], 0, [False] * 8),  # words only
])
def test_recurs_later(texts: list[str], tokens: list[int], ngram: int, expected: list[bool]) -> None:
    from kvagent.policies.recurrence import recurs_later

    assert recurs_later(np.array(tokens), tuple(texts), ngram).tolist() == expected


def test_future_copy_discounts_what_recurs_and_keeps_inf() -> None:
    from kvagent.policies.recurrence import FutureCopy

    v = text_view(["", " cabbage", " rice", " code", " cabbage"], tokens=[0, 1, 2, 3, 1])
    scores = FutureCopy(Fixed([np.inf, 8.0, 6.0, 4.0, 8.0]), 0.25).score(v)
    assert scores.tolist() == [np.inf, 2.0, 6.0, 4.0, 8.0]
    with pytest.raises(ValueError, match=r"discount must be in \[0, 1\]"):
        FutureCopy(Fixed([0.0]), 1.5)


def test_turn_contrast_remembers_a_pruned_turn_and_its_marker() -> None:
    """A turn pruned to its outstanding line is still measured against everything it held (the line keeps its +4),
    and its cells stay in it after its marker went: a new turn's routine line (0 over its own mean) does not push it
    out. Measured against what is left, the line would score 0 and lose to the later, equal line."""
    from kvagent.policies.spans import Spans, TurnContrast

    a_texts = ["", " x.", " y.", " z.", " code 42."]  # a marker, three routine lines, one standout
    a_scores = {0: np.inf, 1: 2.0, 2: 2.0, 3: 2.0, 4: 6.0}  # turn A's mean: 3; the standout +3
    policy = TurnContrast(Fixed([0.0]), reduce="mean")
    first = text_view(a_texts, budget=3)
    policy.inner = Fixed([a_scores[p] for p in range(5)])
    keep = select_keep(policy.score(first), first.pinned, 3)
    assert keep.tolist() == [0, 3, 4]  # the marker (inf), the standout, and the last cell
    policy.kept(first.positions[keep])
    # the next cycle: A without its marker (say another policy evicted it), then turn B
    positions = [3, 4, 5, 6, 7]
    texts = [" z.", " code 42.", "", " u.", " v."]
    scores = [2.0, 6.0, np.inf, 6.0, 6.0]  # B: routine lines as dense as A's standout
    second = CacheView(tokens=np.arange(5, dtype=np.int64), positions=np.array(positions, dtype=np.int64),
                       pinned=np.zeros(5, dtype=bool), new=np.array([False, False, True, True, True]), hidden=None,
                       model_path=Path("m.gguf"), texts=tuple(texts), budget=3)
    policy.inner = Fixed(scores)
    assert policy.turns(second).tolist() == [-1, -1, 5, 5, 5]  # A opened before any recorded start
    assert select_keep(policy.score(second), second.pinned, 3).tolist() == [1, 2, 4]  # A's standout, B's marker, last
    plain = Spans(Fixed(scores), "sentence", "mean")
    assert select_keep(plain.score(second), second.pinned, 3).tolist() == [2, 3, 4]  # the later of the equal lines
