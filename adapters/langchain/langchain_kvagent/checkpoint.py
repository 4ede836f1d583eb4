"""``KVCheckpointer``: a LangGraph checkpointer that keeps each thread's KV snapshot beside its checkpoints.

A thread resumed from a checkpointer (a restarted process, another worker, a fork, a time-travelled checkpoint) starts
with a session that is not open, and the agent's first model call would prefill the whole history again. The wrapper
keeps the session's snapshot (``kvagent.sessions.Snapshot``: KV, prompt, history), signed, beside the checkpoint it
belongs to, keyed by (thread, namespace, checkpoint id); :class:`~langchain_kvagent.middleware.KVCacheMiddleware`
parks a snapshot at the end of a run (it is stored with the run's next checkpoint) and restores the newest one at or
before the checkpoint a run resumes from. Everything else is the wrapped saver's (``InMemorySaver``, ``SqliteSaver``,
any ``BaseCheckpointSaver``): the checkpoints themselves are unchanged.

Snapshots are bounded: at most ``keep_per_thread`` per thread and ``max_bytes`` in all (the oldest dropped first; one
larger than the bound is not kept, and the thread then resumes by prefilling). A snapshot is signed with ``secret``
(HMAC-SHA256, bound to its thread) and checked before it is read: a modified one, or one from another thread, is
refused with :class:`~kvagent.sessions.SnapshotSignatureError`; one from another model with
:class:`SnapshotModelError`; nothing changes either way. Without a ``secret`` the environment's
``KVAGENT_SNAPSHOT_SECRET`` is used, else a random one: snapshots then open only in the process that wrote them.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Collection, Iterator, Mapping, Protocol, Sequence

from cachetools import FIFOCache
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import BaseCheckpointSaver, CheckpointTuple

from kvagent.errors import KVAgentError
from kvagent.sessions import Snapshot
from kvagent.sessions.snapshot import MIN_SECRET, SnapshotSignatureError, sign, unsign

if TYPE_CHECKING:
    from langchain_kvagent.chat_models import ChatKVAgent

log = logging.getLogger(__name__)
SECRET_ENV = "KVAGENT_SNAPSHOT_SECRET"
WALK = 64
"""Checkpoints walked back from the resumed one to find a snapshot."""

Key = tuple[str, str, str]  # (thread id, checkpoint namespace, checkpoint id)


class SnapshotModelError(KVAgentError):
    """A thread's snapshot was saved by another model than the agent's."""


class SnapshotStore(Protocol):
    """Where snapshots are kept, by (thread, namespace, checkpoint id); bounded by the store."""

    def put(self, key: Key, data: bytes) -> bool: ...
    def get(self, key: Key) -> bytes | None: ...
    def delete_thread(self, thread: str) -> None: ...
    def size(self) -> int: ...


class MemorySnapshots:
    """Snapshots in this process's memory: at most ``keep_per_thread`` per thread and ``max_bytes`` in all."""

    def __init__(self, max_bytes: int = 1 << 30, keep_per_thread: int = 4) -> None:
        if max_bytes < 1 or keep_per_thread < 1:
            raise ValueError("MemorySnapshots needs max_bytes >= 1 and keep_per_thread >= 1")
        self.max_bytes, self.keep = max_bytes, keep_per_thread
        # the oldest written dropped first beyond max_bytes; a read changes nothing
        self._kept: FIFOCache[Key, bytes] = FIFOCache(maxsize=max_bytes, getsizeof=len)
        self._lock = threading.Lock()

    def put(self, key: Key, data: bytes) -> bool:
        if len(data) > self.max_bytes:
            return False
        with self._lock:
            # every entry is inserted afresh, so iteration runs oldest first; the thread's own oldest go before the
            # insertion drops other threads' snapshots for room
            self._kept.pop(key, None)
            mine = [k for k in self._kept if k[0] == key[0]]
            for old in mine[: max(0, len(mine) + 1 - self.keep)]:
                del self._kept[old]
            self._kept[key] = data
        return True

    def get(self, key: Key) -> bytes | None:
        with self._lock:
            return self._kept.get(key)

    def delete_thread(self, thread: str) -> None:
        with self._lock:
            for key in [k for k in self._kept if k[0] == thread]:
                del self._kept[key]

    def size(self) -> int:
        with self._lock:
            return self._kept.currsize


