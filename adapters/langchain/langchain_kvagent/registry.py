"""Process-wide engines, and the sessions chat models open on them.

One :class:`EngineSlot` per :class:`EngineKey` (model and engine settings); its engine loads on first use,
so constructing a chat model never loads weights. A slot keeps the sessions chat models opened on its engine
in kvagent's :class:`~kvagent.sessions.SessionTable`, as :class:`SessionEntry` keyed by (owner, session key):
each chat model instance is one namespace, so two instances never share a conversation. When the engine runs
short of free sequences (one is kept free for skill transplants and KV splices), the least recently used idle
session is closed (those of collected chat models first); its entry stays, with its field values and skills,
and its conversation is rebuilt from the history the client resends on its next call.

Invariant: an entry's :class:`~kvagent.conversation.Conversation` describes the message segments its session
holds, because every change the adapter makes to a session happens while holding the entry's lock.
"""

from __future__ import annotations

import atexit
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from kvagent.engine import Engine
from kvagent.conversation import Conversation, Cost, Plan
from kvagent.messages import ChatMessage, is_message_segment
from kvagent.tools.sets import ToolSets
from kvagent.segments import Segment
from kvagent.sessions import NoRoom, OrphansFirst, SessionTable, TableEntry

if TYPE_CHECKING:
    from kvagent.eviction import Eviction
    from kvagent.fields import FieldSpec
    from kvagent.memory import Memory
    from kvagent.session import Session

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineKey:
    """What makes two chat models share an engine: the model and the engine settings they name."""

    model: str
    n_ctx: int
    n_seq_max: int
    n_gpu_layers: int | None
    capture: str = "none"

    def load(self) -> Engine:
        return Engine.load(self.model, n_ctx=self.n_ctx, n_seq_max=self.n_seq_max, n_gpu_layers=self.n_gpu_layers,
                           capture=self.capture)


Turn = Cost
"""What one generation cost (``kvagent.conversation.Cost``), under the name the chat model's ``turns()`` use."""


@dataclass(eq=False)
class SessionEntry(TableEntry):
    """One conversation of one chat model (namespace: the chat model, key: the session key): its session (None
    while closed) and what rebuilds it.

    ``prologue``: the chat model's own policy and skill segments (resolved once); ``skills``: skills
    included later; ``values``: field values a fresh prompt renders (a session holding a conversation
    keeps its own, errata included).
    """

    specs: tuple[FieldSpec, ...] = ()
    values: dict[str, object] = field(default_factory=dict)
    prologue: list[Segment] | None = None
    skills: list[Segment] = field(default_factory=list)
    eviction: Eviction | None = None
    memory: Memory | None = None
    """The session's memory blocks (``kvagent.memory``; a tail's values live here)."""
    conversation: Conversation = field(default_factory=Conversation)

    @property
    def live(self) -> Session:
        """The open session (only while holding the lock, once opened)."""
        if self.session is None or self.session.closed:
            raise RuntimeError("session entry used while closed (internal error)")
        return self.session

    @property
    def fresh(self) -> bool:
        """The session holds no conversation yet: fields and skills still go into the prompt's head."""
        return self.session is None or not any(is_message_segment(s) for s in self.session.segments)

    @property
    def turns(self) -> list[Cost]:
        return self.conversation.costs

    def field_values(self) -> dict[str, object]:
        return dict(self.values) if self.fresh else {**self.values, **self.live.field_values}

    def plan(self, messages: Sequence[ChatMessage], max_tokens: int, tools: Sequence[Segment] = ()) -> Plan:
        """The turn answering ``messages`` (the history the client resent): the chat model's policy and skills, the
        call's ``tools`` and the declared fields after the leading system messages (``Conversation.plan``)."""
        fields = [spec.segment(self.values.get(spec.name, spec.initial)) for spec in self.specs]
        return self.conversation.plan(self.live, messages, max_tokens, static=[*(self.prologue or []), *self.skills],
                                      tools=tools, fields=fields, memory=self.memory)

    def forget(self) -> Session | None:
        """Keep what rebuilds the prompt, drop what describes the cache; returns the session to close."""
        session = self.session
        if session is not None and not self.fresh:
            self.values.update({k: v for k, v in session.field_values.items() if k in self.values})
        self.session = None
        self.conversation.forget()
        return session


