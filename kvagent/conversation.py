"""One conversation on one session: where a turn happens, for every adapter.

A client resends its whole history each call. :class:`Conversation` takes that history, plans the prompt
(:class:`~kvagent.messages.MessageLog`: the new messages appended when the logged ones are a prefix, else the
prompt rebuilt, and a prompt changed inside edited in place by the session's implicit edits), runs the
generation, logs the reply as the client will resend it, and says what the turn cost (:class:`Cost`). The
OpenAI-compatible server and ``ChatKVAgent`` both read "convert in -> conversation -> convert out"; their
message shapes are in :mod:`kvagent.openai_shape`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from kvagent.errors import KVAgentError
from kvagent.messages import ChatMessage, MessageLog, is_message_segment
from kvagent.segments import Segment
from kvagent.tools.format import HERMES, format_of

if TYPE_CHECKING:
    from kvagent.aio import AsyncGenerationStream, AsyncSession
    from kvagent.generation import Generation, GenerationStream
    from kvagent.memory import Memory
    from kvagent.session import Session


@dataclass(frozen=True)
class Cost:
    """What one generation cost, with the edits and includes charged to the conversation since its last turn.

    ``reused + computed + transplanted == input_tokens`` (the whole prompt). ``reused`` counts the cells kept,
    in place or moved by an implicit edit, so ``computed`` = changed + repaired + new (+ what was charged).
    """

    input_tokens: int
    reused: int
    computed: int
    transplanted: int
    output_tokens: int
    finish_reason: str
    ttft_s: float
    total_s: float

    @property
    def cache_read(self) -> int:
        """Prompt tokens whose KV was not computed for this turn: reused from the cache or transplanted."""
        return self.reused + self.transplanted

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second after the first one."""
        span = self.total_s - self.ttft_s
        return (self.output_tokens - 1) / span if self.output_tokens > 1 and span > 0 else 0.0

    @classmethod
    def of(cls, gen: Generation, charged_computed: int = 0, charged_transplanted: int = 0) -> Cost:
        prompt = gen.reused + gen.computed + gen.transplanted
        computed = min(prompt, gen.computed + charged_computed)
        transplanted = min(prompt - computed, gen.transplanted + charged_transplanted)
        return cls(prompt, prompt - computed - transplanted, computed, transplanted, gen.generated,
                   gen.finish_reason, gen.ttft_s, gen.total_s)


@dataclass(frozen=True)
class Plan:
    """One planned turn: the ``messages`` resent, the prompt's ``segments``, its length, the reply budget that
    fits, the KV ``cells`` the turn may add (``Session.fit``), and the ``tool_format`` its calls are written in
    (``kvagent.tools.format.ToolFormat``: what an adapter streams them by)."""

    messages: tuple[ChatMessage, ...]
    segments: tuple[Segment, ...]
    prompt_tokens: int
    max_tokens: int
    cells: int
    tool_format: Any = HERMES