class SQLiteSnapshots:
    """Snapshots in a SQLite table (``kvagent_snapshots``), in a file of their own or in a ``SqliteSaver``'s
    connection (give its ``lock``); bounded as :class:`MemorySnapshots`."""

    def __init__(self, conn: sqlite3.Connection | str | Path, *, lock: Any = None, max_bytes: int = 4 << 30,
                 keep_per_thread: int = 4) -> None:
        if max_bytes < 1 or keep_per_thread < 1:
            raise ValueError("SQLiteSnapshots needs max_bytes >= 1 and keep_per_thread >= 1")
        self.conn = conn if isinstance(conn, sqlite3.Connection) else sqlite3.connect(str(conn),
                                                                                      check_same_thread=False)
        self.lock = lock or threading.Lock()
        self.max_bytes, self.keep = max_bytes, keep_per_thread
        with self.lock:
            self.conn.execute("CREATE TABLE IF NOT EXISTS kvagent_snapshots (thread_id TEXT NOT NULL, "
                              "checkpoint_ns TEXT NOT NULL, checkpoint_id TEXT NOT NULL, created REAL NOT NULL, "
                              "size INTEGER NOT NULL, data BLOB NOT NULL, "
                              "PRIMARY KEY (thread_id, checkpoint_ns, checkpoint_id))")
            self.conn.commit()

    def put(self, key: Key, data: bytes) -> bool:
        if len(data) > self.max_bytes:
            return False
        with self.lock:
            c = self.conn
            c.execute("INSERT OR REPLACE INTO kvagent_snapshots VALUES (?, ?, ?, ?, ?, ?)",
                      (*key, time.time(), len(data), sqlite3.Binary(data)))
            c.execute("DELETE FROM kvagent_snapshots WHERE thread_id = ? AND rowid NOT IN (SELECT rowid FROM "
                      "kvagent_snapshots WHERE thread_id = ? ORDER BY created DESC LIMIT ?)", (key[0], key[0], self.keep))
            total = c.execute("SELECT COALESCE(SUM(size), 0) FROM kvagent_snapshots").fetchone()[0]
            for rowid, size in c.execute("SELECT rowid, size FROM kvagent_snapshots ORDER BY created").fetchall():
                if total <= self.max_bytes:
                    break
                c.execute("DELETE FROM kvagent_snapshots WHERE rowid = ?", (rowid,))
                total -= size
            c.commit()
        return True

    def get(self, key: Key) -> bytes | None:
        with self.lock:
            row = self.conn.execute("SELECT data FROM kvagent_snapshots WHERE thread_id = ? AND checkpoint_ns = ? "
                                    "AND checkpoint_id = ?", key).fetchone()
        return bytes(row[0]) if row is not None else None

    def delete_thread(self, thread: str) -> None:
        with self.lock:
            self.conn.execute("DELETE FROM kvagent_snapshots WHERE thread_id = ?", (thread,))
            self.conn.commit()

    def size(self) -> int:
        with self.lock:
            return int(self.conn.execute("SELECT COALESCE(SUM(size), 0) FROM kvagent_snapshots").fetchone()[0])


def _secret(secret: bytes | str | None) -> bytes:
    if secret is None:
        secret = os.environ.get(SECRET_ENV) or os.urandom(32)
    data = secret.encode() if isinstance(secret, str) else bytes(secret)
    if len(data) < MIN_SECRET:
        raise ValueError(f"a snapshot secret needs at least {MIN_SECRET} bytes, got {len(data)}: use e.g. "
                         "secrets.token_hex(32)")
    return data


