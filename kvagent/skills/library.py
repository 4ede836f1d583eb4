"""Skill compilation and transplantation for one engine ("Models Take Notes at Prefill" (arXiv:2606.17107)).

Compile: a skill's tokens are prefilled once, in a scratch sequence *behind the model's sink token*
(its BOS), and saved to the store. We measured why before kvagent existed (docs/skills.md): computed alone,
the skill's first token
becomes its attention sink and every later key carries that (cosine 0.979 on Gemma-3); behind the sink
and with the sink's cell left out of the transplant, 0.9986.

Transplant at position ``p``: the first ``seam`` tokens are decoded fresh in context (seam repair);
the saved sequence is restored into a scratch sequence (its own cells), the sink and seam cells are
removed, the rest is shifted by ``p - len(sink)`` (llama.cpp re-rotates the keys with RoPE; values
carry no position) and copied into the target sequence. Left to right, as llama.cpp requires.

Selective recompute (CacheBlend's, an option: ``SkillLibrary(recompute=fraction)``): at compile time the skill is
also prefilled cold behind another prefix (:data:`REFERENCE`) and its offsets are ranked by how far their values
are from that prefill's (:func:`kvagent.kv.state.rank_deviating`); the ranking is kept in the store's sidecar. At
each transplant the top ``ceil(fraction * len(tokens))`` of them are decoded fresh in context, like the seam.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

from kvagent.errors import ContextOverflowError, SkillStoreError
from kvagent.kv.pool import SequencePool
from kvagent.kv.sequence import CachedSequence
from kvagent.kv.state import rank_deviating
from kvagent.kvblob import KVBlob
from kvagent.segments import Rendered, Renderer, Segment
from kvagent.skills.spec import SkillSpec
from kvagent.skills.store import SkillStore, StoredSkill, skill_key

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompiledSkill:
    """A registered skill: its store key, its rendered tokens and its seam length."""

    name: str
    key: str
    tokens: tuple[int, ...]
    seam: int
    n_sink: int  # tokens the skill was compiled behind (left out of every transplant)
    recompute: tuple[int, ...] = ()  # offsets decoded fresh at each transplant, when set (else the library's choice)
    ranked: tuple[int, ...] = ()  # offsets >= seam by decreasing compile-time deviation (empty: not ranked)


# the prefix a skill is prefilled behind at compile time to rank its cells (any text unlike the sink will do)
REFERENCE = "You are a helpful assistant. Read the material below carefully and use it to answer the user."
MAX_RECOMPUTE = 0.25  # the largest fraction a library recomputes; the ranking keeps that many offsets


class SkillLibrary:
    """Compiled skills one model can transplant, looked up by their exact rendered tokens.

    A skill compiled by this process, or by any other (``kvagent skills compile``), is found: the
    lookup computes the content key from the tokens and asks the store.
    """

    def __init__(self, pool: SequencePool, fingerprint: str, model_name: str, store: SkillStore | None = None,
                 recompute: float = 0.0) -> None:
        """``recompute``: the share of each transplanted skill's positions decoded fresh beyond the seam, the
        most deviating first (0: none, the default; at most :data:`MAX_RECOMPUTE`)."""
        if not 0.0 <= recompute <= MAX_RECOMPUTE:
            raise ValueError(f"recompute fraction {recompute}: use 0 to {MAX_RECOMPUTE}")
        self.recompute = recompute
        self._pool = pool
        self.fingerprint, self.model_name = fingerprint, model_name
        self.store = store or SkillStore()
        self._by_tokens: dict[tuple[int, ...], CompiledSkill] = {}
        self._missing: set[tuple[int, ...]] = set()  # skill spans already reported as not compiled
        self._renderer: Renderer | None = None  # of the last compile (the ranking's reference prompt)

    def sink(self, renderer: Renderer) -> list[int]:
        """Tokens a skill is compiled behind: what opens every prompt of this rendering.

        The model's BOS where it adds one, then (chat) an empty system message, so the skill's own
        opening tag sits where it sits in a real prompt: after a complete message.
        """
        backend = self._pool.backend
        sink = list(backend.bos_ids)
        fmt = renderer.chat_format
        if fmt.name != "plain":
            sink += backend.tokenize(fmt.system.open + fmt.system.close, special=True)
        return sink or [backend.bos_id]

    def key(self, sink: list[int], tokens: tuple[int, ...]) -> str:
        return skill_key(self.fingerprint, self._pool.backend.format, sink, tokens)

    def compile(self, spec: SkillSpec, renderer: Renderer) -> tuple[CompiledSkill, StoredSkill | None]:
        """Make sure ``spec`` is compiled for this model and rendering; returns (skill, new entry or None)."""
        return self.compile_segment(spec.segment(), renderer, seam=spec.seam, version=spec.version)

    def compile_segment(self, segment: Segment, renderer: Renderer, *, seam: int = 4,
                        version: str = "") -> tuple[CompiledSkill, StoredSkill | None]:
        """Make sure a SKILL ``segment`` (a skill file's, a tool's) is compiled for this model and rendering."""
        name = str(segment.name)
        self._renderer = renderer
        tokens = renderer.segment_tokens(segment)
        sink = self.sink(renderer)
        key = self.key(sink, tokens)
        skill = CompiledSkill(name, key, tokens, seam, len(sink))
        self._by_tokens[tokens] = skill
        if self.store.has(key):  # the ranking, if any, is read where a transplant needs it (chosen)
            return skill, None
        backend = self._pool.backend
        if not backend.capabilities.state_save:
            raise SkillStoreError(f"skill {name!r} cannot be compiled: this backend cannot save a sequence's KV "
                                  "(its skills are prefilled where they stand)")
        full = (*sink, *tokens)
        if len(full) > backend.n_ctx:
            raise ContextOverflowError(f"skill {name!r} has {len(tokens)} tokens, more than the context of {backend.n_ctx}")
        payload = self._pool.prefill_saved(full)
        entry = self.store.put(key, KVBlob(self.fingerprint, backend.format, full, payload), name=name,
                               version=version, model=self.model_name, n_tokens=len(tokens), seam=seam)
        log.info("compiled skill %s: %d tokens, %d bytes", name, len(tokens), entry.bytes)
        if self.recompute > 0:
            skill = self.rank(skill, payload, renderer)
        return skill, entry

    def rank(self, skill: CompiledSkill, payload: bytes | None = None, renderer: Renderer | None = None) -> CompiledSkill:
        """Rank ``skill``'s offsets from its seam on by decreasing value deviation from a cold prefill of its tokens
        behind :data:`REFERENCE` (rendered as a system prompt by ``renderer``, else the BOS and the plain text; the
        renderer of the last compile by default), at the cost of one prefill of the skill; the payload is read
        from the store unless given. Keeps the top :data:`MAX_RECOMPUTE` share in the store's sidecar and in this
        library; returns the ranked skill."""
        backend = self._pool.backend
        payload = payload if payload is not None else self.fetch(skill).payload
        renderer = renderer or self._renderer
        if renderer is not None:
            prefix = list(renderer.render([Segment.policy(REFERENCE)]).tokens)
        else:
            prefix = [*backend.bos_ids, *backend.tokenize(REFERENCE, special=False)]
        reference = self._pool.prefill_saved((*prefix, *skill.tokens))
        order = rank_deviating(payload, skill.n_sink, reference, len(prefix), len(skill.tokens), first=skill.seam)
        ranked = order[: math.ceil(MAX_RECOMPUTE * len(skill.tokens))]
        self.store.set_ranked(skill.key, ranked)
        skill = self._by_tokens[skill.tokens] = replace(skill, ranked=ranked)
        log.info("ranked skill %s: offsets %s deviate most", skill.name, list(ranked[:8]))
        return skill

    def chosen(self, skill: CompiledSkill, fraction: float | None = None) -> tuple[int, ...]:
        """The offsets of ``skill`` decoded fresh at a transplant besides its seam: its own ``recompute`` when set,
        else the top ``ceil(fraction * len(tokens))`` of its ranking (``fraction``: default this library's),
        ascending. Empty at fraction 0; a skill not ranked yet is ranked first."""
        if skill.recompute:
            return skill.recompute
        fraction = self.recompute if fraction is None else fraction
        if fraction <= 0:
            return ()
        if not skill.ranked:
            entry = self.store.entry(skill.key)  # ranked at an earlier compile, in this process or another
            if entry is not None and entry.ranked:
                skill = self._by_tokens[skill.tokens] = replace(skill, ranked=tuple(entry.ranked))
            else:
                skill = self.rank(skill)
        return tuple(sorted(skill.ranked[: math.ceil(fraction * len(skill.tokens))]))

    def segment(self, spec: SkillSpec, renderer: Renderer) -> Segment:
        """The SKILL segment for ``spec`` (compiling it first if needed)."""
        self.compile(spec, renderer)
        return spec.segment()

    def lookup(self, tokens: tuple[int, ...], sink: list[int] | None = None) -> CompiledSkill | None:
        """The compiled skill whose rendered tokens are ``tokens`` (compiled behind ``sink``), or None.

        Skills compiled in this process are known by their tokens; others are found in the store by
        their content key. A skill span that is compiled nowhere is logged once with the fix.
        """
        skill = self._by_tokens.get(tokens)
        if skill is not None or sink is None:
            return skill
        key = self.key(sink, tokens)
        entry = self.store.entry(key)
        if entry is None:
            if tokens not in self._missing:
                self._missing.add(tokens)
                log.warning("a skill span of %d tokens is not compiled for %s: it is prefilled; run `kvagent skills "
                            "compile DIR --model %s` to transplant it", len(tokens), self.model_name, self.model_name)
            return None
        skill = CompiledSkill(entry.name, key, tokens, entry.seam, len(sink), ranked=tuple(entry.ranked))
        self._by_tokens[tokens] = skill
        return skill

    def fetch(self, skill: CompiledSkill) -> KVBlob:
        """The checked blob of ``skill`` (LRU, else disk); ``SkillStoreError`` if missing or refused."""
        return self.store.get(skill.key, fingerprint=self.fingerprint, backend_format=self._pool.backend.format, name=skill.name)

    def transplant(self, sequence: CachedSequence, skill: CompiledSkill, rendered: Rendered) -> tuple[int, int]:
        """Append ``skill`` to ``sequence`` (``CachedSequence.place_transplant``; ``rendered`` is the prompt it
        belongs to, for an eviction cycle after it).

        Returns (tokens decoded fresh, cells copied). Raises ``SkillStoreError`` for a missing, corrupt
        or foreign blob before anything changes.
        """
        blob = self.fetch(skill)
        recompute = self.chosen(skill)
        return sequence.place_transplant(blob.payload, skill.tokens, skill.n_sink, skill.seam, rendered, recompute)
