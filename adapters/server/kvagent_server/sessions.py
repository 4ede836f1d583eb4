"""The server's sessions: keys, live sessions on the engine's sequences, and parking.

Every entry is either *active* (``entry.session`` is a live session on one of the engine's sequences) or
*parked* (``entry.parked`` holds its segments and, unless the session evicted, its saved KV in a file).
A request works on an entry only while it holds the entry's lock. When a new request needs a sequence
or KV cells that are all taken, idle entries (lock free, no request waiting for them) are parked, least
recently used first: saved with ``session.save()``, closed, and restored on their next request with
``session.restore()``; where ``session.save()`` refuses a session (kvagent before blobs recorded evicted
positions: a cache with holes), its segments are kept and prefilled again. Nothing a client sent is lost by
parking: segments, field values, errata, skills and
the messages log stay in the entry. When nothing is idle the request is refused with 503 (``Busy``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable, Sequence, TypeVar

from kvagent.aio import AsyncEngine, AsyncSession
from kvagent.errors import KVAgentError, KVCacheFullError
from kvagent.eviction import Eviction
from kvagent.fields import FieldSpec
from kvagent.generation import ReplyTokens
from kvagent.messages import MessageLog
from kvagent.segments import Segment, SegmentKind

from kvagent_server.errors import Busy, Conflict, NotFound
from kvagent_server.metrics import Metrics

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class SessionOptions:
    """How an entry's sessions are opened (again after each parking)."""

    fields: tuple[FieldSpec, ...] = ()
    eviction: Eviction | None = None
    edit_strategy: str = "auto"


@dataclass(frozen=True)
class Parked:
    """A parked entry: its prompt, and the file with its saved KV (None: prefill the segments again)."""

    segments: tuple[Segment, ...]
    blob: Path | None
    n_tokens: int


@dataclass(eq=False)
class Entry:
    """One session key and everything the server keeps for it."""

    key: str | None
    explicit: bool
    """Made by ``POST /v1/sessions`` or a restore (never forgotten); else keyed by a chat request."""
    options: SessionOptions = field(default_factory=SessionOptions)
    static: list[Segment] = field(default_factory=list)
    """Segments the server added (policy, fields, memory, skills): ``MessageLog.plan``'s ``static``."""
    log: MessageLog = field(default_factory=MessageLog)
    turns: ReplyTokens = field(default_factory=ReplyTokens)
    session: AsyncSession | None = None
    parked: Parked | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    waiting: int = 0
    deleted: bool = False
    evicted_seen: int = 0
    last_used: float = field(default_factory=time.monotonic)

    @property
    def segments(self) -> tuple[Segment, ...]:
        if self.session is not None:
            return tuple(self.session.segments)
        return self.parked.segments if self.parked is not None else tuple(self.static)

    @property
    def idle(self) -> bool:
        return self.session is not None and not self.lock.locked() and self.waiting == 0


