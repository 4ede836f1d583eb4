"""Eviction on the real models (source paper B): sessions with a policy outgrow the budget and the context
without failing, pinned spans survive every cycle, the span table matches the cells llama.cpp holds, the
KV left after eviction gives the logits of an independent replay, and the fast (last-layer) surprise ranks
tokens like the full pass (the figure is printed: run with ``-s``).

Every scenario runs once per (model, policy) and is shared by the tests that check it (module cache).
A spy on ``backend.decode`` checks before every decode of the session, i.e. after every cycle, that the
cells llama.cpp holds are the session's ``cached_positions`` and that every pinned span is whole.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import numpy as np
import pytest

from kvagent.engine import Engine
from kvagent.errors import ContextOverflowError, EvictionError
from kvagent.eviction import _MARGIN, Eviction
from kvagent.kv.compact import compact_positions, position_runs
from kvagent.policies import (
    POLICIES,
    CacheView,
    EvictionPolicy,
    FastSurprise,
    FullSurprise,
    IncrementalSurprise,
    KeepSinks,
    get_policy,
    select_keep,
)
from kvagent.policies.information import SelfInformation
from kvagent.segments import Segment
from kvagent.session import Generation, Session
from kvagent.skills.fidelity import cosine
from tests.models import MODELS
from tests.tiers import tier

N_CTX = 1024
BUDGET, CHUNK = 256, 64
BOOK = "pride_and_prejudice"
QUESTION = "Who is speaking in the last paragraph?"
NOTE = "Note: the access code for the north gate is 4817."
# Same tokens, same batches, other cells: llama.cpp's logits depend on where in the pool the cells lie
# (measured: SmolLM2 cosine 0.9935 for a 316-token prompt decoded after one of another sequence, Gemma-3
# 0.99987). A replay from the same pristine pool (see pristine()) lands in the same cells: measured
# bitwise equal (cosine 1.0) on every replayed case.
# The floor is not loose: the session's logits vs a decode of the whole prompt without eviction measured
# 0.9993 (window) and 0.9975 (surprise) on SmolLM2, and the test's control (one cell fewer) is printed.
REPLAY_FLOOR = 0.99999


# --- engines and prompts -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str | tuple[str, int], Engine]]:
    """model (or (model, n_ctx)) -> engine with native capture (for the hidden-state policies), loaded on
    first use; n_ctx is N_CTX unless given."""
    loaded: dict[tuple[str, int], Engine] = {}

    class Lazy(dict):  # type: ignore[type-arg]
        def __missing__(self, key: str | tuple[str, int]) -> Engine:
            model, n_ctx = (key, N_CTX) if isinstance(key, str) else key
            if (model, n_ctx) not in loaded:
                loaded[model, n_ctx] = Engine.load(model, n_ctx=n_ctx, n_seq_max=4, capture="native")
            self[key] = loaded[model, n_ctx]
            return self[key]

    yield Lazy()
    for eng in loaded.values():
        eng.close()


_PROSE: dict[tuple[str, int, int], str] = {}


def prose(engine: Engine, n_tokens: int, skip: int = 0) -> str:
    """Whole paragraphs of the shipped book (after ``skip`` paragraphs), at least ``n_tokens`` tokens."""
    from kvagent.data import load_prose

    key = (engine.model.name, n_tokens, skip)
    if key not in _PROSE:
        paragraphs = [p for p in load_prose()[BOOK].split("\n\n") if p.strip()][skip:]
        text, count = [], 0
        for p in paragraphs:
            if count >= n_tokens:
                break
            text.append(p)
            count += len(engine.backend.tokenize(p + "\n\n", special=False))
        _PROSE[key] = "\n\n".join(text)
    return _PROSE[key]


def segments(engine: Engine, n_tokens: int) -> list[Segment]:
    """Policy and field (pinned) at the top, a pinned note in the middle of the prose."""
    half = n_tokens // 2
    first = prose(engine, half)
    rest = prose(engine, n_tokens - half, skip=first.count("\n\n") + 1)
    return [
        Segment.policy("You are a careful reader. Answer in one short sentence."),
        Segment.field("reader", "Ada"),
        Segment.user(first),
        Segment.memory(NOTE, pinned=True),
        Segment.user(rest),
    ]


def incomplete_pinned(session: Session) -> list[str]:
    return [span.id for span, cached in session.cached_spans() if span.pinned and len(cached) != span.length]


# --- the decode spy ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Decode:
    """One decode of the session: its batch, and what the session and llama.cpp held just before it."""

    tokens: tuple[int, ...]
    positions: tuple[int, ...]
    outputs: tuple[bool, ...]
    held: tuple[int, ...]  # positions llama.cpp held for the session's sequence
    cached: tuple[int, ...]  # the session's cached_positions
    incomplete_pinned: tuple[str, ...]
    capturing: bool  # activation capture was on (the graph is then computed in pieces: replayed alike)
    cells: tuple[int, ...]  # where the session says llama.cpp holds its cached positions (compacted: 0..k-1)
    closed: int  # holes closed below the decoded positions: their own positions are these cells + closed


@contextmanager
def spy_on_decode(engine: Engine, session: Callable[[], Session | None]) -> Iterator[list[Decode]]:
    backend = engine.backend
    real = backend.decode
    calls: list[Decode] = []

    def decode(tokens, positions, seq_ids, outputs):  # type: ignore[no-untyped-def]
        s = session()
        if s is not None and set(seq_ids) == {s.seq}:
            calls.append(Decode(
                tuple(tokens), tuple(positions), tuple(bool(o) for o in outputs), tuple(backend.seq_positions(s.seq)),
                s.cached_positions, tuple(incomplete_pinned(s)), bool(backend.capture and backend.capture.enabled),
                tuple(s.cache.cells_at(s.cached_positions)), len(s.cache.closed),
            ))
        return real(tokens, positions, seq_ids, outputs)

    backend.decode = decode  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        del backend.decode


# --- scenarios -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    model: str
    policy: str
    n_tokens: int  # prose tokens (the rendered prompt adds the template's)
    budget: int = BUDGET
    chunk: int = CHUNK
    replay: bool = False
    n_ctx: int = N_CTX
    compact: bool = False  # Eviction(compact=True): kept cells renumbered 0..k-1 after each cycle

    @property
    def id(self) -> str:
        extra = "" if (self.budget, self.chunk) == (BUDGET, CHUNK) else f"-J{self.budget}-h{self.chunk}"
        ctx = "" if self.n_ctx == N_CTX else f"-ctx{self.n_ctx}"
        return (f"{self.model}-{self.policy}-{self.n_tokens}{extra}{ctx}{'-compact' if self.compact else ''}"
                f"{'-replay' if self.replay else ''}")


@dataclass(frozen=True)
class Stage:
    """The session after one call: cached positions, llama.cpp's cells, pinned spans not whole."""

    n_tokens: int
    cached: tuple[int, ...]
    evicted: frozenset[int]
    held: tuple[int, ...]
    incomplete_pinned: tuple[str, ...]
    spans_cover_cache: bool  # the cached positions of the spans are exactly the cached positions
    cells: tuple[int, ...]  # where the session says llama.cpp holds its cached positions


