"""The conversations of one ``ChatKVAgent``: its entries in the engine slot's session table, locked and opened
for each call (:meth:`Conversations.entered`), and the two drivers (sync, async) of its other operations
(``langchain_kvagent.operations``). A turn itself runs on the entry's ``kvagent.conversation.Conversation``."""

from __future__ import annotations

import asyncio
import time
import uuid
import weakref
from contextlib import asynccontextmanager, contextmanager
from typing import Any, AsyncIterator, Callable, Iterator, Protocol

from langchain_core.messages import BaseMessage

from kvagent.engine import Engine
from kvagent.eviction import Eviction
from kvagent.fields import FieldSpec
from kvagent.memory import Memory, MemoryBlock
from kvagent.segments import Segment
from kvagent.tools.sets import ToolSets
from kvagent.session import Session

from langchain_kvagent import operations as ops
from langchain_kvagent.convert import DEFAULT_SESSION, to_langchain
from langchain_kvagent.errors import UnknownSessionError
from langchain_kvagent.registry import EngineKey, EngineSlot, SessionEntry, Turn, slot
from langchain_kvagent.skills import skill_files, skill_segment



SIDE = "#side"


class ChatSettings(Protocol):
    """What the conversations read of their chat model (``ChatKVAgent``'s fields)."""

    model: str
    n_ctx: int
    n_seq_max: int
    n_gpu_layers: int | None
    capture: str
    policy: str | None
    fields: list[FieldSpec]
    memory: list[MemoryBlock]
    memory_position: str

    def declared_fields(self) -> list[FieldSpec]: ...

    skills: list[str]
    eviction: Eviction | None
    edit_strategy: str
    compile_skills: bool
    timeout: float | None



class Deadline:
    """When a streamed call must end (None: never); checked at each generated piece, since a sync generator
    cannot be cancelled from outside. Raising inside the session's stream block rolls the turn back."""

    def __init__(self, timeout: float | None, message: str) -> None:
        self.at = time.monotonic() + timeout if timeout is not None else None
        self.message = message

    def check(self) -> None:
        if self.at is not None and time.monotonic() > self.at:
            raise TimeoutError(self.message)


