"""Tiers: retained prefixes moved out of the KV pool, to host memory and then to disk, each bounded in bytes.

When the pool gives a retained sequence back because it needs the room (``SequencePool.reclaim``), the sequence's
clean prefix is saved as a checked blob (``kvblob.KVBlob``: model fingerprint, backend format, tokens, checksum)
into the first tier. A tier past its bound moves its least recently used entries to the next one; the last drops
them. A new session whose prompt matches a stored prefix better than anything in the pool restores that blob and
keeps the matching part (``kv.sync``). This is llama-server's ``--cache-ram`` (old prompts kept in host memory), with
a disk tier below it.

Each tier indexes its prefixes by scope (``PrefixIndex``), so reuse never crosses a scope, as in the pool. Files of
the disk tier are this process's own: written in a private folder, each with an HMAC-SHA256 under a key drawn when
the tier is made, and a file that fails it is dropped, never loaded.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import logging
import os
import shutil
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

from kvagent.kv.codec import Codec, Format, Plain, codec
from kvagent.kv.prefix import PrefixIndex
from kvagent.kvblob import KVBlob

log = logging.getLogger(__name__)
_keys = itertools.count(1)


@dataclass(frozen=True)
class Stored:
    """One stored prefix: its ``key`` in its tier, ``tokens``, ``scope`` and ``size`` in bytes."""

    key: int
    tokens: tuple[int, ...]
    scope: str
    size: int


class Store(Protocol):
    """Where a tier's bytes live."""

    def put(self, key: int, data: bytes) -> int:
        """Keep ``data`` under ``key``; returns the bytes it takes there."""

    def get(self, key: int) -> bytes | None: ...
    def drop(self, key: int) -> None: ...


class MemoryStore:
    """Bytes in this process's memory."""

    def __init__(self) -> None:
        self._data: dict[int, bytes] = {}

    def put(self, key: int, data: bytes) -> int:
        self._data[key] = data
        return len(data)

    def get(self, key: int) -> bytes | None:
        return self._data.get(key)

    def drop(self, key: int) -> None:
        self._data.pop(key, None)


class FolderStore:
    """Bytes in files of a private folder (mode 0700, files 0600), written by ``codec`` (``kvagent.kv.codec``:
    as they are by default) and each signed with a key of this process: a file changed or put there by anything
    else reads as missing. ``close`` removes the folder."""

    def __init__(self, folder: Path, codec: Codec | None = None) -> None:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(folder, 0o700)
        self.folder = folder
        self.codec: Codec = codec or Plain()
        self._secret = os.urandom(32)

    def _path(self, key: int) -> Path:
        return self.folder / f"{key}.kv"

    def put(self, key: int, data: bytes) -> int:
        data = self.codec.encode(data)
        tag = hmac.new(self._secret, data, hashlib.sha256).digest()
        tmp = self.folder / f".{key}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(tag)
            fh.write(data)
        os.replace(tmp, self._path(key))
        return len(tag) + len(data)

    def get(self, key: int) -> bytes | None:
        try:
            raw = self._path(key).read_bytes()
        except OSError:
            return None
        tag, data = raw[:32], raw[32:]
        if not hmac.compare_digest(tag, hmac.new(self._secret, data, hashlib.sha256).digest()):
            log.warning("a stored KV file of the disk tier failed its signature: dropped")
            return None
        return self.codec.decode(data)

    def drop(self, key: int) -> None:
        self._path(key).unlink(missing_ok=True)

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


