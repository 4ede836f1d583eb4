"""Snapshot: a saved conversation in one envelope (its prompt, its message history, its KV blob), for every adapter.

Layout: :data:`MAGIC`, an 8-byte big-endian header length, a JSON header (``format``, ``segments``, ``messages``,
``kv``: whether a blob follows, ``meta``: what the adapter keeps beside the prompt, e.g. declared fields, eviction
settings, the segments it adds itself), then the KV blob (``kvagent.kvblob``: model fingerprint, backend format
and checksum, all checked when it is restored). The header is JSON, never pickle: reading a snapshot runs no code
from it. A snapshot without KV (a session whose cache could not be saved) is restored by prefilling its segments.

A snapshot that travels through a client (a server's ``save`` / ``restore``) is *signed*: :func:`sign` puts
:data:`SIGNED_MAGIC` and an HMAC-SHA256 of the snapshot, under a secret only the saver holds and a ``context``
(e.g. the tenant), in front of it; :func:`unsign` gives the snapshot back only when the MAC matches, so neither
its KV bytes nor its token ids can be forged. :meth:`Snapshot.text_only` is what may be kept of one that
fails: its texts, without KV and without token ids (the text is tokenized again).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvagent.errors import KVBlobError
from kvagent.messages import ChatMessage
from kvagent.segments import Segment, segment_from_dict, segment_to_dict
from kvagent.tools.format import ToolCall

MAGIC = b"KVAGENT-SNAPSHOT\n"
FORMAT = "kvagent-snapshot/1"
SIGNED_MAGIC = b"KVAGENT-SIGNED-SNAPSHOT/1\n"
MIN_SECRET = 32
"""Bytes a signing secret holds at least."""
_LENGTH = struct.Struct(">Q")
_MAC = hashlib.sha256().digest_size


class SnapshotError(KVBlobError):
    """Bytes that are not a kvagent snapshot, or one whose header is corrupt or of another format."""


class SnapshotSignatureError(SnapshotError):
    """A signed snapshot whose signature does not match (modified, or signed with another secret or context),
    or bytes that should be signed and are not."""


def _mac(secret: bytes, context: bytes, data: bytes) -> bytes:
    if len(secret) < MIN_SECRET:
        raise ValueError(f"a snapshot signing secret needs at least {MIN_SECRET} bytes, got {len(secret)}")
    material = hmac.new(secret, digestmod=hashlib.sha256)
    material.update(SIGNED_MAGIC + _LENGTH.pack(len(context)) + context)
    material.update(data)
    return material.digest()


def sign(data: bytes, secret: bytes, context: bytes = b"") -> bytes:
    """``data`` (a snapshot's bytes) signed: :data:`SIGNED_MAGIC`, HMAC-SHA256(secret, context, data), data.
    ``context`` binds the signature to where it may be opened (a tenant's name): another context fails."""
    return SIGNED_MAGIC + _mac(secret, context, data) + data


def is_signed(data: bytes) -> bool:
    return data.startswith(SIGNED_MAGIC)


def unsign(data: bytes, secret: bytes, context: bytes = b"", *, source: str = "the snapshot") -> bytes:
    """The snapshot inside signed ``data``; :class:`SnapshotSignatureError` (nothing trusted) when it is not
    signed or its MAC does not match ``secret`` and ``context`` (compared in constant time)."""
    if not data.startswith(SIGNED_MAGIC) or len(data) < len(SIGNED_MAGIC) + _MAC:
        raise SnapshotSignatureError(f"{source} is not signed by this server: restore only what its save answered")
    mac, inner = data[len(SIGNED_MAGIC):len(SIGNED_MAGIC) + _MAC], data[len(SIGNED_MAGIC) + _MAC:]
    if not hmac.compare_digest(mac, _mac(secret, context, inner)):
        raise SnapshotSignatureError(f"{source}: the signature does not match (the bytes were changed, or saved by "
                                     "another server secret or another tenant): save the session again")
    return inner


def signed_payload(data: bytes) -> bytes:
    """The snapshot bytes inside signed ``data`` without checking the signature (for a text-only restore)."""
    return data[len(SIGNED_MAGIC) + _MAC:] if data.startswith(SIGNED_MAGIC) else data


def _message_dict(m: ChatMessage) -> dict[str, Any]:
    """A message as the header holds it (an assistant's tool calls and a result's call id kept)."""
    out: dict[str, Any] = {"role": m.role, "content": m.content, "name": m.name}
    if m.tool_calls:
        out["tool_calls"] = [{"name": c.name, "arguments": dict(c.arguments), "id": c.id} for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _message(d: dict[str, Any]) -> ChatMessage:
    if not isinstance(d, dict) or not isinstance(d.get("content"), str) or not isinstance(d.get("role"), str):
        raise ValueError("a message is an object with a role and text content")
    if not isinstance(d.get("name"), (str, type(None))) or not isinstance(d.get("tool_call_id"), (str, type(None))):
        raise ValueError("a message's name and tool_call_id are text")
    calls = tuple(ToolCall(str(c["name"]), dict(c["arguments"]), str(c["id"])) for c in d.get("tool_calls") or [])
    return ChatMessage(d["role"], d["content"], d.get("name"), tool_calls=calls, tool_call_id=d.get("tool_call_id"))


@dataclass(frozen=True)
class Snapshot:
    """A conversation as saved: ``segments`` (the prompt), ``messages`` (the history the adapter logged), ``blob``
    (the session's KV blob, ``Session.save``; None: text only) and ``meta`` (JSON-ready adapter data)."""

    segments: tuple[Segment, ...]
    messages: tuple[ChatMessage, ...] = ()
    blob: bytes | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def text_only(self) -> Snapshot:
        """The same conversation without KV and without token ids: what may be trusted of bytes whose signature
        failed (each text is tokenized again, without parsing special tokens). ``meta`` is kept as it is:
        the caller validates it as any client input."""
        segments = tuple(dataclasses.replace(s, token_ids=None) for s in self.segments)
        return Snapshot(segments, self.messages, None, self.meta)

    @property
    def has_token_ids(self) -> bool:
        return any(s.token_ids is not None for s in self.segments)

    def to_bytes(self) -> bytes:
        header = json.dumps({
            "format": FORMAT,
            "segments": [segment_to_dict(s) for s in self.segments],
            "messages": [_message_dict(m) for m in self.messages],
            "kv": self.blob is not None,
            "meta": self.meta,
        }).encode()
        return MAGIC + _LENGTH.pack(len(header)) + header + (self.blob or b"")

    @classmethod
    def from_bytes(cls, data: bytes, *, source: str = "the snapshot") -> Snapshot:
        """Parse ``data``; :class:`SnapshotError` naming ``source`` and the fix when it is not a snapshot."""
        start = len(MAGIC) + _LENGTH.size
        if not data.startswith(MAGIC) or len(data) < start:
            raise SnapshotError(f"{source} is not a saved kvagent session: save one with the adapter's save "
                                "(POST /v1/sessions/{id}/save, ChatKVAgent.asave_session, /save in kvagent chat)")
        (n,) = _LENGTH.unpack(data[len(MAGIC):start])
        try:
            header = json.loads(data[start:start + n])
            if not isinstance(header, dict) or header.get("format") != FORMAT:
                found = header.get("format") if isinstance(header, dict) else None
                raise ValueError(f"format {found!r}, this kvagent reads {FORMAT!r}")
            segments = tuple(segment_from_dict(s) for s in header["segments"])
            messages = tuple(_message(m) for m in header.get("messages", []))
            meta = header.get("meta") or {}
            if not isinstance(meta, dict):
                raise ValueError("meta is not an object")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise SnapshotError(f"{source}: corrupt header ({exc}); save the session again") from None
        except KVBlobError:
            raise
        except Exception as exc:  # a segment the header describes wrongly (SegmentOrderError, ...)
            raise SnapshotError(f"{source}: invalid header ({exc}); save the session again") from None
        blob = data[start + n:] if header.get("kv") else None
        return cls(segments, messages, blob, meta)

    def write(self, path: Path) -> int:
        """Write to ``path`` atomically; returns the file's size."""
        data = self.to_bytes()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        return len(data)

    @classmethod
    def read(cls, path: Path) -> Snapshot:
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise SnapshotError(f"{path}: cannot read the saved session ({exc.strerror})") from exc
        return cls.from_bytes(data, source=str(path))


__all__ = ["FORMAT", "MAGIC", "MIN_SECRET", "SIGNED_MAGIC", "Snapshot", "SnapshotError", "SnapshotSignatureError",
           "is_signed", "sign", "signed_payload", "unsign"]
