"""Engine: one loaded model shared by many sessions, each on its own sequence of one KV pool.

The engine owns the backend, the renderers (chat template or plain text), a lock that serialises
native calls (sessions may live on different threads: LangChain async, an HTTP server), and the
allocation of sequence ids. It also lets a new session start from another live session's cached
prefix (``seq_cp`` shares the cells), so a policy prefilled once serves every session that opens
with it.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterable, Iterator, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field

from kvagent.backends.base import BackendConfig
from kvagent.chat_format import BUILTIN_FORMATS, ChatFormat
from kvagent.errors import ChatTemplateError, KVAgentError
from kvagent.models import DEFAULT_MODEL, ModelRef, resolve_model
from kvagent.segments import Renderer, Segment, common_prefix

if TYPE_CHECKING:
    from kvagent.eviction import Eviction
    from kvagent.edits import EditStrategy
    from kvagent.skills.fidelity import FidelityGuard
    from kvagent.skills.library import SkillLibrary
    from kvagent.fields import FieldSpec
    from kvagent.session import Session

log = logging.getLogger(__name__)


class EngineSettings(BaseModel):
    """Settings of an engine; unknown keys are refused with the list of valid ones."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = DEFAULT_MODEL
    """Registry name (``smollm2-135m``, ``gemma3-270m``) or path of a local ``.gguf`` file."""
    n_ctx: int = Field(4096, ge=32)
    """KV pool size in tokens, shared by all sessions; also the longest one session can get."""
    n_batch: int = Field(512, ge=1)
    """Tokens per ``llama_decode`` call during prefill."""
    n_ubatch: int = Field(512, ge=1)
    """Physical micro-batch size."""
    n_seq_max: int = Field(8, ge=1, le=256)
    """How many sessions (sequences) can be open at once."""
    n_threads: int = Field(0, ge=0)
    """CPU threads; 0 = all cores."""
    n_gpu_layers: int = 0
    """Layers to offload to a GPU (llama.cpp built with CUDA/Metal); 0 = CPU only, -1 = all."""
    flash_attn: bool = False
    """Flash attention; off by default (faster here for short suffixes over a long cache)."""
    swa_full: bool = True
    """Keep full-size caches for sliding-window layers so sequence operations stay exact."""
    capture: Literal["none", "native", "python"] = "none"
    """Activation capture (``backend.capture``, see ``kvagent.native``): none, the C callback, or the
    pure-Python one (slower; also the fallback when the C library cannot be built)."""

    def backend_config(self) -> BackendConfig:
        return BackendConfig(**self.model_dump(exclude={"model"}))