@dataclass
class Run:
    case: Case
    prompt_len: int
    pinned_positions: frozenset[int]
    calls: list[Decode]
    cycles: tuple  # CycleReport, in order
    stages: dict[str, Stage]
    extend_calls: int  # decodes up to the one that produced the logits after the extend
    cycles_at_extend: int
    logits: np.ndarray  # next-token logits after the extend
    generation: Generation
    open_after: int
    seconds: float
    replayed: np.ndarray | None = None
    replay_cycles: int = 0
    replay_before: list[int] = field(default_factory=list)
    control: np.ndarray | None = None  # the replay's last decode with one cell fewer


def stage(session: Session, engine: Engine) -> Stage:
    spans = [p for _, cached in session.cached_spans() for p in cached]
    return Stage(
        len(session.tokens), session.cached_positions, session.evicted_positions,
        tuple(engine.backend.seq_positions(session.seq)), tuple(incomplete_pinned(session)),
        sorted(spans) == list(session.cached_positions) and len(spans) == len(set(spans)),
        tuple(session.cache.cells_at(session.cached_positions)),
    )


def pristine(engine: Engine) -> None:
    """Empty the whole KV pool *and* its bookkeeping (llama_memory_clear resets the cache heads).

    Needed for an exact replay: the cells a decode lands in depend on where the pool's search starts,
    and Gemma-3's sliding-window cache keeps its head where the last session left it. Measured: two
    identical Gemma-3 sessions with scattered evictions (random, surprise) one after the other on one
    engine gave logits with cosine 0.99993-0.99995 and different evictions; with a clear before each,
    bitwise equal. (SmolLM2 and contiguous evictions were bitwise equal either way.)"""
    assert engine.open_sessions == 0
    engine.pool.clear_retained()  # closed sessions' cells go first, so that the pool knows it is empty
    engine.backend.clear_memory()


def replay(engine: Engine, run: Run) -> None:
    """Re-issue the session's decodes in a fresh sequence of the emptied pool, removing after each one
    the positions the session's cycle reports say were evicted there (a cycle ran when its ``before``
    cells were reached), up to the decode of the logits after the extend.

    This is the recompute the KV can be checked against: decoding only the kept tokens at their kept
    positions is refused by llama.cpp ("positions are not continuous": a sequence grows at pos_max + 1
    only), and would not be the same KV anyway (the kept tokens were cached while the evicted ones were
    still there)."""
    pristine(engine)  # the same pool history as the session's: the cells land where the session's did
    backend = engine.backend
    cycles = list(run.cycles[: run.cycles_at_extend])
    capture = backend.capture

    def decode(call: Decode) -> np.ndarray:
        n = len(call.tokens)
        if capture is not None:
            capture.enabled = call.capturing
        try:
            return backend.decode(call.tokens, call.positions, [seq] * n, call.outputs)
        finally:
            if capture is not None:
                capture.enabled = False
                capture.clear()

    with engine.scratch() as seq:
        cells, done, out, cycled = 0, 0, None, False
        held: list[int] = []  # the positions the replay's cells hold, in cell order
        for call in run.calls[: run.extend_calls]:
            out = decode(call)
            held += [c + call.closed for c in call.positions]
            cells += len(call.tokens)
            cycled = done < len(cycles) and cells == cycles[done].before
            if cycled:
                gone = set(cycles[done].evicted)
                at = backend.seq_positions(seq)  # ascending cells, held[i] at at[i]
                for first, last in position_runs([c for c, p in zip(at, held) if p in gone]):
                    backend.seq_rm(seq, first, last + 1)
                if run.case.compact:  # as the session does after the cycle
                    compact_positions(backend, seq, [c for c, p in zip(at, held) if p not in gone])
                held = [p for p in held if p not in gone]
                run.replay_before.append(cells)
                cells = cycles[done].after
                done += 1
        assert out is not None and len(out)
        run.replayed, run.replay_cycles = out[-1].copy(), done
        if not cycled:
            # control: the same last decode without one more cell (the second newest before it; the newest
            # must stay, llama.cpp extends a sequence at pos_max + 1 only) must differ
            last = run.calls[run.extend_calls - 1]
            backend.seq_rm(seq, last.positions[0], -1)
            backend.seq_rm(seq, last.held[-2], last.held[-2] + 1)
            run.control = decode(last)[-1].copy()




def scenario(engine: Engine, case: Case) -> Run:
    """Prefill past the budget, extend with a question (logits), generate a few tokens; then replay."""
    pristine(engine)
    start = time.perf_counter()
    holder: list[Session] = []
    eviction = Eviction(case.policy, case.budget, case.chunk, compact=case.compact)
    with spy_on_decode(engine, lambda: holder[0] if holder else None) as calls, \
            engine.session(segments(engine, case.n_tokens), eviction=eviction) as s:
        holder.append(s)
        rendered = s.rendered
        pinned = frozenset(p for span in rendered.spans if span.pinned for p in range(span.first, span.last + 1))
        stages = {}
        s.prefill()
        stages["prefill"] = stage(s, engine)
        s.extend(Segment.user(QUESTION))
        logits = s.logits()
        extend_calls, cycles_at_extend = len(calls), len(s.cycles)
        stages["extend"] = stage(s, engine)
        generation = s.generate(max_tokens=6)
        stages["generate"] = stage(s, engine)
        cycles = s.cycles
        holder.clear()
    run = Run(case, len(rendered.tokens), pinned, list(calls), cycles, stages, extend_calls, cycles_at_extend, logits,
              generation, engine.open_sessions, time.perf_counter() - start)
    if case.replay:
        replay(engine, run)
    return run


