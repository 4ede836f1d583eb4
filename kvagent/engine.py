"""Engine: one loaded model shared by many sessions, each on its own sequence of one KV pool.

The engine wires the parts together: the backend (by registered name, or an instance), the
:class:`~kvagent.kv.pool.SequencePool` (sequence ids, scratch sequences, the prefix index through which
a new session starts from another's cached prefix), the :class:`~kvagent.scheduler.Scheduler` whose
worker thread makes every native call and batches sessions' decode steps, the renderers (chat template
or plain text) and the skill library. Sessions may be used from many threads (or coroutines, through
``kvagent.aio``).
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterable, Iterator, Literal, Sequence

from cachetools import LRUCache
from pydantic import BaseModel, ConfigDict, Field

from kvagent.backends.base import Backend, BackendConfig
from kvagent.backends.registry import backend_names, create_backend, default_gpu_layers
from kvagent.chat_format import BUILTIN_FORMATS, ChatFormat
from kvagent.errors import ChatTemplateError, KVAgentError
from kvagent.eviction import Eviction, Evictor
from kvagent.kv.codec import Format
from kvagent.kv.pool import SequencePool
from kvagent.kv.tiers import tiers
from kvagent.kv.sequence import CachedSequence
from kvagent.kv.work import Work
from kvagent.models import DEFAULT_MODEL, ModelRef, cache_dir, resolve_model
from kvagent.scheduler import Scheduler
from kvagent.segments import Renderer, Segment, SegmentKind
from kvagent.session import Session
from kvagent.skills.library import SkillLibrary
from kvagent.tools.format import HERMES, ToolFormat, format_of
from kvagent.tools.template import tool_format_of

if TYPE_CHECKING:
    from kvagent.edits import EditStrategy
    from kvagent.edits.implicit import CalibratedSplice
    from kvagent.fields import FieldSpec
    from kvagent.skills.fidelity import FidelityGuard
    from kvagent.skills.store import SkillStore
    from kvagent.tools.spec import ToolSet

log = logging.getLogger(__name__)
RENDERERS = 256
"""Scopes whose renderer (and its memo of tokenized segments) an engine keeps."""


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
    n_gpu_layers: int | None = None
    """Layers to offload to a GPU (llama.cpp built with CUDA, ``make setup GPU=cuda``); 0 = CPU only, -1 = all.
    None (default) = automatic, see :func:`auto_gpu_layers`: ``$KVAGENT_GPU_LAYERS`` when set, else all layers
    when the llama.cpp build can offload and sees a GPU, else 0 (so a CPU build is unchanged)."""
    flash_attn: bool | None = Field(default_factory=lambda: _env_flag("KVAGENT_FLASH_ATTN", None))
    """Flash attention; default ``$KVAGENT_FLASH_ATTN`` when set (1/0), else automatic (None): on when the
    llama.cpp build sees a GPU, off on a CPU build. Off on the CPU: its CPU kernel moves logits with the
    prefill chunking (SmolLM2 Q4: cosine 0.9966 between chunks of 64 and one batch; without it 1.0). On
    with a GPU: measured on an H200 (CUDA build, f16 KV), the non-flash attention path gives all-NaN logits
    when a prompt is decoded in several calls into pool cells freed by an earlier sequence (every session
    after the first; also with ``n_gpu_layers=0``, llama.cpp then still runs big matmuls on the GPU);
    flash attention never did (docs/benchmarks/gpu.md). On with many sessions in one pool: every token
    attends over the whole pool and flash attention skips other sessions' masked cells, so batched decode
    runs faster (``kvagent bench concurrency --flash-attn``)."""
    retain: bool = True
    """Keep a closed session's cells for later sessions of its scope (its prefix, or its whole conversation resumed
    and edited: ``SequencePool.retain``, ``Session.resume``), given back least recently used first when a
    sequence or KV room is wanted. False: a closed session's cells are freed at once."""
    cache_ram_mb: int = Field(256, ge=0)
    """Host memory (MiB) for retained prefixes given back to the KV pool (``kvagent.kv.tiers``): a later session
    restores one instead of computing it. 0: none."""
    cache_disk_mb: int = Field(0, ge=0)
    """Disk (MiB) below the host-memory tier, in a private folder of ``cache_dir()`` removed at ``close``. 0: none."""
    cache_disk_format: Format = "f16"
    """How the disk tier writes a prefix (``kvagent.kv.codec``): ``f16`` as saved (restores exactly), ``q8_0``
    (the key and value rows in 8 bits: about 53% of the bytes, lossy) or ``deflate`` (lossless)."""
    swa_full: bool = True
    """Keep full-size caches for sliding-window layers so sequence operations stay exact."""
    capture: Literal["none", "native", "python"] = "none"
    """Activation capture (``backend.capture``, see ``kvagent.native``): none, the C callback, or the
    pure-Python one (slower; also the fallback when the C library cannot be built)."""
    backend: str = "llama.cpp"
    """Registered backend name (``kvagent.backends.backend_names()``); or pass an instance to ``Engine``."""
    prefill_chunk: int = Field(64, ge=1)
    """Most tokens one session prefills before the scheduler lets other sessions run (latency of
    short requests beside long prefills vs. the long prefill's own speed; see docs/benchmarks/concurrency.md)."""
    prefill_chunk_alone: int | None = Field(None, ge=1)
    """Most tokens a prefill decodes at once while no other work is queued (None: ``prefill_chunk`` always; at
    most ``n_ubatch``). Larger batches prefill faster on the CPU (docs/benchmarks/server.md, "llama-server"). Such a chunk is
    preemptible: work that arrives meanwhile aborts it (llama.cpp's abort callback, in kvagent's native library)
    and the prefill goes on in ``prefill_chunk`` chunks, so a short request does not wait behind it. Where the
    backend cannot preempt (no native library, layers on a GPU) it is ignored with a warning. The cells' last
    bits then depend on what else ran, as a batching server's do."""

    def backend_config(self) -> BackendConfig:
        """The backend's settings, ``n_gpu_layers`` (:func:`auto_gpu_layers`) and ``flash_attn``
        (:func:`auto_flash_attn`) resolved when left unset."""
        config = self.model_dump(exclude={"model", "backend", "prefill_chunk", "prefill_chunk_alone", "retain",
                                           "cache_ram_mb", "cache_disk_mb", "cache_disk_format"})
        if config["n_gpu_layers"] is None:
            config["n_gpu_layers"] = auto_gpu_layers(self.backend)
        if config["flash_attn"] is None:
            config["flash_attn"] = auto_flash_attn(self.backend)
        return BackendConfig(**config)


