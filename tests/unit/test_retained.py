"""Retained KV (``SequencePool.retain``): a closed session's cells stay cached and indexed until the pool needs them.

Pure logic on the fake backend, whose cells carry a digest of everything they were computed from: a reused cell is
checked against a cold prefill of the same tokens, and room is counted exactly (``FakeBackend.used_cells``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from kvagent.backends.fake import FakeBackend
from kvagent.engine import Engine, EngineSettings
from kvagent.errors import KVCacheFullError
from kvagent.segments import Segment

POLICY = "You are a terse assistant that answers in words " * 4


def make(tmp_path: Path, *, n_ctx: int = 256, n_seq_max: int = 4, retain: bool = True) -> Engine:
    path = tmp_path / "fake-model.gguf"
    path.write_bytes(b"GGUF" + bytes(range(60)))
    return Engine(EngineSettings(model=str(path), n_ctx=n_ctx, n_seq_max=n_seq_max, retain=retain),
                  backend=FakeBackend(n_ctx=n_ctx, n_seq_max=n_seq_max))


@pytest.fixture
def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Engine]:
    monkeypatch.setenv("KVAGENT_CACHE_DIR", str(tmp_path / "cache"))
    eng = make(tmp_path)
    yield eng
    eng.close()


def closed_session(engine: Engine, text: str, scope: str = "") -> int:
    """A session that prefilled ``text`` as its policy and was closed; its sequence id."""
    s = engine.session([Segment.policy(text)], chat=False, scope=scope)
    s.prefill()
    s.close()
    return s.seq


def cold_digest(engine: Engine, tokens: tuple[int, ...]) -> bytes:
    """What a cold prefill of ``tokens`` caches (the fake's content digest), in a scratch sequence."""
    backend: FakeBackend = engine.backend  # type: ignore[assignment]
    with engine.scratch() as seq:
        backend.decode(tokens, range(len(tokens)), [seq] * len(tokens), [False] * len(tokens))
        return backend.sequence_digest(seq)


@pytest.mark.parametrize("scope, retain, shared", [
    ("", True, True),  # the same scope starts from the closed session's cells
    ("tenant-b", True, False),  # another scope never does
    ("", False, False),  # an engine that does not retain frees them at close
])
def test_a_closed_sessions_prefix_is_reused_within_its_scope_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  scope: str, retain: bool, shared: bool) -> None:
    monkeypatch.setenv("KVAGENT_CACHE_DIR", str(tmp_path / "cache"))
    engine = make(tmp_path, retain=retain)
    try:
        closed_session(engine, POLICY)
        assert len(engine.pool.retained) == int(retain)
        s = engine.session([Segment.policy(POLICY), Segment.user("hi")], chat=False, scope=scope)
        report = s.prefill()
        assert (report.shared > 0) is shared
        backend: FakeBackend = engine.backend  # type: ignore[assignment]
        assert backend.sequence_digest(s.seq) == cold_digest(engine, s.tokens)
        s.close()
    finally:
        engine.close()


def test_a_sequence_wanted_gives_back_the_least_recently_used_retained_one(engine: Engine) -> None:
    first = closed_session(engine, POLICY + " one")
    second = closed_session(engine, POLICY + " two")
    third = closed_session(engine, POLICY + " three")
    reader = engine.session([Segment.policy(POLICY + " one"), Segment.user("x")], chat=False)
    assert reader.prefill().shared > 0  # reusing `first` makes it the most recently used
    assert [r.seq for r in engine.pool.retained] == [second, third, first]
    other = engine.session([Segment.policy("something else")], chat=False)  # no free id: `second` goes
    assert [r.seq for r in engine.pool.retained] == [third, first] and other.seq == second
    assert engine.pool.reclaimed == 1
    for s in (reader, other):
        s.close()