def _store_for(saver: BaseCheckpointSaver, max_bytes: int, keep: int) -> SnapshotStore:
    """Snapshots beside the saver's checkpoints where it keeps them in SQLite, else in memory."""
    conn = getattr(saver, "conn", None)
    if isinstance(conn, sqlite3.Connection):
        return SQLiteSnapshots(conn, lock=getattr(saver, "lock", None), max_bytes=max_bytes, keep_per_thread=keep)
    return MemorySnapshots(max_bytes, keep)


def _key(config: RunnableConfig) -> Key:
    c = config.get("configurable") or {}
    return str(c.get("thread_id", "")), str(c.get("checkpoint_ns", "")), str(c.get("checkpoint_id", ""))


class KVCheckpointer(BaseCheckpointSaver):
    """``saver`` with each thread's KV snapshot kept beside its checkpoints (see the module).

    ``snapshots``: where (default: a table in the saver's SQLite connection for ``SqliteSaver``, else memory);
    ``max_bytes`` and ``keep_per_thread`` bound the default store; ``secret`` signs them."""

    def __init__(self, saver: BaseCheckpointSaver, *, snapshots: SnapshotStore | None = None,
                 secret: bytes | str | None = None, max_bytes: int = 1 << 30, keep_per_thread: int = 4) -> None:
        if not isinstance(saver, BaseCheckpointSaver):
            raise TypeError(f"KVCheckpointer wraps a LangGraph checkpointer (BaseCheckpointSaver), got "
                            f"{type(saver).__name__}: e.g. KVCheckpointer(InMemorySaver())")
        super().__init__(serde=saver.serde)
        self.saver = saver
        self.snapshots = snapshots if snapshots is not None else _store_for(saver, max_bytes, keep_per_thread)
        self._secret = _secret(secret)
        self._pending: dict[str, bytes] = {}
        self._loaded: dict[str, RunnableConfig] = {}
        self._lock = threading.Lock()

    # -- snapshots ------------------------------------------------------------------------------------
    @staticmethod
    def meta(model: ChatKVAgent) -> dict[str, Any]:
        """What a snapshot says of the model that wrote it."""
        return {"model": model.model, "fingerprint": model.load_engine().fingerprint}

    @staticmethod
    def _context(thread: str) -> bytes:
        return f"kvagent-thread:{thread}".encode()

    def park(self, thread: str, snapshot: Snapshot) -> None:
        """Sign ``snapshot`` and keep it for thread ``thread``'s next checkpoint."""
        data = sign(snapshot.to_bytes(), self._secret, self._context(thread))
        with self._lock:
            self._pending[thread] = data

    def open(self, data: bytes, thread: str, model: ChatKVAgent) -> Snapshot:
        """The snapshot in ``data`` once its signature (for ``thread``) and its model (``model``'s) are checked."""
        source = f"thread {thread!r}'s KV snapshot"
        try:
            snapshot = Snapshot.from_bytes(unsign(data, self._secret, self._context(thread), source=source),
                                           source=source)
        except SnapshotSignatureError as exc:
            raise SnapshotSignatureError(f"{exc}; nothing was restored: delete the thread's snapshots "
                                         f"(checkpointer.snapshots.delete_thread({thread!r})) and it resumes by "
                                         "prefilling, or use the secret that saved them") from None
        mine = self.meta(model)
        if snapshot.meta.get("fingerprint") != mine["fingerprint"]:
            raise SnapshotModelError(
                f"{source} was saved by model {snapshot.meta.get('model')!r}, and this agent runs {mine['model']!r}: "
                "resume the thread with the model that saved it, or delete its snapshots "
                f"(checkpointer.snapshots.delete_thread({thread!r})) to resume by prefilling")
        return snapshot

    def snapshot(self, thread: str, model: ChatKVAgent) -> Snapshot | None:
        """The newest snapshot of ``thread`` at or before the checkpoint it stands at (the one its run loaded, or the
        last one put since; checked), or None."""
        config: RunnableConfig | None = self._loaded.get(thread) or {"configurable": {"thread_id": thread}}
        for _ in range(WALK):
            if config is None:
                return None
            found = self.saver.get_tuple(config)
            if found is None:
                return None
            data = self.snapshots.get(_key(found.config))
            if data is not None:
                return self.open(data, thread, model)
            config = found.parent_config
        return None

    def _keep(self, next_config: RunnableConfig) -> RunnableConfig:
        key = _key(next_config)
        with self._lock:
            data = self._pending.pop(key[0], None)
            self._loaded[key[0]] = next_config  # the thread now resumes from its newest checkpoint
        if data is not None and not self.snapshots.put(key, data):
            log.warning("thread %s: its KV snapshot (%d bytes) is larger than the store's bound; not kept", key[0],
                        len(data))
        return next_config

    def _loaded_from(self, found: CheckpointTuple | None) -> CheckpointTuple | None:
        if found is not None:
            with self._lock:
                self._loaded[_key(found.config)[0]] = found.config
        return found

    # -- the saver's interface: the wrapped saver's, with snapshots kept and dropped beside ----------
    @property
    def config_specs(self) -> list:
        return self.saver.config_specs

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        return self._loaded_from(self.saver.get_tuple(config))

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        return self._loaded_from(await self.saver.aget_tuple(config))

    def list(self, config: RunnableConfig | None, **kwargs: Any) -> Iterator[CheckpointTuple]:
        return self.saver.list(config, **kwargs)

    def alist(self, config: RunnableConfig | None, **kwargs: Any) -> AsyncIterator[CheckpointTuple]:
        return self.saver.alist(config, **kwargs)

    def put(self, config: RunnableConfig, checkpoint: Any, metadata: Any, new_versions: Any) -> RunnableConfig:
        return self._keep(self.saver.put(config, checkpoint, metadata, new_versions))

    async def aput(self, config: RunnableConfig, checkpoint: Any, metadata: Any, new_versions: Any) -> RunnableConfig:
        return self._keep(await self.saver.aput(config, checkpoint, metadata, new_versions))

    def put_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str,
                   task_path: str = "") -> None:
        self.saver.put_writes(config, writes, task_id, task_path)

    async def aput_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str,
                          task_path: str = "") -> None:
        await self.saver.aput_writes(config, writes, task_id, task_path)

    def delete_thread(self, thread_id: str) -> None:
        self.saver.delete_thread(thread_id)
        self.snapshots.delete_thread(str(thread_id))

    async def adelete_thread(self, thread_id: str) -> None:
        await self.saver.adelete_thread(thread_id)
        self.snapshots.delete_thread(str(thread_id))

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        self.saver.delete_for_runs(run_ids)

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        await self.saver.adelete_for_runs(run_ids)

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        self.saver.copy_thread(source_thread_id, target_thread_id)

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        await self.saver.acopy_thread(source_thread_id, target_thread_id)

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        self.saver.prune(thread_ids, strategy=strategy)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        await self.saver.aprune(thread_ids, strategy=strategy)

    def get_delta_channel_history(self, *, config: RunnableConfig, channels: Sequence[str]) -> Mapping[str, Any]:
        return self.saver.get_delta_channel_history(config=config, channels=channels)

    async def aget_delta_channel_history(self, *, config: RunnableConfig,
                                         channels: Sequence[str]) -> Mapping[str, Any]:
        return await self.saver.aget_delta_channel_history(config=config, channels=channels)

    def get_next_version(self, current: Any, channel: None) -> Any:
        return self.saver.get_next_version(current, channel)

    def with_allowlist(self, extra_allowlist: Collection[tuple[str, ...]]) -> KVCheckpointer:
        inner = self.saver.with_allowlist(extra_allowlist)
        if inner is self.saver:
            return self
        clone = KVCheckpointer.__new__(KVCheckpointer)
        clone.__dict__.update(self.__dict__)
        clone.saver, clone.serde = inner, inner.serde
        return clone


__all__ = ["KVCheckpointer", "MemorySnapshots", "SQLiteSnapshots", "SnapshotModelError", "SnapshotStore"]