class Conversations:
    """One chat model's sessions, keyed by session key (the chat model's own namespace of the table)."""

    def __init__(self, model: ChatSettings) -> None:
        self.model, self.owner = model, uuid.uuid4().hex  # the owner: this chat model's namespace of the table
        self._finalizer: Any = None
        self.claimed: set[str] = set()
        """Threads whose session an agent middleware keys itself (``langchain_kvagent.middleware``)."""

    def claim(self, thread: str) -> None:
        """Session ``thread`` is an agent's: other calls on that thread's config get :meth:`thread_key`'s side one."""
        self.claimed.add(thread)

    def thread_key(self, thread: str) -> str:
        """The session a call keyed only by LangGraph's ``thread_id`` uses: the thread's own, or, where an agent
        middleware claimed it, ``f"{thread}{SIDE}"``, so a side call made on the thread's config (a tool selector's,
        a summarizer's) does not replace the agent's prompt."""
        return f"{thread}{SIDE}" if thread in self.claimed else thread

    def slot(self) -> EngineSlot:
        m = self.model
        return slot(EngineKey(m.model, m.n_ctx, m.n_seq_max, m.n_gpu_layers, m.capture))

    def engine(self) -> Engine:
        return self.slot().load()

    def _entry(self, key: str) -> SessionEntry:
        found, m = self.slot(), self.model
        if self._finalizer is None:  # once the chat model is gone its sessions are the first to close
            self._finalizer = weakref.finalize(m, found.orphan, self.owner)
        declared = m.declared_fields()
        return found.table.setdefault(self.owner, key, lambda: SessionEntry(
            self.owner, key, specs=tuple(declared), values={spec.name: spec.initial for spec in declared},
            eviction=m.eviction, memory=Memory(m.memory, m.memory_position) if m.memory else None))

    def toolsets(self) -> ToolSets:
        """Tool sets bound on the engine and their compiled segments, by content (loads the engine)."""
        return self.slot().toolsets

    def skill_segment(self, spec: Any, path: Any) -> Segment:
        return skill_segment(self.engine(), spec, path, compile=self.model.compile_skills, model=self.model.model)

    def open(self, entry: SessionEntry) -> None:
        """Open ``entry``'s session if it is not (resolving the chat model's skills on first use); lock held."""
        m = self.model
        if entry.active:
            return
        if entry.prologue is None:
            policy = [Segment.policy(m.policy, id="chat-model-policy")] if m.policy else []
            entry.prologue = [*policy, *(self.skill_segment(spec, path) for spec, path in skill_files(m.skills))]
        self.slot().open(entry, edit_strategy=m.edit_strategy)

    def enter(self, key: str | None) -> SessionEntry:
        """The entry of session ``key``, locked and open; the caller releases its lock."""
        entry = self._entry(DEFAULT_SESSION if key is None else str(key))
        entry.lock.acquire()
        try:
            entry.touch()
            self.open(entry)
        except BaseException:
            entry.lock.release()
            raise
        return entry

    async def aenter(self, key: str | None) -> SessionEntry:
        """:meth:`enter`, awaited (the model loads and the session opens in a thread, not on the loop)."""
        entry = await asyncio.to_thread(self._entry, DEFAULT_SESSION if key is None else str(key))
        await entry.lock.aacquire()
        try:
            entry.touch()
            await asyncio.to_thread(self.open, entry)
        except BaseException:
            entry.lock.release()
            raise
        return entry

    @contextmanager
    def entered(self, key: str | None) -> Iterator[SessionEntry]:
        """Session ``key``'s entry, locked and open for the block; a timeout inside is reported with the fix."""
        entry = self.enter(key)
        try:
            yield entry
        except TimeoutError:
            raise TimeoutError(self.timeout_message()) from None
        finally:
            entry.lock.release()

    @asynccontextmanager
    async def aentered(self, key: str | None) -> AsyncIterator[SessionEntry]:
        """:meth:`entered`, awaited."""
        entry = await self.aenter(key)
        try:
            yield entry
        except TimeoutError:
            raise TimeoutError(self.timeout_message()) from None
        finally:
            entry.lock.release()

    def apply(self, key: str | None, operation: Callable[[SessionEntry], ops.Operation[Any]]) -> Any:
        """Run ``operation(entry)`` on session ``key`` in this thread."""
        with self.entered(key) as entry:
            return ops.run_steps(entry, operation(entry), self.model.timeout)

    async def aapply(self, key: str | None, operation: Callable[[SessionEntry], ops.Operation[Any]]) -> Any:
        """:meth:`apply`, awaited."""
        async with self.aentered(key) as entry:
            return await ops.arun_steps(entry, operation(entry), self.model.timeout)

    def deadline(self) -> Deadline:
        return Deadline(self.model.timeout, self.timeout_message())

    def timeout_message(self) -> str:
        return (f"ChatKVAgent call took longer than timeout={self.model.timeout}s: cancelled and rolled back; raise "
                "the timeout or lower max_tokens")

    # -- reading ------------------------------------------------------------------------------------
    def find(self, key: str | None) -> SessionEntry | None:
        return self.slot().find(self.owner, DEFAULT_SESSION if key is None else str(key))

    def session(self, key: str | None) -> Session:
        found = self.find(key)
        if found is None or not found.active:
            key = DEFAULT_SESSION if key is None else str(key)
            open_ = ", ".join(repr(k) for k in self.ids()) or "none"
            reason = ("it was closed to free a sequence for another (raise n_seq_max to keep more open); it "
                      "reopens on its next call") if found is not None else "sessions open on their first call"
            raise UnknownSessionError(
                f"no open session {key!r} on this ChatKVAgent: {reason}, e.g. model.invoke(messages, "
                f"session_id={key!r}); open sessions: {open_}")
        return found.live

    def ids(self) -> list[str]:
        return [k for k in self.slot().keys(self.owner) if (e := self.find(k)) is not None and e.active]

    def messages(self, key: str | None) -> list[BaseMessage]:
        found = self.find(key)
        return [to_langchain(m) for m in found.conversation.messages] if found is not None else []

    def turns(self, key: str | None) -> list[Turn]:
        found = self.find(key)
        return list(found.turns) if found is not None else []

    def close(self, key: str | None, *, retain: bool = True) -> bool:
        return self.slot().close_entry(self.owner, DEFAULT_SESSION if key is None else str(key), retain=retain)