@pytest.mark.parametrize("retained_sessions", [1, 2])
def test_room_in_the_kv_pool_comes_from_retained_cells_before_any_refusal(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         retained_sessions: int) -> None:
    monkeypatch.setenv("KVAGENT_CACHE_DIR", str(tmp_path / "cache"))
    engine = make(tmp_path, n_ctx=256, n_seq_max=6)
    backend: FakeBackend = engine.backend  # type: ignore[assignment]
    try:
        live = engine.session([Segment.policy("a live one " * 6)], chat=False)
        live.prefill()
        kept = backend.sequence_digest(live.seq)
        for i in range(retained_sessions):
            closed_session(engine, f"r{i} " * (190 // retained_sessions))
        assert backend.n_ctx - backend.used_cells < 80
        big = engine.session([Segment.policy("a long new prompt " * 20)], chat=False)
        big.prefill()  # needs more than the free cells: retained ones are given back, the live one is untouched
        assert backend.sequence_digest(live.seq) == kept
        assert engine.pool.reclaimed >= 1
        with pytest.raises(KVCacheFullError):  # nothing retained is left to give: refused as before
            engine.session([Segment.policy("too much " * 90)], chat=False).prefill()
        assert backend.sequence_digest(live.seq) == kept
    finally:
        engine.close()


def test_retained_cells_shared_with_a_live_session_stay_with_it(engine: Engine) -> None:
    closed_session(engine, POLICY)
    s = engine.session([Segment.policy(POLICY), Segment.user("go on")], chat=False)
    s.prefill()
    backend: FakeBackend = engine.backend  # type: ignore[assignment]
    assert engine.pool.clear_retained() == 1
    assert backend.sequence_digest(s.seq) == cold_digest(engine, s.tokens)
    assert backend.used_cells == len(s.tokens)
    s.close()


def test_evicted_or_restored_sessions_keep_only_what_may_be_shared(engine: Engine) -> None:
    a = engine.session([Segment.policy(POLICY)], chat=False)
    a.prefill()
    blob, segments = a.save(), a.segments
    a.close()
    engine.pool.clear_retained()
    restored = engine.session(chat=False)
    restored.restore(blob, segments)  # bytes from outside: never shared, so never retained
    restored.close()
    assert engine.pool.retained == ()
    assert engine.backend.used_cells == 0  # type: ignore[attr-defined]


# -- tiers: host memory, then disk ----------------------------------------------------------------------
from kvagent.kv.tiers import FolderStore, MemoryStore, Tier  # noqa: E402


@pytest.mark.parametrize("sizes, ram, disk, in_ram, in_disk", [
    ([10, 10, 10], 25, 100, 2, 1),  # the least recently used moves down
    ([10, 10, 10], 25, 45, 2, 1),  # the disk keeps what fits (a file: the bytes and their 32-byte signature)
    ([10, 10, 10], 25, 41, 2, 0),  # the signature counts
    ([10, 10, 10], 25, 0, 2, 0),  # no room below: dropped
    ([30], 25, 100, 0, 1),  # larger than the RAM tier: straight to disk
    ([30], 25, 20, 0, 0),  # larger than both: kept nowhere
])
def test_each_tier_stays_within_its_bound(tmp_path: Path, sizes: list[int], ram: int, disk: int, in_ram: int,
                                          in_disk: int) -> None:
    lower = Tier("disk", FolderStore(tmp_path / "disk"), disk)
    upper = Tier("ram", MemoryStore(), ram, lower)
    for i, size in enumerate(sizes):
        upper.put((i, i + 1, i + 2), "", bytes(size))
        assert upper.bytes <= ram and lower.bytes <= disk
    assert (len(upper), len(lower)) == (in_ram, in_disk)
    assert sum(p.stat().st_size for p in (tmp_path / "disk").glob("*.kv")) == lower.bytes
    upper.close()
    assert not (tmp_path / "disk").exists()


def test_a_disk_file_changed_by_anything_else_is_never_loaded(tmp_path: Path) -> None:
    store = FolderStore(tmp_path / "disk")
    store.put(7, b"payload")
    assert store.get(7) == b"payload"
    path = tmp_path / "disk" / "7.kv"
    path.write_bytes(path.read_bytes()[:-1] + b"X")
    assert store.get(7) is None


@pytest.mark.parametrize("scope, restored", [("", True), ("tenant-b", False)])
def test_a_prefix_given_back_is_restored_from_host_memory_within_its_scope(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch,
                                                                           scope: str, restored: bool) -> None:
    monkeypatch.setenv("KVAGENT_CACHE_DIR", str(tmp_path / "cache"))
    engine = make(tmp_path)
    try:
        text = POLICY * 3
        closed_session(engine, text)
        assert engine.pool.reclaim()  # the cells go as under pressure: the prefix is saved into the RAM tier first
        assert engine.backend.used_cells == 0 and len(engine.tiers) == 1  # type: ignore[attr-defined,arg-type]
        s = engine.session([Segment.policy(text), Segment.user("hi")], chat=False, scope=scope)
        report = s.prefill()
        assert (report.restored > 0) is restored and (report.reused > 0) is restored
        backend: FakeBackend = engine.backend  # type: ignore[assignment]
        assert backend.sequence_digest(s.seq) == cold_digest(engine, s.tokens)
        s.close()
    finally:
        engine.close()


@pytest.mark.parametrize("n_seq_max", [3, 4])  # 3: no sequence is left to keep the conversation it leaves
def test_a_live_session_resumes_a_retained_conversation_whatever_sequences_are_left(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n_seq_max: int) -> None:
    monkeypatch.setenv("KVAGENT_CACHE_DIR", str(tmp_path / "cache"))
    engine = make(tmp_path, n_seq_max=n_seq_max)
    backend: FakeBackend = engine.backend  # type: ignore[assignment]
    try:
        other = engine.session([Segment.policy("someone else entirely")], chat=False)
        other.prefill()
        conversation = [Segment.policy(POLICY * 2), Segment.user("first question"), Segment.assistant("an answer")]
        with engine.session(chat=False) as before:
            before.generate(2, segments=conversation)
        own = engine.session(chat=False)
        own.generate(2, segments=[Segment.policy("a side task, nothing in common " * 4), Segment.user("go")])
        back = own.generate(2, segments=[*conversation, Segment.user("second question")])
        assert back.resumed > 0 and back.computed < 12
        assert own.tokens == own.rendered.tokens and backend.seq_positions(own.seq) == list(range(len(own.tokens)))
        left = [r for r in engine.pool.retained if r.memo is not None and r.memo.segments[0].text.startswith("a side")]
        assert len(left) == (1 if n_seq_max == 4 else 0)  # the side conversation kept where a sequence was left
        for s in (own, other):
            s.close()
    finally:
        engine.close()
