"""Runtime logic over the pure-Python FakeBackend: the fake itself, plan_runs, SequencePool, sessions,
the scheduler and kvagent.aio. No model is loaded; the fake's logits are deterministic noise that
depends on exactly what each sequence caches, so "same logits" means "same cached content".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

import kvagent.backends.fake  # noqa: F401  (registers backend "fake")
from kvagent.backends.base import Backend
from kvagent.backends.fake import BOS, EOS, FakeBackend
from kvagent.backends.registry import backend_names
from kvagent.engine import Engine, EngineSettings
from kvagent.errors import BackendError, ChatTemplateError, KVAgentError, KVCacheFullError
from kvagent.kv.plan import Run, plan_runs
from kvagent.kv.pool import SequencePool
from kvagent.scheduler import Cancelled, on_done
from kvagent.segments import Rendered, Segment, SegmentKind, Span
from kvagent.session import Session

pytestmark = pytest.mark.timeout(60)

NO_EOS = -1000.0  # eos_bias: generations run to max_tokens


# ---------------------------------------------------------------------------------------------------
# fixtures and helpers
# ---------------------------------------------------------------------------------------------------
@pytest.fixture
def model_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A file resolve_model accepts (a .gguf starting with the magic); fingerprints cached in tmp."""
    monkeypatch.setenv("KVAGENT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "fake-model.gguf"
    path.write_bytes(b"GGUF" + bytes(range(60)))
    return path


@pytest.fixture
def make_engine(model_file: Path) -> Iterator[Any]:
    engines: list[Engine] = []

    def make(*, n_ctx: int = 1024, n_seq_max: int = 6, prefill_chunk: int = 16, backend_cls: type = FakeBackend,
             **fake: Any) -> Engine:
        fake.setdefault("eos_bias", NO_EOS)
        backend = backend_cls(n_ctx=n_ctx, n_seq_max=n_seq_max, **fake)
        settings = EngineSettings(model=str(model_file), n_ctx=max(n_ctx, 32), n_seq_max=n_seq_max,
                                  prefill_chunk=prefill_chunk)
        fake_engine = Engine(settings, backend=backend)
        engines.append(fake_engine)
        return fake_engine

    yield make
    for fake_engine in engines:
        fake_engine.close()


@pytest.fixture
def fake_engine(make_engine: Any) -> Engine:
    return make_engine()


POLICY = "You are a terse assistant that answers in words"


def open_session(fake_engine: Engine, *segments: Segment, **options: Any) -> Session:
    return fake_engine.session(list(segments) or [Segment.policy(POLICY)], chat=False, **options)


def cold_digest(fake_engine: Engine, tokens: tuple[int, ...]) -> bytes:
    """What a cold prefill of ``tokens`` caches (the fake's content digest), in a scratch sequence."""
    backend: FakeBackend = fake_engine.backend  # type: ignore[assignment]
    with fake_engine.scratch() as seq:
        n = len(tokens)
        backend.decode(tokens, range(n), [seq] * n, [False] * n)
        return backend.sequence_digest(seq)


def assert_at_rest(fake_engine: Engine, session: Session) -> None:
    """The session's prompt, its token record and the backend's cells agree, and the cells hold what a
    cold prefill of the prompt would compute."""
    backend: FakeBackend = fake_engine.backend  # type: ignore[assignment]
    assert session.tokens == session.rendered.tokens
    with fake_engine.lock:
        assert backend.seq_positions(session.seq) == list(range(len(session.tokens)))
        assert backend.sequence_digest(session.seq) == cold_digest(fake_engine, session.tokens)


def gate(fake_engine: Engine) -> threading.Event:
    """Hold the scheduler's worker until the returned event is set (so work submitted meanwhile starts
    in the same round)."""
    release, held = threading.Event(), threading.Event()

    def work() -> Iterator[None]:
        held.set()
        release.wait(10)
        return None
        yield  # pragma: no cover

    fake_engine.scheduler.submit("test-gate", work())
    assert held.wait(5)
    return release


# ---------------------------------------------------------------------------------------------------
# the fake backend
# ---------------------------------------------------------------------------------------------------
def prefill(b: FakeBackend, seq: int, tokens: list[int], start: int = 0) -> np.ndarray:
    n = len(tokens)
    return b.decode(tokens, range(start, start + n), [seq] * n, [False] * (n - 1) + [True])


def test_fake_implements_the_protocol_and_is_registered(model_file: Path) -> None:
    b = FakeBackend()
    assert isinstance(b, Backend)
    assert b.capabilities.shift and b.capabilities.state_save and not b.capabilities.hidden_capture
    assert (b.architecture, b.chat_template, b.n_swa, b.n_layer, b.format) == ("fake", None, 0, 2, "fake-1")
    assert b.meta("general.architecture") is None and b.layer_output_name(-1) == "l_out-1"
    assert b.bos_ids == [BOS] and FakeBackend(add_bos=False).bos_ids == [] and b.is_eog(EOS)
    assert "fake" in backend_names()
    fake_engine = Engine.load(str(model_file), backend="fake", n_ctx=256, n_seq_max=3)
    try:
        assert isinstance(fake_engine.backend, FakeBackend)
        assert (fake_engine.backend.n_ctx, fake_engine.backend.n_seq_max) == (256, 3)
        with pytest.raises(ChatTemplateError, match="chat=False"):
            fake_engine.session([Segment.policy("hi")])  # chat=True needs a template the fake has not
    finally:
        fake_engine.close()
    with pytest.raises(BackendError, match="closed"):
        fake_engine.backend.seq_positions(0)


@pytest.mark.parametrize(("text", "special", "pieces"), [
    ("hello world", False, [b" hello", b" world"]),
    ("hello\nworld", False, [b" hello", b"\n", b" world"]),
    ("<|im_start|>user hi", True, [b"", b" user", b" hi"]),
    ("<|im_start|>user", False, [b" <|im_start|>user"]),
    ("", True, []),
])
def test_fake_tokenizer(text: str, special: bool, pieces: list[bytes]) -> None:
    b = FakeBackend()
    ids = b.tokenize(text, special=special)
    assert [b.token_bytes(t) for t in ids] == pieces
    assert b.tokenize(text, special=special) == ids  # stable


def test_fake_tokenizer_caps_the_vocabulary() -> None:
    b = FakeBackend(n_vocab=8)
    ids = b.tokenize(" ".join(f"w{i}" for i in range(10)), special=False)
    assert max(ids) < 8 and ids[-1] == 2  # <unk> once full
    assert b.token_bytes(7) == b" w3"


# (operations before the decode, the decode's (position, seq), expected error)
DECODE_REFUSALS = [
    pytest.param([], (1, 0), "position 0", id="empty-seq-starts-at-0"),
    pytest.param([("prefill", 0, 3)], (5, 0), "position 3", id="gap"),
    pytest.param([("prefill", 0, 3)], (2, 0), "position 3", id="overwrite"),
    pytest.param([("prefill", 0, 3), ("rm", 0, 1)], (1, 0), "position 3", id="hole-does-not-reopen"),
    pytest.param([], (0, 9), "outside", id="seq-id-out-of-range"),
]


@pytest.mark.parametrize(("ops", "where", "message"), DECODE_REFUSALS)
def test_fake_decode_refuses_positions_like_llama_cpp(ops: list[tuple[str, int, int]], where: tuple[int, int],
                                                      message: str) -> None:
    b = FakeBackend(n_seq_max=4)
    for op, seq, n in ops:
        if op == "prefill":
            prefill(b, seq, list(range(4, 4 + n)))
        else:
            b.seq_rm(seq, n, n + 1)
    before = {s: b.seq_positions(s) for s in range(4)}
    with pytest.raises(BackendError, match=message):
        b.decode([5], [where[0]], [where[1]], [True])
    assert {s: b.seq_positions(s) for s in range(4)} == before  # refused before anything landed


def test_fake_decode_in_one_batch_and_cache_full() -> None:
    b = FakeBackend(n_ctx=10, n_batch=4)
    out = b.decode([5, 6, 7, 8], [0, 1, 0, 2], [0, 0, 1, 0], [True, False, True, True])
    assert out.shape == (3, b.n_vocab) and out.dtype == np.float32
    assert b.seq_positions(0) == [0, 1, 2] and b.seq_positions(1) == [0]
    with pytest.raises(KVCacheFullError):
        b.decode(list(range(5, 15)), range(3, 13), [0] * 10, [False] * 10)
    assert b.seq_positions(0) == [0, 1, 2, 3, 4, 5, 6]  # the first chunk of n_batch landed, as llama.cpp
    assert b.used_cells == 8


def test_fake_logits_follow_the_cached_content() -> None:
    b = FakeBackend(n_seq_max=6)
    toks = [5, 6, 7, 8]
    a = prefill(b, 0, toks)
    assert np.array_equal(a, prefill(b, 1, toks))  # same tokens at same positions
    b.seq_cp(0, 2, 0, 3)  # shared cells give the same content
    assert np.array_equal(a, b.decode([8], [3], [2], [True]))
    assert not np.array_equal(a, prefill(b, 3, [5, 6, 9, 8]))  # another token upstream
    prefill(b, 4, [5, 6, 7])
    b.seq_rm(4, 0, 1)
    b.seq_add(4, 1, -1, -1)  # [6, 7] at 0, 1: shifted cells keep the content computed after 5
    assert b.seq_positions(4) == [0, 1]
    prefill(b, 5, [6, 7])
    assert b.sequence_digest(4) != b.sequence_digest(5)  # the cells moved: stale content
    other_seed = FakeBackend(seed=1).decode([5], [0], [0], [True])
    assert not np.array_equal(other_seed, FakeBackend().decode([5], [0], [0], [True]))


def test_fake_shared_cells_move_for_every_holder() -> None:
    b = FakeBackend(n_seq_max=4)
    prefill(b, 0, [5, 6, 7, 8])
    b.seq_cp(0, 1, 2, -1)
    assert b.used_cells == 4 and b.holders(1, 3) == {0, 1}
    b.seq_add(1, 2, -1, 3)  # moves the shared cells of sequence 0 too
    assert b.seq_positions(0) == [0, 1, 5, 6] and b.seq_positions(1) == [5, 6]
    with pytest.raises(BackendError, match="onto its cells"):
        b.seq_add(0, 5, -1, -4)  # would land on sequence 0's cell at position 1
    prefill(b, 2, [5, 6])
    with pytest.raises(BackendError, match="another cell"):
        b.seq_cp(2, 0, 0, -1)  # sequence 0 already holds cells at 0 and 1
    b.seq_rm(2, -1, -1)
    b.seq_rm(0, -1, -1)
    assert b.used_cells == 2  # still held by 1
    b.seq_add(1, 0, -1, -6)  # 5 -> -1 is freed, 6 -> 0 stays
    assert b.seq_positions(1) == [0] and b.used_cells == 1
    b.seq_rm(1, -1, -1)
    assert b.used_cells == 0


def test_fake_save_restore() -> None:
    b = FakeBackend(n_ctx=8, n_seq_max=3)
    logits = prefill(b, 0, [5, 6, 7])
    data = b.seq_save(0)
    prefill(b, 1, [9])
    b.seq_restore(1, data)
    assert b.seq_positions(1) == [0, 1, 2] and b.holders(1, 0) == {1}  # own cells, not shared
    assert b.sequence_digest(1) == b.sequence_digest(0)
    assert np.array_equal(b.decode([8], [3], [1], [True]), b.decode([8], [3], [0], [True]))
    with pytest.raises(BackendError, match="refused"):
        b.seq_restore(1, FakeBackend(model="other", n_ctx=8).seq_save(0))
    assert b.seq_positions(1) == []  # emptied first, as llama.cpp
    prefill(b, 2, [5])
    b.seq_restore(1, data)  # 3 cells into the 3 free
    with pytest.raises(BackendError, match="free KV cells"):
        b.seq_restore(2, data)  # 1 free once sequence 2 is emptied
    assert b.used_cells == 7
    with pytest.raises(BackendError, match="not a saved sequence"):
        b.seq_restore(2, b"garbage")
    assert logits.shape == (1, b.n_vocab)


# ---------------------------------------------------------------------------------------------------
# plan_runs
# ---------------------------------------------------------------------------------------------------
def rendered(*spans: tuple[SegmentKind, int]) -> Rendered:
    out, first = [], 0
    for i, (kind, length) in enumerate(spans):
        out.append(Span(f"s{i}", kind, first, first + length - 1, False))
        first += length
    return Rendered(tuple(range(100, 100 + first)), tuple(out))


P, K, T = SegmentKind.POLICY, SegmentKind.SKILL, SegmentKind.TURN
FOUND = "compiled"

# (spans, start, lookup finds skills?, expected runs as (first, end, skill))
PLAN_CASES = [
    pytest.param([(P, 4), (T, 4)], 0, True, [(0, 8, None)], id="no-skills"),
    pytest.param([(P, 4), (K, 4), (T, 4)], 0, True, [(0, 4, None), (4, 8, FOUND), (8, 12, None)], id="skill-middle"),
    pytest.param([(P, 4), (K, 6)], 0, True, [(0, 4, None), (4, 10, FOUND)], id="skill-at-end"),
    pytest.param([(K, 3), (T, 2)], 0, True, [(0, 3, FOUND), (3, 5, None)], id="skill-first"),
    pytest.param([(P, 2), (K, 2), (K, 2), (T, 1)], 0, True,
                 [(0, 2, None), (2, 4, FOUND), (4, 6, FOUND), (6, 7, None)], id="two-skills-adjacent"),
    pytest.param([(P, 4), (K, 4), (T, 4)], 4, True, [(4, 8, FOUND), (8, 12, None)], id="start-at-skill"),
    pytest.param([(P, 4), (K, 4), (T, 4)], 5, True, [(5, 12, None)], id="start-inside-skill-decodes"),
    pytest.param([(P, 4), (K, 4), (T, 4)], 9, True, [(9, 12, None)], id="start-after-skill"),
    pytest.param([(P, 4), (K, 4), (T, 4)], 12, True, [], id="nothing-to-compute"),
    pytest.param([(P, 4), (K, 4), (T, 4)], 0, False, [(0, 12, None)], id="lookup-finds-nothing"),
    pytest.param([(P, 4), (K, 4), (T, 4)], 0, None, [(0, 12, None)], id="lookup-none"),
]


@pytest.mark.parametrize(("spans", "start", "found", "expected"), PLAN_CASES)
def test_plan_runs(spans: list[tuple[SegmentKind, int]], start: int, found: bool | None,
                   expected: list[tuple[int, int, str | None]]) -> None:
    r = rendered(*spans)
    asked: list[tuple[int, ...]] = []

    def lookup(tokens: tuple[int, ...]) -> str | None:
        asked.append(tokens)
        return FOUND if found else None

    runs = plan_runs(r, start, None if found is None else lookup)
    assert [(run.first, run.end, run.skill) for run in runs] == expected
    assert all(isinstance(run, Run) for run in runs)
    # the runs tile [start, len) in order
    assert [x for run in runs for x in range(run.first, run.end)] == list(range(start, len(r.tokens)))
    # lookup saw exactly the whole skill spans that start at or after `start`
    skill_spans = [s for s in r.spans if s.kind is K and s.first >= start]
    assert asked == ([r.tokens[s.first : s.last + 1] for s in skill_spans] if found is not None else [])


# ---------------------------------------------------------------------------------------------------
# SequencePool
# ---------------------------------------------------------------------------------------------------
def test_pool_take_release_free_count() -> None:
    b = FakeBackend(n_seq_max=3)
    pool = SequencePool(b)
    taken = [pool.take("t") for _ in range(3)]
    assert sorted(taken) == [0, 1, 2] and pool.free == 0 and pool.held == 3
    with pytest.raises(KVAgentError) as err:
        pool.take("a session")
    assert "no free sequence for a session" in str(err.value)
    assert "close a session" in str(err.value) and "n_seq_max" in str(err.value)
    prefill(b, taken[0], [5, 6])
    pool.index.insert(taken[0], (5, 6))
    pool.release(taken[0])
    assert pool.free == 1 and b.seq_positions(taken[0]) == [] and pool.index.match((5, 6)) == (-1, 0)
    pool.release(taken[0])  # idempotent
    assert pool.free == 1
    again = pool.take("t")
    assert again == taken[0] and pool.free == 0


def test_pool_take_empties_a_dirty_sequence() -> None:
    b = FakeBackend(n_seq_max=2)
    prefill(b, 0, [5, 6])  # someone wrote into a free sequence directly
    pool = SequencePool(b)
    assert pool.take("t") == 0 and b.seq_positions(0) == []


def test_pool_scratch_frees_on_exception() -> None:
    b = FakeBackend(n_seq_max=2)
    pool = SequencePool(b)
    with pytest.raises(RuntimeError):
        with pool.scratch() as seq:
            prefill(b, seq, [5, 6, 7])
            assert pool.free == 1
            raise RuntimeError("boom")
    assert pool.free == 2 and b.used_cells == 0


# share(src, dst, p0, p1) ops, then queries (seq, position) -> expected shares_beyond
SHARE_CASES = [
    pytest.param([("share", 0, 1, 0, 6)], [((0, 5), True), ((1, 5), True), ((0, 6), False), ((2, 0), False)],
                 id="one-share"),
    pytest.param([("share", 0, 1, 0, 6), ("cut", 1, 3)], [((0, 2), True), ((0, 3), False), ((1, 3), False)],
                 id="cut-lowers"),
    pytest.param([("share", 0, 1, 0, 6), ("cut", 0, 0)], [((1, 0), False), ((0, 0), False)], id="cut-to-zero-forgets"),
    pytest.param([("share", 2, 1, 0, 8), ("share", 1, 0, 0, 5)],  # a=0 copies from b=1, which copied from c=2
                 [((2, 4), True), ((0, 4), True), ((0, 5), False), ((2, 7), True), ((1, 7), True)], id="transitive"),
    pytest.param([("share", 2, 1, 0, 8), ("share", 1, 0, 0, 5), ("cut", 1, 0)],
                 [((2, 4), True), ((0, 4), True), ((2, 5), False)], id="transitive-survives-middle-cut"),
    pytest.param([("share", 0, 1, 0, 4), ("share", 0, 1, 0, 2)], [((1, 3), True)], id="reshare-keeps-max"),
]


@pytest.mark.parametrize(("ops", "queries"), SHARE_CASES)
def test_pool_share_bookkeeping(ops: list[tuple[Any, ...]], queries: list[tuple[tuple[int, int], bool]]) -> None:
    b = FakeBackend(n_seq_max=4)
    pool = SequencePool(b)
    for _ in range(4):
        pool.take("t")
    prefill(b, ops[0][1], list(range(10, 18)))  # the first source holds 8 cells
    for op in ops:
        if op[0] == "share":
            _, src, dst, p0, p1 = op
            b.seq_rm(dst, p0, -1)
            pool.share(src, dst, p0, p1)
            assert b.holders(dst, p1 - 1) >= {src, dst}  # the backend shares the cells too
        else:
            _, seq, pos = op
            b.seq_rm(seq, pos, -1)
            pool.cut(seq, pos)
    for (seq, position), expected in queries:
        assert pool.shares_beyond(seq, position) is expected, (seq, position)
    # conservative: wherever the backend really shares a cell at or after a position, the pool says so
    for seq in range(4):
        for pos in b.seq_positions(seq):
            if len(b.holders(seq, pos)) > 1:
                assert pool.shares_beyond(seq, pos)


# ---------------------------------------------------------------------------------------------------
# sessions over the fake backend
# ---------------------------------------------------------------------------------------------------
def test_prefill_reuses_the_cached_prefix(fake_engine: Engine) -> None:
    s = open_session(fake_engine)
    first = s.prefill()
    n = len(s.tokens)
    assert (first.reused, first.computed) == (0, n) and n > 3
    again = s.prefill()
    assert (again.reused, again.computed) == (n, 0)
    ext = s.extend(Segment.user("what is the capital of France"))
    assert ext.reused == n and ext.computed == len(s.tokens) - n
    assert_at_rest(fake_engine, s)
    policy, user = s.segments
    rep = s.replace([policy, Segment.user("what is the capital of Spain")])
    assert rep.reused == s.rendered.spans[1].first + 5  # "what is the capital of" is kept
    assert_at_rest(fake_engine, s)


def test_second_session_shares_the_first_sessions_prefix(fake_engine: Engine) -> None:
    a = open_session(fake_engine, Segment.policy(POLICY), Segment.user("first question here"))
    a.prefill()
    b = open_session(fake_engine, Segment.policy(POLICY), Segment.user("another question"))
    report = b.prefill()
    shared_len = b.rendered.spans[0].last + 1
    assert report.shared == shared_len and report.reused == shared_len
    assert report.computed == len(b.tokens) - shared_len
    backend: FakeBackend = fake_engine.backend  # type: ignore[assignment]
    assert backend.holders(b.seq, 0) == {a.seq, b.seq}  # the cells themselves, not copies
    cold = open_session(fake_engine, Segment.policy(POLICY), Segment.user("another question"), share_prefix=False)
    assert cold.prefill().shared == 0
    assert np.array_equal(b.logits(), cold.logits())  # shared cells hold what a cold prefill computes
    for s in (a, b, cold):
        assert_at_rest(fake_engine, s)
    a.close()  # b keeps the shared cells
    assert backend.seq_positions(b.seq) == list(range(len(b.tokens)))
    assert_at_rest(fake_engine, b)


def test_generate_commits_the_turn_and_the_next_call_reuses_it(fake_engine: Engine) -> None:
    s = open_session(fake_engine)
    gen = s.generate(6, user="say something")
    assert gen.finish_reason == "length" and gen.generated == 6 and gen.text
    assert s.segments[-1].role == "assistant" and s.segments[-1].text == gen.text
    assert s.segments[-1].token_ids == gen.token_ids
    assert_at_rest(fake_engine, s)
    n = len(s.tokens)
    nxt = s.chat("and again", max_tokens=4)
    assert nxt.reused == n
    assert_at_rest(fake_engine, s)


def test_generation_is_deterministic_and_ends_at_eos(make_engine: Any) -> None:
    texts = []
    for _ in range(2):
        fake_engine = make_engine()
        texts.append(open_session(fake_engine).generate(8, user="hello").text)
    assert texts[0] == texts[1]
    fake_engine = make_engine(eos_bias=1000.0)
    s = open_session(fake_engine)
    gen = s.generate(8, user="hello")
    assert (gen.finish_reason, gen.text, gen.token_ids) == ("eos", "", ())
    assert_at_rest(fake_engine, s)


def test_stop_string_ends_the_turn(fake_engine: Engine) -> None:
    s = open_session(fake_engine)
    full = s.generate(6, user="hello").text
    s.close()
    words = full.split()
    s = open_session(fake_engine)
    gen = s.generate(6, user="hello", stop=[words[2]])
    assert gen.finish_reason == "stop" and gen.text == full[: full.index(words[2])]
    assert_at_rest(fake_engine, s)


def test_answer_prefix_is_cached_but_not_in_the_text(fake_engine: Engine) -> None:
    s = open_session(fake_engine)
    gen = s.generate(4, user="question", prefix="Answer:")
    assert gen.prefix == "Answer:" and not gen.text.startswith("Answer")
    assert s.segments[-1].text == "Answer:" + gen.text
    assert s.segments[-1].text.startswith("Answer:")
    assert_at_rest(fake_engine, s)


def test_stream_yields_the_text_and_commits(fake_engine: Engine) -> None:
    s = open_session(fake_engine)
    stream = s.stream(8, user="hello")
    pieces = list(stream)
    assert stream.result is not None and "".join(pieces) == stream.result.text
    assert s.segments[-1].text == stream.result.text
    assert_at_rest(fake_engine, s)


def test_closing_a_stream_early_rolls_back(fake_engine: Engine) -> None:
    s = open_session(fake_engine)
    s.prefill()
    before, segments = s.tokens, s.segments
    stream = s.stream(40, user="hello")
    next(stream)
    next(stream)
    stream.close()
    assert s.tokens == before and s.segments == segments
    assert_at_rest(fake_engine, s)
    assert s.generate(3).generated == 3  # the session still works


def test_fifty_cancelled_streams_leak_no_sequence(fake_engine: Engine) -> None:
    backend: FakeBackend = fake_engine.backend  # type: ignore[assignment]
    start = fake_engine.pool.free
    keeper = open_session(fake_engine)
    keeper.prefill()
    for i in range(50):
        s = open_session(fake_engine)
        stream = s.stream(30, user=f"question {i}")
        next(stream)
        stream.close()
        assert s.tokens == s.rendered.tokens
        if i % 2:
            s.close()
        else:
            stream2 = keeper.stream(30, user=f"q {i}")
            next(stream2)
            stream2.close()
            s.close()
    assert fake_engine.pool.free == start - 1 and fake_engine.open_sessions == 1
    fake_engine.pool.clear_retained()  # closed sessions' cells were kept for reuse: every one can be given back
    assert backend.used_cells == len(keeper.tokens)
    assert_at_rest(fake_engine, keeper)
    keeper.close()
    assert fake_engine.pool.free == start and fake_engine.pool.clear_retained() == 1 and backend.used_cells == 0


def test_calling_the_session_while_reading_its_stream_is_refused(fake_engine: Engine) -> None:
    s = open_session(fake_engine)
    s.prefill()
    before = s.segments
    stream = s.stream(20, user="hello")
    next(stream)
    with pytest.raises(KVAgentError, match=r"read it to the end or close\(\)"):
        s.extend(Segment.user("meanwhile"))
    with pytest.raises(KVAgentError, match="stream"):
        s.generate(3)
    rest = list(stream)
    assert stream.result is not None and rest
    assert s.segments[: len(before)] == before and s.segments[-1].text == stream.result.text
    assert_at_rest(fake_engine, s)


def other_thread_call_during_a_stream(fake_engine: Engine, verb: str) -> tuple[Session, Any, dict[str, Any]]:
    """A stream read by this thread while another thread calls ``verb`` on the session; the worker is held
    until both are queued, so the other call is queued behind the whole turn."""
    s = open_session(fake_engine, Segment.policy(POLICY), Segment.field("city", "Paris"))
    s.prefill()
    release = gate(fake_engine)
    stream = s.stream(24, user="tell me")
    seen: dict[str, Any] = {}

    def other() -> None:
        seen["report"] = s.extend(Segment.user("next question")) if verb == "extend" else s.set("city", "Rome", strategy="erratum")
        seen["segments"] = s.segments

    thread = threading.Thread(target=other)
    thread.start()
    deadline = time.monotonic() + 5
    while len(fake_engine.scheduler._queues.get(s, ())) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    release.set()
    pieces = []
    for piece in stream:
        time.sleep(0.001)  # a slow reader: the other call must still wait for the committed turn
        pieces.append(piece)
    thread.join(10)
    assert not thread.is_alive() and stream.result is not None
    assert "".join(pieces) == stream.result.text
    return s, stream.result, seen


def test_other_threads_set_waits_for_the_whole_turn(fake_engine: Engine) -> None:
    s, result, seen = other_thread_call_during_a_stream(fake_engine, "set")
    turn, erratum = seen["segments"][-2:]
    assert turn.role == "assistant" and turn.text == result.text
    assert erratum.kind is SegmentKind.ERRATUM and erratum.value == "Rome"
    assert seen["report"].reused == s.rendered.spans[-1].first  # the whole turn was cached when it ran
    assert_at_rest(fake_engine, s)


def test_extend_from_another_thread_keeps_the_turn_in_flight(fake_engine: Engine) -> None:
    s, result, seen = other_thread_call_during_a_stream(fake_engine, "extend")
    assert [seg.role for seg in seen["segments"][-3:]] == ["user", "assistant", "user"]  # the turn is kept
    assert seen["segments"][-2].text == result.text
    assert_at_rest(fake_engine, s)


def test_aextend_keeps_a_turn_in_flight(fake_engine: Engine) -> None:
    async def main() -> None:
        session = await AsyncEngine(fake_engine).session([Segment.policy(POLICY)], chat=False)
        release = gate(fake_engine)
        chat = asyncio.create_task(session.achat("question", max_tokens=5))
        await asyncio.sleep(0)  # the chat is queued first
        extend = asyncio.create_task(session.aextend(Segment.user("follow-up")))
        await asyncio.sleep(0)
        release.set()
        gen, _ = await asyncio.gather(chat, extend)
        assert [seg.text for seg in session.segments] == [POLICY, "question", gen.text, "follow-up"]
        assert session.tokens == session.rendered.tokens

    asyncio.run(main())


def test_scheduler_batches_decode_steps_of_generating_sessions(fake_engine: Engine) -> None:
    sched, backend = fake_engine.scheduler, fake_engine.backend
    sessions = [open_session(fake_engine, Segment.policy(POLICY), Segment.user(f"question {i}")) for i in range(4)]
    for s in sessions:
        s.prefill()
    rounds, batched, calls = sched.rounds, sched.batched_tokens, backend.decode_calls  # type: ignore[attr-defined]
    release = gate(fake_engine)
    streams = [s.stream(20) for s in sessions]
    release.set()
    texts = ["".join(stream) for stream in streams]
    d_rounds, d_batched = sched.rounds - rounds, sched.batched_tokens - batched
    assert d_batched == 4 * 19  # every decode step went through the shared batch
    assert d_rounds < d_batched
    assert backend.decode_calls - calls < d_batched  # type: ignore[attr-defined]
    for s, text in zip(sessions, texts):
        assert s.segments[-1].text == text
        assert_at_rest(fake_engine, s)
    # batched or alone, the same tokens: compare with one session generating alone
    solo = open_session(fake_engine, Segment.policy(POLICY), Segment.user("question 2"))
    assert solo.generate(20).text == texts[2]


def test_session_close_frees_its_sequence(fake_engine: Engine) -> None:
    start = fake_engine.pool.free
    s = open_session(fake_engine)
    s.generate(3, user="x")
    assert fake_engine.pool.free == start - 1
    s.close()
    s.close()
    assert fake_engine.pool.free == start and [r.seq for r in fake_engine.pool.retained] == [s.seq]
    assert fake_engine.pool.clear_retained() == 1 and fake_engine.backend.used_cells == 0  # type: ignore[attr-defined]
    with pytest.raises(KVAgentError, match="closed"):
        s.prefill()


# ---------------------------------------------------------------------------------------------------
# kvagent.aio
# ---------------------------------------------------------------------------------------------------
from kvagent.aio import AsyncEngine  # noqa: E402

QUESTIONS = [f"question number {i}" for i in range(8)]


def test_aio_concurrent_chats_match_sequential(make_engine: Any) -> None:
    async def sequential() -> list[str]:
        aengine = AsyncEngine(make_engine(n_seq_max=8))
        out = []
        for q in QUESTIONS:
            session = await aengine.session([Segment.policy(POLICY)], chat=False)
            out.append((await session.achat(q, max_tokens=10)).text)
            await session.aclose()
        return out

    async def concurrent() -> tuple[list[str], int, int]:
        aengine = AsyncEngine(make_engine(n_seq_max=8))
        sessions = [await aengine.session([Segment.policy(POLICY)], chat=False) for _ in QUESTIONS]
        sched = aengine.engine.scheduler
        rounds, batched = sched.rounds, sched.batched_tokens
        gens = await asyncio.gather(*(s.achat(q, max_tokens=10) for s, q in zip(sessions, QUESTIONS)))
        for s in sessions:
            assert s.tokens == s.rendered.tokens
            await s.aclose()
        return [g.text for g in gens], sched.rounds - rounds, sched.batched_tokens - batched

    expected = asyncio.run(sequential())
    got, d_rounds, d_batched = asyncio.run(concurrent())
    assert got == expected and len(set(got)) > 1
    assert d_batched == 8 * 9 and d_rounds < d_batched


def test_aio_astream_break_rolls_back(fake_engine: Engine) -> None:
    async def main() -> None:
        aengine = AsyncEngine(fake_engine)
        start = fake_engine.pool.free
        session = await aengine.session([Segment.policy(POLICY)], chat=False)
        await session.aprefill()
        before = session.tokens
        pieces = []
        async with session.astream(100, user="hello") as stream:
            async for piece in stream:
                pieces.append(piece)
                if len(pieces) == 3:
                    break
        assert session.tokens == before and len(pieces) == 3
        assert_at_rest(fake_engine, session.session)
        async with session.astream(5, user="hello") as stream:
            text = "".join([p async for p in stream])
        assert stream.result is not None and text == stream.result.text
        assert session.segments[-1].text == text
        await session.aclose()
        assert fake_engine.pool.free == start

    asyncio.run(main())


def test_aio_arespond_reuses_the_cached_history(fake_engine: Engine) -> None:
    async def main() -> None:
        aengine = AsyncEngine(fake_engine)
        session = await aengine.session([Segment.policy(POLICY)], chat=False)
        first = await session.achat("what is up", max_tokens=6)
        cached = len(session.tokens)
        # the client resends the history as new segments (plain text, new ids) plus a new question
        history = [Segment.policy(POLICY), Segment.user("what is up"), Segment.assistant(first.text),
                   Segment.user("and then")]
        second = await session.arespond(history, max_tokens=4)
        assert second.reused == cached > 0
        assert session.tokens == session.rendered.tokens
        assert [seg.text for seg in session.segments[:-1]] == [seg.text for seg in history]
        await session.aclose()

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------------
# races and rollbacks at the edges of a turn (each named after what must hold)
# ---------------------------------------------------------------------------------------------------
class HookedBackend(FakeBackend):
    """A fake whose next single-token decode (a generation step) runs ``hook`` once it has landed."""

    hook: Any = None

    def decode(self, tokens: Any, positions: Any, seq_ids: Any, outputs: Any) -> np.ndarray:
        out = super().decode(tokens, positions, seq_ids, outputs)
        if self.hook is not None and len(tokens) == 1:
            hook, self.hook = self.hook, None
            hook()
        return out


def test_stream_closed_at_its_first_step_rolls_back(make_engine: Any) -> None:
    """Cancelled right after the first step was decoded (before the decoder took it): the user turn and
    that cell go, as when the call added no prompt tokens (the test below)."""
    fake_engine = make_engine(backend_cls=HookedBackend)
    backend: HookedBackend = fake_engine.backend  # type: ignore[assignment]
    s = open_session(fake_engine)
    s.prefill()
    before = s.tokens
    box: dict[str, Any] = {}
    backend.hook = lambda: box["stream"].close(wait=False)
    box["stream"] = s.stream(10, user="hi")
    job = s._stream[0]  # type: ignore[index]
    concurrent.futures.wait([job.future], 5)
    assert isinstance(job.future.exception(), Cancelled)
    assert s.tokens == before
    assert_at_rest(fake_engine, s)


def test_cancel_after_a_decoded_step_leaves_no_orphan_cell(make_engine: Any) -> None:
    fake_engine = make_engine(backend_cls=HookedBackend)
    backend: HookedBackend = fake_engine.backend  # type: ignore[assignment]
    s = open_session(fake_engine)  # plain format: a reply without user or prefix adds no prompt token
    s.prefill()
    box: dict[str, Any] = {}
    backend.hook = lambda: box["stream"].close(wait=False)  # the reader closes while the step is in the cache
    box["stream"] = stream = s.stream(10)
    job = s._stream[0]  # type: ignore[index]
    concurrent.futures.wait([job.future], 5)
    assert isinstance(job.future.exception(), Cancelled)
    assert s.tokens == s.rendered.tokens
    assert backend.seq_positions(s.seq) == list(range(len(s.tokens)))  # no cell at len(tokens)
    assert stream.result is None
    assert s.generate(2).generated == 2  # the next step lands at pos_max + 1


def test_answer_prefix_on_an_empty_session_has_one_bos(fake_engine: Engine) -> None:
    s = fake_engine.session([], chat=False)
    gen = s.generate(3, prefix="Once upon")
    assert s.segments[-1].text == "Once upon" + gen.text
    assert s.rendered.tokens.count(BOS) == 1  # not (BOS, BOS, Once, upon, ...)
    assert BOS not in (s.segments[-1].token_ids or ())


def test_a_failed_restore_leaves_no_token_claiming_a_missing_cell(make_engine: Any) -> None:
    fake_engine = make_engine(n_ctx=64)
    backend: FakeBackend = fake_engine.backend  # type: ignore[assignment]
    a = open_session(fake_engine, Segment.policy(" ".join(f"w{i}" for i in range(19))))
    a.prefill()
    blob, segments = a.save(), a.segments
    a.replace([Segment.policy("x y z")])
    b = open_session(fake_engine, Segment.policy(" ".join(f"v{i}" for i in range(55))))
    b.prefill()  # the pool now has no room for the blob's 21 cells
    with pytest.raises(KVAgentError):
        a.restore(blob, segments)
    held = backend.seq_positions(a.seq)
    assert list(range(len(a.tokens))) == held  # not: tokens (1, x, y, z, \n) with nothing in the backend
    assert len(fake_engine.pool.index.indexed(a.seq)) <= len(held)
    b.close()  # room for the cold prefill assert_at_rest compares with
    a.prefill()
    assert_at_rest(fake_engine, a)


def test_dropping_a_stream_cancels_it(fake_engine: Engine) -> None:
    s = open_session(fake_engine)
    s.prefill()
    stream = s.stream(40, user="hello")
    next(stream)
    job = fake_engine.scheduler.active(s)
    assert job is not None
    del stream
    gc.collect()
    done, _ = concurrent.futures.wait([job.future], 0.5)
    assert done  # not still waiting for the dropped reader


def test_a_cancelled_task_returns_after_the_rollback(fake_engine: Engine) -> None:
    async def main() -> None:
        aengine = AsyncEngine(fake_engine)
        start = fake_engine.pool.free
        session = await aengine.session([Segment.policy(POLICY)], chat=False)
        await session.aprefill()
        before, segments = session.tokens, session.segments
        loop = asyncio.get_running_loop()
        got_pieces, resume = asyncio.Event(), threading.Event()

        def on_piece(piece: str) -> None:  # on the worker: hold it a moment after the third piece
            on_piece.count += 1  # type: ignore[attr-defined]
            if on_piece.count == 3:  # type: ignore[attr-defined]
                loop.call_soon_threadsafe(got_pieces.set)
                resume.wait(5)

        on_piece.count = 0  # type: ignore[attr-defined]
        task = asyncio.create_task(session.achat("hello", max_tokens=500, on_piece=on_piece))
        await asyncio.wait_for(got_pieces.wait(), 5)
        threading.Timer(0.3, resume.set).start()  # the worker sees the cancellation 0.3 s from now
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task  # must return once the turn is rolled back (the docstring's promise)
        assert session.tokens == before and session.segments == segments  # the turn is gone
        assert_at_rest(fake_engine, session.session)
        await session.aclose()
        assert fake_engine.pool.free == start

    asyncio.run(main())


def test_cancelled_task_is_rolled_back_eventually(fake_engine: Engine) -> None:
    """What holds today: the cancelled generation rolls back and leaks nothing once the worker got to it."""
    async def main() -> None:
        aengine = AsyncEngine(fake_engine)
        start = fake_engine.pool.free
        session = await aengine.session([Segment.policy(POLICY)], chat=False)
        await session.aprefill()
        before = session.tokens
        loop = asyncio.get_running_loop()
        got_pieces = asyncio.Event()
        count = [0]

        def on_piece(piece: str) -> None:
            count[0] += 1
            if count[0] == 3:
                loop.call_soon_threadsafe(got_pieces.set)

        task = asyncio.create_task(session.achat("hello", max_tokens=500, on_piece=on_piece))
        await asyncio.wait_for(got_pieces.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await session.aprefill()  # queued behind the cancelled job
        assert session.tokens == before and count[0] < 500
        assert_at_rest(fake_engine, session.session)
        await session.aclose()
        assert fake_engine.pool.free == start

    asyncio.run(main())


def test_a_stream_ends_when_its_end_comes_before_the_reader(make_engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_engine = make_engine(eos_bias=1000.0)  # the first token ends the turn: no piece, so no reader is needed
    s = open_session(fake_engine)
    s.prefill()
    submit = fake_engine.scheduler.submit

    def preempted_submit(owner: Any, work: Any, ready: Any = None) -> Any:
        job = submit(owner, work, ready)
        concurrent.futures.wait([job.future], 5)  # the calling thread is descheduled until the job is done
        return job

    monkeypatch.setattr(fake_engine.scheduler, "submit", preempted_submit)
    stream = s.stream(5, user="hi")
    out: dict[str, Any] = {}
    reader = threading.Thread(target=lambda: out.update(pieces=list(stream)), daemon=True)
    reader.start()
    reader.join(0.5)
    try:
        assert not reader.is_alive()  # END reaches the stream
        assert stream.result is not None and stream.result.finish_reason == "eos"
    finally:
        stream.close(wait=False)
        reader.join(2)


def test_await_sees_a_job_finished_between_callbacks_and_result() -> None:
    from kvagent.aio import _await
    from kvagent.scheduler import Job, Scheduler

    scheduler = Scheduler(SequencePool(FakeBackend(n_seq_max=1)))
    entered, gate = threading.Event(), threading.Event()

    class SlowFuture(concurrent.futures.Future):  # type: ignore[type-arg]
        def set_result(self, result: Any) -> None:  # the worker is between the callbacks and the result
            entered.set()
            gate.wait(5)
            super().set_result(result)

    def work() -> Iterator[None]:
        return None
        yield  # pragma: no cover

    job = Job("owner", work(), None)
    job.future = SlowFuture()
    finisher = threading.Thread(target=lambda: scheduler._finish(job, result=42), daemon=True)
    finisher.start()
    assert entered.wait(5)

    async def main() -> Any:
        asyncio.get_running_loop().call_later(0.05, gate.set)
        return await asyncio.wait_for(_await(scheduler, job), 0.5)

    try:
        assert asyncio.run(main()) == 42  # no TimeoutError
    finally:
        gate.set()
        finisher.join(5)


# ---------------------------------------------------------------------------------------------------
# failures roll back; the scheduler interleaves
# ---------------------------------------------------------------------------------------------------
def test_context_overflow_during_generation_rolls_back(make_engine: Any) -> None:
    fake_engine = make_engine(n_ctx=40)
    s = open_session(fake_engine)
    s.prefill()
    before = s.tokens
    with pytest.raises(KVAgentError) as err:
        s.generate(200, user="go on")
    assert "n_ctx" in str(err.value) and getattr(err.value, "partial", "")
    assert s.tokens == before
    assert_at_rest(fake_engine, s)


def test_pool_full_during_generation_rolls_back(make_engine: Any) -> None:
    fake_engine = make_engine(n_ctx=64)
    a = open_session(fake_engine, Segment.policy(" ".join(f"w{i}" for i in range(40))))
    a.prefill()
    b = open_session(fake_engine, Segment.policy("short prompt"))
    b.prefill()
    before, used = b.tokens, fake_engine.backend.used_cells  # type: ignore[attr-defined]
    with pytest.raises(KVCacheFullError):
        b.generate(60, user="go")
    assert b.tokens == before == b.rendered.tokens
    assert fake_engine.backend.used_cells == used  # type: ignore[attr-defined]
    assert fake_engine.backend.seq_positions(b.seq) == list(range(len(before)))
    a.close()  # room for the cold prefill assert_at_rest compares with
    assert_at_rest(fake_engine, b)


def test_short_prefill_is_not_queued_behind_a_long_one(make_engine: Any) -> None:
    fake_engine = make_engine(prefill_chunk=8)
    long = open_session(fake_engine, Segment.policy(" ".join(f"w{i}" for i in range(120))))
    short = open_session(fake_engine, Segment.policy("hi there"))
    finished: list[str] = []
    release = gate(fake_engine)
    for name, s in (("long", long), ("short", short)):
        job = fake_engine.scheduler.submit(s, s.prefill_work())
        on_done(job, lambda result, error, name=name: finished.append(name))
    release.set()
    concurrent.futures.wait([fake_engine.scheduler.submit(s, s.prefill_work()).future for s in (long, short)], 5)
    assert finished == ["short", "long"]
    for s in (long, short):
        assert_at_rest(fake_engine, s)


def test_calls_on_one_session_run_in_call_order(fake_engine: Engine) -> None:
    s = open_session(fake_engine)
    release = gate(fake_engine)
    order: list[int] = []
    futures = []
    for i in range(5):
        job = fake_engine.scheduler.submit(s, s.replace_work([Segment.policy(POLICY), Segment.user(f"message {i}")]))
        on_done(job, lambda result, error, i=i: order.append(i))
        futures.append(job.future)
    release.set()
    concurrent.futures.wait(futures, 5)
    assert order == [0, 1, 2, 3, 4]
    assert s.segments[-1].text == "message 4"
    assert_at_rest(fake_engine, s)


@pytest.mark.parametrize("name", ["tokens", "logits", "stale", "evicted", "floor"])
def test_a_sequence_is_the_one_owner_of_its_cache_fields(fake_engine: Engine, name: str) -> None:
    """``CachedSequence`` changes its fields only through its verbs: from outside they are read-only."""
    session = open_session(fake_engine)
    session.prefill()
    with pytest.raises(AttributeError):
        setattr(session.cache, name, getattr(session.cache, name))
