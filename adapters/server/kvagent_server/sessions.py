"""The server's sessions: keys, live sessions on the engine's sequences, and parking.

Entries live in kvagent's :class:`~kvagent.sessions.SessionTable`, keyed by (tenant, kind, key): each tenant's
``session`` namespace holds what ``POST /v1/sessions`` and restores made, its ``prompt_cache_key`` and ``user``
namespaces what chat requests keyed that way made, so neither kind can be created ahead of the other and another
tenant's key is simply not there (404). Every session opens in its tenant's prefix-index scope
(``engine.session(scope=...)``), narrowed by the ``cache_salt`` of the request that made it and, for a tenant whose
``cache_scope`` is ``session``, by its session key (:func:`scope_of`): it starts only from cells of that scope, so
``cached_tokens`` and timing say nothing of another tenant's prompts (or another salt's, or another key's). Keyed
entries unused for ``session_idle_s`` are forgotten (checked at most once a second, on the next request).
Every entry is either *active* (``entry.session`` is a live session on one of the engine's sequences) or
*parked* (``entry.parked`` holds its segments and, unless the session evicted, its saved KV in a file).
A request works on an entry only while it holds the entry's lock. When a new request needs a sequence
or KV cells that are all taken, idle entries (lock free, no request waiting for them) are parked, least
recently used first (the table's reclaim, with :class:`ParkToDisk` as its parking hook): saved with
``session.save()``, closed, and restored on their next request with ``session.restore()``; where
``session.save()`` refuses a session, its segments are kept and prefilled again. Nothing a client sent is lost
by parking: segments, field values, errata, skills and the messages log stay in the entry. When nothing is
idle the request is refused with 503 (``Busy``).

Parked KV files are ``0600`` in the park folder (``0700``); a tenant's parked bytes are bounded by its quota and the
disk's free space by ``min_free_disk_mb``: past either, the session parks without its KV (prefilled again later).
A session holds its lock from the moment it is created or restored until its prefill and skills are in, so a chat
request on the same id waits and then sees the whole session.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
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
from kvagent.memory import MemoryBlock
from kvagent.generation import ReplyTokens
from kvagent.conversation import Conversation
from kvagent.segments import Segment
from kvagent.session import Session
from kvagent.sessions import LRU, NoRoom, SessionTable, TableEntry

from kvagent_server.errors import Busy, Conflict, InvalidRequest, NotFound, Quota
from kvagent_server.front import SESSION  # made by POST /v1/sessions or a restore
from kvagent_server.metrics import Metrics
from kvagent_server.tenants import Tenant

log = logging.getLogger(__name__)
T = TypeVar("T")
CHAT_KINDS = ("prompt_cache_key", "user")  # keyed by chat requests, made on first use
KINDS = (SESSION, *CHAT_KINDS)
_TEMPORARY = "~temporary"  # requests without a session key: one entry each, closed after the request


def namespace(tenant: str, kind: str) -> str:
    """The table namespace of one tenant's sessions of one kind (the unit separator never occurs in a name)."""
    return f"{tenant}\x1f{kind}"


def scope_of(tenant: Tenant, salt: str | None = None, key: str | None = None) -> str | None:
    """The prefix-index scope of a tenant's session: the tenant's, narrowed by a request's ``cache_salt`` (its
    digest, :func:`salt_digest`) and, for a tenant whose ``cache_scope`` is ``session``, by the session's ``key``
    (its kind and key). None: a scope of the request's own, shared with nothing (a keyless request without a salt
    under ``session``)."""
    scope = tenant_scope(tenant)
    if salt is not None:
        scope += f"\x1fsalt:{salt}"
    if tenant.cache_scope == "session":
        if key is None and salt is None:
            return None
        if key is not None:
            scope += f"\x1fsession:{key}"
    return scope


def tenant_scope(tenant: Tenant) -> str:
    """The scope of what a tenant's sessions all share: its compiled tools and its renderer's memo."""
    return f"tenant:{tenant.name}"