class Tier:
    """Stored prefixes in ``store``, at most ``max_bytes`` of them, least recently used moved to ``lower`` (or
    dropped). Safe from several threads."""

    def __init__(self, name: str, store: Store, max_bytes: int, lower: Tier | None = None) -> None:
        self.name, self.store, self.max_bytes, self.lower = name, store, max(0, max_bytes), lower
        self.index = PrefixIndex()
        self._entries: OrderedDict[int, Stored] = OrderedDict()  # least recently used first
        self.bytes = 0
        self.restores = 0
        """Prefixes new sessions restored from this tier (counted by the restore, ``kv.sync``)."""
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, tokens: Sequence[int], scope: str, data: bytes) -> None:
        """Keep ``data`` (a blob of ``tokens``) for ``scope``; it goes to the next tier down when it cannot fit here."""
        if not tokens:
            return
        if len(data) > self.max_bytes:
            if self.lower is not None:
                self.lower.put(tokens, scope, data)
            return
        with self._lock:
            key = next(_keys)
            try:
                size = self.store.put(key, data)
            except Exception as exc:  # noqa: BLE001 - a tier is a cache: a prefix it cannot keep is dropped
                log.warning("%s tier: a prefix of %d tokens could not be kept (%s): dropped", self.name, len(tokens),
                            exc)
                self.store.drop(key)
                return
            entry = Stored(key, tuple(tokens), scope, size)
            self._entries[entry.key] = entry
            self.index.insert(entry.key, entry.tokens, scope)
            self.bytes += entry.size
            while self.bytes > self.max_bytes:
                self._spill(next(iter(self._entries.values())))
        log.debug("%s tier: kept %d tokens (%d bytes; %d of %d held)", self.name, len(tokens), len(data), self.bytes,
                  self.max_bytes)

    def _spill(self, entry: Stored) -> None:
        data = self.store.get(entry.key)
        self._forget(entry)
        if self.lower is not None and data is not None:
            self.lower.put(entry.tokens, entry.scope, data)

    def _forget(self, entry: Stored) -> None:
        self._entries.pop(entry.key, None)
        self.index.remove(entry.key)
        self.store.drop(entry.key)
        self.bytes -= entry.size

    def match(self, tokens: Sequence[int], scope: str) -> tuple[Tier, Stored, int] | None:
        """The stored prefix of ``scope`` sharing the most leading tokens with ``tokens``, in this tier or below:
        ``(tier, entry, n)``; None when none shares any."""
        with self._lock:
            key, n = self.index.match(tokens, scope=scope)
            best = (self, self._entries[key], n) if key >= 0 else None
        below = self.lower.match(tokens, scope) if self.lower is not None else None
        if below is not None and (best is None or below[2] > best[2]):
            return below
        return best

    def load(self, entry: Stored, fingerprint: str, backend_format: str) -> KVBlob | None:
        """The stored blob, checked (model, format, checksum), the entry now the most recently used; None when its
        bytes are gone or refused (the entry is forgotten)."""
        with self._lock:
            if entry.key not in self._entries:
                return None
            try:  # reading decodes the disk format too: a file that does not decode is refused like a bad blob
                data = self.store.get(entry.key)
                blob = KVBlob.from_bytes(data, model_fingerprint=fingerprint, backend_format=backend_format) \
                    if data is not None else None
            except Exception as exc:  # noqa: BLE001 - any refusal drops the entry: it is a cache
                log.warning("%s tier: a stored prefix was refused (%s): dropped", self.name, exc)
                blob = None
            if blob is None:
                self._forget(entry)
                return None
            self._entries.move_to_end(entry.key)
            return blob

    def clear(self) -> None:
        """Forget every stored prefix, in this tier and below."""
        for tier in self.tiers():
            with tier._lock:
                for entry in list(tier._entries.values()):
                    tier._forget(entry)

    def tiers(self) -> list[Tier]:
        """This tier and those below it, in order."""
        return [self, *(self.lower.tiers() if self.lower is not None else [])]

    def close(self) -> None:
        for tier in self.tiers():
            close = getattr(tier.store, "close", None)
            if close is not None:
                close()


def tiers(ram_bytes: int, disk_bytes: int, folder: Path | None, disk_format: Format = "f16") -> Tier | None:
    """A host-memory tier of ``ram_bytes`` over a disk tier of ``disk_bytes`` in ``folder``, its files written in
    ``disk_format`` (``kvagent.kv.codec``; either tier may be 0: left out); None when both are."""
    disk = Tier("disk", FolderStore(folder, codec(disk_format)), disk_bytes) \
        if disk_bytes > 0 and folder is not None else None
    if ram_bytes > 0:
        return Tier("ram", MemoryStore(), ram_bytes, disk)
    return disk