S, G = "smollm2-135m", "gemma3-270m"
LONG = 1150  # prose tokens: the prompt is longer than the context (N_CTX)
CASES = [
    pytest.param(Case(S, "window", LONG, replay=True)),
    pytest.param(Case(S, "random", 700)),
    pytest.param(Case(S, "h2o", 700), marks=pytest.mark.full),
    pytest.param(Case(S, "tova", 700), marks=pytest.mark.full),
    pytest.param(Case(S, "importance", 700), marks=pytest.mark.full),
    pytest.param(Case(S, "surprise", 700, replay=True)),
    pytest.param(Case(S, "surprise-token", 700), marks=pytest.mark.full),
    # the composed and reconstruction policies: the hybrid (window + span-level surprise) replayed; the
    # reconstruction probe decodes in a scratch sequence, which moves where later cells land in the pool, so its
    # session is not replayed bit for bit
    pytest.param(Case(S, "hybrid", 700, replay=True), marks=pytest.mark.full),
    pytest.param(Case(S, "kvzip", 700), marks=pytest.mark.full),
    # self-information (Selective Context): each cell scored once, its table pruned with the cells
    pytest.param(Case(S, "selfinfo", 700, replay=True), marks=pytest.mark.full),
    # turn contrast over self-information with the future-copy discount: its turn table follows the cells
    # the fast tier replays contrast compacted (below); this one, 11 s, in the full tier
    pytest.param(Case(S, "contrast", 700, replay=True), marks=pytest.mark.full),
    pytest.param(Case(G, "window", 700, replay=True)),
    pytest.param(Case(G, "random", 700)),
    # scattered evictions on Gemma-3 replayed (its sliding-window cache, see pristine()): 400 prompt tokens, 2
    # cycles, 6 s (the 700-token case, slow: 12 s)
    pytest.param(Case(G, "surprise", 330, replay=True), marks=pytest.mark.arch),
    pytest.param(Case(G, "contrast", 330, replay=True), marks=pytest.mark.arch),
    # budget + chunk + margin == n_ctx and the chunk does not divide budget + chunk: a chunk must stop where
    # the cycle falls due (otherwise the 5th chunk of 56 goes to 280 cells and llama_decode finds no free cell in
    # the pool of 256)
    pytest.param(Case(S, "window", 400, budget=256 - 56 - _MARGIN, chunk=56, n_ctx=256)),
    pytest.param(Case(G, "window", 400, budget=256 - 56 - _MARGIN, chunk=56, n_ctx=256)),
    # Eviction(compact=True): the kept cells renumbered 0..k-1 after each cycle (K-shift); the window decodes in the
    # shared batch (generation's positions are cells), contrast through the evictor; Gemma-3's sliding window
    # (SmolLM2's compacted window in the full tier, for the fast tier's budget; its compacted contrast stays)
    pytest.param(Case(S, "window", 700, replay=True, compact=True), marks=pytest.mark.full),
    pytest.param(Case(S, "contrast", 700, replay=True, compact=True)),
    # Gemma-3 compacted in the fast tier: contrast at 330 (below); the window at 700 (11 s) in the full tier
    pytest.param(Case(G, "window", 700, replay=True, compact=True), marks=pytest.mark.full),
    pytest.param(Case(G, "contrast", 330, replay=True, compact=True), marks=pytest.mark.arch),
    pytest.param(Case(G, "window", LONG, replay=True), marks=pytest.mark.slow),
    pytest.param(Case(S, "random", 700, replay=True), marks=pytest.mark.slow),
    pytest.param(Case(G, "h2o", 700), marks=pytest.mark.slow),
    pytest.param(Case(G, "tova", 700), marks=pytest.mark.slow),
    pytest.param(Case(G, "importance", 700), marks=pytest.mark.slow),
    pytest.param(Case(G, "surprise", 700, replay=True), marks=pytest.mark.slow),
    pytest.param(Case(S, "surprise-full", 700, replay=True), marks=pytest.mark.slow),
    pytest.param(Case(G, "surprise-full", 700), marks=pytest.mark.slow),
    pytest.param(Case(G, "hybrid", 330, replay=True), marks=pytest.mark.slow),
    pytest.param(Case(G, "kvzip", 700), marks=pytest.mark.slow),
]
CASE_IDS = [p.values[0].id for p in CASES]
REPLAYS = [p for p in CASES if p.values[0].replay]
LONGS = [p for p in CASES if p.values[0].n_tokens > p.values[0].n_ctx]
_RUNS: dict[Case, Run] = {}


@pytest.fixture
def run(engines: dict[str, Engine], case: Case) -> Run:
    if case not in _RUNS:
        _RUNS[case] = scenario(engines[case.model, case.n_ctx], case)
        print(f"\n[{case.id}] {_RUNS[case].prompt_len} prompt tokens, {len(_RUNS[case].cycles)} cycles, "
              f"{_RUNS[case].seconds:.1f} s")
    return _RUNS[case]


def in_fast_tier(param: object) -> bool:
    """Whether a case of CASES runs in the fast tier (tests/tiers.py)."""
    return tier((mark.name for mark in param.marks), {param.values[0].model}) == "fast"  # type: ignore[attr-defined]


def test_the_cases_cover_the_policies_and_the_fast_tier_replays_each_model() -> None:
    assert {(S, pol) for pol in ("window", "random", "h2o", "tova", "importance", "surprise", "contrast")} <= {
        (c.model, c.policy) for p in CASES for c in p.values}
    assert {c.policy for p in CASES for c in p.values} <= set(POLICIES)
    fast = [c for p in CASES if in_fast_tier(p) for c in p.values]
    # in the fast tier, on every model: a scattered eviction (surprise) and the default policy (contrast) replayed,
    # and a compacted session replayed (Gemma-3: its sliding-window cache under both)
    replayed = {(c.model, c.policy) for c in fast if c.replay}
    assert {(m, pol) for m in MODELS for pol in ("surprise", "contrast")} <= replayed
    assert set(MODELS) <= {c.model for c in fast if c.replay and c.compact}
    # and the window past the context, on the first model
    assert any(c.model == MODELS[0] and c.policy == "window" and c.n_tokens > c.n_ctx for c in fast)


# --- the checks, one per property ----------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_cycles_ran_and_decoding_continued(run: Run, case: Case) -> None:
    assert run.prompt_len > case.budget + case.chunk
    assert run.cycles_at_extend > 0  # the prompt was evicted before the question was decoded
    assert len(run.cycles) >= run.cycles_at_extend
    assert np.all(np.isfinite(run.logits))
    assert run.generation.generated >= 1
    assert run.generation.finish_reason in ("eos", "length", "stop")
    assert len(run.calls) > run.extend_calls  # the generation decoded after the evictions
    assert run.open_after == 0


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_pinned_spans_survive_every_cycle(run: Run, case: Case) -> None:
    assert len(run.pinned_positions) > 20  # policy, field and the note in the middle of the prose
    evicted_pinned = [i for i, c in enumerate(run.cycles) if run.pinned_positions & set(c.evicted)]
    assert evicted_pinned == []
    # before every decode (so after every cycle) and after every call, each pinned span is whole
    assert [c.positions[0] for c in run.calls if c.incomplete_pinned] == []
    assert {name: st.incomplete_pinned for name, st in run.stages.items()} == {name: () for name in run.stages}


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_span_table_matches_the_cells_after_every_cycle(run: Run, case: Case) -> None:
    assert [c.positions[0] for c in run.calls if c.held != c.cells] == []
    assert {name: st.held == st.cells for name, st in run.stages.items()} == {name: True for name in run.stages}
    # compacted: the cells are 0..k-1; else each position is its own cell
    numbered = {name: st.cells == (tuple(range(len(st.cached))) if case.compact else st.cached)
                for name, st in run.stages.items()}
    assert numbered == {name: True for name in run.stages}
    assert {name: st.spans_cover_cache for name, st in run.stages.items()} == {name: True for name in run.stages}
    # every position of the prompt is either cached or evicted, and evicted exactly by the cycles
    at_extend = run.stages["extend"]
    assert sorted(set(at_extend.cached) | at_extend.evicted) == list(range(at_extend.n_tokens))
    assert not set(at_extend.cached) & at_extend.evicted
    by_cycles = [p for c in run.cycles[: run.cycles_at_extend] for p in c.evicted]
    assert sorted(by_cycles) == sorted(at_extend.evicted)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_cells_stay_within_budget_chunk_and_margin(run: Run, case: Case) -> None:
    limit = case.budget + case.chunk + _MARGIN
    peak = max(len(c.held) + len(c.tokens) for c in run.calls)  # cells right after each decode
    assert peak <= limit
    assert max(c.before for c in run.cycles) <= case.budget + case.chunk
    assert {c.after for c in run.cycles} == {case.budget}
    assert max(len(st.held) for st in run.stages.values()) <= limit


@pytest.mark.parametrize("case", LONGS, ids=[p.values[0].id for p in LONGS])
def test_a_prompt_longer_than_the_context_is_evicted_not_refused(run: Run, case: Case) -> None:
    assert run.prompt_len > case.n_ctx
    assert len(run.stages["prefill"].cached) <= case.budget + case.chunk
    assert run.stages["prefill"].cached[-1] == run.prompt_len - 1  # the whole prompt went through