class SessionManager:
    """Entries by key (least recently used first), parking and restoring them as sequences and cells run out."""

    def __init__(self, engine: AsyncEngine, metrics: Metrics, park_dir: Path, *, reserve: int = 0,
                 max_parked: int = 1024, retry_after_s: int = 1) -> None:
        self.engine = engine
        self.metrics = metrics
        self.park_dir = park_dir
        self.reserve = reserve  # sequences kept free (skill transplants need a scratch sequence)
        self.max_parked = max_parked
        self.retry_after_s = retry_after_s
        self.entries: OrderedDict[str, Entry] = OrderedDict()
        self._temporary: set[Entry] = set()
        self._admission = asyncio.Lock()
        self.n_ctx = engine.engine.backend.n_ctx
        self.renderer = engine.engine.renderer(True)
        metrics.watch(active=lambda: float(self.active_count), parked=lambda: float(self.parked_count),
                      cells=lambda: float(self.cells_used()), total=self.n_ctx)

    # -- reading ----------------------------------------------------------------------------------
    @property
    def active_count(self) -> int:
        return sum(e.session is not None for e in self.entries.values()) + len(self._temporary)

    @property
    def parked_count(self) -> int:
        return sum(e.parked is not None for e in self.entries.values())

    def get(self, key: str) -> Entry:
        entry = self.entries.get(key)
        if entry is None:
            raise NotFound(f"unknown session {key!r}: create it with POST /v1/sessions (or send it as the "
                           "session key of a chat request)", param="session", code="session_not_found")
        return entry

    def cells_used(self) -> int:
        """KV cells the live sessions hold, cells shared between sequences counted once.

        Shared cells are prefixes (a new session starts from another's cells); the pool records which pairs
        share up to which position. Two sessions that computed (or restored) the same tokens each hold
        their own cells, so equal tokens alone do not mean shared cells.
        """
        pool = self.engine.engine.pool
        counted: list[int] = []
        total = 0
        for entry in (*self.entries.values(), *self._temporary):
            session = entry.session
            if session is None:
                continue
            seq, n = session.seq, len(session.tokens)
            overlap = max((min(pool.shared_upto(seq, t), n) for t in counted), default=0)
            total += n - overlap - len(session.evicted_positions)
            counted.append(seq)
        return max(0, total)

    # -- creating, using, deleting ------------------------------------------------------------------
    async def create(self, key: str, static: Sequence[Segment], options: SessionOptions, *,
                     explicit: bool = True) -> Entry:
        """A new active entry whose prompt is ``static`` (not prefilled yet); 409 if ``key`` is taken."""
        if key in self.entries:
            raise Conflict(f"session {key!r} already exists: delete it first or use another id", param="id")
        entry = Entry(key, explicit, options, list(static))
        self.entries[key] = entry
        try:
            async with entry.lock:
                await self._activate(entry)
        except BaseException:
            self._forget(entry)
            raise
        return entry

    @asynccontextmanager
    async def use(self, key: str | None, *, implicit: bool = True) -> AsyncIterator[Entry]:
        """The entry of ``key``, active and locked for this request. ``key=None``: a temporary session,
        closed afterwards; an unknown key makes an implicit entry (``implicit``) or is a 404."""
        if key is None:
            entry = Entry(None, False)
            self._temporary.add(entry)
            try:
                async with entry.lock:
                    await self._activate(entry)
                    with self._running():
                        yield entry
            finally:
                self._temporary.discard(entry)
                if entry.session is not None:
                    await _close_quietly(entry.session)
                    entry.session = None
            return
        entry = self.entries.get(key)
        if entry is None:
            if not implicit:
                self.get(key)  # raises NotFound
            entry = Entry(key, False)
            self.entries[key] = entry
        entry.waiting += 1
        self.metrics.requests_waiting.inc()
        try:
            await entry.lock.acquire()
        finally:
            entry.waiting -= 1
            self.metrics.requests_waiting.dec()
        try:
            if entry.deleted:
                raise NotFound(f"session {key!r} was deleted", param="session", code="session_not_found")
            try:
                await self._activate(entry)
            except BaseException:
                if entry.session is None and entry.parked is None:  # never came to life: leave no ghost
                    self._forget(entry)
                raise
            if key in self.entries:
                self.entries.move_to_end(key)
            with self._running():
                yield entry
        finally:
            entry.last_used = time.monotonic()
            entry.lock.release()

    async def delete(self, key: str) -> None:
        entry = self.get(key)
        entry.deleted = True
        self.entries.pop(key, None)
        async with entry.lock:
            if entry.session is not None:
                await _close_quietly(entry.session)
                entry.session = None
            self._drop_blob(entry)

    async def close(self) -> None:
        for entry in [*self.entries.values(), *self._temporary]:
            if entry.session is not None:
                await _close_quietly(entry.session)
                entry.session = None
            self._drop_blob(entry)
        self.entries.clear()

    # -- room -------------------------------------------------------------------------------------
    async def make_room(self, entry: Entry, cells: int, *, force: bool = False) -> None:
        """Park idle entries until ``cells`` more KV cells fit in the pool; 503 when nothing is idle.
        ``force``: park at least one (llama.cpp found no room where the count said there was some)."""
        if self.cells_used() + cells <= self.n_ctx and not force:
            return
        self.metrics.requests_waiting.inc()
        try:
            async with self._admission:
                while force or self.cells_used() + cells > self.n_ctx:
                    force = False
                    victim = self._victim(entry)
                    if victim is None:
                        raise Busy(f"the KV pool ({self.n_ctx} cells, {self.cells_used()} held) has no room for "
                                   f"{cells} more and every other session is working: retry shortly",
                                   self.retry_after_s)
                    await self._park(victim)
        finally:
            self.metrics.requests_waiting.dec()

    async def with_room(self, entry: Entry, cells: int, work: Callable[[], Awaitable[T]]) -> T:
        """``work()`` after making room for ``cells``. Where llama.cpp still finds no free cells (the work
        rolled back), one more idle session is parked and the work runs again (three tries)."""
        await self.make_room(entry, cells)
        for attempt in range(3):
            try:
                return await work()
            except KVCacheFullError:
                if attempt == 2:
                    raise
                log.info("no free KV cells for session %r: parking one more idle session", entry.key)
                await self.make_room(entry, cells, force=True)
        raise AssertionError("unreachable")  # pragma: no cover

    def _victim(self, keep: Entry) -> Entry | None:
        return next((e for e in self.entries.values() if e is not keep and e.idle), None)

    async def _activate(self, entry: Entry) -> None:
        """Give a parked or new entry a live session (parking others for its sequence and cells)."""
        if entry.session is not None:
            return
        parked = entry.parked
        segments = list(parked.segments) if parked is not None else list(entry.static)
        cells = parked.n_tokens if parked is not None else 0
        async with self._admission:
            while self.engine.engine.pool.free <= self.reserve or self.cells_used() + cells > self.n_ctx:
                victim = self._victim(entry)
                if victim is None:
                    what = "sequence" if self.engine.engine.pool.free <= self.reserve else "room in the KV pool"
                    raise Busy(f"no free {what}: all sessions are working ({self.active_count} active); retry "
                               "shortly", self.retry_after_s)
                await self._park(victim)
            opts = entry.options
            session = await self.engine.session(segments, fields=list(opts.fields), eviction=opts.eviction,
                                                edit_strategy=opts.edit_strategy)
        session.session.replies = entry.turns  # the memory of generated turns outlives the sequence
        entry.evicted_seen = 0
        if parked is not None:
            try:
                await self._restore(session, parked)
            except BaseException:
                await _close_quietly(session)
                raise
            self._drop_blob(entry)
            entry.parked = None
            self.metrics.restored.inc()
        entry.session = session

    async def _restore(self, session: AsyncSession, parked: Parked) -> None:
        if parked.blob is not None:
            try:
                blob = await asyncio.to_thread(parked.blob.read_bytes)
                await session.arestore(blob, parked.segments)
                return
            except (OSError, KVAgentError) as exc:
                log.warning("restoring a parked session from %s failed (%s): prefilling its segments again",
                            parked.blob, exc)
        await session.areplace(parked.segments)

    async def _park(self, entry: Entry) -> None:
        """Save ``entry`` (idle: its lock is free), free its sequence, keep its segments."""
        async with entry.lock:
            session = entry.session
            if session is None:
                return
            segments = tuple(session.segments)
            path: Path | None = None
            try:
                blob = await session.asave()
                path = self.park_dir / f"{uuid.uuid4().hex}.kv"
                await asyncio.to_thread(path.write_bytes, blob)
            except KVAgentError as exc:  # save refused (a cache with holes, before blobs kept them): prefill later
                log.info("parking session %r without its KV (%s): its segments will be prefilled again", entry.key, exc)
                path = None
            n_tokens = len(session.tokens)
            await _close_quietly(session)
            entry.session, entry.parked = None, Parked(segments, path, n_tokens)
            self.metrics.parked.inc()
            log.debug("parked session %r (%d tokens)", entry.key, n_tokens)
        self._trim_parked()

    def _trim_parked(self) -> None:
        """Forget the least recently used implicit parked entries beyond ``max_parked``."""
        excess = self.parked_count - self.max_parked
        for entry in [e for e in self.entries.values() if e.parked is not None and not e.explicit]:
            if excess <= 0:
                break
            if entry.lock.locked() or entry.waiting:
                continue
            self._forget(entry)
            excess -= 1

    def _forget(self, entry: Entry) -> None:
        if entry.key is not None and self.entries.get(entry.key) is entry:
            del self.entries[entry.key]
        entry.deleted = True
        self._drop_blob(entry)

    @staticmethod
    def _drop_blob(entry: Entry) -> None:
        if entry.parked is not None and entry.parked.blob is not None:
            entry.parked.blob.unlink(missing_ok=True)

    def _running(self) -> _Running:
        return _Running(self.metrics)


class _Running:
    """Counts a request as running while inside."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def __enter__(self) -> None:
        self.metrics.requests_running.inc()

    def __exit__(self, *exc: object) -> None:
        self.metrics.requests_running.dec()


async def _close_quietly(session: AsyncSession) -> None:
    try:
        await session.aclose()
    except KVAgentError as exc:  # the engine is closing
        log.debug("closing a session: %s", exc)


def field_values(segments: Sequence[Segment]) -> dict[str, object]:
    """Each field's current value: its declared value, overridden by the latest erratum."""
    return {str(s.name): s.value for s in segments if s.kind in (SegmentKind.FIELD, SegmentKind.ERRATUM)}
