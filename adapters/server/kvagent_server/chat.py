"""``POST /v1/chat/completions``: OpenAI's chat API over kvagent sessions.

A request is read in OpenAI's shape (``kvagent.openai_shape``) and its turn runs on the entry's
``kvagent.conversation.Conversation`` (the turn every adapter shares): a client that resends its history has only
its new messages appended, so the cached prefix, errata and skills stay where they are, and a prompt changed inside
is edited in place. Everything is checked before the session changes: the front's checks (``kvagent_server.front``:
the model name, what the server cannot honour, the limits), the tools, tool choice and reply format
(``kvagent_server.tools``), and whether the prompt fits (413). A client that goes away cancels its generation at
the next token, and the turn is rolled back.

Tools: their segments (one compiled skill per tool, cached by the tools' JSON) follow the server's own segments;
a request whose tool set differs from the previous one's rebuilds the prompt from there (the cached prefix before
them is still reused). A tool-call turn is logged as its calls, so the history a client resends (the assistant
message with ``tool_calls``, then the ``tool`` results) extends the cached prompt instead of rebuilding it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, AsyncIterator

from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from kvagent import openai_shape as shape
from kvagent.aio import AsyncGenerationStream
from kvagent.conversation import Cost, Plan
from kvagent.errors import KVAgentError
from kvagent.generation import Generation
from kvagent.messages import ChatMessage
from kvagent.openai_shape import StreamedCalls, reply_message

from kvagent_server import front
from kvagent_server.errors import ServerError, error_body
from kvagent_server.front import SESSION, ChatRequest
from kvagent_server.sessions import Entry, salt_digest
from kvagent_server.state import ServerState
from kvagent_server.tenants import Tenant
from kvagent_server.tools import NO_TOOLS, TurnTools, chat_messages, turn_tools


log = logging.getLogger(__name__)
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "tool_calls": "tool_calls"}


@dataclass(frozen=True)
class Turn:
    """One checked request: its planned prompt (``kvagent.conversation.Plan``), sampling and tools."""

    plan: Plan
    sampling: dict[str, Any]
    tools: TurnTools = NO_TOOLS
    report_edits: bool = False  # the request asked for the extension field ``usage.kvagent_edits``

    @property
    def options(self) -> dict[str, Any]:
        """What the decoder takes: sampling, and the tools' options."""
        return {**self.sampling, **self.tools.options}

    def usage(self, gen: Generation, cost: Cost) -> dict[str, Any]:
        return shape.usage(cost, gen.edits if self.report_edits else None)


def check_request(state: ServerState, body: ChatRequest) -> list[ChatMessage]:
    """The messages as kvagent's, after the front's checks (``kvagent_server.front.check``; nothing has changed
    yet)."""
    front.check(body, state.config, state.model_ids, state.model_id)
    return chat_messages(body.messages)


def fit(state: ServerState, entry: Entry, messages: list[ChatMessage], body: ChatRequest,
        tools: TurnTools = NO_TOOLS) -> Turn:
    """The checked turn, planned on the entry's conversation (``ContextOverflowError``: 413 when the prompt leaves
    no room for a reply)."""
    session = entry.session
    if session is None:  # pragma: no cover - the request holds an active entry
        raise KVAgentError("chat request on a parked session (internal error)")
    plan = entry.conversation.plan(session, messages, body.reply_budget(state.config), static=entry.static,
                                   tools=tools.segments)
    sampling = {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "seed": body.seed,
                "stop": body.stops()}
    return Turn(plan, sampling, tools, body.report_edits)


def count(state: ServerState, entry: Entry, gen: Generation) -> None:
    """The turn is in the session (its conversation logged it): count it."""
    state.metrics.count_generation(gen.reused, gen.computed, gen.transplanted, gen.generated, gen.ttft_s)
    for edit in gen.edits:
        state.metrics.implicit_edits.labels(edit.kind).inc()
    if entry.session is not None:
        evicted = sum(len(c.evicted) for c in entry.session.cycles)
        state.metrics.evicted_cells.inc(max(0, evicted - entry.evicted_seen))
        entry.evicted_seen = evicted


async def complete(state: ServerState, tenant: Tenant, body: ChatRequest, request: Request) -> Response:
    messages = check_request(state, body)
    # checked, and compiled on first sight (in the tenant's own cache), before taking the session
    tools = await turn_tools(state.tools(tenant), body, messages if state.config.auto_tools == "once" else None)
    kind, key = front.session_key(body, request.headers)
    stack = AsyncExitStack()
    entry = await stack.enter_async_context(state.sessions.use(tenant, key, kind, implicit=kind != SESSION,
                                                               salt=salt_digest(body.cache_salt)))
    try:
        # rendering tokenizes the whole prompt: off the event loop
        turn = await asyncio.to_thread(fit, state, entry, messages, body, tools)
        if body.stream:
            await state.sessions.make_room(entry, turn.plan.cells)
    except BaseException:
        await stack.aclose()
        raise
    ident = f"chatcmpl-{uuid.uuid4().hex}"
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return _TurnStream(state, entry, turn, stack, ident, include_usage)
    async with stack:
        done = await state.sessions.with_room(entry, turn.plan.cells,
                                              lambda: _generate_unless_gone(state, entry, turn, request))
        if done is None:  # the client went away: the generation was cancelled and rolled back
            return Response(status_code=499)
        gen, cost = done
        count(state, entry, gen)
    return JSONResponse({
        "id": ident, "object": "chat.completion", "created": int(time.time()), "model": state.model_id,
        "system_fingerprint": state.fingerprint,
        "choices": [{"index": 0, "message": reply_message(gen), "logprobs": None,
                     "finish_reason": FINISH.get(gen.finish_reason, gen.finish_reason)}],
        "usage": turn.usage(gen, cost),
    }, headers={"X-KVAgent-Cache": cache_header(gen)})