def salt_digest(salt: str | None) -> str | None:
    """What the server keeps of a request's ``cache_salt``: its sha256 (the salt itself is never stored)."""
    return None if salt is None else hashlib.sha256(salt.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class SessionOptions:
    """How an entry's sessions are opened (again after each parking)."""

    fields: tuple[FieldSpec, ...] = ()
    eviction: Eviction | None = None
    edit_strategy: str = "auto"
    compact_after: int | None = None
    """Errata kept before they are folded back into their fields (``Session.compact``)."""
    memory: tuple[MemoryBlock, ...] = ()
    """Memory blocks (``kvagent.memory``): each is also one of ``fields``, under its label."""


@dataclass(frozen=True)
class Parked:
    """A parked entry: its prompt, and the file with its saved KV (None: prefill the segments again)."""

    segments: tuple[Segment, ...]
    blob: Path | None
    n_tokens: int
    size: int = 0
    """Bytes of the blob file (counted against the tenant's parked-bytes quota)."""


@dataclass(eq=False)
class Entry(TableEntry):
    """One session key and everything the server keeps for it."""

    tenant: Tenant | None = None
    kind: str = SESSION
    explicit: bool = False
    """Made by ``POST /v1/sessions`` or a restore (never forgotten); else keyed by a chat request."""
    options: SessionOptions = field(default_factory=SessionOptions)
    static: list[Segment] = field(default_factory=list)
    """Segments the server added (policy, fields, memory, skills): ``Conversation.plan``'s ``static``."""
    conversation: Conversation = field(default_factory=Conversation)
    """The messages the prompt holds, and the last request's tool segments (after ``static``)."""
    replies: ReplyTokens = field(default_factory=ReplyTokens)
    parked: Parked | None = None
    deleted: bool = False
    evicted_seen: int = 0
    restored: bool = False
    """Restored from a client's snapshot: its cells are never published to the prefix index (even after parking)."""
    salt: str | None = None
    """The digest of the ``cache_salt`` of the request that made it (:func:`salt_digest`); later requests keep it."""
    scope: str = ""
    """The prefix-index scope its sessions open in (:func:`scope_of`)."""
    retain: bool = True
    """Whether its cells are retained when it closes (not where its scope is its own: nobody could reuse them)."""

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
    """The table's parking hook: save the session's KV to a file in ``folder`` (mode 0600), close it, keep its
    segments. A blob that would take the tenant past its parked-bytes quota, or the disk below ``min_free``
    bytes, is not written: the session keeps its segments and is prefilled again."""

    def __init__(self, folder: Path, metrics: Metrics, min_free: int = 0) -> None:
        self.folder, self.metrics, self.min_free = folder, metrics, min_free
        self.bytes: dict[str, int] = {}  # parked KV bytes by tenant

    def park(self, entry: Entry) -> bool:
        session = entry.session
        if session is None:
            return False
        segments = tuple(session.segments)
        path: Path | None = None
        size = 0
        try:
            blob = session.save()
            self._room_for(entry, len(blob))
            path = self.folder / f"{uuid.uuid4().hex}.kv"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(blob)
            size = len(blob)
        except (KVAgentError, OSError) as exc:  # a cache that cannot be saved: prefill its segments later
            log.info("parking session %r without its KV (%s): its segments will be prefilled again", entry.key, exc)
            if path is not None:
                path.unlink(missing_ok=True)
            path = None
        n_tokens = len(session.tokens)
        _close_quietly(session, retain=entry.retain)
        entry.session, entry.parked = None, Parked(segments, path, n_tokens, size)
        if entry.tenant is not None and size:
            self.bytes[entry.tenant.name] = self.bytes.get(entry.tenant.name, 0) + size
        self.metrics.parked.inc()
        log.debug("parked session %r (%d tokens)", entry.key, n_tokens)
        return False

    def _room_for(self, entry: Entry, size: int) -> None:
        tenant = entry.tenant
        if tenant is not None and self.bytes.get(tenant.name, 0) + size > tenant.max_parked_bytes:
            raise OSError(f"tenant {tenant.name!r} would pass its parked-bytes quota ({tenant.max_parked_bytes >> 20} MiB)")
        if shutil.disk_usage(self.folder).free - size < self.min_free:
            raise OSError(f"the park folder's disk would keep less than {self.min_free >> 20} MiB free")

    def dropped(self, entry: Entry) -> None:
        """The entry's blob file was removed: its bytes leave the tenant's count."""
        parked = entry.parked
        if parked is not None and parked.size and entry.tenant is not None:
            self.bytes[entry.tenant.name] = max(0, self.bytes.get(entry.tenant.name, 0) - parked.size)


class SessionManager:
    """Entries by key in a session table, parking and restoring them as sequences and cells run out."""

    def __init__(self, engine: AsyncEngine, metrics: Metrics, park_dir: Path, *, max_parked: int = 1024,
                 retry_after_s: int = 1, min_free_bytes: int = 0, compact_after: int | None = None,
                 libraries: Callable[[Tenant], object] | None = None, session_idle_s: int = 0) -> None:
        self.engine = engine
        self.metrics = metrics
        self.park_dir = park_dir
        self.max_parked = max_parked
        self.retry_after_s = retry_after_s
        self.compact_after = compact_after
        self.libraries = libraries  # the skill library of a tenant's sessions (None: the engine's)
        self.session_idle_s = session_idle_s  # keyed entries unused this long are forgotten (0: never)
        self._swept = 0.0
        self.parking = ParkToDisk(park_dir, metrics, min_free_bytes)
        # one sequence kept free beside the sessions: a scratch for skill transplants and splicing edits
        self.table: SessionTable[Entry] = SessionTable(engine.engine, strategy=LRU(), parking=self.parking, spare=1)
        self._admission = asyncio.Lock()  # making room and opening the session it was made for, one at a time
        self.n_ctx = engine.engine.backend.n_ctx
        self.renderer = engine.engine.renderer(True)
        metrics.watch(active=lambda: float(self.active_count), parked=lambda: float(self.parked_count),
                      cells=lambda: float(self.cells_used()), total=self.n_ctx)
        metrics.watch_retained(engine.engine)

    # -- reading ----------------------------------------------------------------------------------
    def entries_of(self, tenant: Tenant, kind: str | None = None) -> list[Entry]:
        """A tenant's keyed entries (of one kind, or all; temporary ones left out), oldest first."""
        kinds = KINDS if kind is None else (kind,)
        return [e for k in kinds for e in self.table.entries(namespace(tenant.name, k))]

    @property
    def keyed(self) -> list[Entry]:
        """Every tenant's keyed entries (temporary ones left out)."""
        return [e for e in self.table.entries() if e.kind in KINDS and not e.namespace.endswith(_TEMPORARY)]

    @property
    def active_count(self) -> int:
        return sum(e.active for e in self.table.entries())

    @property
    def parked_count(self) -> int:
        return sum(e.parked is not None for e in self.keyed)

    def get(self, tenant: Tenant, key: str, kind: str = SESSION) -> Entry:
        """The tenant's entry of ``kind`` and ``key``; 404 when there is none (another tenant's is none)."""
        entry = self.table.get(namespace(tenant.name, kind), key)
        if entry is None:
            hint = ("create it with POST /v1/sessions" if kind == SESSION else
                    f"a chat request with {kind} {key!r} makes it")
            raise NotFound(f"unknown session {key!r} ({kind}): {hint}", param="session", code="session_not_found")
        return entry

    def cells_used(self) -> int:
        """KV cells the live sessions hold, cells shared between sequences counted once (``SessionTable``)."""
        return self.table.cells_used()

    # -- creating, using, deleting ------------------------------------------------------------------
    @asynccontextmanager
    async def creating(self, tenant: Tenant, key: str, static: Sequence[Segment], options: SessionOptions, *,
                       restored: bool = False, salt: str | None = None) -> AsyncIterator[Entry]:
        """A new explicit entry of ``tenant`` whose prompt is ``static``, active and locked until the block ends
        (the caller prefills it and includes its skills there: a request on the same id waits, then sees it
        whole). 409 if ``key`` is taken, 429 past the tenant's session quota; a block that fails forgets the
        entry (nothing was created). ``salt``: the digest of its ``cache_salt``."""
        await self._expire()
        if len(self.entries_of(tenant)) >= tenant.max_sessions:
            raise Quota(f"this key holds {tenant.max_sessions} sessions, its quota: delete one first "
                        "(DELETE /v1/sessions/{id})", self.retry_after_s, param="id")
        entry = self._entry(tenant, SESSION, key, salt, explicit=True, options=options, static=list(static),
                            restored=restored)
        if not self.table.add(entry):
            raise Conflict(f"session {key!r} already exists: delete it first or use another id", param="id")
        await entry.lock.aacquire()
        try:
            try:
                await self._activate(entry)
                with self._running():
                    yield entry
            except BaseException:
                self._forget(entry)
                await _close(entry)
                raise
        finally:
            entry.last_used = time.monotonic()
            entry.lock.release()

    @asynccontextmanager
    async def use(self, tenant: Tenant, key: str | None, kind: str = SESSION, *,
                  implicit: bool = True, salt: str | None = None) -> AsyncIterator[Entry]:
        """The tenant's entry of ``kind`` and ``key``, active and locked for this request. ``key=None``: a
        temporary session, closed afterwards; an unknown key makes an implicit entry (``implicit``, chat kinds
        only) or is a 404. ``salt``: the digest of the request's ``cache_salt``; an entry made with another is a
        422 (a session keeps the salt it was made with)."""
        await self._expire()
        if key is None:
            entry = self._entry(tenant, _TEMPORARY, uuid.uuid4().hex, salt)
            self.table.add(entry)
            await entry.lock.aacquire()
            try:
                await self._activate(entry)
                with self._running():
                    yield entry
            finally:
                self.table.remove(entry)
                await _close(entry)
                entry.lock.release()
            return
        ns = namespace(tenant.name, kind)
        entry = self.table.get(ns, key)
        if entry is None:
            if not implicit or kind == SESSION:
                self.get(tenant, key, kind)  # raises NotFound
            await self._make_room_for_a_key(tenant)
            entry = self.table.setdefault(ns, key, lambda: self._entry(
                tenant, kind, key, salt, options=SessionOptions(compact_after=self.compact_after)))
        if salt is not None and entry.salt != salt:
            raise InvalidRequest(f"session {key!r} ({kind}) was made with another cache_salt, or none: send the "
                                 "salt it was made with, none, or another session key", param="cache_salt")
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
                # an implicit entry that never came to life leaves no ghost, unless others wait for it (they try
                # again themselves); an explicit one keeps its segments for the next try
                if (not entry.explicit and entry.session is None and entry.parked is None
                        and entry.lock.waiting == 0 and not entry.conversation.messages):
                    self._forget(entry)
                raise
            with self._running():
                yield entry
        finally:
            entry.last_used = time.monotonic()
            entry.lock.release()

    def _entry(self, tenant: Tenant, kind: str, key: str, salt: str | None, **fields: object) -> Entry:
        """A new entry of ``tenant``, in the scope its kind, key and salt give (:func:`scope_of`)."""
        scope = scope_of(tenant, salt, None if kind == _TEMPORARY else f"{kind}:{key}")
        own = scope is None
        return Entry(namespace(tenant.name, kind), key, tenant=tenant, kind=kind, salt=salt,  # type: ignore[arg-type]
                     scope=f"{tenant_scope(tenant)}\x1frequest:{key}" if own else scope, retain=not own, **fields)

    async def _expire(self) -> None:
        """Forget the keyed entries unused for ``session_idle_s`` (checked at most once a second): each is closed as
        a session a client ended (its cells retained for its scope) and its parked file removed."""
        now = time.monotonic()
        if not self.session_idle_s or now - self._swept < 1.0:
            return
        self._swept = now
        for entry in self.keyed:
            if now - entry.last_used < self.session_idle_s or not entry.lock.try_acquire():
                continue
            try:
                log.info("session %r (%s) unused for %d s: forgotten", entry.key, entry.kind, now - entry.last_used)
                self._forget(entry)
                self.metrics.expired.inc()
                await _close(entry)
            finally:
                entry.lock.release()

    async def _make_room_for_a_key(self, tenant: Tenant) -> None:
        """Before a new chat key: past the tenant's session quota, forget its least recently used idle chat
        entry (its client resends the history); 429 when none is idle."""
        held = self.entries_of(tenant)
        if len(held) < tenant.max_sessions:
            return
        for victim in sorted((e for e in held if not e.explicit), key=lambda e: e.last_used):
            if not victim.lock.try_acquire():  # in use, awaited, or being parked
                continue
            try:
                self._forget(victim)  # out of the table first: a request that finds it later gets a 404
                await _close(victim)
            finally:
                victim.lock.release()
            return
        raise Quota(f"this key holds {tenant.max_sessions} sessions, its quota, and none is idle: retry shortly "
                    "or delete one", self.retry_after_s)

    async def delete(self, tenant: Tenant, key: str, kind: str = SESSION) -> None:
        entry = self.get(tenant, key, kind)
        entry.deleted = True
        self.table.remove(entry)
        await entry.lock.aacquire()
        try:
            await _close(entry, retain=False)  # a deleted session leaves nothing: its cells are not retained
            self._drop_blob(entry)
        finally:
            entry.lock.release()

    async def close(self) -> None:
        for entry in self.table.entries():
            await _close(entry)
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
            tenant = entry.tenant
            library = self.libraries(tenant) if (self.libraries is not None and tenant is not None) else None
            session = await self.engine.session(segments, fields=list(opts.fields), eviction=opts.eviction,
                                                edit_strategy=opts.edit_strategy, compact_after=opts.compact_after,
                                                scope=entry.scope,
                                                skills=library)
        session.session.replies = entry.replies  # the memory of generated turns outlives the sequence
        entry.evicted_seen = 0
        if parked is not None:
            try:
                await self._restore(session, parked, share=not entry.restored)
            except BaseException:
                await asyncio.to_thread(_close_quietly, session.session)
                raise
            self._drop_blob(entry)
            entry.parked = None
            self.metrics.restored.inc()
        entry.session = session.session

    async def _restore(self, session: AsyncSession, parked: Parked, *, share: bool) -> None:
        if parked.blob is not None:
            try:
                blob = await asyncio.to_thread(parked.blob.read_bytes)
                await session.arestore(blob, parked.segments, share=share)
                return
            except (OSError, KVAgentError) as exc:
                log.warning("restoring a parked session from %s failed (%s): prefilling its segments again",
                            parked.blob, exc)
        await session.areplace(parked.segments)

    def _trim_parked(self) -> None:
        """Forget implicit parked entries beyond ``max_parked``: those of the namespace holding the most first, least
        recently used first within it."""
        excess = self.parked_count - self.max_parked
        if excess <= 0:
            return
        implicit = [e for e in self.keyed if e.parked is not None and not e.explicit]
        held: dict[str, int] = {}
        for e in implicit:
            held[e.namespace] = held.get(e.namespace, 0) + 1
        # the tenant (and kind) holding the most parked chat sessions gives way first: one tenant's many keys do
        # not push out another's few
        parked = sorted(implicit, key=lambda e: (-held[e.namespace], e.last_used))
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

    def _drop_blob(self, entry: Entry) -> None:
        if entry.parked is not None and entry.parked.blob is not None:
            entry.parked.blob.unlink(missing_ok=True)
            self.parking.dropped(entry)
            entry.parked = Parked(entry.parked.segments, None, entry.parked.n_tokens)

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


async def _close(entry: Entry, *, retain: bool | None = None) -> None:
    """Close ``entry``'s session, if it has one, off the event loop: its cells retained as ``entry.retain`` says
    (``retain`` overrides)."""
    session, entry.session = entry.session, None
    if session is not None:
        await asyncio.to_thread(_close_quietly, session, retain=entry.retain if retain is None else retain)


def _close_quietly(session: Session, *, retain: bool = True) -> None:
    try:
        session.close(retain=retain)
    except KVAgentError as exc:  # the engine is closing
        log.debug("closing a session: %s", exc)