@pytest.mark.parametrize("case", REPLAYS, ids=[p.values[0].id for p in REPLAYS])
def test_logits_after_eviction_match_a_replay(run: Run, case: Case) -> None:
    assert run.replayed is not None
    assert run.replay_cycles == run.cycles_at_extend > 0
    assert run.replay_before == [c.before for c in run.cycles[: run.cycles_at_extend]]
    cos = cosine(run.logits, run.replayed)
    control = cosine(run.logits, run.control) if run.control is not None else float("nan")
    print(f"\n[{case.id}] logits after {run.replay_cycles} cycles vs replay: cosine {cos:.9f}, "
          f"max |diff| {np.abs(run.logits - run.replayed).max():.3g}; replay with one cell fewer: cosine {control:.6f}")
    assert cos >= REPLAY_FLOOR
    assert int(run.logits.argmax()) == int(run.replayed.argmax())
    if run.control is not None:  # the floor tells one cell apart
        assert control < REPLAY_FLOOR


# --- refusals ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("how", ["prefill", "extend"])
def test_without_a_policy_a_prompt_longer_than_the_context_is_refused(engines: dict[str, Engine], model: str,
                                                                        how: str) -> None:
    engine = engines[model]
    long = Segment.user(prose(engine, LONG))
    if how == "prefill":
        with engine.session([long]) as s:
            with pytest.raises(ContextOverflowError, match="eviction") as err:
                s.prefill()
            assert s.tokens == () and s.cached_positions == () and engine.backend.seq_positions(s.seq) == []
    else:
        with engine.session([Segment.policy("You are a careful reader."), Segment.user(QUESTION)]) as s:
            s.prefill()
            before = (s.segments, s.tokens, s.cached_positions, engine.backend.seq_positions(s.seq), s.logits())
            with pytest.raises(ContextOverflowError, match="eviction") as err:
                s.extend(long)
            after = (s.segments, s.tokens, s.cached_positions, engine.backend.seq_positions(s.seq), s.logits())
            assert after[:4] == before[:4]
            assert np.array_equal(after[4], before[4])
    assert str(N_CTX) in str(err.value) and "Eviction(" in str(err.value)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("bad", ["nope", "Surprise", ""])
def test_an_unknown_policy_lists_the_valid_ones_and_leaks_no_sequence(engines: dict[str, Engine], model: str,
                                                                       bad: str) -> None:
    engine = engines[model]
    open_before = engine.open_sessions
    with pytest.raises(EvictionError) as err:
        engine.session([Segment.user(QUESTION)], eviction=Eviction(bad, budget=BUDGET, chunk=CHUNK))
    assert all(name in str(err.value) for name in POLICIES)
    assert engine.open_sessions == open_before
    # every sequence is still free: as many sessions as n_seq_max open
    sessions = [engine.session([Segment.user(QUESTION)]) for _ in range(engine.backend.n_seq_max)]
    for s in sessions:
        s.close()


HIDDEN = sorted(name for name, make in POLICIES.items() if make().needs_hidden)


@pytest.mark.parametrize("policy", HIDDEN)
def test_a_hidden_state_policy_needs_an_engine_with_capture(engine: Engine, policy: str) -> None:
    """The conftest engine is loaded without capture."""
    assert engine.backend.capture is None
    open_before = engine.open_sessions
    with pytest.raises(EvictionError, match="capture='native'"):
        engine.session([Segment.user(QUESTION)], eviction=Eviction(policy, budget=BUDGET, chunk=CHUNK))
    assert engine.open_sessions == open_before


# --- fast vs full surprise -----------------------------------------------------------------------------
class Snapshot(EvictionPolicy):
    """Keeps the views a cycle shows it (with the hidden states llama.cpp's decode captured)."""

    def __init__(self, inner: EvictionPolicy) -> None:
        self.inner, self.name, self.needs_hidden = inner, inner.name, inner.needs_hidden
        self.views: list[CacheView] = []

    def score(self, view: CacheView) -> np.ndarray:
        self.views.append(view)
        return self.inner.score(view)


def ranks(x: np.ndarray) -> np.ndarray:
    """Ranks from 0, ties given their mean rank."""
    order = np.argsort(x, kind="stable")
    r = np.empty(x.size)
    r[order] = np.arange(x.size)
    _, inverse = np.unique(x, return_inverse=True)
    return (np.bincount(inverse, weights=r) / np.bincount(inverse))[inverse]


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


@pytest.mark.parametrize(("a", "b", "rho"), [
    ([1, 2, 3, 4], [10, 20, 30, 40], 1.0),
    ([1, 2, 3, 4], [4, 3, 2, 1], -1.0),
    ([1, 2, 3, 4, 5], [1, 4, 9, 16, 25], 1.0),  # monotone, not linear
    ([1, 1, 2, 3], [5, 5, 6, 7], 1.0),  # ties
])
def test_spearman_helper(a: list[float], b: list[float], rho: float) -> None:
    assert spearman(np.array(a, float), np.array(b, float)) == pytest.approx(rho)


RANK_TOKENS = 504  # one cycle falls due at exactly budget + chunk = 504 cells: the view holds 0..503
_VIEWS: dict[str, CacheView] = {}


def captured_view(engine: Engine) -> CacheView:
    """The view the first cycle of a surprise session shows its policy: 504 prose cells with the hidden
    states llama.cpp's decode captured."""
    if engine.model.name not in _VIEWS:
        pristine(engine)  # Gemma-3's captured states depend on the pool's history otherwise (see pristine)
        snap = Snapshot(get_policy("surprise-token"))
        with engine.session([Segment.user(prose(engine, RANK_TOKENS + 20))],
                            eviction=Eviction(snap, budget=RANK_TOKENS - CHUNK, chunk=CHUNK)) as s:
            s.prefill()
        _VIEWS[engine.model.name] = snap.views[0]
    return _VIEWS[engine.model.name]


def cells_of(view: CacheView, index: np.ndarray) -> CacheView:
    """The view restricted to the cells at ``index`` (ascending), every per-cell field with them."""
    def pick(x: np.ndarray | None) -> np.ndarray | None:
        return None if x is None else x[index]
    return replace(view, tokens=view.tokens[index], positions=view.positions[index], pinned=view.pinned[index],
                   new=view.new[index], hidden=pick(view.hidden), query_hidden=pick(view.query_hidden),
                   previous=pick(view.previous),
                   texts=None if view.texts is None else tuple(view.texts[i] for i in index))


# (query, proxy): the token-level pass of "surprise", and the paper's literal recipe ("surprise-paper")
VARIANTS = [("previous", "logprob"), ("self", "logit")]
# Spearman of fast vs full on this view, measured (deterministic for a given llama.cpp and GGUF):
# SmolLM2 0.562 (previous/logprob), 0.607 (self/logit); Gemma-3 0.549, 0.526. Lowest-quarter overlaps
# 0.48, 0.63, 0.44, 0.46 (chance 0.25). Alike, not the same: the floors sit 0.1 under the measurements.
RANK_FLOOR = {(S, "previous", "logprob"): 0.45, (S, "self", "logit"): 0.50,
              (G, "previous", "logprob"): 0.45, (G, "self", "logit"): 0.40}


