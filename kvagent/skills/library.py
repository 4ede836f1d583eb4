"""Skill compilation and transplantation for one engine (source paper A, DESIGN.md).

Compile: a skill's tokens are prefilled once, in a scratch sequence *behind the model's sink token*
(its BOS), and saved to the store. DESIGN.md measured why: computed alone, the skill's first token
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
from typing import TYPE_CHECKING

from kvagent.kvblob import KVBlob
from kvagent.segments import Renderer, Segment
from kvagent.skills.spec import SkillSpec
from kvagent.skills.store import SkillStore, StoredSkill, skill_key

if TYPE_CHECKING:
    from kvagent.engine import Engine

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
    """Compiled skills an engine can transplant, looked up by their exact rendered tokens."""

    def __init__(self, engine: Engine, store: SkillStore | None = None) -> None:
        self._engine = engine
        self.store = store or SkillStore()
        self._by_tokens: dict[tuple[int, ...], CompiledSkill] = {}

    def sink(self, renderer: Renderer) -> list[int]:
        """Tokens a skill is compiled behind: what opens every prompt of this rendering.

        The model's BOS where it adds one, then (chat) an empty system message, so the skill's own
        opening tag sits where it sits in a real prompt: after a complete message.
        """
        backend = self._engine.backend
        sink = list(backend.bos_ids)
        fmt = renderer.chat_format
        if fmt.name != "plain":
            sink += backend.tokenize(fmt.system.open + fmt.system.close, special=True)
        return sink or [backend.bos_id]

    def key(self, sink: list[int], tokens: tuple[int, ...]) -> str:
        backend = self._engine.backend
        return skill_key(self._engine.fingerprint, backend.format, sink, tokens)

    def compile(self, spec: SkillSpec, renderer: Renderer) -> tuple[CompiledSkill, StoredSkill | None]:
        """Make sure ``spec`` is compiled for this model and rendering; returns (skill, new entry or None)."""
        segment = spec.segment()
        tokens = renderer.segment_tokens(segment)
        sink = self.sink(renderer)
        key = self.key(sink, tokens)
        skill = CompiledSkill(spec.name, key, tokens, spec.seam, len(sink))
        self._by_tokens[tokens] = skill
        if self.store.has(key):
            return skill, None
        engine, backend = self._engine, self._engine.backend
        full = (*sink, *tokens)
        if len(full) > backend.n_ctx:
            from kvagent.errors import ContextOverflowError

            raise ContextOverflowError(f"skill {spec.name!r} has {len(tokens)} tokens, more than the context of {backend.n_ctx}")
        with engine.lock, engine.scratch() as scratch:
            backend.decode(full, range(len(full)), [scratch] * len(full), [False] * len(full))
            payload = backend.seq_save(scratch)
        entry = self.store.put(key, KVBlob(engine.fingerprint, backend.format, full, payload),
                               name=spec.name, version=spec.version, model=engine.model.name, n_tokens=len(tokens))
        log.info("compiled skill %s: %d tokens, %d bytes", spec.name, len(tokens), entry.bytes)
        return skill, entry

    def segment(self, spec: SkillSpec, renderer: Renderer) -> Segment:
        """The SKILL segment for ``spec`` (compiling it first if needed)."""
        self.compile(spec, renderer)
        return spec.segment()

    def lookup(self, tokens: tuple[int, ...]) -> CompiledSkill | None:
        return self._by_tokens.get(tokens)

    def fetch(self, skill: CompiledSkill) -> KVBlob:
        """The checked blob of ``skill`` (LRU, else disk); ``SkillStoreError`` if missing or refused."""
        engine = self._engine
        return self.store.get(skill.key, fingerprint=engine.fingerprint, backend_format=engine.backend.format, name=skill.name)

    def transplant(self, seq: int, skill: CompiledSkill, position: int) -> tuple[int, int]:
        """Place ``skill`` at ``position`` of ``seq`` (whose last position is ``position - 1``).

        Returns (tokens decoded fresh, cells copied). Raises ``SkillStoreError`` for a missing, corrupt
        or foreign blob before anything changes.
        """
        engine, backend = self._engine, self._engine.backend
        blob = self.fetch(skill)
        n_sink, length = skill.n_sink, len(skill.tokens)
        seam = min(skill.seam, length)
        if seam:
            backend.decode(skill.tokens[:seam], range(position, position + seam), [seq] * seam, [False] * seam)
        if seam < length:
            with engine.scratch() as scratch:
                backend.seq_restore(scratch, blob.payload)
                backend.seq_rm(scratch, 0, n_sink + seam)  # the sink's cell never travels
                backend.seq_add(scratch, n_sink + seam, -1, position - n_sink)
                backend.seq_cp(scratch, seq, position + seam, position + length)
        return seam, length - seam
