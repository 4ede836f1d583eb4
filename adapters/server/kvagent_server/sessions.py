"""The server's sessions: keys, live sessions on the engine's sequences, and parking.

Entries live in kvagent's :class:`~kvagent.sessions.SessionTable` (one namespace for now; tenants get their own).
Every entry is either *active* (``entry.session`` is a live session on one of the engine's sequences) or
*parked* (``entry.parked`` holds its segments and, unless the session evicted, its saved KV in a file).
A request works on an entry only while it holds the entry's lock. When a new request needs a sequence
or KV cells that are all taken, idle entries (lock free, no request waiting for them) are parked, least
recently used first (the table's reclaim, with :class:`ParkToDisk` as its parking hook): saved with
``session.save()``, closed, and restored on their next request with ``session.restore()``; where
``session.save()`` refuses a session, its segments are kept and prefilled again. Nothing a client sent is lost
by parking: segments, field values, errata, skills and the messages log stay in the entry. When nothing is
idle the request is refused with 503 (``Busy``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
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
from kvagent.session import Session
from kvagent.sessions import LRU, NoRoom, SessionTable, TableEntry

from kvagent_server.errors import Busy, Conflict, NotFound
from kvagent_server.metrics import Metrics

log = logging.getLogger(__name__)
T = TypeVar("T")
NAMESPACE = ""  # every session's, until the server keeps tenants apart
_TEMPORARY = "~temporary"  # requests without a session key: one entry each, closed after the request


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
class Entry(TableEntry):
    """One session key and everything the server keeps for it."""

    explicit: bool = False
    """Made by ``POST /v1/sessions`` or a restore (never forgotten); else keyed by a chat request."""
    options: SessionOptions = field(default_factory=SessionOptions)
    static: list[Segment] = field(default_factory=list)
    """Segments the server added (policy, fields, memory, skills): ``MessageLog.plan``'s ``static``."""
    tools: list[Segment] = field(default_factory=list)
    """The segments of the last request's tools (after ``static`` in the prompt; ``kvagent_server.tools``)."""
    log: MessageLog = field(default_factory=MessageLog)
    replies: ReplyTokens = field(default_factory=ReplyTokens)
    parked: Parked | None = None
    deleted: bool = False
    evicted_seen: int = 0

    @property
    def segments(self) -> tuple[Segment, ...]:
        if self.session is not None:
            return tuple(self.session.segments)
        return self.parked.segments if self.parked is not None else tuple(self.static)

    @property
    def asession(self) -> AsyncSession:
        """The live session, awaited from the loop (only while the request holds the entry)."""
        if self.session is None:
            raise RuntimeError("session entry used while parked (internal error)")
        return AsyncSession(self.session)


class ParkToDisk:
    """The table's parking hook: save the session's KV to a file in ``folder``, close it, keep its segments."""

    def __init__(self, folder: Path, metrics: Metrics) -> None:
        self.folder, self.metrics = folder, metrics

    def park(self, entry: Entry) -> bool:
        session = entry.session
        if session is None:
            return False
        segments = tuple(session.segments)
        path: Path | None = None
        try:
            blob = session.save()
            path = self.folder / f"{uuid.uuid4().hex}.kv"
            path.write_bytes(blob)
        except (KVAgentError, OSError) as exc:  # a cache that cannot be saved: prefill its segments later
            log.info("parking session %r without its KV (%s): its segments will be prefilled again", entry.key, exc)
            path = None
        n_tokens = len(session.tokens)
        _close_quietly(session)
        entry.session, entry.parked = None, Parked(segments, path, n_tokens)
        self.metrics.parked.inc()
        log.debug("parked session %r (%d tokens)", entry.key, n_tokens)
        return False


