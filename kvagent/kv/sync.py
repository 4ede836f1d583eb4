"""Sync: make a sequence hold exactly a rendered prompt, reusing what is cached.

The longest prefix already cached (in this sequence, or shared from another through the pool's prefix
index) is kept; the rest is cut and rebuilt left to right from the plan (``kv.plan``): decoded runs, and
compiled skills transplanted by RoPE re-rotation ("Models Take Notes at Prefill: KV Cache Can Be Editable
and Composable", https://arxiv.org/abs/2606.17107). Skill blobs are fetched and checked before the cache changes. The work pauses between
chunks so a scheduler can interleave other sessions.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Literal

from kvagent.errors import ContextOverflowError, KVAgentError
from kvagent.kv.plan import Run, plan_runs
from kvagent.kv.sequence import CachedSequence
from kvagent.kv.work import Work
from kvagent.segments import Rendered, SegmentKind, common_prefix

if TYPE_CHECKING:
    from kvagent.skills.fidelity import FidelityGuard
    from kvagent.skills.library import CompiledSkill, SkillLibrary

log = logging.getLogger(__name__)

ImplicitKind = Literal["replace", "delete", "insert", "fallback"]


@dataclass(frozen=True)
class ImplicitEdit:
    """One changed region of a resent prompt and what was done with it.

    ``kind``: ``replace`` / ``delete`` / ``insert`` (spliced in place), or ``fallback`` (recomputed from
    ``new_first`` on, ``reason`` says why). Positions: the old prompt's ``old_first..old_end-1`` became the new
    prompt's ``new_first..new_end-1``. ``computed``: tokens decoded for it; ``line``: the new prompt's line it
    starts in (for a person, and for naming a region that changes turn after turn)."""

    kind: ImplicitKind
    old_first: int
    old_end: int
    new_first: int
    new_end: int
    computed: int
    line: str = ""
    reason: str | None = None

    def as_dict(self) -> dict[str, object]:
        """What the adapters report (the server's ``usage.kvagent_edits``, LangChain's ``response_metadata``)."""
        return {"kind": self.kind, "old": [self.old_first, self.old_end], "new": [self.new_first, self.new_end],
                "computed": self.computed, "line": self.line, "reason": self.reason}


@dataclass(frozen=True)
class PrefillReport:
    """What one sync cost: tokens reused from cache, tokens computed, wall time."""

    reused: int
    computed: int
    seconds: float
    shared: int = 0  # of the reused tokens, how many came from another session's cells
    transplanted: int = 0  # tokens whose KV was copied from a compiled skill (not computed)
    fidelity: float | None = None  # logit_cosine vs a recompute, when the fidelity guard checked this sync
    fell_back: bool = False  # the guard found the transplant too far off and adopted the recompute
    recomputed_because: str | None = None  # a splice that could not be exact recomputed from the field: why
    edits: tuple[ImplicitEdit, ...] = ()  # a resent prompt's changed regions and what was done (``kv.rebase``)
    resumed: int = 0  # tokens of a retained conversation this sync started from (``Session.resume``; 0: none)
    restored: int = 0  # tokens restored from a tier (``kv.tiers``; 0: none)


def check_fits(n_tokens: int, n_ctx: int, can_evict: bool) -> None:
    """Refuse a prompt that cannot fit (before any change), naming the fixes."""
    if n_tokens > n_ctx and not can_evict:
        raise ContextOverflowError(
            f"prompt of {n_tokens} tokens does not fit the context of {n_ctx}: shorten it, load the "
            "engine with a larger n_ctx, or open the session with an eviction policy "
            "(engine.session(..., eviction=Eviction('contrast', budget=...))); nothing was cut or changed"
        )


def sync(
    state: CachedSequence,
    rendered: Rendered,
    *,
    skills: SkillLibrary | None,
    renderer_sink: Callable[[], list[int]] | None = None,
    share_prefix: bool = True,
    fidelity: FidelityGuard | None = None,
) -> Work[PrefillReport]:
    """Bring ``state`` to hold ``rendered.tokens`` with next-token logits (see the module docstring).

    ``skills`` is the engine's skill library (None: decode every skill span); ``renderer_sink()`` the sink
    tokens skills of this rendering are compiled behind (for looking compiled skills up in the store).
    """
    start = time.perf_counter()
    backend, pool = state.backend, state.pool
    new = rendered.tokens
    check_fits(len(new), backend.n_ctx, state.evictor is not None)
    restored = _from_tier(state, new) if share_prefix else 0
    keep = common_prefix(state.tokens, new)
    if keep == len(new) == len(state.tokens) and state.logits is not None:
        return PrefillReport(reused=keep, computed=0, seconds=time.perf_counter() - start)
    keep = min(keep, len(new) - 1)  # the last token is always decoded: its logits are needed
    if keep < state.floor:  # SWA cells below the floor are missing: extending from there is not exact
        keep = 0
    shared_seq, shared = pool.index.match(new, exclude=state.seq, scope=state.scope) if share_prefix else (-1, 0)
    shared = min(shared, len(new) - 1)
    if state.cell(keep) != keep:  # holes closed below: another sequence's cells sit at other positions than ours
        shared = 0
    # a reused prefix that ends inside a compiled skill would decode the skill's rest: transplant it whole
    keep = _before_skill(rendered, keep, skills, renderer_sink)
    shared = _before_skill(rendered, shared, skills, renderer_sink)
    start_at = max(keep, shared)
    runs = _plan(state, rendered, start_at, skills, renderer_sink)  # blobs checked before any change
    state.cut(keep)
    gained = 0
    if shared > keep:  # share the other session's cells for the positions we lack
        state.share_prefix(shared_seq, new[:shared])
        gained, keep = shared - keep, shared
    computed = transplanted = 0
    logits = None
    try:
        for run in runs:
            if run.skill is not None and skills is not None:
                fresh, copied = skills.transplant(state, run.skill, rendered)
                computed, transplanted = computed + fresh, transplanted + copied
            else:
                logits = yield from state.decode_run(new, run.first, run.end, rendered)
                computed += run.length
        if runs[-1].skill is not None:  # the prompt ends inside a skill: decode its last token again
            logits = state.redecode_last()[None, :]
            transplanted, computed = transplanted - 1, computed + 1
    except KVAgentError:
        state.resync_from_backend(new)  # some chunks may have landed: record exactly what is there
        raise
    if logits is None or len(logits) == 0:  # pragma: no cover - every plan ends with a decode
        raise KVAgentError("sync produced no logits (internal error)")
    state.commit(new, logits[-1])
    fidelity_cos, fell_back = None, False
    # (not after eviction: a full prefill is no reference for a cache that forgot on purpose)
    if transplanted and fidelity is not None and not state.evicted and fidelity.sampled():
        fidelity_cos, fell_back = _guard(state, fidelity, new, start_at)
    log.debug("seq %d sync: reused %d (shared %d), computed %d, transplanted %d", state.seq, keep, gained, computed, transplanted)
    return PrefillReport(keep, computed, time.perf_counter() - start, gained, transplanted, fidelity_cos, fell_back,
                         restored=restored)


TIER_GAIN = 32
"""Tokens a stored prefix must hold beyond what the pool offers, to be worth restoring."""


def _from_tier(state: CachedSequence, new: tuple[int, ...]) -> int:
    """For a sequence that caches nothing yet: restore the stored prefix of its scope (``kv.tiers``) that matches
    ``new`` best, when it beats the pool's by :data:`TIER_GAIN` tokens, keeping the matching part; the tokens
    restored (0: none). A restore refused for room, or a stored blob refused, loses nothing: the sync computes."""
    pool = state.pool
    if state.tokens or pool.tiers is None or state.evictor is not None:
        return 0
    found = pool.tiers.match(new, state.scope)
    if found is None:
        return 0
    tier, entry, n = found
    n = min(n, len(new) - 1)
    _, in_pool = pool.index.match(new, exclude=state.seq, scope=state.scope)
    if n < in_pool + TIER_GAIN:
        return 0
    blob = tier.load(entry, pool.fingerprint, state.backend.format)
    if blob is None:
        return 0
    try:
        state.restore(blob.payload, blob.tokens, None, share=True)
    except Exception as exc:  # noqa: BLE001 - no room, or bytes the backend refuses: computed instead
        log.info("seq %d: a stored prefix of %d tokens could not be restored (%s): computing it", state.seq, n, exc)
        return 0
    state.cut(n)
    tier.restores += 1
    log.info("seq %d restored %d tokens from the %s tier", state.seq, n, tier.name)
    return n


def free_start(state: CachedSequence, rendered: Rendered, *, skills: SkillLibrary | None,
               renderer_sink: Callable[[], list[int]] | None = None) -> int:
    """Tokens of ``rendered`` a sync into ``state``, caching nothing yet, would not decode: the longest prefix the
    pool's index or a tier offers, and the compiled skills it transplants after it (what resuming a retained
    conversation must beat)."""
    tokens, pool = rendered.tokens, state.pool
    start = pool.index.match(tokens, exclude=state.seq, scope=state.scope)[1]
    found = pool.tiers.match(tokens, state.scope) if pool.tiers is not None and state.evictor is None else None
    start = min(max(start, found[2] if found is not None else 0), len(tokens) - 1)
    lookup = _skill_lookup(state, skills, renderer_sink, fetch=False)
    if lookup is None:
        return start
    start = _before_skill(rendered, start, skills, renderer_sink)
    return start + sum(run.length for run in plan_runs(rendered, start, lookup) if run.skill is not None)


def _before_skill(
    rendered: Rendered, position: int, library: SkillLibrary | None, renderer_sink: Callable[[], list[int]] | None
) -> int:
    """``position``, or the start of the compiled skill span it falls strictly inside."""
    if library is None:
        return position
    for span in rendered.spans:
        if span.kind is SegmentKind.SKILL and span.first < position <= span.last:
            tokens = rendered.tokens[span.first : span.last + 1]
            sink = renderer_sink() if renderer_sink is not None else None
            return span.first if library.lookup(tokens, sink) is not None else position
    return position


def _plan(
    state: CachedSequence, rendered: Rendered, start: int, library: SkillLibrary | None,
    renderer_sink: Callable[[], list[int]] | None,
) -> list[Run[CompiledSkill]]:
    """The runs from ``start``; a transplant needs a shiftable cache and a free scratch sequence."""
    runs = plan_runs(rendered, start, _skill_lookup(state, library, renderer_sink, fetch=True))
    if any(run.skill is not None for run in runs) and not state.pool.free:
        raise KVAgentError(
            "a transplant needs a free scratch sequence and all are in use: close a session or load the "
            "engine with a larger n_seq_max (nothing was changed)"
        )
    return runs


def _skill_lookup(state: CachedSequence, library: SkillLibrary | None, renderer_sink: Callable[[], list[int]] | None,
                  *, fetch: bool) -> Callable[[tuple[int, ...]], CompiledSkill | None] | None:
    """The compiled skill a span's tokens transplant (None: decode them), or None where nothing can be transplanted:
    no library, or a cache that cannot restore a saved skill and shift it. ``fetch``: each skill found is read and
    checked at once, so a refused blob fails before the cache changes."""
    caps = state.backend.capabilities
    if library is None or not (caps.shift and caps.state_save):
        return None
    sink = renderer_sink() if renderer_sink is not None else None

    def lookup(tokens: tuple[int, ...]) -> CompiledSkill | None:
        skill = library.lookup(tokens, sink)
        if skill is not None and fetch:
            library.fetch(skill)
        return skill

    return lookup


def _guard(state: CachedSequence, guard: FidelityGuard, tokens: tuple[int, ...], start: int) -> tuple[float, bool]:
    """Compare with a full prefill in a scratch sequence; below threshold, adopt its cells."""
    backend = state.backend
    with state.pool.scratch() as scratch:
        n = len(tokens)
        reference = backend.decode(tokens, range(n), [scratch] * n, [False] * (n - 1) + [True])[0]
        cos = guard.cosine(state.logits if state.logits is not None else reference, reference)
        if cos >= guard.threshold:
            return cos, False
        log.warning("transplant fidelity %.4f < %.4f on sequence %d: using the recomputed KV", cos, guard.threshold, state.seq)
        state.adopt_recompute(scratch, start, reference)
        return cos, True
