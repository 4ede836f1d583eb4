"""SessionTable: the sessions adapters keep on one engine by (namespace, key), and which idle one gives way.

Adapters (the LangChain chat model, the HTTP server) keep conversations by a key their callers send. Each
entry belongs to a *namespace* (a chat model instance, a server tenant): keys of two namespaces never meet.
When the engine runs short of free sequences or of KV cells, the table *reclaims* an idle entry (its lock
free, nobody waiting for it): the :class:`ReclaimStrategy` orders the candidates, SGLang's
``get_priority`` shape (``python/sglang/srt/mem_cache/evict_policy.py``: lowest priority goes first), and
the :class:`Parking` hook decides what becomes of it (closed and rebuilt from the resent history, or saved
to disk and restored on its next use). Callers take an entry's lock for every change to its session, so a
reclaim never meets a request halfway.

The sync and async drivers (``make_room`` / ``amake_room``) share one body: the async one runs it in a thread, since parking saves KV through the engine's scheduler and may write files.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Generic, Iterator, Protocol, TypeVar

from kvagent.errors import KVAgentError
from kvagent.sessions.lock import EntryLock

if TYPE_CHECKING:
    from kvagent.engine import Engine
    from kvagent.session import Session

log = logging.getLogger(__name__)


class NoRoom(KVAgentError):
    """Every sequence or KV cell is held by a session that is working, and no idle one can give way."""


@dataclass(eq=False)
class TableEntry:
    """One keyed conversation: its live session (None while parked or closed) and its lock.

    Adapters subclass it with what they keep beside the session (histories, options, parked state).
    """

    namespace: str
    key: str
    session: Session | None = None
    last_used: float = field(default_factory=time.monotonic)
    hits: int = 0
    orphaned: bool = False
    """Its namespace's owner is gone (a chat model instance was collected): reclaimed before the others."""
    lock: EntryLock = field(default_factory=EntryLock, repr=False)

    @property
    def active(self) -> bool:
        """It holds an open session."""
        return self.session is not None and not self.session.closed

    @property
    def idle(self) -> bool:
        """Active, and neither in use nor awaited: a reclaim may take it."""
        return self.active and not self.lock.locked and self.lock.waiting == 0

    def touch(self) -> None:
        self.last_used = time.monotonic()
        self.hits += 1


E = TypeVar("E", bound=TableEntry)


class ReclaimStrategy(ABC):
    """Which idle entry gives way first: the one with the lowest :meth:`get_priority`."""

    @abstractmethod
    def get_priority(self, entry: TableEntry) -> float | tuple[float, ...]:
        """The entry's priority (compared between entries; lowest is reclaimed first)."""


class LRU(ReclaimStrategy):
    """Least recently used first."""

    def get_priority(self, entry: TableEntry) -> float:
        return entry.last_used


class LFU(ReclaimStrategy):
    """Least often used first, least recently used among equals."""

    def get_priority(self, entry: TableEntry) -> tuple[float, float]:
        return (float(entry.hits), entry.last_used)


@dataclass(frozen=True)
class OrphansFirst(ReclaimStrategy):
    """Entries whose owner is gone go before every other; ``inner`` orders within each group."""

    inner: ReclaimStrategy = field(default_factory=LRU)

    def get_priority(self, entry: TableEntry) -> tuple[float, ...]:
        inner = self.inner.get_priority(entry)
        return (float(not entry.orphaned), *(inner if isinstance(inner, tuple) else (inner,)))


class Parking(Protocol[E]):  # type: ignore[misc]
    """What becomes of a reclaimed entry; called with the entry's lock held, from a thread (never the loop).
    It must leave ``entry.session`` closed (or None); it returns whether the table should forget the entry."""

    def park(self, entry: E) -> bool: ...


class CloseParking:
    """Close the session and forget the entry if its owner is gone (the adapter rebuilds it from the history)."""

    def park(self, entry: TableEntry) -> bool:
        if entry.session is not None:
            entry.session.close()
            entry.session = None
        return entry.orphaned