class SessionManager:
    """Entries by key in a session table, parking and restoring them as sequences and cells run out."""

    def __init__(self, engine: AsyncEngine, metrics: Metrics, park_dir: Path, *, max_parked: int = 1024,
                 retry_after_s: int = 1) -> None:
        self.engine = engine
        self.metrics = metrics
        self.park_dir = park_dir
        self.max_parked = max_parked
        self.retry_after_s = retry_after_s
        # one sequence kept free beside the sessions: a scratch for skill transplants and splicing edits
        self.table: SessionTable[Entry] = SessionTable(engine.engine, strategy=LRU(),
                                                       parking=ParkToDisk(park_dir, metrics), spare=1)
        self._admission = asyncio.Lock()  # making room and opening the session it was made for, one at a time
        self.n_ctx = engine.engine.backend.n_ctx
        self.renderer = engine.engine.renderer(True)
        metrics.watch(active=lambda: float(self.active_count), parked=lambda: float(self.parked_count),
                      cells=lambda: float(self.cells_used()), total=self.n_ctx)

    # -- reading ----------------------------------------------------------------------------------
    @property
    def entries(self) -> dict[str, Entry]:
        """The keyed entries (temporary ones left out), oldest first."""
        return {e.key: e for e in self.table.entries(NAMESPACE)}

    @property
    def active_count(self) -> int:
        return sum(e.active for e in self.table.entries())

    @property
    def parked_count(self) -> int:
        return sum(e.parked is not None for e in self.table.entries(NAMESPACE))

    def get(self, key: str) -> Entry:
        entry = self.table.get(NAMESPACE, key)
        if entry is None:
            raise NotFound(f"unknown session {key!r}: create it with POST /v1/sessions (or send it as the "
                           "session key of a chat request)", param="session", code="session_not_found")
        return entry

    def cells_used(self) -> int:
        """KV cells the live sessions hold, cells shared between sequences counted once (``SessionTable``)."""
        return self.table.cells_used()

    # -- creating, using, deleting ------------------------------------------------------------------
    async def create(self, key: str, static: Sequence[Segment], options: SessionOptions, *,
                     explicit: bool = True) -> Entry:
        """A new active entry whose prompt is ``static`` (not prefilled yet); 409 if ``key`` is taken."""
        entry = Entry(NAMESPACE, key, explicit=explicit, options=options, static=list(static))
        if not self.table.add(entry):
            raise Conflict(f"session {key!r} already exists: delete it first or use another id", param="id")
        try:
            await entry.lock.aacquire()
            try:
                await self._activate(entry)
            finally:
                entry.lock.release()
        except BaseException:
            self._forget(entry)
            raise
        return entry

    @asynccontextmanager
    async def use(self, key: str | None, *, implicit: bool = True) -> AsyncIterator[Entry]:
        """The entry of ``key``, active and locked for this request. ``key=None``: a temporary session,
        closed afterwards; an unknown key makes an implicit entry (``implicit``) or is a 404."""
        if key is None:
            entry = Entry(_TEMPORARY, uuid.uuid4().hex)
            self.table.add(entry)
            await entry.lock.aacquire()
            try:
                await self._activate(entry)
                with self._running():
                    yield entry
            finally:
                self.table.remove(entry)
                if entry.session is not None:
                    await asyncio.to_thread(_close_quietly, entry.session)
                    entry.session = None
                entry.lock.release()
            return
        entry = self.table.get(NAMESPACE, key)
        if entry is None:
            if not implicit:
                self.get(key)  # raises NotFound
            entry = self.table.setdefault(NAMESPACE, key, lambda: Entry(NAMESPACE, key))
        self.metrics.requests_waiting.inc()
        try:
            await entry.lock.aacquire()
        finally:
            self.metrics.requests_waiting.dec()
        try:
            if entry.deleted:
                raise NotFound(f"session {key!r} was deleted", param="session", code="session_not_found")
            entry.touch()
            try:
                await self._activate(entry)
            except BaseException:
                if entry.session is None and entry.parked is None:  # never came to life: leave no ghost
                    self._forget(entry)
                raise
            with self._running():
                yield entry
        finally:
            entry.last_used = time.monotonic()
            entry.lock.release()

    async def delete(self, key: str) -> None:
        entry = self.get(key)
        entry.deleted = True
        self.table.remove(entry)
        await entry.lock.aacquire()
        try:
            if entry.session is not None:
                await asyncio.to_thread(_close_quietly, entry.session)
                entry.session = None
            self._drop_blob(entry)
        finally:
            entry.lock.release()

    async def close(self) -> None:
        for entry in self.table.entries():
            if entry.session is not None:
                await asyncio.to_thread(_close_quietly, entry.session)
                entry.session = None
            self._drop_blob(entry)
            self.table.remove(entry)

    async def park(self, entry: Entry) -> None:
        """Park ``entry`` now (waiting for its lock): its KV saved to a file, its sequence freed."""
        await entry.lock.aacquire()
        try:
            await asyncio.to_thread(self.table.parking.park, entry)
        finally:
            entry.lock.release()
        self._trim_parked()

    # -- room -------------------------------------------------------------------------------------
    async def make_room(self, entry: Entry, cells: int, *, force: bool = False) -> None:
        """Park idle entries until ``cells`` more KV cells fit in the pool; 503 when nothing is idle.
        ``force``: park at least one (llama.cpp found no room where the count said there was some)."""
        self.metrics.requests_waiting.inc()
        try:
            async with self._admission:
                await self._room(entry, cells=cells, force=force)
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

    async def _room(self, entry: Entry, *, sequences: int = 0, cells: int = 0, force: bool = False) -> None:
        try:
            await self.table.amake_room(sequences=sequences, cells=cells, keep=entry, force=force)
        except NoRoom as exc:
            raise Busy(f"{exc} ({self.active_count} sessions active)", self.retry_after_s) from None
        finally:
            self._trim_parked()

    async def _activate(self, entry: Entry) -> None:
        """Give a parked or new entry a live session (parking others for its sequence and cells)."""
        if entry.session is not None:
            return
        parked = entry.parked
        segments = list(parked.segments) if parked is not None else list(entry.static)
        async with self._admission:
            await self._room(entry, sequences=1, cells=parked.n_tokens if parked is not None else 0)
            opts = entry.options
            session = await self.engine.session(segments, fields=list(opts.fields), eviction=opts.eviction,
                                                edit_strategy=opts.edit_strategy)
        session.session.replies = entry.replies  # the memory of generated turns outlives the sequence
        entry.evicted_seen = 0
        if parked is not None:
            try:
                await self._restore(session, parked)
            except BaseException:
                await asyncio.to_thread(_close_quietly, session.session)
                raise
            self._drop_blob(entry)
            entry.parked = None
            self.metrics.restored.inc()
        entry.session = session.session

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

    def _trim_parked(self) -> None:
        """Forget the least recently used implicit parked entries beyond ``max_parked``."""
        excess = self.parked_count - self.max_parked
        parked = sorted((e for e in self.table.entries(NAMESPACE) if e.parked is not None and not e.explicit),
                        key=lambda e: e.last_used)
        for entry in parked:
            if excess <= 0:
                break
            if entry.lock.locked or entry.lock.waiting:
                continue
            self._forget(entry)
            excess -= 1

    def _forget(self, entry: Entry) -> None:
        self.table.remove(entry)
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


def _close_quietly(session: Session) -> None:
    try:
        session.close()
    except KVAgentError as exc:  # the engine is closing
        log.debug("closing a session: %s", exc)


def field_values(segments: Sequence[Segment]) -> dict[str, object]:
    """Each field's current value: its declared value, overridden by the latest erratum."""
    return {str(s.name): s.value for s in segments if s.kind in (SegmentKind.FIELD, SegmentKind.ERRATUM)}

