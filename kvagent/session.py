"""Session: one conversation's prompt and the sequence of KV that holds it.

A session keeps an ordered list of segments and, in its backend sequence, the KV of exactly the tokens
those segments render to (positions ``0..n-1``). Every call that changes the prompt re-renders it and
*syncs*: the longest prefix already cached (in this sequence, or shared from another session) is
reused, the rest is removed and decoded left to right. Each call reports reused vs computed tokens.
At rest, ``session.tokens == session.rendered.tokens`` and the span table covers every cached position
exactly once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from kvagent.errors import ContextOverflowError, FieldValueError, KVAgentError, SessionClosedError
from kvagent.kvblob import KVBlob
from kvagent.sampling import Sampler, SamplingParams
from kvagent.segments import Renderer, Rendered, Segment, SegmentKind, Span, common_prefix
from kvagent.textstream import TextAssembler

if TYPE_CHECKING:
    from kvagent.edits import EditReport, EditStrategy
    from kvagent.skills.fidelity import FidelityGuard
    from kvagent.skills.library import CompiledSkill
    from kvagent.skills.spec import SkillSpec
    from kvagent.engine import Engine
    from kvagent.eviction import CycleReport, Evictor
    from kvagent.fields import FieldSpec

log = logging.getLogger(__name__)
_MAX_REMEMBERED_TURNS = 256


@dataclass(frozen=True)
class PrefillReport:
    """What one sync cost: tokens reused from cache, tokens computed, wall time."""

    reused: int
    computed: int
    seconds: float
    shared: int = 0  # of the reused tokens, how many came from another session's cells
    transplanted: int = 0  # tokens whose KV was copied from a compiled skill (not computed)
    fidelity: float | None = None  # cosine vs a recompute, when the fidelity guard checked this sync
    fell_back: bool = False  # the guard found the transplant too far off and adopted the recompute


@dataclass(frozen=True)
class Generation:
    """One generated assistant turn and what it cost.

    ``finish_reason``: ``eos`` (the model ended its turn), ``stop`` (a stop string), ``length``
    (``max_tokens`` reached). ``reused``/``computed`` count the prompt tokens of this call;
    ``ttft_s`` is the time from the call to the first sampled token.
    """

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    reused: int
    computed: int
    ttft_s: float
    total_s: float
    transplanted: int = 0  # prompt tokens whose KV came from compiled skills

    @property
    def generated(self) -> int:
        return len(self.token_ids)


class GenerationStream:
    """Iterator of text pieces of one generation; :attr:`result` holds the :class:`Generation` at the end."""

    def __init__(self) -> None:
        self._pieces: Iterator[str] = iter(())
        self.result: Generation | None = None

    def __iter__(self) -> GenerationStream:
        return self

    def __next__(self) -> str:
        return next(self._pieces)


class Session:
    """A prompt of segments kept alive as KV in one sequence. Open with ``engine.session(...)``."""

    def __init__(
        self,
        engine: Engine,
        seq: int,
        renderer: Renderer,
        segments: list[Segment],
        *,
        fields: Sequence[FieldSpec] = (),
        edit_strategy: str | EditStrategy = "erratum",
        compact_after: int | None = None,
        share_prefix: bool = True,
        fidelity: FidelityGuard | None = None,
        evictor: Evictor | None = None,
    ) -> None:
        from kvagent.edits import get_strategy

        self._engine = engine
        self._backend = engine.backend
        self.seq = seq
        self._renderer = renderer
        self._segments: list[Segment] = list(segments)
        self._cached: tuple[int, ...] = ()
        self._logits: np.ndarray | None = None  # next-token logits after the last cached position
        self._rendered: Rendered | None = None
        self._closed = False
        # text of turns this session generated -> their exact tokens, so a client that sends the
        # whole history back (OpenAI/LangChain style) re-renders to the tokens already cached
        self._generated: dict[str, tuple[int, ...]] = {}
        self._specs: dict[str, FieldSpec] = {spec.name: spec for spec in fields}
        self._strategy = get_strategy(edit_strategy)
        if compact_after is not None and compact_after < 1:
            raise ValueError(f"compact_after must be >= 1 (or None to never compact), got {compact_after}")
        self._compact_after = compact_after
        self._share_prefix = share_prefix
        self._fidelity = fidelity
        # positions whose KV was deliberately left stale by a field-only / selective edit
        self._stale: frozenset[int] = frozenset()
        # Sliding-window models: restored or transplanted KV holds only the last window of SWA cells
        # (llama.cpp saves no more), so the cache may not be cut below this position and extended
        # again; a cut below it recomputes from 0. 0 = no such limit.
        self._floor = 0
        # eviction (source paper B): positions whose KV a cycle removed; the span table still covers them
        self._evictor = evictor
        self._evicted: frozenset[int] = frozenset()

    # -- state ------------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def segments(self) -> tuple[Segment, ...]:
        return tuple(self._segments)

    @property
    def tokens(self) -> tuple[int, ...]:
        """Token ids of the cached prompt at positions ``0..len-1`` (minus :attr:`evicted_positions`)."""
        return self._cached

    @property
    def evicted_positions(self) -> frozenset[int]:
        """Positions an eviction cycle removed from the cache (kept positions never move)."""
        return self._evicted

    @property
    def cached_positions(self) -> tuple[int, ...]:
        """Positions whose KV the sequence holds, ascending."""
        return tuple(p for p in range(len(self._cached)) if p not in self._evicted)

    @property
    def cycles(self) -> tuple[CycleReport, ...]:
        """Every eviction cycle this session ran (empty without an eviction policy)."""
        return tuple(self._evictor.cycles) if self._evictor is not None else ()

    def cached_spans(self) -> list[tuple[Span, tuple[int, ...]]]:
        """Provenance: each span of the prompt with the positions of it still cached."""
        return [
            (span, tuple(p for p in range(span.first, span.last + 1) if p not in self._evicted))
            for span in self.rendered.spans
        ]

    @property
    def rendered(self) -> Rendered:
        """Tokens and span table of the current segments."""
        if self._rendered is None:
            self._rendered = self._renderer.render(self._segments)
        return self._rendered

    @property
    def spans(self) -> tuple[Span, ...]:
        """Span table of the cached prompt: one span per segment, covering every position once."""
        return self.rendered.spans

    @property
    def model_fingerprint(self) -> str:
        return self._engine.fingerprint

    @property
    def stale_positions(self) -> frozenset[int]:
        """Cached positions whose KV predates an edit upstream of them (kept by field-only / selective)."""
        return self._stale

    @property
    def clean_prefix(self) -> int:
        """Length of the cached prefix other sessions may share: no stale position, no missing window."""
        if self._floor:
            return 0
        dirty = self._stale | self._evicted
        return min(dirty) if dirty else len(self._cached)

    @property
    def field_values(self) -> dict[str, object]:
        """Current value of every field: the declared value, overridden by the latest erratum."""
        values: dict[str, object] = {}
        for seg in self._segments:
            if seg.kind in (SegmentKind.FIELD, SegmentKind.ERRATUM):
                values[str(seg.name)] = seg.value
        return values

    @property
    def n_ctx(self) -> int:
        return self._backend.n_ctx

    def _check_open(self) -> None:
        if self._closed:
            raise SessionClosedError(f"session on sequence {self.seq} is closed: open a new one with engine.session()")

    # -- prompt -----------------------------------------------------------------------------------
    def prefill(self) -> PrefillReport:
        """Bring the cache in line with the current segments (reusing the cached prefix)."""
        with self._engine.lock:
            self._check_open()
            return self._sync(self.rendered)

    def extend(self, *segments: Segment) -> PrefillReport:
        """Append segments and prefill them; refused (nothing changed) if the order is invalid or too long."""
        return self.replace([*self._segments, *segments])

    def replace(self, segments: Sequence[Segment]) -> PrefillReport:
        """Make ``segments`` the whole prompt; the longest cached prefix is reused, the rest computed."""
        with self._engine.lock:
            self._check_open()
            segments = [self._with_generated_ids(s) for s in segments]
            rendered = self._renderer.render(segments)  # validates before anything changes
            report = self._sync(rendered)
            self._segments, self._rendered = segments, rendered
            return report

    def include(self, skill: SkillSpec) -> PrefillReport:
        """Place a skill at the end of the prompt: compiled once per model, then transplanted (not prefilled).

        The report's ``transplanted`` counts the tokens whose KV was copied; where the backend cannot
        shift positions the skill is prefilled instead (``transplanted == 0``).
        """
        with self._engine.lock:
            self._check_open()
            segment = self._engine.skills.segment(skill, self._renderer)
            return self.extend(segment)

    def _with_generated_ids(self, seg: Segment) -> Segment:
        if seg.kind is SegmentKind.TURN and seg.role == "assistant" and seg.token_ids is None:
            ids = self._generated.get(seg.text)
            if ids is not None:
                return replace(seg, token_ids=ids)
        return seg

    # -- the one place the cache changes ----------------------------------------------------------
    def _sync(self, rendered: Rendered) -> PrefillReport:
        """Make the sequence hold exactly ``rendered.tokens`` with next-token logits available."""
        start = time.perf_counter()
        new = rendered.tokens
        if len(new) > self.n_ctx and self._evictor is None:
            raise ContextOverflowError(
                f"prompt of {len(new)} tokens does not fit the context of {self.n_ctx}: shorten it, load the "
                "engine with a larger n_ctx, or open the session with an eviction policy "
                "(engine.session(..., eviction=Eviction('surprise', budget=...))); nothing was cut or changed"
            )
        keep = common_prefix(self._cached, new)
        if keep == len(new) == len(self._cached) and self._logits is not None:
            return PrefillReport(reused=keep, computed=0, seconds=time.perf_counter() - start)
        keep = min(keep, len(new) - 1)  # the last token is always decoded: its logits are needed
        if keep < self._floor:  # SWA cells below the floor are missing: extending from there is not exact
            keep = 0
        shared_seq, shared = self._engine.shared_prefix(new, self.seq) if self._share_prefix else (-1, 0)
        shared = min(shared, len(new) - 1)
        start_at = max(keep, shared)
        plan = self._plan(rendered, start_at)  # blobs are fetched and checked before the cache changes
        backend = self._backend
        self._cut(keep)
        self._stale = frozenset(p for p in self._stale if p < keep)
        if keep == 0:
            self._floor = 0
        if shared > keep:
            # copy (share) the other session's cells for the positions we lack
            backend.seq_cp(shared_seq, self.seq, keep, shared)
            gained, keep = shared - keep, shared
        else:
            gained = 0
        self._cached, self._logits = new[:keep], None
        computed = transplanted = 0
        logits = None
        try:
            for first, end, skill in plan:
                if skill is not None:
                    fresh, copied = self._engine.skills.transplant(self.seq, skill, first)
                    computed, transplanted = computed + fresh, transplanted + copied
                    n_swa = backend.n_swa
                    if n_swa and copied + skill.n_sink > n_swa:  # its middle SWA cells did not travel
                        self._floor = max(self._floor, end)
                else:
                    logits = self._decode_run(new, first, end, rendered)
                    computed += end - first
                self._cached = new[:end]
                self._maybe_cycle(rendered)
            if plan[-1][2] is not None:  # the prompt ends inside a skill: decode its last token again
                backend.seq_rm(self.seq, len(new) - 1, -1)
                logits = backend.decode([new[-1]], [len(new) - 1], [self.seq], [True])
                transplanted, computed = transplanted - 1, computed + 1
        except KVAgentError:
            # some chunks may have landed: record exactly what the sequence now holds
            _, pos_max = backend.seq_pos_range(self.seq)
            self._cached = new[: pos_max + 1]
            raise
        if logits is None:  # pragma: no cover - every plan ends with a decode
            raise KVAgentError("sync produced no logits (internal error)")
        self._cached, self._logits = new, logits[-1]
        fidelity, fell_back = None, False
        if transplanted and self._fidelity is not None and self._fidelity.sampled():
            fidelity, fell_back = self._guard(self._fidelity, new, start_at)
        report = PrefillReport(keep, computed, time.perf_counter() - start, gained, transplanted, fidelity, fell_back)
        log.debug("seq %d sync: reused %d (shared %d), computed %d, transplanted %d", self.seq, keep, gained, computed, transplanted)
        return report

    # -- eviction (kvagent.eviction; source paper B) ---------------------------------------------------
    def _cells(self) -> int:
        return len(self._cached) - len(self._evicted)

    def _cut(self, position: int) -> None:
        """Remove every cell from ``position`` on (and what eviction recorded about them)."""
        self._backend.seq_rm(self.seq, position, -1)
        if self._evicted:
            self._evicted = frozenset(p for p in self._evicted if p < position)
        if self._evictor is not None:
            self._evictor.forget_from(position)

    def _decode_run(self, tokens: tuple[int, ...], first: int, end: int, rendered: Rendered) -> np.ndarray:
        """Decode ``tokens[first:end]`` at their positions (logits of the last one if it ends the prompt).
        With an eviction policy: in chunks of h tokens, a cycle whenever one is due."""
        want_last = end == len(tokens)
        ev = self._evictor
        if ev is None:
            n = end - first
            return self._backend.decode(tokens[first:end], range(first, end), [self.seq] * n, [False] * (n - 1) + [want_last])
        logits = np.zeros((0, self._backend.n_vocab), np.float32)
        s = first
        while s < end:
            # a chunk stops where a cycle falls due, so the cells never exceed budget + chunk
            e = min(end, s + ev.chunk, s + max(ev.budget + ev.chunk - self._cells(), 1))
            logits = ev.decode(tokens[s:e], range(s, e), self.seq, [False] * (e - s - 1) + [want_last and e == end])
            self._cached = tokens[:e]
            self._maybe_cycle(rendered)
            s = e
        return logits

    def _maybe_cycle(self, rendered: Rendered) -> None:
        ev = self._evictor
        if ev is None or not ev.due(self._cells()):
            return
        pinned_at = {p for span in rendered.spans if span.pinned for p in range(span.first, span.last + 1)}
        positions = self.cached_positions
        report = ev.cycle(self.seq, [self._cached[p] for p in positions], positions, [p in pinned_at for p in positions])
        self._evicted = self._evicted | frozenset(report.evicted)

    def _guard(self, guard: FidelityGuard, tokens: tuple[int, ...], start: int) -> tuple[float, bool]:
        """Compare with a full prefill in a scratch sequence; below threshold, adopt its cells."""
        backend = self._backend
        with self._engine.scratch() as scratch:
            n = len(tokens)
            reference = backend.decode(tokens, range(n), [scratch] * n, [False] * (n - 1) + [True])[0]
            cos = guard.cosine(self._require_logits(), reference)
            if cos >= guard.threshold:
                return cos, False
            log.warning("transplant fidelity %.4f < %.4f on sequence %d: using the recomputed KV", cos, guard.threshold, self.seq)
            backend.seq_rm(self.seq, start, -1)
            backend.seq_cp(scratch, self.seq, start, n)
            self._logits = reference
            return cos, True

    def _plan(self, rendered: Rendered, start: int) -> list[tuple[int, int, CompiledSkill | None]]:
        """Runs ``(first, end, skill)`` covering ``[start, len)``: compiled skills to transplant, else decode.

        A skill is transplanted only when its whole span is to be computed and the backend can shift;
        its blob is fetched (and checked) here, so a refused blob fails before the cache changes.
        """
        library = self._engine.skills_if_loaded
        runs: list[tuple[int, int, CompiledSkill | None]] = []
        cursor = start
        if library is not None and self._backend.can_shift:
            for span in rendered.spans:
                if span.kind is not SegmentKind.SKILL or span.first < start or span.length == 0:
                    continue
                skill = library.lookup(rendered.tokens[span.first : span.last + 1])
                if skill is None:
                    continue
                library.fetch(skill)
                if span.first > cursor:
                    runs.append((cursor, span.first, None))
                runs.append((span.first, span.last + 1, skill))
                cursor = span.last + 1
        if cursor < len(rendered.tokens):
            runs.append((cursor, len(rendered.tokens), None))
        if any(skill is not None for _, _, skill in runs) and not self._engine.has_free_sequence:
            raise KVAgentError(
                "a transplant needs a free scratch sequence and all are in use: close a session or load the "
                "engine with a larger n_seq_max (nothing was changed)"
            )
        return runs

    # -- edits (kvagent.edits; source paper A, DESIGN.md) ------------------------------------------
    def set(self, name: str, value: object, *, strategy: str | EditStrategy | None = None) -> EditReport:
        """Change one field's value through an edit strategy (default: the session's, ``erratum``)."""
        return self.set_many({name: value}, strategy=strategy)

    def set_many(
        self, changes: Mapping[str, object], *, strategy: str | EditStrategy | None = None
    ) -> EditReport:
        """Change several fields at once. Every name and value is checked before any KV changes."""
        from kvagent.edits import get_strategy

        with self._engine.lock:
            self._check_open()
            checked = self._check_changes(changes)
            chosen = self._strategy if strategy is None else get_strategy(strategy)
            report = chosen.apply(self, checked)
            n_errata = sum(seg.kind is SegmentKind.ERRATUM for seg in self._segments)
            if self._compact_after is not None and n_errata > self._compact_after:
                self.compact()
            return report

    def _check_changes(self, changes: Mapping[str, object]) -> dict[str, object]:
        declared = {str(seg.name) for seg in self._segments if seg.kind is SegmentKind.FIELD}
        if not changes:
            raise FieldValueError("no field to set: pass at least one name and value")
        checked: dict[str, object] = {}
        for name, value in changes.items():
            if name not in declared:
                known = ", ".join(sorted(declared)) or "none"
                raise FieldValueError(f"unknown field {name!r}: this session's fields are {known}")
            spec = self._specs.get(name)
            checked[name] = spec.check(value) if spec is not None else value
        return checked

    def compact(self) -> PrefillReport:
        """Fold every erratum back into its field and rebuild from the first changed field.

        Long-lived sessions would otherwise grow by one line per update. The prompt keeps its policy
        and turns; only the KV after the first changed field is recomputed.
        """
        with self._engine.lock:
            self._check_open()
            values = self.field_values
            folded = [
                seg.with_value(values[str(seg.name)]) if seg.kind is SegmentKind.FIELD else seg
                for seg in self._segments
                if seg.kind is not SegmentKind.ERRATUM
            ]
            return self.replace(folded)

    def splice_field(
        self, name: str, value: object, refresh: Callable[[Rendered, Span], Iterable[int]] | None = None
    ) -> PrefillReport:
        """Rewrite one field's KV in place, keeping the downstream KV stale except ``refresh`` positions.

        ``refresh(old_rendered, old_field_span)`` names downstream positions (old coordinates) to
        recompute in context; every other downstream cell keeps the KV computed with the old value
        (shifted by RoPE if the field's token length changed) and is listed in ``stale_positions``.
        Built left to right (llama.cpp accepts tokens only at ``pos_max + 1``): the downstream KV is
        parked in a scratch sequence, the field decoded fresh, then runs of parked cells copied back
        and refreshed positions decoded in order. Used by the ``field_only`` and ``selective`` edits.
        """
        with self._engine.lock:
            self._check_open()
            if self._evicted:
                # the downstream KV is partly evicted: nothing to keep stale, recompute from the field
                log.info("splice of %s after eviction: recomputing from the field", name)
                segments = [s.with_value(value) if s.kind is SegmentKind.FIELD and s.name == name else s for s in self._segments]
                return self.replace(segments)
            start = time.perf_counter()
            old = self.rendered
            if self._cached != old.tokens:
                self._sync(old)
            index = next(i for i, seg in enumerate(self._segments) if seg.kind is SegmentKind.FIELD and seg.name == name)
            segments = list(self._segments)
            segments[index] = segments[index].with_value(value)
            new = self._renderer.render(segments)
            if len(new.tokens) > self.n_ctx:
                raise ContextOverflowError(f"the edited prompt of {len(new.tokens)} tokens exceeds the context of {self.n_ctx}")
            first, last = old.spans[index].first, old.spans[index].last
            delta = new.spans[index].last - last
            n_old, n_new = len(old.tokens), len(new.tokens)
            picked = set(refresh(old, old.spans[index])) if refresh is not None else set()
            fresh = {p + delta for p in picked if last < p < n_old} | set(range(first, last + delta + 1))
            backend = self._backend
            if first < self._floor or (backend.n_swa and n_old - first > backend.n_swa):
                # Sliding-window models: llama.cpp keeps only a window of SWA cells once they fall out
                # of every query's reach (and saves no more), so KV far behind the end cannot be spliced
                # into exactly. Measured on Gemma-3: splices with more than a window downstream failed.
                log.info("splice of %r on sequence %d: more than the sliding window (%d) downstream, or "
                         "restored/transplanted KV; recomputing from the field", name, self.seq, backend.n_swa)
                return self.replace(segments)
            shared_downstream = self._engine.may_share_cells(self.seq, last + 1)
            if delta != 0 and shared_downstream and backend.n_swa:
                # the own-copy path restores saved state, which keeps only the sliding window of SWA
                # layers: cells in the middle would be missing. Rebuild from the field instead.
                log.info("splice of %r on sequence %d: downstream cells are shared and the model uses "
                         "sliding-window attention; recomputing from the field", name, self.seq)
                return self.replace(segments)
            with self._engine.scratch() as park:
                if last + 1 < n_old:
                    if delta != 0 and shared_downstream:
                        # a shift moves every sharer of a cell: give the parked run its own cells first
                        backend.seq_restore(park, backend.seq_save(self.seq))
                        backend.seq_rm(park, 0, last + 1)
                    else:  # park the run by sharing its cells (no copy)
                        backend.seq_cp(self.seq, park, last + 1, n_old)
                backend.seq_rm(self.seq, first, -1)
                if delta != 0 and last + 1 < n_old:
                    # the park is now the only holder of those cells: shifting them moves nobody else
                    backend.seq_add(park, last + 1, -1, delta)
                self._cached, self._logits = new.tokens[:first], None
                self._segments, self._rendered = segments, new
                old_stale = self._stale
                self._stale = frozenset(p for p in old_stale if p < first)
                computed = 0
                pos = first
                try:
                    while pos < n_new:
                        run_fresh = pos in fresh
                        end = pos
                        while end < n_new and (end in fresh) == run_fresh:
                            end += 1
                        if run_fresh:
                            n = end - pos
                            backend.decode(new.tokens[pos:end], range(pos, end), [self.seq] * n, [False] * n)
                            computed += n
                        else:
                            backend.seq_cp(park, self.seq, pos, end)
                        pos = end
                except KVAgentError:
                    # the prompt holds the new value; its KV from the field on will be recomputed
                    backend.seq_rm(self.seq, first, -1)
                    raise
            self._cached = new.tokens
            kept = frozenset(p for p in range(last + delta + 1, n_new) if p not in fresh)
            self._stale = self._stale | kept
            return PrefillReport(reused=first + len(kept), computed=computed, seconds=time.perf_counter() - start)

    # -- generation -------------------------------------------------------------------------------
    def generate(self, max_tokens: int = 128, **options: Any) -> Generation:
        """Generate the assistant's next turn and keep it in the cache; ``options`` as in :meth:`stream`."""
        stream = self.stream(max_tokens, **options)
        for _ in stream:
            pass
        if stream.result is None:  # pragma: no cover - the iterator always sets it
            raise KVAgentError("generation ended without a result")
        return stream.result

    def stream(
        self,
        max_tokens: int = 128,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        user: str | None = None,
    ) -> GenerationStream:
        """Generate the next assistant turn as an iterator of text pieces.

        Greedy when ``temperature == 0``; else temperature / top-k / top-p sampling with ``seed``.
        Ends at the model's end-of-turn token, at a stop string (not included in the text), or after
        ``max_tokens``. ``user``, if given, is a user turn appended first (prefilled in the same pass,
        so TTFT covers it). The finished turn becomes an assistant segment whose KV stays cached. If the
        context fills up first, the turn is rolled back and :class:`ContextOverflowError` carries the
        partial text.
        """
        self._check_open()
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        sampler = Sampler(SamplingParams(temperature, top_p, top_k, seed))
        holder = GenerationStream()
        extra = [Segment.user(user)] if user is not None else []
        holder._pieces = self._generate(max_tokens, sampler, list(stop), extra, holder)
        return holder

    def _generate(
        self, max_tokens: int, sampler: Sampler, stop: list[str], extra: list[Segment], holder: GenerationStream
    ) -> Iterator[str]:
        start = time.perf_counter()
        backend = self._backend
        with self._engine.lock:
            self._check_open()
            original = list(self._segments)
            before = [*original, *extra]
            pending = Segment(SegmentKind.TURN, "", role="assistant", complete=False)
            rendered = self._renderer.render([*before, pending])
            report = self._sync(rendered)
            call_start = rendered.spans[len(original)].first  # where this call's segments begin
            # room kept for the closing tag, so a finished turn always fits
            reserve = 1 + self._renderer.closing_length("assistant")
            logits = self._require_logits()
        out = TextAssembler(stop)
        ids: list[int] = []
        finish = "length"
        ttft = 0.0
        while True:
            with self._engine.lock:
                self._check_open()
                token = sampler(logits)
                if not ids:
                    ttft = time.perf_counter() - start
                if backend.is_eog(token):
                    finish = "eos"
                    break
                ids.append(token)
                piece = out.feed(backend.token_bytes(token))
                if out.stopped:
                    finish = "stop"
                done = out.stopped or len(ids) >= max_tokens
                if not done and self._cells() + reserve > self.n_ctx:
                    self._rollback(call_start, original)
                    raise ContextOverflowError(
                        f"the context of {self.n_ctx} tokens filled up after {len(ids)} generated tokens: the turn "
                        "was rolled back; start a new session or load the engine with a larger n_ctx",
                        partial=out.text,
                    )
                if not done:
                    pos = len(self._cached)
                    if self._evictor is not None:
                        logits = self._evictor.decode([token], [pos], self.seq, [True])[0]
                    else:
                        logits = backend.decode([token], [pos], [self.seq], [True])[0]
                    self._cached = (*self._cached, token)
                    self._logits = logits
                    self._maybe_cycle(rendered)
            if piece:
                yield piece
            if done:
                break
        tail = out.flush()
        if tail:
            yield tail
        with self._engine.lock:
            text = out.text
            # a stop string cut the text mid-token: its tokens are re-derived from the text
            turn_ids = None if finish == "stop" else tuple(ids)
            turn = Segment.assistant(text, token_ids=turn_ids)
            if turn_ids is not None:
                if len(self._generated) >= _MAX_REMEMBERED_TURNS:
                    self._generated.clear()
                self._generated[text] = turn_ids
            self.replace([*before, turn])
            holder.result = Generation(
                text, tuple(ids), finish, report.reused, report.computed, ttft, time.perf_counter() - start,
                report.transplanted,
            )

    def _rollback(self, first: int, segments: list[Segment]) -> None:
        self._cut(first)
        self._cached, self._logits = self._cached[:first], None
        self._segments, self._rendered = segments, None

    def chat(self, user_text: str, max_tokens: int = 128, **sampling: object) -> Generation:
        """Append a user turn and generate the reply in one pass (``sampling`` as in :meth:`generate`)."""
        return self.generate(max_tokens, user=user_text, **sampling)

    # -- logits, save, restore --------------------------------------------------------------------
    def logits(self) -> np.ndarray:
        """Next-token logits ``[n_vocab]`` after the cached prompt (prefills first if needed)."""
        with self._engine.lock:
            self._check_open()
            self._sync(self.rendered)
            return self._require_logits().copy()

    def _require_logits(self) -> np.ndarray:
        if self._logits is None:  # _sync always leaves them; this guards the invariant, not user input
            raise KVAgentError(f"session on sequence {self.seq} has no logits after a sync (internal error)")
        return self._logits

    def save(self) -> bytes:
        """This session's KV and prompt as a checked blob (see ``kvblob.KVBlob``)."""
        with self._engine.lock:
            self._check_open()
            self._sync(self.rendered)
            if self._evicted:
                raise KVAgentError(
                    f"this session evicted {len(self._evicted)} positions; saving a cache with holes is not supported: "
                    "save before the first eviction cycle, or save the segments and prefill them again"
                )
            payload = self._backend.seq_save(self.seq)
            logits = self._require_logits().astype(np.float32).tobytes()
            return KVBlob(self._engine.fingerprint, self._backend.format, self._cached, payload, logits).to_bytes()

    def restore(self, blob: bytes, segments: Sequence[Segment]) -> None:
        """Load KV saved by :meth:`save` for the prompt ``segments`` (which must render to its tokens).

        Checks come first (model, format, checksum, tokens); a refused blob leaves the session as it was.
        """
        with self._engine.lock:
            self._check_open()
            parsed = KVBlob.from_bytes(blob, model_fingerprint=self._engine.fingerprint, backend_format=self._backend.format)
            segments = list(segments)
            rendered = self._renderer.render(segments)
            if rendered.tokens != parsed.tokens:
                n = common_prefix(rendered.tokens, parsed.tokens)
                raise KVAgentError(
                    f"the blob holds {len(parsed.tokens)} tokens that differ from the given segments' "
                    f"{len(rendered.tokens)} from position {n}: pass the segments the blob was saved with"
                )
            logits = np.frombuffer(parsed.logits, dtype=np.float32).copy() if parsed.logits else None
            if logits is not None and logits.shape != (self._backend.n_vocab,):
                raise KVAgentError(f"the blob's logits have {logits.size} entries, the model {self._backend.n_vocab}")
            self._backend.seq_restore(self.seq, parsed.payload)
            self._segments, self._rendered = segments, rendered
            self._cached, self._logits = parsed.tokens, logits
            self._evicted = frozenset()
            if self._evictor is not None:
                self._evictor.forget_from(0)  # restored cells come without captured hidden states
            self._stale = frozenset()  # stale marks are not part of a blob: save sessions after a clean sync
            n_swa = self._backend.n_swa
            self._floor = len(parsed.tokens) if n_swa and len(parsed.tokens) > n_swa else 0

    # -- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Free this session's sequence; later calls raise :class:`SessionClosedError`."""
        if not self._closed:
            self._closed = True
            self._engine._release(self.seq)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
