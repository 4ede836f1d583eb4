"""One streamed chat completion read to the end (server-sent events), for the benchmarks that time first tokens
against ``kvagent serve`` and other OpenAI-compatible servers: the text, the first content token's time, the
final usage and (llama-server's) timings."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass
class Streamed:
    """A streamed reply: its text, the first content token's time (``perf_counter``), the final usage and
    timings (llama-server's), and when it ended."""

    text: str = ""
    first: float | None = None
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    end: float = 0.0

    def feed(self, line: str, path: str) -> None:
        """One line of the server-sent events."""
        if not line.startswith("data:") or line.endswith("[DONE]"):
            return
        chunk = json.loads(line[5:])
        if "error" in chunk:
            raise RuntimeError(f"{path} stream: {chunk['error']}")
        for choice in chunk.get("choices") or ():
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                self.first = self.first if self.first is not None else time.perf_counter()
                self.text += piece
        self.usage = chunk.get("usage") or self.usage
        self.timings = chunk.get("timings") or self.timings

    def done(self, path: str) -> Streamed:
        self.end = time.perf_counter()
        if self.usage is None:
            raise RuntimeError(f"{path}: the stream carried no usage")
        self.first = self.first if self.first is not None else self.end
        return self

    @property
    def cached(self) -> int:
        return int(((self.usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

    @property
    def prompt(self) -> int:
        return int((self.usage or {}).get("prompt_tokens") or 0)


STREAM = {"stream": True, "stream_options": {"include_usage": True}}


def stream_chat(client: httpx.Client, body: dict[str, Any], headers: dict[str, str] | None = None,
                path: str = "/v1/chat/completions") -> Streamed:
    """POST a streamed chat completion and read it to the end."""
    out = Streamed()
    with client.stream("POST", path, json={**body, **STREAM}, headers=headers or {}) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{path}: {r.status_code} {r.text[:300]}")
        for line in r.iter_lines():
            out.feed(line, path)
    return out.done(path)


async def astream_chat(client: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str] | None = None,
                       path: str = "/v1/chat/completions") -> Streamed:
    """:func:`stream_chat` on an async client."""
    out = Streamed()
    async with client.stream("POST", path, json={**body, **STREAM}, headers=headers or {}) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"{path}: {r.status_code} {r.text[:300]}")
        async for line in r.aiter_lines():
            out.feed(line, path)
    return out.done(path)


__all__ = ["STREAM", "Streamed", "astream_chat", "stream_chat"]