@pytest.mark.parametrize(("query", "proxy"), VARIANTS, ids=["-".join(v) for v in VARIANTS])
@pytest.mark.parametrize("model", MODELS)  # Gemma-3: 19-43 s on 2 busy cores (both variants), SmolLM2 16-30 s
def test_fast_and_full_surprise_rank_tokens_alike(engines: dict[str, Engine], model: str, query: str,
                                                  proxy: str) -> None:
    view = captured_view(engines[model])
    assert len(view) == RANK_TOKENS and view.positions.tolist() == list(range(RANK_TOKENS))
    assert view.hidden is not None and not np.isnan(view.hidden).any()
    fast = FastSurprise(query=query, proxy=proxy).score(view)
    full = FullSurprise(query=query, proxy=proxy).score(view)
    # unscored cells (the first with query="previous") are the only non-finite ones; the last sees no future
    scored = np.isfinite(fast) & np.isfinite(full)
    scored[-1] = False
    assert scored.sum() >= RANK_TOKENS - 3
    fast, full = fast[scored], full[scored]
    rho = spearman(fast, full)
    top = len(fast) // 4  # overlap of the quarters each would evict first (lowest scores)
    overlap = len(set(np.argsort(fast)[:top].tolist()) & set(np.argsort(full)[:top].tolist())) / top
    print(f"\n[{model} query={query} proxy={proxy}] fast vs full surprise over {len(fast)} cells: "
          f"Spearman {rho:.3f}, lowest-quarter overlap {overlap:.2f} (chance 0.25)")
    assert rho >= RANK_FLOOR[model, query, proxy]


@pytest.mark.parametrize("model", MODELS)
def test_self_information_is_llama_cpp_s_own_log_probability(engines: dict[str, Engine], model: str) -> None:
    """The last layer over the captured states with the causal mask is the model's forward pass: each cell's
    self-information equals -log P(x_p | x_<p) from llama.cpp's logits of the same tokens decoded afresh."""
    engine = engines[model]
    view = captured_view(engine)
    info = SelfInformation().score(view)
    n = len(view)
    with engine.pool.lock:
        seq = engine.pool.take("a replay of the captured view")
        try:
            logits = engine.backend.decode(view.tokens.tolist(), view.positions.tolist(), [seq] * n, [True] * n)
        finally:
            engine.pool.release(seq)
    z = logits.astype(np.float64)
    logz = z.max(-1) + np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1))
    exact = -(z[np.arange(n - 1), view.tokens[1:]] - logz[:-1])  # -log P(x_p | x_<p), p = 1..n-1
    assert np.isposinf(info[0]) and np.isfinite(info[1:]).all()  # the first cell has no past: kept
    err = np.abs(info[1:] - exact)
    rho = spearman(info[1:], exact)
    print(f"\n[{model}] self-information vs llama.cpp over {n - 1} cells: largest difference {err.max():.4f} nats, "
          f"median {np.median(err):.5f}, mean self-information {exact.mean():.2f}, Spearman {rho:.4f}")
    # measured: largest 0.251 / 0.205 nats, median 0.022 / 0.022 (SmolLM2 / Gemma-3; mean 2.8 nats): torch runs the
    # last layer on dequantized float32 weights, llama.cpp on the quantized ones with quantized activations
    assert err.max() < 0.4 and np.median(err) < 0.04 and rho > 0.99


@pytest.mark.parametrize("model", MODELS)
def test_the_fast_counter_causal_pass_ranks_cells_as_self_information_does(engines: dict[str, Engine],
                                                                          model: str) -> None:
    """The fast pass queries from the state at p - 1, which already carries the causal prediction of x_p: on these
    models its counter-causal surprise orders the cells as the forward self-information does, the future adding
    little (why kvagent's contrast policy models the future's say with a copy model, FutureCopy). Measured on the
    held-out calibration contexts: Spearman 0.996-0.997 on both models; on this prose view 0.9968 (SmolLM2) and
    0.9951 (Gemma-3), median difference 0.06 / 0.08 nats."""
    view = captured_view(engines[model])
    fast = FastSurprise().score(view)  # query="previous", proxy="logprob": the token-level pass of "surprise"
    info = SelfInformation().score(view)
    scored = np.isfinite(fast) & np.isfinite(info)
    scored[-1] = False  # the last cell has no future
    rho = spearman(fast[scored], info[scored])
    diff = np.abs(fast[scored] - info[scored])
    print(f"\n[{model}] fast counter-causal surprise vs self-information over {int(scored.sum())} cells: "
          f"Spearman {rho:.4f}, median difference {np.median(diff):.3f} nats, largest {diff.max():.2f}")
    assert scored.sum() >= RANK_TOKENS - 3
    assert rho > 0.98


# --- a random code in prose must survive surprise -------------------------------------------
CODE_SENTENCE = "The access code for the vault is 4821."
CODE_PROSE = 1000  # prose tokens around it: 9-13 cycles of 64 at budgets of 50% / 25%


class Recorder(EvictionPolicy):
    """Keeps each cycle's view and the inner policy's scores."""

    def __init__(self, inner: EvictionPolicy) -> None:
        self.inner, self.name, self.needs_hidden = inner, inner.name, inner.needs_hidden
        self.views: list[CacheView] = []
        self.scores: list[np.ndarray] = []

    def score(self, view: CacheView) -> np.ndarray:
        scores = np.asarray(self.inner.score(view), dtype=np.float64)
        self.views.append(view)
        self.scores.append(scores)
        return scores

    def kept(self, positions: np.ndarray) -> None:
        self.inner.kept(positions)


