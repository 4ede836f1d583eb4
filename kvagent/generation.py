"""Generation: one assistant turn decoded token by token, in steps a scheduler can drive.

A :class:`Decoder` has three phases, in the shape of gpt-fast's ``prefill`` / ``decode_one_token``:
``prepare`` syncs the prompt (reused prefix + computed suffix, pausing between chunks), ``step`` samples
the next token from the current logits and asks for it to be decoded (a :class:`DecodeStep` the
scheduler batches with other sessions' tokens), ``finish`` commits the turn as an assistant segment whose
KV stays cached; ``abort`` rolls the turn back (the cache and the prompt return to what they were).
:func:`generation_work` strings them together as one unit of runtime work.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, Sequence

import numpy as np

from kvagent.errors import ContextOverflowError, KVAgentError
from kvagent.kv.work import PAUSE, DecodeStep, Work
from kvagent.kv.sync import ImplicitEdit, PrefillReport
from kvagent.sampling import Sampler
from kvagent.segments import Rendered, Renderer, Segment, SegmentKind, common_prefix
from kvagent.textstream import TextAssembler
from kvagent.tools.format import ToolCall, call_schema, dumps, format_of
from kvagent.tools.grammar import Constraint, accepts, json_grammar

from kvagent.scheduler import Job, Scheduler, on_done

if TYPE_CHECKING:
    from kvagent.kv.sequence import CachedSequence
    from kvagent.tools.spec import ToolSet

# how many text pieces a generation may run ahead of its consumer before it waits for it
AHEAD = 64
# tokens past max_tokens a structured reply may take to close (strings, objects) so that it always parses
CLOSE_BUDGET = 64


@dataclass(frozen=True)
class Generation:
    """One generated assistant turn and what it cost.

    ``finish_reason``: ``eos`` (the model ended its turn), ``stop`` (a stop string, or the grammar of a
    structured reply ended it), ``length`` (``max_tokens`` reached), ``tool_calls`` (the turn called tools:
    :attr:`tool_calls`). ``reused``/``computed`` count the prompt tokens of this call;
    ``ttft_s`` is the time from the call to the first sampled token. ``text`` is what the model
    generated; with an answer ``prefix`` the cached turn holds ``prefix + text``.
    """

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    reused: int
    computed: int
    ttft_s: float
    total_s: float
    transplanted: int = 0  # prompt tokens whose KV came from compiled skills
    prefix: str = ""  # the answer prefix the turn was started from
    tool_calls: tuple[ToolCall, ...] = ()  # the calls the turn made (``finish_reason`` ``tool_calls``)
    edits: tuple[ImplicitEdit, ...] = ()  # what a resent prompt's changes became (``kv.rebase``)
    resumed: int = 0  # tokens of a retained conversation this turn resumed (``Session.resume``; 0: none)
    restored: int = 0  # prompt tokens restored from a tier of retained prefixes (``kv.tiers``; 0: none)

    @property
    def generated(self) -> int:
        return len(self.token_ids)


class ReplyTokens:
    """Text of assistant turns a session generated -> their exact tokens (bounded), so a client that sends
    the whole history back (OpenAI / LangChain style) re-renders to the tokens already cached."""

    def __init__(self, limit: int = 256) -> None:
        self._ids: dict[str, tuple[int, ...]] = {}
        self._limit = limit

    def remember(self, text: str, token_ids: tuple[int, ...]) -> None:
        if len(self._ids) >= self._limit:
            self._ids.clear()
        self._ids[text] = token_ids

    def resolve(self, seg: Segment) -> Segment:
        """``seg`` with the exact tokens when it is an assistant turn this session generated."""
        if _is_reply(seg) and seg.token_ids is None:
            ids = self._ids.get(seg.text)
            if ids is not None:
                return replace(seg, token_ids=ids)
        return seg

    def resolve_all(self, segments: Sequence[Segment], held: Sequence[Segment] = ()) -> list[Segment]:
        """``segments`` with each assistant turn's exact tokens: the k-th turn of a text takes the tokens of the k-th
        turn of that text the prompt ``held`` (a model may write one text as different tokens in two turns), and
        one ``held`` lacks those of the last turn generated with its text."""
        queued: dict[str, deque[tuple[int, ...]]] = {}
        for seg in held:
            if _is_reply(seg) and seg.token_ids is not None:
                queued.setdefault(seg.text, deque()).append(seg.token_ids)
        out = []
        for seg in segments:
            found = queued.get(seg.text) if _is_reply(seg) and seg.token_ids is None else None
            out.append(replace(seg, token_ids=found.popleft()) if found else self.resolve(seg))
        return out


def _is_reply(seg: Segment) -> bool:
    return seg.kind is SegmentKind.TURN and seg.role == "assistant"


class TurnHost(Protocol):
    """What a decoder needs from the session it generates for."""

    cache: CachedSequence
    renderer: Renderer

    @property
    def segments(self) -> tuple[Segment, ...]: ...
    def sync_work(self, rendered: Rendered) -> Work[PrefillReport]: ...
    def replace_work(self, segments: Sequence[Segment]) -> Work[PrefillReport]: ...
    def rebase_work(self, rendered: Rendered) -> Work[PrefillReport]: ...
    def resume(self, segments: Sequence[Segment], tail: Sequence[Segment] = ()) -> list[Segment]: ...
    def restore_segments(self, segments: Sequence[Segment]) -> None: ...
    replies: ReplyTokens


class Decoder:
    """One turn on ``host``: ``prepare`` -> (``step`` -> ``accept``)* -> ``finish`` (or ``abort``).

    ``extra`` segments (e.g. the user turn) are appended before the reply and prefilled in the same pass,
    so TTFT covers them; ``prefix`` starts the reply with given text (the model continues it).
    ``on_piece`` receives each piece of final text as soon as it is known. ``base``, when given, replaces
    the whole prompt first (in the same pass: TTFT covers it), for clients that resend the history.
    ``constraint`` (``kvagent.tools.grammar.Constraint``) masks every token to a grammar (tool calls, a JSON
    reply): the turn ends where the grammar does; ``tools``: the bound tools, whose calls the text is read for.
    A structured reply or a tool call that ``max_tokens`` cuts is closed in the fewest tokens the grammar allows
    (strings closed, objects finished; up to :data:`CLOSE_BUDGET` more tokens), so it always parses and matches its
    schema; ``finish_reason`` stays ``length``, saying its content was cut.
    """

    def __init__(
        self, host: TurnHost, max_tokens: int, sampler: Sampler, stop: Sequence[str], extra: Sequence[Segment],
        prefix: str = "", on_piece: Callable[[str], None] = lambda piece: None, *,
        base: Sequence[Segment] | None = None, constraint: Constraint | None = None, tools: ToolSet | None = None,
    ) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.host = host
        self.max_tokens, self.sampler, self.prefix = max_tokens, sampler, prefix
        self.extra = list(extra)
        self.base = list(base) if base is not None else None
        self.on_piece = on_piece
        self.constraint, self.tools = constraint, tools
        self.close_cut = constraint is not None  # a structured reply or a call cut by max_tokens is closed
        self._closing = False
        self.calls: tuple[ToolCall, ...] = ()
        self._out = TextAssembler(list(stop))
        self.ids: list[int] = []
        self.finish_reason = "length"
        self.ttft = 0.0
        self.done = False
        self._start = time.perf_counter()
        self._original: list[Segment] = []
        self._rendered: Rendered | None = None
        self._report = PrefillReport(0, 0, 0.0)
        self._before: list[Segment] = []
        self._logits: np.ndarray | None = None
        self._reserve = 0

    @property
    def batchable(self) -> bool:
        return self.host.cache.batchable

    def prepare(self) -> Work[None]:
        """Sync the prompt (with the extra segments and the open reply) and keep its next-token logits."""
        host = self.host
        self._original = list(host.segments)
        self._before = [*(self.base if self.base is not None else self._original), *self.extra]
        pending = Segment(SegmentKind.TURN, self.prefix, role="assistant", complete=False)
        if self.base is not None:  # a resent prompt: resume a conversation seen before where that keeps more
            self.base = host.resume(self.base, [*self.extra, pending])
            self._before = [*self.base, *self.extra]
        rendered = host.renderer.render([*self._before, pending])  # validates before anything changes
        self._rendered = rendered
        # a resent prompt (base) is edited where it changed; an extended one is synced from its common prefix
        self._report = yield from (host.rebase_work(rendered) if self.base is not None else host.sync_work(rendered))
        self._reserve = 1 + host.renderer.closing_length("assistant")  # a finished turn always fits
        self._logits = host.cache.logits

    def step(self) -> DecodeStep | None:
        """Sample the next token; the decode it needs, or None when the turn is complete."""
        if self._logits is None:
            raise KVAgentError("step() before prepare() finished (internal error)")
        constraint = self.constraint
        if constraint is None:
            token = self.sampler(self._logits)
        elif self._closing:  # past max_tokens inside a structured reply: close it, greedily
            token = int(np.argmax(constraint.closing(self._logits)))
        else:
            token = self.sampler(constraint.masked(self._logits))
        if not self.ids:
            self.ttft = time.perf_counter() - self._start
        if self.host.cache.backend.is_eog(token):
            self.finish_reason, self.done = "eos", True
            return None
        if constraint is not None:
            constraint.consume(token)
        self.ids.append(token)
        piece = self._out.feed(self.host.cache.backend.token_bytes(token))
        if piece:
            self.on_piece(piece)
        if self._out.stopped:
            self.finish_reason, self.done = "stop", True
        elif constraint is not None and constraint.done:  # the grammar admits nothing more: the turn is complete
            self.finish_reason, self.done = ("length" if self._closing else "stop"), True
        elif self._closing and constraint is not None and constraint.accepting:
            self.done = True  # closed: finish_reason stays length
        elif len(self.ids) >= self.max_tokens:
            if self.close_cut and constraint is not None and not constraint.accepting \
                    and len(self.ids) < self.max_tokens + CLOSE_BUDGET:
                self._closing = True  # a structured reply always parses: end it as soon as the grammar lets it
            else:
                self.done = True
        if self.done:
            return None
        state = self.host.cache
        if state.cells + self._reserve > state.backend.n_ctx:
            raise ContextOverflowError(
                f"the context of {state.backend.n_ctx} tokens filled up after {len(self.ids)} generated tokens: the "
                "turn was rolled back; start a new session or load the engine with a larger n_ctx",
                partial=self._out.text,
            )
        return DecodeStep(token, state.cell(len(state.tokens)), state.seq)

    def accept(self, step: DecodeStep, logits: np.ndarray) -> None:
        """``step``'s token was decoded with next-token ``logits`` ``[n_vocab]``."""
        if self._rendered is None:
            raise KVAgentError("accept() before prepare() (internal error)")
        self.host.cache.append(step.token, logits, self._rendered)
        self._logits = logits

    def decode_alone(self, step: DecodeStep) -> None:
        """Decode ``step`` without the batch (sessions whose eviction records hidden states)."""
        if self._rendered is None:
            raise KVAgentError("decode_alone() before prepare() (internal error)")
        self._logits = self.host.cache.decode_token(step.token, self._rendered)

    def finish(self) -> Work[Generation]:
        """Commit the turn (its tokens stay cached) and return the :class:`Generation`."""
        tail = self._out.flush()
        if tail:
            self.on_piece(tail)
        text = self._out.text
        host = self.host
        body_ids: tuple[int, ...] | None = None
        reply = self.prefix + text
        tool_format = format_of(host.renderer)
        if self.tools is not None and tool_format.starts_call(reply):  # a text reply never opens a call
            # complete calls only: a call cut by a stop string (or one the closing could not finish) is no call
            closed = self._closing and self.constraint is not None and self.constraint.accepting
            self.calls = tuple(tool_format.parse_calls(
                reply, self.tools, complete=(self.finish_reason != "length" or closed) and not self._out.stopped))
            if self.calls and not self._closing:  # a call closed past max_tokens keeps finish_reason length
                self.finish_reason = "tool_calls"
        elif self.tools is not None and self.finish_reason != "length" and not self._out.stopped:
            self.calls = tuple(self._untagged(reply, tool_format))
            if self.calls:
                self.finish_reason = "tool_calls"
        if not self._out.stopped:  # a stop string cut the text mid-token: its tokens come from the text
            body_ids = (*self._prefix_ids(), *self.ids)
            host.replies.remember(self.prefix + text, body_ids)
            if self.calls:  # a client resends the calls, not the text: the canonical rendering maps to these tokens
                host.replies.remember(tool_format.render_calls(self.calls), body_ids)
        turn = Segment.assistant(self.prefix + text, token_ids=body_ids)
        yield from host.replace_work([*self._before, turn])
        r = self._report
        return Generation(text, tuple(self.ids), self.finish_reason, r.reused, r.computed, self.ttft,
                          time.perf_counter() - self._start, r.transplanted, self.prefix, self.calls, r.edits,
                          r.resumed, r.restored)

    def _untagged(self, reply: str, tool_format: Any) -> list[ToolCall]:
        """The bare-JSON calls of a text reply (``ToolFormat.untagged_calls``) whose arguments the tool's schema
        accepts (the grammar held the text, not the JSON: a call that would not have passed it stays text)."""
        calls = tool_format.untagged_calls(reply, self.tools)
        backend = self.host.cache.backend
        for call in calls:
            spec = self.tools.only([call.name])  # type: ignore[union-attr]
            if not accepts(backend, json_grammar(call_schema(spec)),
                           dumps({"name": call.name, "arguments": dict(call.arguments)})):
                return []
        return calls

    def abort(self) -> None:
        """Roll the call back: the prompt is what it was before it, and the cache holds no token beyond the
        part of it that still agrees with that prompt."""
        host = self.host
        if self._rendered is None and not self._original:  # prepare never ran: nothing changed
            return
        original = host.renderer.render(self._original).tokens if self._original else ()
        # always cut: a step decoded but not yet accepted (cancelled in between) left a cell past the tokens
        host.cache.cut(common_prefix(host.cache.tokens, original))
        host.restore_segments(self._original)

    def _prefix_ids(self) -> tuple[int, ...]:
        """The prefix's body tokens as rendered in the open reply (without its opening tag)."""
        if not self.prefix:
            return ()
        renderer = self.host.renderer
        opening = len(renderer.segment_tokens(Segment.reply()))
        return renderer.segment_tokens(Segment(SegmentKind.TURN, self.prefix, role="assistant", complete=False))[opening:]


