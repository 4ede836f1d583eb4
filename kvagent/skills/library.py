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
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvagent.errors import ContextOverflowError, SkillStoreError
from kvagent.kv.pool import SequencePool
from kvagent.kv.sequence import CachedSequence
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


class SkillLibrary:
    """Compiled skills one model can transplant, looked up by their exact rendered tokens.

    A skill compiled by this process, or by any other (``kvagent skills compile``), is found: the
    lookup computes the content key from the tokens and asks the store.
    """

    def __init__(self, pool: SequencePool, fingerprint: str, model_name: str, store: SkillStore | None = None) -> None:
        self._pool = pool
        self.fingerprint, self.model_name = fingerprint, model_name
        self.store = store or SkillStore()
        self._by_tokens: dict[tuple[int, ...], CompiledSkill] = {}
        self._missing: set[tuple[int, ...]] = set()  # skill spans already reported as not compiled

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
        tokens = renderer.segment_tokens(segment)
        sink = self.sink(renderer)
        key = self.key(sink, tokens)
        skill = CompiledSkill(name, key, tokens, seam, len(sink))
        self._by_tokens[tokens] = skill
        if self.store.has(key):
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
        return skill, entry

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
        skill = CompiledSkill(entry.name, key, tokens, entry.seam, len(sink))
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
        return sequence.place_transplant(blob.payload, skill.tokens, skill.n_sink, skill.seam, rendered)
