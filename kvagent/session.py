"""Session: one conversation's prompt (segments, fields, skills) and the chat API over its cached KV.

A session keeps an ordered list of segments; its :class:`~kvagent.kv.sequence.CachedSequence` holds the
KV of exactly the tokens they render to. Every call that changes the prompt re-renders it and syncs
(``kv.sync``): the longest prefix already cached, here or in another session, is reused and the rest
computed. At rest ``session.tokens == session.rendered.tokens`` and the span table covers every cached
position exactly once. Every verb runs as one unit of work on the engine's scheduler: calls on one
session run in the order they were made, whatever thread (or coroutine, ``kvagent.aio``) makes them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import logging
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence, TypeVar

import numpy as np

from kvagent.chat_format import ChatFormat
from kvagent.edits import EditReport, EditStrategy, get_strategy
from kvagent.edits.implicit import CalibratedSplice, field_name
from kvagent.errors import ContextOverflowError, KVAgentError, SessionClosedError
from kvagent.fields import check_changes
from kvagent.generation import Decoder, Generation, GenerationStream, ReplyTokens, generation_work, start_stream
from kvagent.kv.persist import restore_blob, save_blob
from kvagent.kv.pool import TIER_MIN_TOKENS, Retained
from kvagent.kv.sequence import CachedSequence
from kvagent.kv.rebase import plan as plan_rebase
from kvagent.kv.rebase import rebase
from kvagent.kv.splice import Refresh, splice_field, splice_refusal
from kvagent.kv.work import Work
from kvagent.kv.sync import PrefillReport, free_start, sync
from kvagent.sampling import Sampler, SamplingParams
from kvagent.scheduler import Job, Scheduler
from kvagent.segments import Renderer, Rendered, Segment, SegmentKind, Span, common_prefix, field_values
from kvagent.tools.format import attach as attach_tools
from kvagent.tools.choice import ToolChoice, callable_tools, turn_grammar
from kvagent.tools.format import format_of
from kvagent.tools.grammar import Constraint
from kvagent.tools.spec import ToolSet

if TYPE_CHECKING:
    from kvagent.eviction import CycleReport
    from kvagent.fields import FieldSpec
    from kvagent.skills.fidelity import FidelityGuard
    from kvagent.skills.library import SkillLibrary
    from kvagent.skills.spec import SkillSpec

log = logging.getLogger(__name__)
T = TypeVar("T")


RESUME_CANDIDATES = 8
"""Retained conversations a resent prompt is compared with (the most recently used first)."""
RESUME_GAIN = 32
"""Tokens resuming a retained conversation must keep beyond the prefix the index gives, to be worth taking it."""


@dataclass(frozen=True)
class Resume:
    """What a closed session leaves with its retained cells (``SequencePool.retain``) for a later session to resume
    from: the renderer it rendered with (a chat format and a scope's memo), its segments and their rendering."""

    renderer: Renderer
    segments: tuple[Segment, ...]
    rendered: Rendered


@dataclass(frozen=True)
class TurnFit:
    """What a turn needs (:meth:`Session.fit`): the prompt's tokens, the reply budget, the KV cells it may add."""

    prompt_tokens: int
    max_tokens: int
    cells: int


class Session:
    """A prompt of segments kept alive as KV in one sequence. Open with ``engine.session(...)``."""

    def __init__(
        self, cache: CachedSequence, scheduler: Scheduler, renderer: Renderer, segments: Sequence[Segment], *,
        skills: Callable[[], SkillLibrary], fingerprint: str, on_close: Callable[[Session], None],
        fields: Sequence[FieldSpec] = (), edit_strategy: str | EditStrategy = "auto",
        compact_after: int | None = None, share_prefix: bool = True, fidelity: FidelityGuard | None = None,
        implicit_edits: CalibratedSplice | None = None,
    ) -> None:
        if compact_after is not None and compact_after < 1:
            raise ValueError(f"compact_after must be >= 1 (or None to never compact), got {compact_after}")
        self.cache, self.renderer, self.model_fingerprint = cache, renderer, fingerprint
        self._scheduler, self._skills, self._on_close = scheduler, skills, on_close
        self._segments: list[Segment] = attach_tools(renderer, segments)
        self._rendered: Rendered | None = None
        self._closed = False
        self.replies = ReplyTokens()
        self._specs = {spec.name: spec for spec in fields}
        self._strategy = get_strategy(edit_strategy)
        self._compact_after, self._share_prefix, self._fidelity = compact_after, share_prefix, fidelity
        self._stream: tuple[Job, weakref.ref[GenerationStream]] | None = None
        self._warned: set[str] = set()  # fallback reasons already logged at WARNING
        self._implicit = implicit_edits if implicit_edits is not None else CalibratedSplice()
        self._discovered: dict[str, int] = {}
        self._resumed = 0  # tokens of a retained conversation the next rebase starts from (reported once)
        self.retains = True  # whether its cells are retained once it is closed (``close(retain=...)``)

    # -- state ------------------------------------------------------------------------------------
    seq = property(lambda self: self.cache.seq, doc="The backend sequence id this session's KV lives in.")
    closed = property(lambda self: self._closed)
    segments = property(lambda self: tuple(self._segments))
    tokens = property(lambda self: self.cache.tokens, doc="Token ids of the cached prompt (positions 0..len-1).")
    evicted_positions = property(lambda self: self.cache.evicted, doc="Positions an eviction cycle removed.")
    cached_positions = property(lambda self: self.cache.cached_positions, doc="Positions whose KV is held.")
    stale_positions = property(lambda self: self.cache.stale, doc="KV kept stale by a field-only/selective edit.")
    clean_prefix = property(lambda self: self.cache.clean_prefix, doc="Cached prefix other sessions may share.")
    n_ctx = property(lambda self: self.cache.backend.n_ctx)
    scheduler = property(lambda self: self._scheduler, doc="The engine's scheduler this session's work runs on.")

    @property
    def cycles(self) -> tuple[CycleReport, ...]:
        """Every eviction cycle this session ran (empty without an eviction policy)."""
        return tuple(self.cache.evictor.cycles) if self.cache.evictor is not None else ()

    def cached_spans(self) -> list[tuple[Span, tuple[int, ...]]]:
        """Provenance: each span of the prompt with the positions of it still cached."""
        if not self._segments:  # nothing rendered yet (a session opened empty)
            return []
        gone = self.cache.evicted
        return [(s, tuple(p for p in range(s.first, s.last + 1) if p not in gone)) for s in self.rendered.spans]

    @property
    def rendered(self) -> Rendered:
        """Tokens and span table of the current segments."""
        if self._rendered is None:
            self._rendered = self.renderer.render(self._segments)
        return self._rendered

    @property
    def spans(self) -> tuple[Span, ...]:
        return self.rendered.spans

    @property
    def field_values(self) -> dict[str, object]:
        """Current value of every field: the declared value, overridden by the latest erratum."""
        return field_values(self._segments)

    @property
    def prompt_format(self) -> str:
        """``chat`` when the session renders with the model's chat template, ``plain`` when it renders plain
        text (``engine.session(chat=False)``); edit calibrations are kept per format."""
        return "plain" if self.renderer.chat_format == ChatFormat.plain() else "chat"

    def fit(self, segments: Sequence[Segment], max_tokens: int) -> TurnFit:
        """How a turn that makes ``segments`` the prompt and replies with up to ``max_tokens`` fits this session:
        the prompt's tokens, the reply budget that fits (clipped to the context; with eviction, as asked) and the
        KV cells it may add beyond what is cached. Raises :class:`ContextOverflowError` (nothing changed) when
        no reply fits. Reads only: safe beside running work."""
        rendered = self.renderer.render([*self.replies.resolve_all(segments, self._segments), Segment.reply()])
        tokens = rendered.tokens  # SegmentOrderError on a bad order
        closing = self.renderer.closing_length("assistant") + 1
        n_ctx, evictor = self.n_ctx, self.cache.evictor
        if evictor is None:
            room = n_ctx - len(tokens) - closing
            if room < 1:
                raise ContextOverflowError(
                    f"the prompt is {len(tokens)} tokens and the context {n_ctx}: no room for a reply; shorten the "
                    "messages or start a new session (nothing was changed)")
            max_tokens = min(max_tokens, room)
        cells = self._cells_to_bring(rendered) + max_tokens + closing
        if evictor is not None:
            cells = min(cells, evictor.budget + evictor.chunk + closing)
        return TurnFit(len(tokens), max_tokens, cells)

    # -- running work on the scheduler -------------------------------------------------------------
    def run(self, work: Work[T], *, timeout: float | None = None) -> T:
        """Run a unit of work built from this session's ``*_work`` verbs, in order with its other calls, and
        return its result (from any thread; inline when called from the engine's worker). ``timeout``: cancel
        it (rolled back) and raise ``TimeoutError`` past that many seconds."""
        if self._stream is not None and not self._scheduler.on_worker:
            job, ref = self._stream
            stream = ref()
            if stream is not None and stream.live and stream.consumer == threading.get_ident() and self._scheduler.active(self) is job:
                work.close()
                raise KVAgentError("this thread is reading a stream of this session: read it to the end or close() "
                                   "it before calling the session again")
        return self._scheduler.run(self, work, timeout=timeout)

    def _check_open(self) -> None:
        if self._closed:
            raise SessionClosedError(f"session on sequence {self.seq} is closed: open a new one with engine.session()")

    def sync_work(self, rendered: Rendered) -> Work[PrefillReport]:
        """Bring the cache to ``rendered`` (the one place a sync starts; see ``kv.sync``)."""
        library = self._skills()
        return sync(self.cache, rendered, skills=library, renderer_sink=lambda: library.sink(self.renderer),
                    share_prefix=self._share_prefix, fidelity=self._fidelity)

    @property
    def resume_point(self) -> Resume | None:
        """What this session's retained cells can be resumed from once it is closed (None: nothing rendered)."""
        if not self._segments or self._rendered is None:
            return None
        return Resume(self.renderer, tuple(self._segments), self._rendered)

    def resume(self, segments: Sequence[Segment], tail: Sequence[Segment] = ()) -> list[Segment]:
        """About to be given the resent prompt ``segments`` (then ``tail``): take the retained conversation of this
        scope (``SequencePool.retained``: a closed session's cells, or one this session left) that keeps the most
        of it once its changed regions are edited in place, when that beats what this session's own cache keeps
        (or, caching nothing, what starting afresh keeps: the prefix another sequence or a tier gives, and the
        compiled skills transplanted after it) by :data:`RESUME_GAIN` tokens. Its cells become
        this session's, and the next :meth:`rebase_work` edits them into ``segments`` ("beyond a prefix": a
        history resent with a line changed near its top keeps the rest). A conversation this session leaves
        (resuming another, or a prompt that keeps less than half of it: an agent's side request under the same
        key) is retained in turn, so the next request can come back to it. Returns ``segments`` with the resumed
        conversation's exact reply tokens. Runs on the engine's worker (it moves cells)."""
        cache = self.cache
        segments = list(segments)
        if not self._share_prefix or cache.evictor is not None or not cache.backend.capabilities.shift:
            return segments
        own = bool(cache.tokens) and self._rendered is not None and self._rendered.tokens == cache.tokens \
            and not cache.restored
        if cache.tokens and not own:
            return segments
        first = self.renderer.render(attach_tools(self.renderer, [*self.replies.resolve_all(segments, self._segments),
                                                                  *tail]))
        if own:
            kept_here = self._kept(self.rendered, self._segments, first)
        else:  # what starting afresh keeps: a prefix of the pool or a tier, and the compiled skills transplanted
            library = self._skills()
            kept_here = free_start(cache, first, skills=library, renderer_sink=lambda: library.sink(self.renderer))
        # at most that little left to compute: not worth a search
        searched = len(first.tokens) - kept_here >= 2 * RESUME_GAIN
        candidates = [r for r in reversed(cache.pool.retained) if searched and r.scope == cache.scope
                      and isinstance(r.memo, Resume) and r.memo.renderer is self.renderer
                      and r.tokens[:len(r.memo.rendered.tokens)] == r.memo.rendered.tokens][:RESUME_CANDIDATES]
        best, best_kept, best_segments = None, kept_here + RESUME_GAIN, segments
        for retained in candidates:
            memo: Resume = retained.memo
            resolved = self.replies.resolve_all(segments, memo.segments)
            kept = self._kept(memo.rendered, memo.segments,
                              self.renderer.render(attach_tools(self.renderer, [*resolved, *tail])))
            if kept >= best_kept:
                best, best_kept, best_segments = retained, kept, resolved
        if best is None:
            if own and kept_here < len(cache.tokens) // 2 and len(cache.tokens) >= RESUME_GAIN:
                self._leave()  # most of this conversation is about to go: keep it for a request that comes back
            return segments
        memo = best.memo
        if len(best.tokens) - best_kept >= TIER_MIN_TOKENS:  # the edit drops a part worth storing: a copy in the
            cache.pool.store_copy(best)  # tiers, for a request of the prompt it held to come back to
        if own:
            cache.pool.touch(best.seq)  # the most recently used: taking a sequence for what is left gives back another
            self._leave(best)
            cache.cut(0)
        try:
            cache.adopt(best, len(memo.rendered.tokens))
        except KVAgentError as exc:  # given back meanwhile: the prompt is computed as it would be without it
            log.warning("seq %d could not resume retained seq %d (%s)", cache.seq, best.seq, exc)
            return segments
        self._segments, self._rendered = list(memo.segments), memo.rendered
        self._resumed = len(memo.rendered.tokens)
        log.info("seq %d resumed a retained conversation of %d tokens (seq %d): %d of %d tokens kept (its own cache "
                 "or a fresh start offered %d)", cache.seq, len(memo.rendered.tokens), best.seq, best_kept,
                 len(first.tokens), kept_here)
        return best_segments

    def _kept(self, old: Rendered, segments: Sequence[Segment], new: Rendered) -> int:
        """Tokens of ``old`` (rendered from ``segments``) that bringing a cache holding it to ``new`` keeps."""
        hunks, _, why = plan_rebase(old, new, **self._rebase_options(segments))
        return common_prefix(old.tokens, new.tokens) if why is not None else len(new.tokens) - sum(h.added for h in hunks)

    def _leave(self, keep: Retained | None = None) -> None:
        """Retain a copy of this session's conversation (its cells shared, not copied) before it goes; not where that
        would take the sequence of ``keep`` (the retained conversation about to be resumed)."""
        cache, pool = self.cache, self.cache.pool
        if not pool.can_take(excluding=keep.seq if keep is not None else None):
            return
        seq = pool.take("a conversation left behind")
        pool.share(cache.seq, seq, 0, len(cache.tokens))
        pool.index.insert(seq, cache.tokens[:cache.shareable], cache.scope)
        pool.retain(seq, cache.tokens, cache.scope, stale=cache.stale, memo=self.resume_point)
        log.info("seq %d: the conversation it leaves (%d tokens) is retained as seq %d", cache.seq, len(cache.tokens),
                 seq)

    def rebase_work(self, rendered: Rendered) -> Work[PrefillReport]:
        """Bring the cache to ``rendered``, a prompt a client resent whole: the regions that changed inside it are
        edited in place where this model's calibration says splices hold (``kv.rebase``), the rest synced as usual.
        The report's ``edits`` say what was done; a region edited turn after turn becomes a discovered field."""
        if not self._segments:  # nothing rendered yet: nothing to edit
            return (yield from self.sync_work(rendered))
        backend = self.cache.backend

        def detokenize(tokens: tuple[int, ...]) -> str:
            return b"".join(backend.token_bytes(t) for t in tokens).decode("utf-8", "replace")

        report = yield from rebase(self.cache, self.rendered, rendered, sync=self.sync_work, detokenize=detokenize,
                                   **self._rebase_options())
        if self._resumed:
            report, self._resumed = dataclasses.replace(report, resumed=self._resumed), 0
        for edit in report.edits:
            if edit.kind != "fallback":
                name = field_name(edit.line)
                self._discovered[name] = self._discovered.get(name, 0) + 1
        return report

    def _rebase_options(self, segments: Sequence[Segment] | None = None) -> dict[str, Any]:
        """What ``kv.rebase`` decides with for this session (editing ``segments``, default its own): the model's
        calibration (``recompute_because``), the spans a resend may not edit in place (``frozen``: an assistant
        turn that called tools), the policy's bounds."""
        by_id = {seg.id: seg for seg in (self._segments if segments is None else segments)}
        tool_format = format_of(self.renderer)

        def frozen(span: Span) -> str | None:
            seg = by_id.get(span.segment_id)
            if seg is not None and seg.role == "assistant" and tool_format.writes_calls(seg.text):
                return "a change inside an assistant turn that called tools (its calls are the model's own tokens)"
            return None

        policy = self._implicit
        return {"recompute_because": policy.recompute_because(self.model_fingerprint, self.prompt_format),
                "frozen": frozen, "max_share": policy.max_share, "max_edits": policy.max_edits}

    def _cells_to_bring(self, new: Rendered) -> int:
        """KV cells bringing the cache to ``new`` may add (an upper bound): the tokens after the common prefix, or,
        where a resend would edit the changed regions in place, the tokens those regions and the end add."""
        old = self.cache.tokens
        keep = common_prefix(old, new.tokens)
        if keep == len(old) or not self._segments or self.rendered.tokens != old:
            return len(new.tokens) - keep
        hunks, inner, why = plan_rebase(self.rendered, new, **self._rebase_options())
        if not inner or why is not None:
            return len(new.tokens) - keep
        return sum(h.added for h in hunks)

    @property
    def discovered_fields(self) -> dict[str, int]:
        """Regions of a resent prompt that changed in more than one turn (named after their line, :func:`
        kvagent.edits.implicit.field_name`) -> how many turns edited them."""
        return {name: n for name, n in self._discovered.items() if n > 1}

    def restore_segments(self, segments: Sequence[Segment]) -> None:
        self._segments, self._rendered = list(segments), None

    # -- prompt: units of work, and their blocking forms ------------------------------------------
    def prefill_work(self) -> Work[PrefillReport]:
        self._check_open()
        return (yield from self.sync_work(self.rendered))

    def replace_work(self, segments: Sequence[Segment]) -> Work[PrefillReport]:
        return (yield from self._become_work(segments, self.sync_work))

    def resend_work(self, segments: Sequence[Segment]) -> Work[PrefillReport]:
        return (yield from self._become_work(segments, self.rebase_work))

    def _become_work(self, segments: Sequence[Segment],
                     bring: Callable[[Rendered], Work[PrefillReport]]) -> Work[PrefillReport]:
        """Make ``segments`` the prompt, the cache brought to it by ``bring`` (a sync, or a rebase)."""
        self._check_open()
        segments = attach_tools(self.renderer, self.replies.resolve_all(segments, self._segments))
        rendered = self.renderer.render(segments)  # validates before anything changes
        report = yield from bring(rendered)
        self._segments, self._rendered = segments, rendered
        return report

    def extend_work(self, segments: Sequence[Segment]) -> Work[PrefillReport]:
        return (yield from self.replace_work([*self._segments, *segments]))  # the prompt as it is when this runs

    def include_work(self, skill: SkillSpec) -> Work[PrefillReport]:
        self._check_open()
        segment = self._skills().segment(skill, self.renderer)
        return (yield from self.replace_work([*self._segments, segment]))

    def prefill(self) -> PrefillReport:
        """Bring the cache in line with the current segments (reusing the cached prefix)."""
        return self.run(self.prefill_work())

    def extend(self, *segments: Segment) -> PrefillReport:
        """Append segments and prefill them; refused (nothing changed) if the order is invalid or too long."""
        return self.run(self.extend_work(segments))

    def replace(self, segments: Sequence[Segment]) -> PrefillReport:
        """Make ``segments`` the whole prompt; the longest cached prefix is reused, the rest computed."""
        return self.run(self.replace_work(segments))

    def resend(self, segments: Sequence[Segment]) -> PrefillReport:
        """Make ``segments`` the whole prompt as a client that resends it does: the regions that changed are edited
        in place where the model's calibration says splices hold, the rest computed (:meth:`rebase_work`); the
        report's ``edits`` say what was done. :meth:`replace` recomputes from the first change instead."""
        return self.run(self.resend_work(segments))

    def include(self, skill: SkillSpec) -> PrefillReport:
        """Place a skill at the end of the prompt: compiled once per model, then transplanted (not prefilled).

        The report's ``transplanted`` counts the tokens whose KV was copied; where the backend cannot
        shift positions the skill is prefilled instead (``transplanted == 0``).
        """
        return self.run(self.include_work(skill))

    # -- edits (kvagent.edits) --------------------------------------------------------------------
    def set_many_work(self, changes: Mapping[str, object], *, strategy: str | EditStrategy | None = None) -> Work[EditReport]:
        self._check_open()
        checked = check_changes(self._segments, self._specs, changes)
        report = yield from (self._strategy if strategy is None else get_strategy(strategy)).apply(self, checked)
        n_errata = sum(seg.kind is SegmentKind.ERRATUM for seg in self._segments)
        if self._compact_after is not None and n_errata > self._compact_after:
            yield from self.compact_work()
        return report

    def set(self, name: str, value: object, *, strategy: str | EditStrategy | None = None) -> EditReport:
        """Change one field's value through an edit strategy (default: the session's, ``auto``)."""
        return self.set_many({name: value}, strategy=strategy)

    def set_many(self, changes: Mapping[str, object], *, strategy: str | EditStrategy | None = None) -> EditReport:
        """Change several fields at once. Every name and value is checked before any KV changes."""
        return self.run(self.set_many_work(changes, strategy=strategy))

    def compact_work(self) -> Work[PrefillReport]:
        values = self.field_values
        return (yield from self.replace_work([
            seg.with_value(values[str(seg.name)]) if seg.kind is SegmentKind.FIELD else seg
            for seg in self._segments if seg.kind is not SegmentKind.ERRATUM
        ]))

    def compact(self) -> PrefillReport:
        """Fold every erratum back into its field; only the KV after the first changed field is recomputed."""
        return self.run(self.compact_work())

    def _with_value(self, name: str, value: object) -> tuple[int, list[Segment]]:
        """(index of field ``name``, the segments with that field holding ``value``)."""
        index = next(i for i, s in enumerate(self._segments) if s.kind is SegmentKind.FIELD and s.name == name)
        return index, [*self._segments[:index], self._segments[index].with_value(value), *self._segments[index + 1:]]

    def splice_refusal_work(self, name: str, value: object) -> Work[str | None]:
        self._check_open()
        old = self.rendered
        yield from self.sync_work(old)
        index, segments = self._with_value(name, value)
        return splice_refusal(self.cache, old, self.renderer.render(segments), index)

    def splice_refusal(self, name: str, value: object) -> str | None:
        """Why field ``name`` cannot be spliced to ``value`` exactly right now (after eviction, past a sliding
        window, ...), or None when it can: what ``splice_field`` would fall back on. Prefills first."""
        return self.run(self.splice_refusal_work(name, value))

    def splice_field_work(self, name: str, value: object, refresh: Refresh | None = None) -> Work[PrefillReport]:
        self._check_open()
        old = self.rendered
        yield from self.sync_work(old)
        index, segments = self._with_value(name, value)
        new = self.renderer.render(segments)
        reason = splice_refusal(self.cache, old, new, index)
        if reason is not None:
            # no silent fallback: the report says why, the log says it once per session and reason
            if reason not in self._warned:
                self._warned.add(reason)
                log.warning("field %r cannot be spliced exactly on sequence %d (%s): recomputing from the field",
                            name, self.seq, reason)
            report = yield from self.replace_work(segments)
            return dataclasses.replace(report, recomputed_because=reason)
        self._segments, self._rendered = segments, new  # from here the prompt holds the new value
        return (yield from splice_field(self.cache, old, new, index, refresh))

    def splice_field(self, name: str, value: object, refresh: Refresh | None = None) -> PrefillReport:
        """Rewrite one field's KV in place, keeping the downstream KV stale except ``refresh`` positions
        (``kv.splice``); where that cannot be exact (after eviction, past a sliding window) it recomputes
        from the field. Used by the ``field_only`` and ``selective`` edits."""
        return self.run(self.splice_field_work(name, value, refresh))

    # -- generation -------------------------------------------------------------------------------
    def respond_work(self, max_tokens: int = 128, **options: Any) -> Work[Generation]:
        """The next assistant turn as one unit of work (``options`` as in :meth:`stream`)."""
        self._check_open()
        return (yield from generation_work(self.decoder(max_tokens, **options)))

    def generate(self, max_tokens: int = 128, **options: Any) -> Generation:
        """Generate the assistant's next turn and keep it in the cache; ``options`` as in :meth:`stream`."""
        self._check_open()
        return self.run(self.respond_work(max_tokens, **options))

    def decoder(
        self, max_tokens: int = 128, *, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
        seed: int | None = None, stop: Sequence[str] = (), user: str | None = None, prefix: str = "",
        segments: Sequence[Segment] | None = None, on_piece: Callable[[str], None] = lambda piece: None,
        tools: ToolSet | None = None, tool_choice: Any = "auto", parallel_tool_calls: bool | None = None,
        response_schema: Mapping[str, Any] | None = None,
    ) -> Decoder:
        """A :class:`~kvagent.generation.Decoder` for the next turn (what :meth:`stream` runs).

        ``tools`` (a ``kvagent.tools.ToolSet`` whose segments the prompt holds, ``engine.tool_segments``):
        the turn is decoded under a grammar so its calls always parse and match the tools' schemas;
        ``tool_choice``: ``auto`` (text or calls), ``none``, ``required`` or a tool's name;
        ``parallel_tool_calls``: several calls in one turn (only where asked). ``response_schema``: a JSON schema the
        whole reply follows (``{"type": "object"}``: any JSON object); with tools, a turn in ``auto`` either calls or
        replies in the schema, one that must call only calls."""
        sampler = Sampler(SamplingParams(temperature, top_p, top_k, seed))
        extra = [Segment.user(user)] if user is not None else []
        base = attach_tools(self.renderer, self.replies.resolve_all(segments, self._segments)) if segments is not None else None
        constraint, called = None, None
        if tools or response_schema is not None:
            choice = ToolChoice.of(tool_choice, tools or ToolSet(), parallel_tool_calls) if tools else None
            grammar = turn_grammar(tools, choice, response_schema, format_of(self.renderer), self.cache.backend)
            if grammar is not None:
                constraint = Constraint(self.cache.backend, grammar)
            if choice is not None and choice.mode != "none":  # with a schema too: auto is a call or the reply
                called = callable_tools(tools, choice) or None  # the calls of the turn are read from its text
        return Decoder(self, max_tokens, sampler, stop, extra, prefix, on_piece, base=base, constraint=constraint,
                       tools=called)

    def stream(self, max_tokens: int = 128, **options: Any) -> GenerationStream:
        """Generate the next assistant turn as an iterator of text pieces (it starts at once, in the worker).

        Greedy when ``temperature == 0``, else sampled (``top_p``, ``top_k``, ``seed``); ends at the model's
        end of turn, a ``stop`` string (not in the text) or ``max_tokens``. ``user``: a user turn appended
        first; ``prefix``: the answer starts with that text; ``segments``: the whole prompt replaced first
        (clients that resend the history); all prefilled in the same pass, so TTFT covers them. The turn
        stays cached. Closing the stream early rolls it back; a full context rolls it back and raises
        :class:`ContextOverflowError` with the partial text."""
        return self.open_stream(GenerationStream(), max_tokens, **options)

    def open_stream(self, stream: GenerationStream, max_tokens: int = 128, **options: Any) -> GenerationStream:
        """Start a generation that feeds ``stream`` (a sync or an async stream; see :meth:`stream`)."""
        self._check_open()
        job = start_stream(self._scheduler, self, stream, lambda push: self.decoder(max_tokens, on_piece=push, **options))
        self._stream = (job, weakref.ref(stream))
        return stream

    def chat(self, user_text: str, max_tokens: int = 128, **sampling: object) -> Generation:
        """Append a user turn and generate the reply in one pass (``sampling`` as in :meth:`stream`)."""
        return self.generate(max_tokens, user=user_text, **sampling)

    # -- logits, save, restore --------------------------------------------------------------------
    def logits_work(self) -> Work[np.ndarray]:
        yield from self.prefill_work()
        return self.cache.logits.copy()  # type: ignore[union-attr]

    def logits(self) -> np.ndarray:
        """Next-token logits ``[n_vocab]`` after the cached prompt (prefills first if needed)."""
        return self.run(self.logits_work())

    def save_work(self) -> Work[bytes]:
        yield from self.prefill_work()
        return save_blob(self.cache, self.model_fingerprint)

    def save(self) -> bytes:
        """This session's KV and prompt as a checked blob (see ``kvblob.KVBlob``)."""
        return self.run(self.save_work())

    def restore_work(self, blob: bytes, segments: Sequence[Segment], *, share: bool = False) -> Work[None]:
        self._check_open()
        rendered = self.renderer.render(list(segments))
        restore_blob(self.cache, blob, rendered.tokens, self.model_fingerprint, share=share)
        self._segments, self._rendered = list(segments), rendered
        return None
        yield  # pragma: no cover - a unit of work that never pauses

    def restore(self, blob: bytes, segments: Sequence[Segment], *, share: bool = False) -> None:
        """Load KV saved by :meth:`save` for the prompt ``segments`` (which must render to its tokens).
        Checks come first (model, format, checksum, tokens); a refused blob leaves the session as it was.
        Restored cells are never offered to other sessions through the prefix index unless ``share`` (bytes this
        process saved itself, e.g. a parked session); cells computed on top of them are kept out as well, until
        the prompt is rebuilt from its first token."""
        self.run(self.restore_work(blob, segments, share=share))

    # -- lifetime ---------------------------------------------------------------------------------
    def close(self, *, retain: bool = True) -> None:
        """End this session (a stream still running is cancelled and rolled back first); later calls raise
        :class:`SessionClosedError`. Its cells are retained for later sessions of its scope (``SequencePool.retain``,
        where the engine retains), or freed at once with ``retain=False`` (a session deleted: nothing of it stays)."""
        if self._closed:
            return
        stream = self._stream[1]() if self._stream is not None else None
        if stream is not None:
            stream.close()
        self._scheduler.run(self, self.close_work(retain=retain))

    def close_work(self, *, retain: bool = True) -> Work[None]:
        """The close itself, queued behind this session's other work (cancel a running stream first)."""
        if not self._closed:
            self._closed = True
            self.retains = retain
            self._on_close(self)
        return None
        yield  # pragma: no cover - a unit of work that never pauses

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
