"""``kvagent.sessions``: the entry lock, the session table's reclaim (strategies, parking hook, room) and the
snapshot format, on the pure-Python FakeBackend (bookkeeping only: no KV result is claimed here)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from kvagent.backends.fake import FakeBackend
from kvagent.engine import Engine, EngineSettings
from kvagent.messages import ChatMessage
from kvagent.segments import Segment
from kvagent.sessions import (
    LFU,
    LRU,
    CloseParking,
    EntryLock,
    NoRoom,
    OrphansFirst,
    SessionTable,
    Snapshot,
    SnapshotError,
    TableEntry,
)


@pytest.fixture
def fake_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Engine]:
    monkeypatch.setenv("KVAGENT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "fake-model.gguf"
    path.write_bytes(b"GGUF" + bytes(range(60)))
    eng = Engine(EngineSettings(model=str(path), n_ctx=256, n_seq_max=4), backend=FakeBackend(n_ctx=256, n_seq_max=4))
    yield eng
    eng.close()


def opened(fake_engine: Engine, table: SessionTable[TableEntry], key: str, text: str = "a policy", *,
           used: float = 0.0, hits: int = 0, orphaned: bool = False) -> TableEntry:
    entry = TableEntry("ns", key, last_used=used, hits=hits, orphaned=orphaned)
    entry.session = fake_engine.session([Segment.policy(text)], chat=False)
    entry.session.prefill()
    assert table.add(entry)
    return entry


# -- the lock -------------------------------------------------------------------------------------
def test_the_lock_hands_over_in_order_to_threads_and_coroutines() -> None:
    lock, order = EntryLock(), []
    lock.acquire()
    assert lock.locked and not lock.try_acquire()

    def thread_waiter() -> None:
        lock.acquire()
        order.append("thread")
        lock.release()

    async def main() -> None:
        worker = threading.Thread(target=thread_waiter)
        worker.start()
        while lock.waiting < 1:
            await asyncio.sleep(0.001)

        async def coroutine_waiter() -> None:
            await lock.aacquire()
            order.append("coroutine")
            lock.release()

        task = asyncio.ensure_future(coroutine_waiter())
        while lock.waiting < 2:
            await asyncio.sleep(0.001)
        lock.release()  # the thread first (it queued first), then the coroutine
        await task
        worker.join(5)

    asyncio.run(main())
    assert order == ["thread", "coroutine"] and not lock.locked and lock.waiting == 0


def test_a_cancelled_waiter_passes_the_lock_on() -> None:
    lock = EntryLock()

    async def main() -> None:
        await lock.aacquire()
        first = asyncio.ensure_future(lock.aacquire())
        second = asyncio.ensure_future(lock.aacquire())
        await asyncio.sleep(0.01)
        first.cancel()
        await asyncio.sleep(0.01)
        assert lock.waiting == 1
        lock.release()
        await asyncio.wait_for(second, 5)  # the lock skipped the cancelled waiter
        assert lock.locked
        lock.release()

    asyncio.run(main())
    assert not lock.locked and lock.waiting == 0


# -- reclaiming -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("strategy", "expected"), [
    (LRU(), ["old", "new", "hot", "orphan"]),  # by last use: orphan=3, hot=2.5 ... see the entries below
    (LFU(), ["old", "orphan", "new", "hot"]),
    (OrphansFirst(), ["orphan", "old", "new", "hot"]),
    (OrphansFirst(LFU()), ["orphan", "old", "new", "hot"]),
])
def test_idle_entries_give_way_lowest_priority_first(fake_engine: Engine, strategy: Any, expected: list[str]) -> None:
    table: SessionTable[TableEntry] = SessionTable(fake_engine, strategy=strategy, spare=0)
    specs = {"old": (1.0, 0, False), "new": (2.0, 2, False), "hot": (2.5, 9, False), "orphan": (3.0, 1, True)}
    entries = {k: opened(fake_engine, table, k, f"policy {k}", used=u, hits=h, orphaned=o) for k, (u, h, o) in specs.items()}
    order = []
    for _ in entries:
        before = {k for k, e in entries.items() if e.active}
        assert table.reclaim()
        order += [k for k in before if not entries[k].active]
    assert order == expected
    assert not table.reclaim()  # nothing idle is left
    assert table.keys("ns") == ["old", "new", "hot"]  # the orphaned entry was forgotten, the others kept


def test_busy_entries_and_keep_never_give_way(fake_engine: Engine) -> None:
    table: SessionTable[TableEntry] = SessionTable(fake_engine, spare=0)
    busy, waited, kept, idle = (opened(fake_engine, table, k, f"policy {k}", used=i) for i, k in
                                enumerate(["busy", "waited", "kept", "idle"]))
    busy.lock.acquire()
    waiter = threading.Thread(target=lambda: (waited.lock.acquire(), waited.lock.release()))
    waited.lock.acquire()
    waiter.start()
    while waited.lock.waiting < 1:
        time.sleep(0.001)
    waited.lock.release()  # handed to the waiting thread, which releases it at once
    waiter.join(5)
    waited.lock.acquire()  # held again, by this thread: in use
    assert table.reclaim(keep=kept) and not idle.active
    assert not table.reclaim(keep=kept)  # busy and waited are in use, kept is kept
    assert busy.active and waited.active and kept.active
    busy.lock.release()
    waited.lock.release()


def test_make_room_frees_sequences_or_names_what_is_short(fake_engine: Engine) -> None:
    table: SessionTable[TableEntry] = SessionTable(fake_engine, spare=1)  # 4 sequences: room for 3 sessions
    a, b, c = (opened(fake_engine, table, k, f"policy {k}", used=i) for i, k in enumerate("abc"))
    assert fake_engine.pool.free == 1 and not table.fits(sequences=1)
    assert table.make_room(sequences=1) == 1 and not a.active and table.fits(sequences=1)
    for e in (b, c):
        e.lock.acquire()
    with pytest.raises(NoRoom, match="no free room in the KV pool"):
        table.make_room(cells=10_000)  # more cells than the pool has, and nothing idle
    with pytest.raises(NoRoom, match="retry shortly"):
        table.make_room(sequences=2)
    assert b.active and c.active  # a refused make_room parks nothing that is in use


def test_cells_used_counts_shared_prefixes_once(fake_engine: Engine) -> None:
    table: SessionTable[TableEntry] = SessionTable(fake_engine, spare=0)
    first = opened(fake_engine, table, "first", "a shared policy of several words")
    n = len(first.session.tokens)  # type: ignore[union-attr]
    second = TableEntry("ns", "second")
    second.session = fake_engine.session([Segment.policy("a shared policy of several words"), Segment.user("hi")],
                                    chat=False)
    second.session.prefill()  # starts from the first one's cells
    table.add(second)
    assert second.session.tokens[:n] == first.session.tokens  # type: ignore[union-attr]
    assert table.cells_used() == len(second.session.tokens)  # the shared prefix once
    assert CloseParking().park(second) is False and not second.active
    assert table.cells_used() == n


def test_keys_of_two_namespaces_never_meet(fake_engine: Engine) -> None:
    table: SessionTable[TableEntry] = SessionTable(fake_engine)
    a = table.setdefault("tenant-a", "s1", lambda: TableEntry("tenant-a", "s1"))
    b = table.setdefault("tenant-b", "s1", lambda: TableEntry("tenant-b", "s1"))
    assert a is not b and table.get("tenant-a", "s1") is a and table.get("tenant-c", "s1") is None
    assert not table.add(TableEntry("tenant-a", "s1"))  # taken: nothing changed
    assert [e.key for e in table.entries("tenant-b")] == ["s1"] and len(table) == 2


# -- snapshots ------------------------------------------------------------------------------------
def test_a_snapshot_round_trips_and_bad_bytes_are_refused() -> None:
    segments = (Segment.policy("p", id="p"), Segment.assistant("hi", token_ids=(5, 6), id="a"))
    messages = (ChatMessage("user", "hello"), ChatMessage("tool", "42", "lookup"))
    snap = Snapshot(segments, messages, b"\x00KV\xff", {"skills": ["refund"]})
    back = Snapshot.from_bytes(snap.to_bytes())
    assert back.segments == segments and back.messages == messages and back.blob == b"\x00KV\xff"
    assert back.meta == {"skills": ["refund"]} and Snapshot.from_bytes(Snapshot(segments).to_bytes()).blob is None
    data = snap.to_bytes()
    for bad, why in [(b"", "not a saved kvagent session"), (data[:20], "not a saved kvagent session"),
                     (data.replace(b"kvagent-snapshot/1", b"kvagent-snapshot/9"), "this kvagent reads"),
                     (data.replace(b'"kind": "policy"', b'"kind": "nonsense"'), "corrupt header")]:
        with pytest.raises(SnapshotError, match=why):
            Snapshot.from_bytes(bad, source="the upload")