@dataclass
class Conversation:
    """The messages a session's prompt holds and what its turns cost. Use it only while holding the session
    (its adapter's lock): it describes the message segments that session holds."""

    log: MessageLog = field(default_factory=MessageLog)
    costs: list[Cost] = field(default_factory=list)
    charged: tuple[int, int] = (0, 0)
    """(computed, transplanted) by edits and includes since the last turn, added to the next turn's cost."""

    @property
    def messages(self) -> list[ChatMessage]:
        return self.log.messages

    @property
    def tools(self) -> list[Segment]:
        """The last call's tool segments."""
        return self.log.tools

    # -- a turn -------------------------------------------------------------------------------------
    def plan(self, session: Session, messages: Sequence[ChatMessage], max_tokens: int, *,
             static: Sequence[Segment] = (), tools: Sequence[Segment] = (), fields: Sequence[Segment] = (),
             memory: Memory | None = None) -> Plan:
        """The prompt that answers ``messages`` on ``session`` (reads only; nothing changes).

        After the leading system messages come the adapter's ``static`` segments (policy, skills), the call's
        ``tools`` (a changed tool set rebuilds the prompt from there) and the declared ``fields``; a ``tail``
        ``memory`` follows the trajectory. A session holding only the adapter's own segments and no message yet
        takes the tools after them and the messages after those (its errata stay). Raises
        ``ContextOverflowError`` (413 in the server) when no reply fits, ``SegmentOrderError`` for a bad order."""
        described = {s.id for s in (*self.log.tools, *tools)}
        self.log.bind_tools(tools)
        current = list(session.segments)
        if not any(is_message_segment(s) for s in current):
            current = [*(s for s in current if s.id not in described), *self.log.tools]
        segments = self.log.plan(current, messages, [*static, *self.log.tools, *fields], format_of(session.renderer))
        if memory is not None and memory.position == "tail":  # after the trajectory, wherever it was
            segments = [*(s for s in segments if not memory.is_memory(s)), *memory.segments()]
        room = session.fit(segments, max_tokens)
        return Plan(tuple(messages), tuple(segments), room.prompt_tokens, room.max_tokens, room.cells,
                    format_of(session.renderer))

    def respond(self, session: Session, plan: Plan, options: Mapping[str, Any], *,
                timeout: float | None = None) -> tuple[Generation, Cost]:
        """Generate the reply to ``plan`` (``options``: sampling, tools, as ``Session.decoder`` takes them) and
        log it; a failed or timed-out turn is rolled back and logs nothing."""
        gen = session.run(session.respond_work(plan.max_tokens, segments=list(plan.segments), **options),
                          timeout=timeout)
        return gen, self.commit(plan, gen)

    async def arespond(self, session: AsyncSession, plan: Plan, options: Mapping[str, Any], *,
                       timeout: float | None = None) -> tuple[Generation, Cost]:
        """:meth:`respond`, awaited (the session decodes in the engine's shared batch meanwhile)."""
        work = session.session.respond_work(plan.max_tokens, segments=list(plan.segments), **options)
        gen = await session.run(work, timeout=timeout)
        return gen, self.commit(plan, gen)

    def stream(self, session: Session, plan: Plan, options: Mapping[str, Any]) -> GenerationStream:
        """The reply to ``plan`` as text pieces; :meth:`commit` its ``result`` once it has one."""
        return session.stream(plan.max_tokens, segments=list(plan.segments), **options)

    def astream(self, session: AsyncSession, plan: Plan, options: Mapping[str, Any]) -> AsyncGenerationStream:
        """:meth:`stream`, for the event loop."""
        return session.astream(plan.max_tokens, segments=list(plan.segments), **options)

    def finish(self, plan: Plan, stream: GenerationStream | AsyncGenerationStream,
               call_ids: Sequence[str] = ()) -> tuple[Generation, Cost]:
        """:meth:`commit` a stream that ended without error."""
        if stream.result is None:  # pragma: no cover - a stream that ended without error has its result
            raise KVAgentError("the stream ended without a result (internal error)")
        return stream.result, self.commit(plan, stream.result, call_ids)

    def commit(self, plan: Plan, gen: Generation, call_ids: Sequence[str] = ()) -> Cost:
        """The turn is in the session: its messages and reply (a tool-call turn as its calls, with the ``call_ids``
        the client was given) are the history; returns its cost."""
        self.log.record(plan.messages, gen, call_ids)
        cost = Cost.of(gen, *self.charged)
        self.charged = (0, 0)
        self.costs.append(cost)
        return cost

    # -- between turns ------------------------------------------------------------------------------
    def charge(self, computed: int, transplanted: int = 0) -> None:
        """Tokens an edit or include decoded (or transplanted) for the next turn."""
        self.charged = (self.charged[0] + computed, self.charged[1] + transplanted)

    def restore(self, messages: Sequence[ChatMessage], tools: Sequence[Segment] = ()) -> None:
        """The session now holds ``messages`` after ``tools`` (a snapshot restored); nothing is charged."""
        self.log.bind_tools(tools)
        self.log.commit(messages)
        self.charged = (0, 0)

    def forget(self) -> None:
        """The session is gone: the next plan rebuilds from the resent history (costs are kept)."""
        self.log = MessageLog()
        self.charged = (0, 0)


__all__ = ["Conversation", "Cost", "Plan"]