def cache_header(gen: Generation) -> str:
    """Where the prompt's KV came from, for a user who wants to see why a request was or was not cached:
    ``resumed`` (a retained conversation of the scope, edited in place: ``kvagent.session.Session.resume``),
    ``restored`` (a prefix restored from the host-memory or disk tier: ``kvagent.kv.tiers``), ``prefix`` (a cached
    prefix, the session's own or another's of the scope) or ``none``; then the counts."""
    how = "resumed" if gen.resumed else "restored" if gen.restored else "prefix" if gen.reused else "none"
    return f"{how}; reused={gen.reused}; computed={gen.computed}"


async def _generate_unless_gone(state: ServerState, entry: Entry, turn: Turn,
                                request: Request) -> tuple[Generation, Cost] | None:
    work = asyncio.ensure_future(entry.conversation.arespond(entry.asession, turn.plan, turn.options))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not work.done():
        work.cancel()
        try:
            await work  # returns once the turn is rolled back
        except (asyncio.CancelledError, KVAgentError):
            pass
        state.metrics.cancelled.inc()
        log.info("client left: generation for session %r cancelled and rolled back", entry.key)
        return None
    return work.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _TurnStream(EventSourceResponse):
    """The reply as server-sent events, holding the session until the stream ends however it ends.

    A client that disconnects cancels the events task: leaving ``astream``'s block cancels the generation,
    which rolls its turn back; the response's own ``__call__`` then waits for that and releases the session
    (also when the client left before the first event).
    """

    def __init__(self, state: ServerState, entry: Entry, turn: Turn, stack: AsyncExitStack, ident: str,
                 include_usage: bool) -> None:
        self.state, self.entry, self.turn, self.stack = state, entry, turn, stack
        self.ident, self.include_usage = ident, include_usage
        self.created = int(time.time())
        self.stream: AsyncGenerationStream | None = None
        self.calls = StreamedCalls(turn.plan.tool_format) if turn.tools.calls else None  # the text split into call deltas
        self.recorded: Cost | None = None
        super().__init__(self._events(), ping=15)

    def _chunk(self, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, str]:
        return self._event([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra)

    @staticmethod
    def _error(message: str, kind: str, code: str) -> dict[str, str]:
        return {"data": json.dumps(error_body(message, kind, None, code))}

    def _event(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, str]:
        body = {"id": self.ident, "object": "chat.completion.chunk", "created": self.created,
                "model": self.state.model_id, "system_fingerprint": self.state.fingerprint, "choices": choices, **extra}
        return {"data": json.dumps(body)}

    async def _events(self) -> AsyncIterator[dict[str, str]]:
        session = self.entry.asession
        turn = self.turn
        calls = self.calls
        yield self._chunk({"role": "assistant", "content": None if calls is not None else ""})
        try:
            async with self.entry.conversation.astream(session, turn.plan, turn.options) as stream:
                self.stream = stream
                async for piece in stream:
                    for delta in (calls.feed(piece) if calls is not None else [{"content": piece}]):
                        yield self._chunk(delta)
        except (KVAgentError, ServerError) as exc:  # the turn was rolled back; the status line is already sent
            log.info("stream for session %r ended early: %s", self.entry.key, exc)
            yield self._error(str(exc), "invalid_request_error" if isinstance(exc, ServerError) else "server_error",
                              type(exc).__name__)
            yield {"data": "[DONE]"}
            return
        except Exception:  # a fault of the server's own: logged with its traceback, the client told in OpenAI's shape
            log.exception("stream for session %r failed", self.entry.key)
            yield self._error("the server failed while generating (the turn was rolled back): retry, and report it "
                              "if it happens again", "server_error", "internal_error")
            yield {"data": "[DONE]"}
            return
        gen = stream.result
        if gen is None:  # pragma: no cover - a stream that ended without error has its result
            raise KVAgentError("the stream ended without a result (internal error)")
        for delta in (calls.finish(gen.tool_calls) if calls is not None else []):
            yield self._chunk(delta)
        cost = self._record(gen)
        extra = {"usage": None} if self.include_usage else {}
        finish = FINISH.get(gen.finish_reason, gen.finish_reason)
        if finish == "tool_calls" and calls is not None and len(calls.ids) > len(gen.tool_calls):
            finish = "length"  # the last call was streamed in part: the turn was cut, its complete calls are logged
        yield self._chunk({}, finish, **extra)
        if self.include_usage:
            yield self._event([], usage=self.turn.usage(gen, cost))
        yield {"data": "[DONE]"}

    def _record(self, gen: Generation) -> Cost:
        """Log the turn (its calls with the ids the client was given) and count it, once."""
        if self.recorded is None:
            self.recorded = self.entry.conversation.commit(self.turn.plan, gen,
                                                           self.calls.ids if self.calls is not None else ())
            count(self.state, self.entry, gen)
        return self.recorded

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await asyncio.shield(self._release())

    async def _release(self) -> None:
        stream = self.stream
        try:
            if stream is not None:
                await stream.aclose()  # returns once a cancelled generation is rolled back
                if stream.result is not None:
                    self._record(stream.result)  # it finished before the client left: the turn is kept
                elif self.recorded is None:
                    self.state.metrics.cancelled.inc()
                    log.info("client left: stream for session %r cancelled and rolled back", self.entry.key)
        finally:
            await self.stack.aclose()
