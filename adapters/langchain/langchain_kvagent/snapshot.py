"""A saved conversation: one file holding a session's prompt (segments), its message history and its KV blob.

Layout: ``MAGIC``, a 4-byte little-endian header length, a JSON header (format, segments, messages, skill
names), then the KV blob (``kvagent.kvblob``: model fingerprint, format and checksum, checked on restore).
The header is JSON, not pickle: loading a file never runs code from it.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Sequence

from kvagent.errors import KVBlobError
from kvagent.messages import ChatMessage
from kvagent.segments import Segment, segment_from_dict, segment_to_dict

MAGIC = b"KVLC"
FORMAT = "langchain-kvagent-session/1"


def write(path: Path, blob: bytes, segments: Sequence[Segment], messages: Sequence[ChatMessage],
          skills: Sequence[str]) -> int:
    """Write atomically; returns the file's size."""
    header = json.dumps({
        "format": FORMAT,
        "segments": [segment_to_dict(s) for s in segments],
        "messages": [{"role": m.role, "content": m.content, "name": m.name} for m in messages],
        "skills": list(skills),
    }).encode()
    data = MAGIC + struct.pack("<I", len(header)) + header + blob
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return len(data)


def read(path: Path) -> tuple[bytes, list[Segment], list[ChatMessage], list[str]]:
    """(KV blob, segments, messages, skill names) of a saved conversation; :class:`KVBlobError` if the file
    is not one."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise KVBlobError(f"{path}: cannot read the saved conversation ({exc.strerror})") from exc
    if len(data) < 8 or data[:4] != MAGIC:
        raise KVBlobError(f"{path} is not a conversation saved by langchain-kvagent: save one with /save PATH "
                          "(or model.asave_session)")
    (length,) = struct.unpack("<I", data[4:8])
    try:
        header = json.loads(data[8:8 + length])
        if header.get("format") != FORMAT:
            raise ValueError(f"format {header.get('format')!r}, expected {FORMAT!r}")
        segments = [segment_from_dict(s) for s in header["segments"]]
        messages = [ChatMessage(m["role"], m["content"], m.get("name")) for m in header["messages"]]
        skills = [str(s) for s in header.get("skills", [])]
    except (ValueError, KeyError, TypeError) as exc:
        raise KVBlobError(f"{path}: corrupt conversation header ({exc}); save it again") from exc
    return data[8 + length:], segments, messages, skills
