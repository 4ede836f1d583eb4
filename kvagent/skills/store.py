"""Compiled-skill store: KV blobs on disk, content-addressed, checked, with an in-memory LRU.

Key = sha256 of (model fingerprint, backend format, sink token ids, the skill's exact token ids). The
token ids carry the tokenizer and the rendering (chat template or plain text), so any change to them
is another key. Each blob is a ``kvblob.KVBlob`` (model, format, tokens, sha256); writes go to a
temporary file then ``os.replace`` (atomic); a blob for another model or format, or a corrupt one, is
refused and never handed to llama.cpp. A JSON sidecar per blob feeds ``kvagent skills list``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from cachetools import LRUCache

from kvagent.errors import KVBlobError, SkillStoreError
from kvagent.kvblob import KVBlob
from kvagent.models import cache_dir, private_dir

log = logging.getLogger(__name__)
SUFFIX = ".kvskill"


def skill_key(fingerprint: str, backend_format: str, sink: Sequence[int], tokens: Sequence[int]) -> str:
    material = json.dumps([fingerprint, backend_format, list(sink), list(tokens)]).encode()
    return hashlib.sha256(material).hexdigest()


@dataclass(frozen=True)
class StoredSkill:
    """A sidecar entry: what one blob holds."""

    key: str
    name: str
    version: str
    model: str
    fingerprint: str
    n_tokens: int
    bytes: int
    created: str
    seam: int = 4  # tokens recomputed in context at each transplant (older sidecars: the spec default)
    ranked: tuple[int, ...] | list[int] = ()  # offsets by decreasing deviation from a cold prefill (selective recompute)


class SkillStore:
    """Compiled skills under ``root`` (default ``cache_dir()/skills``, checked by ``models.private_dir``: a folder
    other users can write is refused), ``lru_size`` blobs kept in memory."""

    def __init__(self, root: Path | None = None, lru_size: int = 16) -> None:
        if root is None:  # the shared default: refused where another user could put KV bytes there
            root = private_dir(private_dir(cache_dir()) / "skills", "kvagent's compiled skill folder")
        self.root = root
        self._lru: LRUCache[str, KVBlob] = LRUCache(maxsize=lru_size)

    def path(self, key: str) -> Path:
        return self.root / f"{key}{SUFFIX}"

    def has(self, key: str) -> bool:
        return key in self._lru or self.path(key).is_file()

    def put(
        self, key: str, blob: KVBlob, *, name: str, version: str, model: str, n_tokens: int, seam: int = 4
    ) -> StoredSkill:
        self.root.mkdir(parents=True, exist_ok=True)
        data = blob.to_bytes()
        _atomic_write(self.path(key), data)
        entry = StoredSkill(key, name, version, model, blob.model_fingerprint, n_tokens, len(data),
                            time.strftime("%Y-%m-%d %H:%M:%S"), seam)
        _atomic_write(self.path(key).with_suffix(".json"), json.dumps(entry.__dict__, indent=1).encode())
        self._remember(key, blob)
        return entry

    def get(self, key: str, *, fingerprint: str, backend_format: str, name: str = "?") -> KVBlob:
        """The checked blob for ``key``; :class:`SkillStoreError` (with the fix) when absent or refused."""
        blob = self._lru.get(key)  # a hit is a use: it becomes the most recent
        if blob is not None:
            return blob
        try:
            raw = self.path(key).read_bytes()
        except OSError:
            raise SkillStoreError(f"skill {name!r} is not compiled for this model: run `kvagent skills compile`") from None
        try:
            blob = KVBlob.from_bytes(raw, model_fingerprint=fingerprint, backend_format=backend_format)
        except KVBlobError as exc:
            raise SkillStoreError(
                f"compiled skill {name!r} ({self.path(key).name}) is unusable: {exc}. "
                "Run `kvagent skills compile` again"
            ) from exc
        self._remember(key, blob)
        return blob

    def set_ranked(self, key: str, ranked: tuple[int, ...]) -> None:
        """Record the compile-time deviation ranking of stored skill ``key`` in its sidecar (no-op when absent)."""
        entry = self.entry(key)
        if entry is None:
            return
        side = {**entry.__dict__, "ranked": list(ranked)}
        _atomic_write(self.path(key).with_suffix(".json"), json.dumps(side, indent=1).encode())

    def entry(self, key: str) -> StoredSkill | None:
        """The sidecar of ``key`` when its blob is stored (None when absent or unreadable)."""
        if not self.path(key).is_file():
            return None
        try:
            return StoredSkill(**json.loads(self.path(key).with_suffix(".json").read_text()))
        except (OSError, ValueError, TypeError):
            log.warning("unreadable skill sidecar for %s", key)
            return None

    def entries(self) -> list[StoredSkill]:
        out = []
        for side in sorted(self.root.glob("*.json")) if self.root.is_dir() else []:
            try:
                out.append(StoredSkill(**json.loads(side.read_text())))
            except (OSError, ValueError, TypeError):
                log.warning("unreadable skill sidecar %s", side)
        return out

    def _remember(self, key: str, blob: KVBlob) -> None:
        if self._lru.maxsize:  # lru_size 0 keeps nothing in memory (cachetools refuses any store into it)
            self._lru[key] = blob


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