def _env_flag(name: str, default: bool | None = False) -> bool | None:
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise KVAgentError(f"${name}={value!r}: use 1 or 0 (true/false, yes/no, on/off)")


def auto_gpu_layers(backend: str = "llama.cpp") -> int:
    """``n_gpu_layers`` for settings that leave it unset: ``$KVAGENT_GPU_LAYERS`` when set (an int, -1 = all);
    else, for the llama.cpp backend, -1 when its build can offload (``llama_supports_gpu_offload``) and a GPU
    device is present, 0 otherwise (the backend registry's ``default_gpu_layers``); 0 for the fake backend."""
    value = os.environ.get("KVAGENT_GPU_LAYERS", "").strip()
    if value:
        try:
            return int(value)
        except ValueError:
            raise KVAgentError(
                f"$KVAGENT_GPU_LAYERS={value!r}: use an integer (-1 = all layers, 0 = CPU only)"
            ) from None
    return default_gpu_layers(backend)


def auto_flash_attn(backend: str = "llama.cpp") -> bool:
    """``flash_attn`` for settings that leave it unset: on when the llama.cpp build can offload and sees a GPU
    (the non-flash path gave NaN logits there, see :class:`EngineSettings`), off otherwise."""
    return default_gpu_layers(backend) != 0