class ForgetParking:
    """A reclaimed conversation is closed and rebuilt from the history its client resends (entries of a
    collected chat model are forgotten)."""

    def park(self, entry: SessionEntry) -> bool:
        session = entry.forget()
        if session is not None:
            session.close()
        return entry.orphaned


class EngineSlot:
    """One engine (loaded on first use) and the session table on it."""

    def __init__(self, key: EngineKey) -> None:
        self.key = key
        self.engine: Engine | None = None
        self._table: SessionTable[SessionEntry] | None = None
        self._toolsets: ToolSets | None = None
        self._load_lock = threading.Lock()

    @property
    def loaded(self) -> bool:
        return self.engine is not None

    def load(self) -> Engine:
        """The engine, loaded once (concurrent callers wait for the one load)."""
        if self.engine is None:
            with self._load_lock:
                if self.engine is None:
                    engine = self.key.load()
                    self._table = SessionTable(engine, strategy=OrphansFirst(), parking=ForgetParking(), spare=1)
                    self._toolsets = ToolSets(engine)
                    self.engine = engine
                    log.info("loaded %s for the LangChain adapter (%s)", engine.model.name, self.key)
        return self.engine

    @property
    def table(self) -> SessionTable[SessionEntry]:
        """The sessions on the engine (loading it)."""
        self.load()
        assert self._table is not None  # set with the engine
        return self._table

    @property
    def toolsets(self) -> ToolSets:
        """The tool sets chat models bound on the engine and their compiled segments, by content (loading it)."""
        self.load()
        assert self._toolsets is not None  # set with the engine
        return self._toolsets

    # -- entries -----------------------------------------------------------------------------------
    def find(self, owner: str, key: str) -> SessionEntry | None:
        return self._table.get(owner, key) if self._table is not None else None

    def keys(self, owner: str) -> list[str]:
        return self._table.keys(owner) if self._table is not None else []

    def open(self, entry: SessionEntry, *, edit_strategy: str) -> Session:
        """Open ``entry``'s session (empty prompt), closing idle ones first when sequences run short.
        Call while holding ``entry``'s lock."""
        engine, table = self.load(), self.table
        try:
            table.make_room(sequences=1, keep=entry)
        except NoRoom:  # every other session is working: the last sequences go to this one (no scratch left)
            pass
        entry.session = engine.session([], fields=entry.specs, edit_strategy=edit_strategy, eviction=entry.eviction)
        entry.conversation.forget()
        return entry.session

    def close_entry(self, owner: str, key: str, *, retain: bool = True) -> bool:
        """Close and forget one session (its cells retained for later sessions unless ``retain`` is False); False if
        there is none."""
        entry = self.find(owner, key)
        if entry is None:
            return False
        self.table.remove(entry)
        entry.lock.acquire()
        try:
            session = entry.forget()
            if session is not None:
                session.close(retain=retain)
        finally:
            entry.lock.release()
        return True

    def orphan(self, owner: str) -> None:
        """``owner`` is gone: its sessions are the first to close. Safe from a finalizer (takes no lock)."""
        if self._table is not None:
            self._table.orphan(owner)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine, self._table, self._toolsets = None, None, None


_slots: dict[EngineKey, EngineSlot] = {}
_slots_lock = threading.Lock()


def slot(key: EngineKey) -> EngineSlot:
    """The slot for ``key`` (created unloaded: nothing is loaded here)."""
    found = _slots.get(key)
    if found is None:
        with _slots_lock:
            found = _slots.setdefault(key, EngineSlot(key))
    return found


def loaded_engines() -> list[Engine]:
    return [s.engine for s in list(_slots.values()) if s.engine is not None]


@atexit.register
def close_all() -> None:
    """Close every engine the adapter loaded (sessions first, then the model)."""
    with _slots_lock:
        slots = list(_slots.values())
        _slots.clear()
    for s in slots:
        try:
            s.close()
        except Exception as exc:  # at exit: report, keep closing the others
            log.warning("closing %s failed: %s", s.key, exc)