def code_run(engine: Engine, policy: str, fraction: float) -> tuple[list[int], set[int], Recorder]:
    """Prose with the code sentence in the middle streamed through a session at ``fraction`` of its length;
    returns the code's digit positions, the positions cached at the end, and the policy's record."""
    pristine(engine)
    text = prose(engine, CODE_PROSE).split("\n\n")
    text.insert(len(text) // 2, CODE_SENTENCE)
    segs = [Segment.user("\n\n".join(text))]
    rec = Recorder(get_policy(policy))
    with engine.session(segs) as probe:
        ids = probe.rendered.tokens
    texts = [engine.backend.token_bytes(t).decode("utf-8", "replace") for t in ids]
    vault = next(i for i, t in enumerate(texts) if "vault" in t)
    digits = [i for i in range(vault, vault + 10) if texts[i].strip().isdigit()]
    assert "".join(texts[i].strip() for i in digits) == "4821"
    with engine.session(segs, eviction=Eviction(rec, budget=int(len(ids) * fraction), chunk=CHUNK)) as s:
        s.prefill()
        cached = set(s.cached_positions)
    assert len(rec.views) >= 5
    return digits, cached, rec


@pytest.mark.parametrize("fraction", [pytest.param(0.5, marks=pytest.mark.full), 0.25])  # 0.5: the fast tier's budget
@pytest.mark.parametrize("model", MODELS)
def test_surprise_keeps_the_tokens_of_a_code_in_prose(engines: dict[str, Engine], model: str, fraction: float) -> None:
    """Token-level scores lose digits of a code (measured: 2/4 kept at 50% on both models, 0/4 (SmolLM2) or
    1/4 (Gemma-3) at 25%); "surprise" scores spans, so the sentence stays whole."""
    digits, cached, _ = code_run(engines[model, 2048], "surprise", fraction)
    assert [p for p in digits if p not in cached] == []


@pytest.mark.parametrize("model", MODELS)
def test_token_surprise_scores_a_cell_whose_predecessor_was_evicted_from_its_predecessors_state(
        engines: dict[str, Engine], model: str) -> None:
    """The query of x_p is the state at p - 1, not the previous *cached* cell's state, which predicts another
    token: scored from that one, in the last cycle at 50%, cells whose predecessor was evicted had a median
    surprise 2.3x (SmolLM2 10.0 vs 4.4) and 2.3x (Gemma-3 9.7 vs 4.2) that of the others, so they crowded out
    contiguous text; from the right state: 1.10 (4.31 vs 3.92) and 1.00 (3.88 vs 3.87)."""
    _, _, rec = code_run(engines[model, 2048], "surprise-token", 0.5)
    view, scores = rec.views[-1], rec.scores[-1]
    follows = np.r_[False, np.diff(view.positions) == 1]
    finite = np.isfinite(scores)
    gap, run = np.median(scores[~follows & finite]), np.median(scores[follows & finite])
    print(f"\n[{model}] last cycle: median surprise {gap:.2f} (predecessor evicted, {int((~follows & finite).sum())} "
          f"cells) vs {run:.2f} (predecessor cached)")
    assert (~follows & finite).sum() >= 50
    assert gap <= 1.4 * run


# --- save and restore after eviction -------------------------------
# The blob carries the evictor's state (the hidden rows it recorded, the policy's running state), so a session
# restored from it evicts at its next cycles as the saved one does. The restored cells lie elsewhere in llama.cpp's
# pool, which moves its numbers a little (the stateless window: logits cosine 0.9963 on SmolLM2 after the extend), so
# the new tokens' hidden states differ in the last bits and a near-tie can rank the other way: measured 0-2 of
# 128-192 cells chosen otherwise. The control restores the same blob with the evictor's state stripped: the
# restored cells then have no hidden states and the extend's cycles choose
# other cells (and the hybrid on SmolLM2 measured logits cosine 0.63).
RESTORE_AGREEMENT = 0.97


def scenario_run(engines: dict[str, Engine], model: str, policy: str, compact: bool) -> Run:
    """The module's scenario of ``policy`` on ``model`` over 700 prose tokens at the default budget, chunk and
    context: the run a case above already made (replayed or not: the session's logits are the same), else made now
    and kept."""
    for case, run in _RUNS.items():
        if (case.model, case.policy, case.n_tokens, case.compact, case.budget, case.chunk, case.n_ctx) == (
                model, policy, 700, compact, BUDGET, CHUNK, N_CTX):
            return run
    case = Case(model, policy, 700, compact=compact)
    _RUNS[case] = scenario(engines[model], case)
    return _RUNS[case]


def _extend_restored(engine: Engine, blob: bytes, segs: list[Segment], eviction: Eviction,
                     more: Segment) -> tuple[np.ndarray, frozenset[int], np.ndarray, frozenset[int]]:
    """Restore ``blob`` in a new session and extend it by ``more``: (logits and evicted positions once restored,
    the same after the extend)."""
    with engine.session(segs, eviction=eviction) as b:
        b.restore(blob, segs)
        assert engine.backend.seq_positions(b.seq) == b.cache.cells_at(b.cached_positions)
        logits, before = b.logits(), b.evicted_positions
        b.extend(more)
        return logits, before, b.logits(), b.evicted_positions


@pytest.mark.parametrize(("model", "policy", "compact"), [
    # the fast tier's budget: SmolLM2's compacted contrast below stays there; its window in the full tier
    pytest.param(S, "window", False, marks=pytest.mark.full), (G, "window", False),
    pytest.param(S, "hybrid", False, marks=pytest.mark.full),
    (G, "hybrid", False),
    pytest.param(S, "h2o", False, marks=pytest.mark.full), pytest.param(S, "selfinfo", False, marks=pytest.mark.full),
    pytest.param(S, "contrast", False, marks=pytest.mark.full),
    # Eviction(compact=True), the default: the blob's cells sit at compacted positions
    (S, "contrast", True), pytest.param(G, "window", True, marks=pytest.mark.arch),
    pytest.param(G, "contrast", False, marks=pytest.mark.slow),
    pytest.param(S, "kvzip", False, marks=pytest.mark.slow),  # 22 s: the replays
    pytest.param(G, "surprise-token", False, marks=pytest.mark.slow)])
def test_a_session_that_evicted_is_saved_and_restored(engines: dict[str, Engine], model: str, policy: str,
                                                      compact: bool) -> None:
    from kvagent.kvblob import KVBlob

    engine = engines[model]
    pristine(engine)
    segs = segments(engine, 700)
    eviction = Eviction(policy, BUDGET, CHUNK, compact=compact)
    more = Segment.user(prose(engine, 2 * CHUNK, skip=40) + "\n\n" + QUESTION)  # long enough for cycles
    with engine.session(segs, eviction=eviction) as a:
        a.prefill()
        evicted = a.evicted_positions
        assert evicted and len(a.cycles) >= 1
        blob, fingerprint = a.save(), a.model_fingerprint
        saved_logits = a.logits()
        a.extend(more)
        want, want_evicted = a.logits(), a.evicted_positions
    # the question right after the restore, against the same session asked it unsaved: the module's scenario of
    # this model and policy is exactly that (prefill, then the question, from the pristine pool)
    question = Segment.user(QUESTION)
    want_asked = scenario_run(engines, model, policy, compact).logits
    pristine(engine)
    with engine.session(segs, eviction=eviction) as b:
        b.restore(blob, segs)
        b.extend(question)
        asked = cosine(b.logits(), want_asked)
    print(f"\n[{model}/{policy}] the question after the restore: logits cosine {asked:.6f}")
    assert asked >= 0.999
    parsed = KVBlob.from_bytes(blob, model_fingerprint=fingerprint, backend_format=engine.backend.format)
    assert parsed.closed == (tuple(sorted(evicted)) if compact else ())
    stripped = replace(parsed, evictor_policy="", evictor={}).to_bytes()

    def agreement(got_evicted: frozenset[int]) -> float:
        new = want_evicted - evicted
        return len(new & (got_evicted - evicted)) / len(new)

    logits, restored, got, got_evicted = _extend_restored(engine, blob, segs, eviction, more)
    assert restored == evicted and np.array_equal(logits, saved_logits)
    _, _, control, control_evicted = _extend_restored(engine, stripped, segs, eviction, more)
    c, agree, control_agree = cosine(got, want), agreement(got_evicted), agreement(control_evicted)
    print(f"\n[{model}/{policy}] restored after {len(evicted)} evicted positions; the extend evicted "
          f"{len(want_evicted - evicted)} more: chosen alike {agree:.3f} (without the state {control_agree:.3f}); "
          f"logits cosine {c:.6f} (without the state {cosine(control, want):.6f}); blob {len(blob) / 1e6:.2f} MB, "
          f"{len(stripped) / 1e6:.2f} MB without the state")
    assert len(want_evicted) > len(evicted)  # the extend had cells to choose
    assert len(got_evicted) == len(want_evicted) and agree >= RESTORE_AGREEMENT
    assert c >= 0.99
    if get_policy(policy).needs_hidden:  # the control: without the state the choices differ
        assert control_agree < RESTORE_AGREEMENT


@pytest.mark.parametrize("model", [S])
def test_a_blob_restored_under_another_policy_keeps_its_cells_and_drops_the_state(
        engines: dict[str, Engine], model: str, caplog: pytest.LogCaptureFixture) -> None:
    engine = engines[model]
    pristine(engine)
    segs = segments(engine, 700)
    with engine.session(segs, eviction=Eviction("hybrid", BUDGET, CHUNK)) as a:
        a.prefill()
        blob, evicted, logits = a.save(), a.evicted_positions, a.logits()
    with engine.session(segs, eviction=Eviction("window", BUDGET, CHUNK)) as b:
        with caplog.at_level("WARNING", logger="kvagent.kv.persist"):
            b.restore(blob, segs)
        assert "saved under eviction policy 'hybrid'" in caplog.text
        assert b.evicted_positions == evicted and np.array_equal(b.logits(), logits)


# --- the incremental surprise pass equals the from-scratch one --------------------------------
class AgainstScratch(EvictionPolicy):
    """Scores every cycle with the default incremental policy (which drives the session), the exact one
    (``drift=0``) and, on the same view, the from-scratch fast pass; records per drift the largest score
    difference, its 99th percentile, and how many of the cells each keeps the from-scratch choice keeps."""

    needs_hidden = True

    def __init__(self, budget: int) -> None:
        self.name, self.budget = "surprise", budget
        self.incs = {drift: IncrementalSurprise(drift=drift) for drift in DRIFTS}  # the driver first
        self.diffs: dict[float, list[float]] = {drift: [] for drift in DRIFTS}
        self.p99: dict[float, list[float]] = {drift: [] for drift in DRIFTS}
        self.same_keep: dict[float, list[float]] = {drift: [] for drift in DRIFTS}
        self.refreshed: dict[float, list[float]] = {drift: [] for drift in DRIFTS}

    def score(self, view: CacheView) -> np.ndarray:
        want = FastSurprise().score(view)
        finite = np.isfinite(want)
        b = select_keep(want, view.pinned, self.budget)
        scores = {}
        for drift, inc in self.incs.items():
            got = scores[drift] = inc.score(view)
            assert np.array_equal(finite, np.isfinite(got))
            diff = np.abs(got[finite] - want[finite])
            self.diffs[drift].append(float(diff.max()))
            self.p99[drift].append(float(np.quantile(diff, 0.99)))
            a = select_keep(got, view.pinned, self.budget)
            self.same_keep[drift].append(len(set(a.tolist()) & set(b.tolist())) / len(b))
            self.refreshed[drift].append(inc.stats.head_refreshed / max(inc.stats.cells, 1))
        return scores[DRIFTS[0]]

    def kept(self, positions: np.ndarray) -> None:
        for inc in self.incs.values():
            inc.kept(positions)


DRIFTS = (0.05, 0.0)  # the default (drives the session), and every row's vocabulary head recomputed
INCREMENTAL_PROSE = 800  # 9 cycles of 64 at a quarter of the prompt
# The incremental pass against the from-scratch one, measured on the shipped GGUFs (CPU build, deterministic:
# repeated runs identical) over 7 sessions per model (1,000 prose tokens from paragraphs 0, 12, 30 and 50 at
# budgets n/4 and n/3, 800 tokens from paragraph 0: 9-14 cycles; the test runs the last):
#   drift=0: largest |incremental - scratch| 7.6e-6-1.1e-5 on both models (float error).
#   default drift (first-order log Z for rows not refreshed), largest error / 99th percentile / least share of
#   the from-scratch keep set kept:
#     SmolLM2 0.095-0.172 / 0.043-0.069 / 0.9918 (this test: 0.124 / 0.051 / 0.9953)
#     Gemma-3 0.379-0.767 / 0.081-0.180 / 0.9952 (this test: 0.509 / 0.081 / 0.9952)
#   Gemma-3's largest errors are single rows (its 262k-entry head moves more per unit of state); the p99 is 2-7x
#   under the max on both.
# Those 7 sessions ran up to 128 refreshed rows per cycle. Gemma-3's default refreshes at most 64 (its new rows at
# chunk 64: the decode-overhead target); measured on this test's session only (2026-12-02): Gemma-3 (64 rows)
# 0.613 / 0.307 / 0.9905; with the opt-in bf16 head too 0.647 / 0.287 / 0.9905; SmolLM2 with bf16 0.135 / 0.090 /
# 0.9905 (float32, its default: 0.124 / 0.051 / 0.9953). With the "mixed" head, the default where the CPU has
# native bf16 (2026-12-02): Gemma-3 0.604 / 0.307 / 0.9905, SmolLM2 0.115 / 0.051 / 0.9953.
# Bounds: 1.5x the worst measured (1 - keep: 1.5x the worst disagreement), per model; SmolLM2's from the 7-session
# sweep, Gemma-3's from the 64-row cap's measured price. They hold for the shipped files only: on the 4-layer
# truncated SmolLM2 of the GPU check the default's largest error was 1.14 nats (docs/benchmarks/gpu.md, run 2): a
# truncated model's last-layer states are not a real model's, so there the drift=0 exactness is checked and the
# default's bounds are not.
EXACT_BOUND = 2e-5
DRIFT_BOUNDS = {  # model: (largest error, 99th percentile, least keep-set agreement)
    S: (0.26, 0.11, 0.987),
    G: (1.15, 0.43, 0.985),
}
MEASURED_ON = {S: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
               G: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"}
_AGAINST: dict[str, AgainstScratch] = {}


def against_scratch(engine: Engine) -> AgainstScratch:
    """One session per model with the code sentence in the prose, evicted to a quarter of its length."""
    if engine.model.name not in _AGAINST:
        pristine(engine)
        text = prose(engine, INCREMENTAL_PROSE).split("\n\n")
        text.insert(len(text) // 2, CODE_SENTENCE)
        segs = [Segment.user("\n\n".join(text))]
        with engine.session(segs) as probe:
            n = len(probe.rendered.tokens)
        policy = AgainstScratch(n // 4)
        with engine.session(segs, eviction=Eviction(KeepSinks(policy, 4), budget=n // 4, chunk=CHUNK)) as s:
            s.prefill()
        _AGAINST[engine.model.name] = policy
    return _AGAINST[engine.model.name]


@pytest.mark.parametrize("drift", [0.0, pytest.param(0.05, marks=pytest.mark.full)])  # fast tier: one drift
@pytest.mark.parametrize("model", MODELS)
def test_incremental_surprise_equals_the_from_scratch_pass(engines: dict[str, Engine], model: str, drift: float) -> None:
    """drift=0 (every row's vocabulary head recomputed): the online-softmax state, updated with the new keys
    and the evicted ones subtracted, gives the from-scratch scores to float error. The default (first-order
    log Z for the rows not refreshed) is approximate: the cells it keeps, its largest error and its 99th
    percentile are held to the bounds measured on each model (DRIFT_BOUNDS)."""
    engine = engines[model, 2048]
    policy = against_scratch(engine)
    diffs, p99, keep = policy.diffs[drift], policy.p99[drift], policy.same_keep[drift]
    print(f"\n[{model} drift={drift}] {len(diffs)} cycles: max |incremental - scratch| {max(diffs):.2e} "
          f"(99th percentile {max(p99):.2e}), keep-set agreement min {min(keep):.4f}, "
          f"vocabulary rows recomputed {np.mean(policy.refreshed[drift]):.2f} of the scored")
    assert len(diffs) >= 8
    if drift == 0:
        assert max(diffs) <= EXACT_BOUND
        return
    if engine.fingerprint != MEASURED_ON[model]:
        pytest.skip(f"the default drift's bounds were measured on the shipped {model} GGUF, not on this file")
    largest, percentile, agreement = DRIFT_BOUNDS[model]
    assert max(diffs) <= largest and max(p99) <= percentile and min(keep) >= agreement


# --- segment eviction priority --------------------------------------------------------------
def test_a_segment_with_a_higher_priority_outlives_later_ones(engines: dict[str, Engine]) -> None:
    """The window keeps the newest cells; an earlier user turn given priority 1 is kept whole instead, and the
    later (priority 0) turn's cells are the ones evicted. Without the priority the early turn goes first."""
    engine = engines[S]
    pristine(engine)
    early, late = prose(engine, 200), prose(engine, 400, skip=30)
    for priority in (1, 0):
        segs = [Segment.user(early, priority=priority), Segment.user(late)]
        with engine.session(segs, eviction=Eviction("window", budget=BUDGET + 64, chunk=CHUNK)) as s:
            s.prefill()
            span = s.rendered.spans[0]
            kept = set(s.cached_positions)
            early_kept = sum(p in kept for p in range(span.first, span.last + 1)) / span.length
            assert s.evicted_positions
            assert engine.backend.seq_positions(s.seq) == s.cache.cells_at(s.cached_positions)
        print(f"\n[priority {priority}] early turn: {early_kept:.2f} of its {span.length} cells kept")
        assert early_kept == 1.0 if priority else early_kept < 0.2


@pytest.mark.parametrize("model", MODELS)
def test_incremental_surprise_follows_cells_that_were_rewritten_or_moved(engines: dict[str, Engine], model: str) -> None:
    """A session that rewrote its tail (same positions, other tokens and states), or evicted cells in the middle,
    then appended: the state subtracts what changed and adds it again, and still equals the from-scratch pass.
    On the first 256 cells of the captured view (all 504: 22 s on Gemma-3, its vocabulary head scored 8 times)."""
    view = cells_of(captured_view(engines[model]), np.arange(256))
    inc = IncrementalSurprise(drift=0.0)
    n = len(view)
    rng = np.random.default_rng(0)
    tail = np.arange(n - 40, n)
    rewritten_tokens = view.tokens.copy()
    rewritten_tokens[tail] = rng.permutation(view.tokens[tail])
    hidden = view.hidden.copy()  # type: ignore[union-attr]
    hidden[tail] = hidden[rng.permutation(tail)]
    query = view.query_hidden if view.query_hidden is not None else hidden
    query = query.copy()
    query[tail[1:]] = hidden[tail[:-1]]
    rewritten = replace(view, tokens=rewritten_tokens, hidden=hidden, query_hidden=query)
    holes = cells_of(view, np.sort(np.r_[np.arange(100), rng.choice(np.arange(100, n - 1), 75, replace=False), n - 1]))
    scratch = {}
    worst = 0.0
    for step in (view, rewritten, holes, view):
        if id(step) not in scratch:
            scratch[id(step)] = FastSurprise().score(step)
        got, want = inc.score(step), scratch[id(step)]
        finite = np.isfinite(want)
        assert np.array_equal(finite, np.isfinite(got))
        worst = max(worst, float(np.abs(got[finite] - want[finite]).max()))
    print(f"\n[{model}] rewritten tail, holes, back: max |incremental - scratch| {worst:.2e}")
    assert worst <= EXACT_BOUND
    assert inc.stats.keys_added > 0


# --- compaction next to a session that shares the cells (Eviction(compact=True)) ------------------------------------
@pytest.mark.arch
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("own_copy", [True, False])
def test_compacting_never_moves_the_cells_of_a_session_that_shares_them(engines: dict[str, Engine], model: str,
                                                                        own_copy: bool,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """B starts from A's prompt (its cells shared through the prefix index), evicts inside it and compacts: llama.cpp
    moves a shared cell for every sequence holding it, so B takes its own copy first and A's cells stay where they
    were. The control (``own_copy=False``: the copy skipped) shows what the copy prevents: A's cells move."""
    from kvagent.kv.sequence import CachedSequence

    if not own_copy:
        monkeypatch.setattr(CachedSequence, "_own_cells", lambda self: True)
    engine = engines[model]
    pristine(engine)
    segs = segments(engine, 400)
    with engine.session(segs) as a:
        a.prefill()
        before = engine.backend.seq_positions(a.seq)
        more = [*segs, Segment.user(prose(engine, 3 * CHUNK, skip=40))]
        with engine.session(more, eviction=Eviction("window", BUDGET, CHUNK, compact=True)) as b:
            report = b.prefill()
            assert b.cycles and report.shared > 0  # it started from A's cells, then evicted among them
            held_b = engine.backend.seq_positions(b.seq)
            assert held_b == list(range(len(b.cached_positions)))  # compacted
            after = engine.backend.seq_positions(a.seq)
            shared_after = engine.pool.shares_beyond(b.seq, 0)
        print(f"\n[{model}] own copy {own_copy}: A held {len(before)} cells at 0..{before[-1]}; after B compacted: "
              f"{len(after)} cells, first moved {next((p for p, q in zip(before, after) if p != q), None)}")
    if own_copy:
        assert after == before
        assert not shared_after
    else:
        assert after != before


# --- compacted positions read as the same tokens decoded there ------------------------------------------------------
# (tokens, the position the shifted copy is decoded from): compaction renumbers kept cells by llama.cpp's K-shift, and
# RoPE makes attention depend on relative positions only, so cells decoded at SHIFT.. and compacted to 0.. must read
# as the same tokens decoded at 0.. (Gemma-3: both rope bases, the local layers' and the global ones')
COMPACTED = [(300, 600), (120, 250)]


@pytest.mark.arch
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize(("n", "shift"), COMPACTED)
def test_compacted_positions_read_like_the_same_tokens_decoded_there(engines: dict[str, Engine], model: str, n: int,
                                                                     shift: int) -> None:
    from kvagent.skills.fidelity import logit_cosine

    engine = engines[model]
    backend, pool = engine.backend, engine.pool
    ids = [*backend.bos_ids, *backend.tokenize(prose(engine, n), special=False)][: n + 1]
    assert len(ids) == n + 1
    with pool.lock:
        a, b = pool.take("at 0"), pool.take("shifted")
        try:
            backend.decode(ids[:n], range(n), [a] * n, [False] * n)
            backend.decode(ids[:n], range(shift, shift + n), [b] * n, [False] * n)
            assert compact_positions(backend, b, range(shift, shift + n)) == n
            assert backend.seq_positions(b) == list(range(n))
            want, got = (backend.decode([ids[n]], [n], [s], [True])[0] for s in (a, b))
        finally:
            pool.release(a)
            pool.release(b)
    print(f"n={n} shift={shift}: logit cosine {logit_cosine(got, want):.6f}, max |diff| {abs(got - want).max():.4f}")
    assert int(got.argmax()) == int(want.argmax())
    assert logit_cosine(got, want) >= 0.999
