"""Snapshot: a saved conversation in one envelope (its prompt, its message history, its KV blob), for every adapter.

Layout: :data:`MAGIC`, an 8-byte big-endian header length, a JSON header (``format``, ``segments``, ``messages``,
``kv``: whether a blob follows, ``meta``: what the adapter keeps beside the prompt, e.g. declared fields, eviction
settings, the segments it adds itself), then the KV blob (``kvagent.kvblob``: model fingerprint, backend format
and checksum, all checked when it is restored). The header is JSON, never pickle: reading a snapshot runs no code
from it. A snapshot without KV (a session whose cache could not be saved) is restored by prefilling its segments.
"""

from __future__ import annotations

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
_LENGTH = struct.Struct(">Q")


class SnapshotError(KVBlobError):
    """Bytes that are not a kvagent snapshot, or one whose header is corrupt or of another format."""


def _message_dict(m: ChatMessage) -> dict[str, Any]:
    """A message as the header holds it (an assistant's tool calls and a result's call id kept)."""
    out: dict[str, Any] = {"role": m.role, "content": m.content, "name": m.name}
    if m.tool_calls:
        out["tool_calls"] = [{"name": c.name, "arguments": dict(c.arguments), "id": c.id} for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _message(d: dict[str, Any]) -> ChatMessage:
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


__all__ = ["FORMAT", "MAGIC", "Snapshot", "SnapshotError"]