class Engine:
    """A loaded model and the sessions that share it. Use :meth:`load`, then :meth:`session`.

    ``backend``: an instance implementing ``kvagent.backends.Backend`` (its model file is still named by
    ``settings.model``, for the fingerprint), or None to build ``settings.backend`` by name.
    """

    def __init__(self, settings: EngineSettings, backend: Backend | None = None) -> None:
        self.settings = settings
        self.model: ModelRef = resolve_model(settings.model)
        self.fingerprint = self.model.fingerprint
        if backend is not None and not isinstance(backend, Backend):
            raise KVAgentError(f"{type(backend).__name__} does not implement kvagent.backends.Backend; "
                               f"pass an instance that does, or a registered name: {', '.join(backend_names())}")
        self.backend: Backend = backend or create_backend(settings.backend, self.model.path, settings.backend_config())
        folder = cache_dir() / "tiers" / f"{os.getpid()}-{uuid.uuid4().hex[:8]}" if settings.cache_disk_mb else None
        self.tiers = tiers(settings.cache_ram_mb << 20, settings.cache_disk_mb << 20, folder,
                           settings.cache_disk_format)
        self.pool = SequencePool(self.backend, retain=settings.retain, tiers=self.tiers, fingerprint=self.fingerprint)
        self.scheduler = Scheduler(self.pool)
        self._alone_chunk = self._preemptible_chunk(settings.prefill_chunk_alone)
        self._sessions: dict[int, Session] = {}
        # one renderer per scope in use: a server may open a scope per cache_salt or per session key, so the least
        # recently used are dropped (a session keeps its own; a later one of that scope tokenizes again)
        self._renderers: LRUCache[tuple[bool, str], Renderer] = LRUCache(maxsize=RENDERERS)
        self._renderers_lock = threading.Lock()
        self._skills: SkillLibrary | None = None

    def _preemptible_chunk(self, chunk: int | None) -> int | None:
        """``prefill_chunk_alone`` where the backend can preempt a decode (at most one micro-batch, so that an
        abort leaves the sequence as it was before the chunk); None otherwise, with a WARNING when it was set."""
        if chunk is None:
            return None
        enable = getattr(self.backend, "enable_preemption", None)  # optional in the Backend protocol
        if enable is None or not enable():
            log.warning("prefill_chunk_alone=%d needs a backend that can preempt a decode (llama.cpp on the CPU "
                        "with kvagent's native library): prefills keep chunks of %d", chunk, self.settings.prefill_chunk)
            return None
        return min(chunk, int(getattr(self.backend, "n_ubatch", chunk)))

    @classmethod
    def load(cls, model: str | None = None, *, backend: str | Backend | None = None, **settings: object) -> Engine:
        """Load ``model`` (default ``smollm2-135m``) with optional :class:`EngineSettings` overrides;
        ``backend`` is a registered name (default ``llama.cpp``) or a backend instance."""
        if model is not None:
            settings["model"] = model
        if isinstance(backend, str):
            settings["backend"] = backend
            backend = None
        return cls(EngineSettings(**settings), backend)  # type: ignore[arg-type]

    @property
    def lock(self) -> threading.RLock:
        """Serialises native calls: take it to call ``engine.backend`` directly (benchmarks, tests)."""
        return self.pool.lock  # type: ignore[return-value]

    # -- sessions ---------------------------------------------------------------------------------
    def session(
        self,
        segments: Iterable[Segment] = (),
        *,
        chat: bool = True,
        fields: Sequence[FieldSpec] = (),
        edit_strategy: str | EditStrategy = "auto",
        compact_after: int | None = None,
        share_prefix: bool = True,
        fidelity: FidelityGuard | None = None,
        eviction: Eviction | None = None,
        scope: str = "",
        skills: SkillLibrary | None = None,
        implicit_edits: CalibratedSplice | None = None,
    ) -> Session:
        """Open a session on a free sequence.

        ``chat=False`` renders plain text instead of the chat template. ``fields`` are specs that
        validate ``session.set``; ``edit_strategy`` is the default way edits reach the KV (see
        ``kvagent.edits``); ``compact_after`` folds errata back into the fields once more than that many
        have accumulated. ``share_prefix=False`` never starts from another session's cells (a cold
        prefill, as benchmarks and oracles need). ``fidelity`` checks sampled transplants against a
        recompute and falls back below its threshold. ``eviction`` (``kvagent.eviction.Eviction``: policy,
        budget J, chunk h) prunes the cache in cycles instead of failing when the prompt outgrows it;
        such a session decodes alone when its policy reads captured hidden states.

        ``scope`` (a tenant, as vLLM's ``cache_salt``): the session shares cached prefixes only with sessions of
        the same scope, both ways, and renders with that scope's own tokenizing memo, so neither its
        ``reused`` counts nor its timing depend on another scope's prompts. ``skills``: the library its skill
        spans are looked up in and compiled into (default: the engine's, :attr:`skills`). ``implicit_edits``: when a
        resent prompt's changes are spliced in place (``kvagent.edits.implicit.CalibratedSplice``, the default: where
        the model's calibration says splices hold, up to its thresholds).
        """
        return self.scheduler.run(None, self.session_work(
            segments, chat=chat, fields=fields, edit_strategy=edit_strategy, compact_after=compact_after,
            share_prefix=share_prefix, fidelity=fidelity, eviction=eviction, scope=scope, skills=skills,
            implicit_edits=implicit_edits))

    def session_work(
        self, segments: Iterable[Segment] = (), *, chat: bool = True, fields: Sequence[FieldSpec] = (),
        edit_strategy: str | EditStrategy = "auto", compact_after: int | None = None, share_prefix: bool = True,
        fidelity: FidelityGuard | None = None, eviction: Eviction | None = None, scope: str = "",
        skills: SkillLibrary | None = None, implicit_edits: CalibratedSplice | None = None,
    ) -> Work[Session]:
        """:meth:`session` as a unit of work (run on the scheduler: taking a sequence is a native call)."""
        evictor = Evictor(eviction, self.backend, self.model.path, self.pool.scratch) if eviction is not None else None
        renderer = self.renderer(chat, scope)
        library = (lambda: skills) if skills is not None else (lambda: self.skills)
        seq = self.pool.take("a session")
        try:
            cache = CachedSequence(self.pool, seq, evictor=evictor, chunk=self.settings.prefill_chunk, scope=scope,
                                   alone_chunk=self._alone_chunk, alone=self.scheduler.alone)
            session = Session(
                cache, self.scheduler, renderer, list(segments), skills=library,
                fingerprint=self.fingerprint, on_close=self._release, fields=fields, edit_strategy=edit_strategy,
                compact_after=compact_after, share_prefix=share_prefix, fidelity=fidelity,
                implicit_edits=implicit_edits,
            )
        except Exception:  # a refused argument must not leak the sequence
            self.pool.release(seq)
            raise
        self._sessions[seq] = session
        return session
        yield  # pragma: no cover - a unit of work that never pauses

    @contextmanager
    def scratch(self) -> Iterator[int]:
        """A temporary sequence (for tests and benchmarks that call the backend), freed on exit; holds the lock."""
        with self.pool.lock, self.pool.scratch() as seq:
            yield seq

    def renderer(self, chat: bool, scope: str = "") -> Renderer:
        """The renderer of chat (or plain) prompts for ``scope``: each scope has its own memo of tokenized
        segments, so how fast a prompt renders says nothing about another scope's prompts."""
        key = (chat, scope)
        with self._renderers_lock:
            found = self._renderers.get(key)
            if found is None:
                found = self._renderers[key] = Renderer(self.backend,
                                                        self._chat_format() if chat else ChatFormat.plain(),
                                                        tools=self._tool_format() if chat else None)
            return found

    @property
    def skills(self) -> SkillLibrary:
        """This engine's compiled skills (store in ``cache_dir()/skills``), created on first use."""
        if self._skills is None:
            self._skills = self.skill_library()
        return self._skills

    def skill_library(self, store: SkillStore | None = None, *, recompute: float = 0.0) -> SkillLibrary:
        """A library of this model's compiled skills over ``store`` (default: ``cache_dir()/skills``);
        ``recompute``: the share of each transplant's positions decoded fresh, the most deviating from a cold
        prefill first (selective recompute, ``kvagent.skills.library``; 0: none)."""
        return SkillLibrary(self.pool, self.fingerprint, self.model.name, store, recompute=recompute)

    def tool_segments(self, tools: ToolSet, *, chat: bool = True, library: SkillLibrary | None = None,
                      scope: str = "") -> list[Segment]:
        """The segments that describe ``tools`` to the model in its tool format (``kvagent.tools.format``: the chat
        template's where it has one, else kvagent's own), each compiled as a skill
        for this model once (stored: later sessions and processes transplant them instead of prefilling), into
        ``library`` (default: the engine's) with the renderer of ``scope``."""
        renderer, library = self.renderer(chat, scope), library or self.skills
        segments = format_of(renderer).segments(tools)

        def work() -> Iterator[None]:
            for segment in segments:
                if segment.kind is SegmentKind.SKILL:  # a format whose tools are prefilled has none
                    library.compile_segment(segment, renderer)
            return None
            yield  # pragma: no cover - a unit of work that never pauses

        self.scheduler.run(None, work())
        return segments

    @skills.setter
    def skills(self, library: SkillLibrary) -> None:
        """Use another library (e.g. one over a store in another folder)."""
        self._skills = library

    def _tool_format(self) -> ToolFormat | None:
        """The tool format the model's chat template writes (``kvagent.tools.template``), or None: kvagent's own."""
        template = self.backend.chat_template
        if not template:
            return None
        found = tool_format_of(template, self._chat_format(), self.model.name)
        if found is None and "tools" in template:
            log.warning("%s: its chat template mentions tools, but kvagent cannot read a tool format from it: tools, "
                        "calls and results are written in kvagent's own %s format", self.model.name,
                        HERMES.name)
        return found

    def _chat_format(self) -> ChatFormat:
        template = self.backend.chat_template
        if template:
            # the EOS text: templates that close assistant turns with it (Mistral's) are written as they are
            return ChatFormat.from_template(template, self.model.name, getattr(self.backend, "eos_text", ""))
        builtin = BUILTIN_FORMATS.get(self.backend.architecture)
        if builtin is None:
            raise ChatTemplateError(
                f"{self.model.name} has no chat template and kvagent has no built-in one for architecture "
                f"{self.backend.architecture!r}: open the session with chat=False"
            )
        log.info("%s has no chat template in its GGUF: using the built-in %s format", self.model.name, builtin.name)
        return builtin

    def _release(self, session: Session) -> None:
        """Runs on the scheduler's worker, as the session's last unit of work."""
        if self._sessions.pop(session.seq, None) is not None:
            if session.retains:
                session.cache.retain(session.resume_point)
            else:
                self.pool.release(session.seq)

    @property
    def open_sessions(self) -> int:
        return len(self._sessions)

    # -- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Close every session, stop the scheduler, then free the model."""
        for session in list(self._sessions.values()):
            session.close()
        self.scheduler.close()
        with self.pool.lock:
            self.backend.close()
        if self.tiers is not None:
            self.tiers.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