def generation_work(decoder: Decoder, *, drain: bool = False) -> Work[Generation]:
    """The whole turn as one unit of work; any failure or cancellation rolls it back.

    ``drain``: pause once before committing, so a scheduler can hold the commit until the reader has
    taken every piece (a stream closed before its end is then rolled back, however fast it ran).
    """
    committed = False
    try:
        yield from decoder.prepare()
        while (step := decoder.step()) is not None:
            if decoder.batchable:
                logits = yield step
                decoder.accept(step, logits)
            else:
                decoder.decode_alone(step)
                yield PAUSE
        if drain:
            yield PAUSE
        committed = True
        return (yield from decoder.finish())
    except BaseException:
        if not committed:
            decoder.abort()
        raise


class GenerationStream:
    """Iterator of text pieces of one generation; :attr:`result` holds the :class:`Generation` at the end.

    Closing it (``close()``, or dropping it) before the end cancels the generation at its next token and
    rolls the turn back.
    """

    _END = object()

    def __init__(self) -> None:
        self.result: Generation | None = None
        self._pieces: list[object] = []
        self._cond = threading.Condition()
        self._taken = 0
        self._error: BaseException | None = None
        self._finished = False
        self._closed = False
        self.consumer: int | None = None  # thread id of the last reader
        self._scheduler: Scheduler | None = None
        self._job: Job | None = None

    def attach(self, scheduler: Scheduler, job: Job) -> None:
        """The job that produces this stream's pieces, and the scheduler that runs it."""
        self._scheduler, self._job = scheduler, job

    # -- producer side (the scheduler's thread) -----------------------------------------------------
    def push(self, piece: str) -> None:
        with self._cond:
            self._pieces.append(piece)
            self._cond.notify_all()

    def end(self, result: Generation | None, error: BaseException | None) -> None:
        with self._cond:
            self.result, self._error, self._finished = result, error, True
            self._pieces.append(self._END)
            self._cond.notify_all()

    @property
    def backlog(self) -> int:
        """Pieces produced and not read yet."""
        return len(self._pieces) - self._taken

    @property
    def live(self) -> bool:
        """Not finished, not closed."""
        return not (self._finished or self._closed)

    # -- consumer side ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        self.consumer = threading.get_ident()
        with self._cond:
            while self._taken >= len(self._pieces):
                if self._closed:
                    raise StopIteration
                self._cond.wait(0.5)
            item = self._pieces[self._taken]
            self._taken += 1
        self._wake()
        if item is self._END:
            self._closed = True
            if self._error is not None:
                raise self._error
            raise StopIteration
        return item  # type: ignore[return-value]

    def _wake(self) -> None:
        if self._scheduler is not None and self.backlog < AHEAD // 2 + 1:
            self._scheduler.wake()  # the producer may be waiting for the reader

    def close(self, *, wait: bool = True) -> None:
        """Stop early: the generation is cancelled at its next token and its turn rolled back (``wait``:
        return once that is done)."""
        if not self._closed:
            self._closed = True
            if not self._finished and self._scheduler is not None and self._job is not None:
                self._scheduler.cancel(self._job, wait=wait)
            with self._cond:
                self._cond.notify_all()

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close(wait=False)
        except Exception:  # interpreter shutdown
            pass


def start_stream(
    scheduler: Scheduler, owner: object, stream: GenerationStream, make: Callable[[Callable[[str], None]], Decoder]
) -> Job:
    """Submit the generation ``make(push)`` builds as ``owner``'s work, feeding ``stream``.

    Only the reader holds the stream (the job sees it through a weak reference), so dropping it cancels
    the generation. The job runs at most :data:`AHEAD` pieces ahead of the reader and commits the turn once
    the reader has taken every piece, so a stream closed before its end is always rolled back.
    """
    ref = weakref.ref(stream)

    def push(piece: str) -> None:
        if (live := ref()) is not None:
            live.push(piece)

    def ready() -> bool:
        live = ref()
        return live is None or (live.backlog < AHEAD if not decoder.done else live.backlog == 0)

    def end(result: Generation | None, error: BaseException | None) -> None:
        if (live := ref()) is not None:
            live.end(result, error)

    decoder = make(push)
    stream.consumer = threading.get_ident()  # the reader, until another thread reads it
    job = scheduler.submit(owner, generation_work(decoder, drain=True), ready)  # type: ignore[arg-type]
    stream.attach(scheduler, job)
    on_done(job, end)
    return job
