"""Streamed replies of a :class:`~langchain_kvagent.ChatKVAgent`: the session's pieces as LangChain chunks
(text, then tool-call chunks, then the last chunk with usage), sync and async, under the chat model's timeout."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, AsyncIterator, Iterator

from langchain_core.outputs import ChatGenerationChunk

from kvagent.aio import AsyncSession

from langchain_kvagent.convert import Call, Chunks, last_chunk

if TYPE_CHECKING:
    from langchain_kvagent.conversations import Conversations


class Deadline:
    """When a streamed call must end (None: never); checked at each generated piece, since a sync generator
    cannot be cancelled from outside. Raising inside the session's stream block rolls the turn back."""

    def __init__(self, timeout: float | None, conversations: Conversations) -> None:
        self.at = time.monotonic() + timeout if timeout is not None else None
        self.conversations = conversations

    def check(self) -> None:
        if self.at is not None and time.monotonic() > self.at:
            raise TimeoutError(self.conversations.timeout_message())


def stream(conversations: Conversations, model: str, call: Call,
           timeout: float | None) -> Iterator[ChatGenerationChunk]:
    """The chunks of ``call`` on its session, holding the session's lock until the last one."""
    deadline, tools = Deadline(timeout, conversations), conversations.tool_segments(call.tools)
    entry, chunks = conversations.enter(call.key), Chunks(call.tools is not None)
    try:
        segments, max_tokens = entry.plan(call.messages, call.max_tokens, tools)
        with entry.live.stream(max_tokens, segments=segments, **call.options) as pieces:
            for piece in pieces:
                deadline.check()
                yield from chunks.feed(piece)
        yield from chunks.finish()
        yield last_chunk(model, call, pieces.result, entry)
    finally:
        entry.lock.release()


async def astream(conversations: Conversations, model: str, call: Call,
                  timeout: float | None) -> AsyncIterator[ChatGenerationChunk]:
    """:func:`stream` for the event loop: the session decodes in the engine's shared batch meanwhile."""
    deadline = Deadline(timeout, conversations)
    tools = await asyncio.to_thread(conversations.tool_segments, call.tools)
    entry, chunks = await conversations.aenter(call.key), Chunks(call.tools is not None)
    try:
        segments, max_tokens = entry.plan(call.messages, call.max_tokens, tools)
        async with AsyncSession(entry.live).astream(max_tokens, segments=segments, **call.options) as pieces:
            async for piece in pieces:
                deadline.check()
                for chunk in chunks.feed(piece):
                    yield chunk
        for chunk in chunks.finish():
            yield chunk
        yield last_chunk(model, call, pieces.result, entry)
    finally:
        entry.lock.release()