class SessionTable(Generic[E]):
    """Entries of one engine by (namespace, key); reclaims idle ones when sequences or cells run short.

    ``spare``: sequences kept free beside the sessions (a scratch sequence for skill transplants and KV splices).
    """

    def __init__(self, engine: Engine, *, strategy: ReclaimStrategy | None = None, parking: Parking[E] | None = None,
                 spare: int = 1) -> None:
        self.engine = engine
        self.strategy = strategy or LRU()
        self.parking: Parking[E] = parking or CloseParking()  # type: ignore[assignment]
        self.spare = max(0, min(spare, engine.backend.n_seq_max - 1))
        self._entries: dict[tuple[str, str], E] = {}
        self._lock = threading.Lock()  # the table itself
        self._room = threading.Lock()  # one make_room at a time: two callers must not both take the last room

    # -- entries ----------------------------------------------------------------------------------
    def get(self, namespace: str, key: str) -> E | None:
        return self._entries.get((namespace, key))

    def setdefault(self, namespace: str, key: str, make: Callable[[], E]) -> E:
        """The entry of ``(namespace, key)``, made by ``make()`` when there is none."""
        with self._lock:
            found = self._entries.get((namespace, key))
            if found is None:
                found = self._entries[(namespace, key)] = make()
            return found

    def add(self, entry: E) -> bool:
        """Add ``entry`` under its own namespace and key; False (nothing changed) when that key is taken."""
        with self._lock:
            if (entry.namespace, entry.key) in self._entries:
                return False
            self._entries[(entry.namespace, entry.key)] = entry
            return True

    def remove(self, entry: E) -> None:
        """Forget ``entry`` (its session is the caller's to close)."""
        with self._lock:
            if self._entries.get((entry.namespace, entry.key)) is entry:
                del self._entries[(entry.namespace, entry.key)]

    def entries(self, namespace: str | None = None) -> list[E]:
        """Entries of one namespace (every namespace: None), oldest added first."""
        with self._lock:
            return [e for (ns, _), e in self._entries.items() if namespace is None or ns == namespace]

    def keys(self, namespace: str) -> list[str]:
        return [e.key for e in self.entries(namespace)]

    def __len__(self) -> int:
        return len(self._entries)

    def orphan(self, namespace: str) -> None:
        """The owner of ``namespace`` is gone: its entries are reclaimed first. Takes no lock (safe from a
        finalizer)."""
        for entry in list(self._entries.values()):
            if entry.namespace == namespace:
                entry.orphaned = True

    # -- room -------------------------------------------------------------------------------------
    def cells_used(self, extra: Iterator[Session] | None = None) -> int:
        """KV cells the live sessions hold (those of the table and ``extra`` ones), cells shared between
        sequences counted once. Shared cells are prefixes (a session starts from another's cells); the pool
        records which pairs share up to which position; equal tokens alone do not mean shared cells."""
        pool = self.engine.pool
        sessions = [e.session for e in self.entries() if e.active]
        counted: list[int] = []
        total = 0
        for session in [*sessions, *(extra or ())]:
            if session is None or session.closed:
                continue
            seq, n = session.seq, len(session.tokens)
            overlap = max((min(pool.shared_upto(seq, t), n) for t in counted), default=0)
            total += n - overlap - len(session.evicted_positions)
            counted.append(seq)
        return max(0, total)

    def fits(self, sequences: int = 0, cells: int = 0, extra: Iterator[Session] | None = None) -> bool:
        """Whether ``sequences`` more sessions (beside the spare ones) and ``cells`` more KV cells fit now."""
        free_ok = sequences == 0 or self.engine.pool.free >= sequences + self.spare
        return free_ok and (cells == 0 or self.cells_used(extra) + cells <= self.engine.backend.n_ctx)

    def make_room(self, *, sequences: int = 0, cells: int = 0, keep: E | None = None, force: bool = False,
                  extra: Callable[[], Iterator[Session]] | None = None) -> int:
        """Reclaim idle entries (``strategy`` order, never ``keep``) until :meth:`fits`; returns how many gave
        way. ``force``: reclaim at least one (llama.cpp found no room where the count said there was some).
        :class:`NoRoom` names what is short when nothing idle is left."""
        reclaimed = 0
        with self._room:
            while force or not self.fits(sequences, cells, extra() if extra else None):
                force = False
                if not self.reclaim(keep):
                    short = ("sequence" if not self.fits(sequences, 0) else "room in the KV pool")
                    n_ctx = self.engine.backend.n_ctx
                    raise NoRoom(f"no free {short} ({self.engine.pool.free} free sequences, "
                                 f"{self.cells_used(extra() if extra else None)} of {n_ctx} cells held) and every "
                                 "other session is working: retry shortly")
                reclaimed += 1
        return reclaimed

    async def amake_room(self, *, sequences: int = 0, cells: int = 0, keep: E | None = None, force: bool = False,
                         extra: Callable[[], Iterator[Session]] | None = None) -> int:
        """:meth:`make_room`, awaited (run in a thread; returns at once when nothing needs to give way)."""
        if not force and self.fits(sequences, cells, extra() if extra else None):
            return 0
        return await asyncio.to_thread(self.make_room, sequences=sequences, cells=cells, keep=keep, force=force,
                                       extra=extra)

    def reclaim(self, keep: E | None = None) -> bool:
        """Park the idle entry with the lowest priority (not ``keep``); False when none is idle."""
        with self._lock:
            candidates = sorted((e for e in self._entries.values() if e is not keep and e.idle),
                                key=self.strategy.get_priority)
        for entry in candidates:
            if not entry.lock.try_acquire():
                continue  # taken in the meantime
            try:
                if not entry.active:
                    continue
                log.info("reclaiming idle session %r/%r to free room", entry.namespace, entry.key)
                if self.parking.park(entry):
                    self.remove(entry)
                return True
            finally:
                entry.lock.release()
        return False