class Engine:
    """A loaded model and the sessions that share it. Use :meth:`load`, then :meth:`session`."""

    def __init__(self, settings: EngineSettings) -> None:
        from kvagent.backends.llama_cpp import LlamaCppBackend

        self.settings = settings
        self.model: ModelRef = resolve_model(settings.model)
        self.fingerprint = self.model.fingerprint
        self.backend = LlamaCppBackend(self.model.path, settings.backend_config())
        self.lock = threading.RLock()
        self._free = list(range(self.backend.n_seq_max - 1, -1, -1))
        self._sessions: dict[int, Session] = {}
        self._renderers: dict[bool, Renderer] = {}
        self._skills: SkillLibrary | None = None

    @classmethod
    def load(cls, model: str | None = None, **settings: object) -> Engine:
        """Load ``model`` (default ``smollm2-135m``) with optional :class:`EngineSettings` overrides."""
        if model is not None:
            settings["model"] = model
        return cls(EngineSettings(**settings))  # type: ignore[arg-type]

    # -- sessions ---------------------------------------------------------------------------------
    def session(
        self,
        segments: Iterable[Segment] = (),
        *,
        chat: bool = True,
        fields: Sequence[FieldSpec] = (),
        edit_strategy: str | EditStrategy = "erratum",
        compact_after: int | None = None,
        share_prefix: bool = True,
        fidelity: FidelityGuard | None = None,
        eviction: Eviction | None = None,
    ) -> Session:
        """Open a session on a free sequence.

        ``chat=False`` renders plain text instead of the chat template. ``fields`` are specs that
        validate ``session.set``; ``edit_strategy`` is the default way edits reach the KV (see
        ``kvagent.edits``); ``compact_after`` folds errata back into the fields once more than that many
        have accumulated. ``share_prefix=False`` never starts from another session's cells (a cold
        prefill, as benchmarks and oracles need). ``fidelity`` checks sampled transplants against a
        recompute and falls back below its threshold. ``eviction`` (``kvagent.eviction.Eviction``: policy,
        budget J, chunk h) prunes the cache in cycles instead of failing when the prompt outgrows it.
        """
        from kvagent.eviction import Evictor
        from kvagent.session import Session

        evictor = Evictor(eviction, self.backend, self.model.path) if eviction is not None else None

        with self.lock:
            renderer = self.renderer(chat)
            seq = self._take_sequence("a session")
            try:
                session = Session(
                    self, seq, renderer, list(segments), fields=fields, edit_strategy=edit_strategy,
                    compact_after=compact_after, share_prefix=share_prefix, fidelity=fidelity, evictor=evictor,
                )
            except Exception:  # a refused argument must not leak the sequence
                self._free.append(seq)
                raise
            self._sessions[seq] = session
            return session

    def _take_sequence(self, purpose: str) -> int:
        if not self._free:
            raise KVAgentError(
                f"no free sequence for {purpose}: all {self.backend.n_seq_max} are in use; close a session or "
                "load the engine with a larger n_seq_max"
            )
        seq = self._free.pop()
        self.backend.seq_rm(seq, -1, -1)
        return seq

    @property
    def has_free_sequence(self) -> bool:
        return bool(self._free)

    @contextmanager
    def scratch(self) -> Iterator[int]:
        """A temporary sequence (for splicing KV left to right), emptied and freed on exit."""
        with self.lock:
            seq = self._take_sequence("a scratch copy")
            try:
                yield seq
            finally:
                self.backend.seq_rm(seq, -1, -1)
                self._free.append(seq)

    def renderer(self, chat: bool) -> Renderer:
        if chat not in self._renderers:
            if chat:
                fmt = self._chat_format()
            else:
                fmt = ChatFormat.plain()
            self._renderers[chat] = Renderer(self.backend, fmt)
        return self._renderers[chat]

    @property
    def skills(self) -> SkillLibrary:
        """This engine's compiled skills (store in ``cache_dir()/skills``), created on first use."""
        if self._skills is None:
            from kvagent.skills.library import SkillLibrary

            self._skills = SkillLibrary(self)
        return self._skills

    @skills.setter
    def skills(self, library: SkillLibrary) -> None:
        """Use another library (e.g. one over a store in another folder)."""
        self._skills = library

    @property
    def skills_if_loaded(self) -> SkillLibrary | None:
        return self._skills

    def _chat_format(self) -> ChatFormat:
        template = self.backend.chat_template
        if template:
            return ChatFormat.from_template(template, self.model.name)
        builtin = BUILTIN_FORMATS.get(self.backend.architecture)
        if builtin is None:
            raise ChatTemplateError(
                f"{self.model.name} has no chat template and kvagent has no built-in one for architecture "
                f"{self.backend.architecture!r}: open the session with chat=False"
            )
        log.info("%s has no chat template in its GGUF: using the built-in %s format", self.model.name, builtin.name)
        return builtin

    def _release(self, seq: int) -> None:
        with self.lock:
            if self._sessions.pop(seq, None) is not None:
                self.backend.seq_rm(seq, -1, -1)
                self._free.append(seq)

    def shared_prefix(self, tokens: tuple[int, ...], seq: int) -> tuple[int, int]:
        """(source sequence, length) of the longest cached prefix of ``tokens`` held by another session."""
        best = (-1, 0)
        for other_seq, other in self._sessions.items():
            if other_seq != seq:
                # never share stale cells (kept by a field-only or selective edit): only the clean prefix
                n = common_prefix(other.tokens[: other.clean_prefix], tokens)
                if n > best[1]:
                    best = (other_seq, n)
        return best

    def may_share_cells(self, seq: int, position: int) -> bool:
        """Whether another session might hold ``seq``'s cells at or after ``position``.

        Sessions share cells only through :meth:`shared_prefix` (a common cached prefix), so a session
        whose cached tokens agree with ``seq``'s beyond ``position`` might hold them; conservative.
        """
        mine = self._sessions[seq].tokens if seq in self._sessions else ()
        return any(common_prefix(other.tokens, mine) > position for s, other in self._sessions.items() if s != seq)

    @property
    def open_sessions(self) -> int:
        return len(self._sessions)

    # -- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Close every session, then free the model."""
        with self.lock:
            for session in list(self._sessions.values()):
                session.close()
            self.backend.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
