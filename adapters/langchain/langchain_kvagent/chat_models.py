"""ChatKVAgent: a LangChain chat model on kvagent, whose KV cache stays alive across a conversation's turns.

Each conversation is one kvagent session, chosen per call by its *session key*: a ``session_id`` keyword
(``model.invoke(msgs, session_id="a")``), else ``config["configurable"]["session_id"]``, else
``config["configurable"]["thread_id"]`` (LangGraph), else one default session per chat model instance.
Clients resend the whole history each call; the messages the session already holds are reused from its
cache and only new ones are computed (``kvagent.messages``: leading system messages are the policy, later
ones memory, human messages user turns, AI messages assistant turns, tool results a user turn naming the
tool). The chat model's own ``policy``, ``skills`` and ``fields`` follow the leading system messages, so a
value that changes goes in a declared field (an erratum line is appended; the prefix stays cached) instead
of the top of the system prompt.

    model = ChatKVAgent(policy="You are Northwind's support agent.", fields=[FieldSpec(name="plan", initial="basic")])
    reply = model.invoke("Can I cancel?", config={"configurable": {"session_id": "alice"}})
    reply.usage_metadata["input_token_details"]["cache_read"]      # prompt tokens not computed
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import weakref
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Iterator, Literal, Mapping, Sequence

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams, LanguageModelInput
from langchain_core.language_models.chat_models import generate_from_stream
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
    UsageMetadata,
)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import RunnableConfig, ensure_config
from pydantic import Field, InstanceOf, PrivateAttr, SecretStr, model_validator

from kvagent.edits.base import EditReport
from kvagent.engine import Engine
from kvagent.errors import EvictionError, KVAgentError
from kvagent.eviction import Eviction
from kvagent.fields import FieldSpec
from kvagent.generation import Generation
from kvagent.messages import ChatMessage
from kvagent.models import DEFAULT_MODEL
from kvagent.policies import get_policy
from kvagent.segments import Segment
from kvagent.session import Session
from kvagent.skills.spec import SkillSpec, load_skill, load_skills

from langchain_kvagent import snapshot
from langchain_kvagent.errors import SkillNotCompiledError, UndeclaredFieldError, UnknownSessionError, UnknownSkillError
from langchain_kvagent.registry import EngineKey, EngineSlot, SessionEntry, Turn, slot

log = logging.getLogger(__name__)

DEFAULT_SESSION = "default"
_ROLES = {"system": "system", "human": "user", "ai": "assistant", "tool": "tool", "function": "tool"}
_CHAT_ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "ai": "assistant",
               "tool": "tool"}
_MEDIA = {"image", "image_url", "audio", "input_audio", "video", "file", "document"}
_SAMPLING = ("temperature", "top_p", "top_k", "seed", "max_tokens")


def to_chat_messages(messages: Sequence[BaseMessage]) -> list[ChatMessage]:
    """LangChain messages as kvagent chat messages (text only; a media block is refused by name)."""
    out: list[ChatMessage] = []
    for index, message in enumerate(messages):
        if message.type == "chat":
            role = _CHAT_ROLES.get(str(getattr(message, "role", "")))
        else:
            role = _ROLES.get(message.type)
        if role is None:
            raise KVAgentError(f"message {index} is a {type(message).__name__} ({message.type!r}): ChatKVAgent takes "
                               "system, human, AI and tool messages")
        name = (message.name or getattr(message, "tool_call_id", None)) if role == "tool" else None
        out.append(ChatMessage(role, _text(message, index), name))  # type: ignore[arg-type]
    return out


def to_langchain(message: ChatMessage) -> BaseMessage:
    """A kvagent chat message as the LangChain message it came from."""
    if message.role == "system":
        return SystemMessage(message.content)
    if message.role == "user":
        return HumanMessage(message.content)
    if message.role == "assistant":
        return AIMessage(message.content)
    name = message.name or "tool"
    return ToolMessage(message.content, tool_call_id=name, name=name)


def _text(message: BaseMessage, index: int) -> str:
    if isinstance(message.content, str):
        return message.content
    parts: list[str] = []
    for block in message.content:
        if isinstance(block, str):
            parts.append(block)
        elif block.get("type") == "text":
            parts.append(str(block.get("text", "")))
        elif block.get("type") in _MEDIA:
            raise KVAgentError(f"message {index} has a {block.get('type')!r} block: ChatKVAgent reads text only "
                               "(a 135M-270M text model); send the text, or describe the media in words")
    return "".join(parts)


def usage_metadata(turn: Turn) -> UsageMetadata:
    """``input_tokens``: the whole prompt; ``cache_read``: its tokens that were not computed (reused from the
    cache, or transplanted from a compiled skill)."""
    return UsageMetadata(input_tokens=turn.input_tokens, output_tokens=turn.output_tokens,
                         total_tokens=turn.input_tokens + turn.output_tokens,
                         input_token_details={"cache_read": turn.cache_read})


@dataclass(frozen=True)
class _Call:
    """One call's session key, messages and generation options."""

    key: str
    messages: list[ChatMessage]
    max_tokens: int
    options: dict[str, Any]


class ChatKVAgent(BaseChatModel):
    """A local llama.cpp model whose KV cache stays alive across each conversation's turns.

    Setup: ``pip install -e 'adapters/langchain'`` (kvagent and a model package installed).

    Instantiate:
        .. code-block:: python

            from kvagent.fields import FieldSpec
            from langchain_kvagent import ChatKVAgent

            model = ChatKVAgent(model="smollm2-135m", max_tokens=64, policy="You are a support agent. Be brief.",
                                fields=[FieldSpec(name="order_status", initial="processing")])

    Invoke, on a session chosen per call:
        .. code-block:: python

            reply = model.invoke("Can I cancel?", session_id="alice")
            reply.usage_metadata            # input_tokens, output_tokens, input_token_details.cache_read
            reply.response_metadata         # model_name, finish_reason, session_id, reused, computed, ...
            model.set_fields({"order_status": "shipped"}, session_id="alice")  # an erratum, prefix kept

    Stream (the last chunk carries usage and metadata, once):
        .. code-block:: python

            for chunk in model.stream("And the refund?", config={"configurable": {"thread_id": "t1"}}):
                print(chunk.text, end="")

    Async (native, on ``kvagent.aio``: calls on different sessions decode in one batch):
        .. code-block:: python

            await model.ainvoke("Hi", session_id="bob")
    """

    model: str = DEFAULT_MODEL
    """Registry name (``smollm2-135m``, ``gemma3-270m``) or path of a local ``.gguf`` file. Loaded on first use;
    chat models with the same model and engine settings share one engine (one KV pool) per process."""
    temperature: float = 0.0
    """Sampling temperature; 0 is greedy (deterministic)."""
    max_tokens: int = Field(256, ge=1)
    """Most tokens one reply may have."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling: the smallest set of tokens whose probability adds up to ``top_p`` (with temperature > 0)."""
    top_k: int = Field(0, ge=0)
    """Sample among the ``top_k`` most likely tokens (0: all), with temperature > 0."""
    seed: int | None = None
    """Seed of the sampler (temperature > 0); None: a fresh one each call."""
    stop: list[str] | None = None
    """Strings that end a reply (not included in it); a call's own ``stop`` replaces them."""
    n_ctx: int = Field(4096, ge=32)
    """KV pool of the engine, in tokens, shared by its sessions; also the longest one conversation can get."""
    n_seq_max: int = Field(8, ge=2, le=256)
    """Sessions the engine holds at once; past it the least recently used idle session is closed (and rebuilt
    from the resent history when it is used again). One sequence is kept free for skill transplants."""
    n_gpu_layers: int | None = None
    """Layers offloaded to a GPU (llama.cpp built with CUDA or Metal); 0: CPU only, -1: all; None: the engine's
    automatic choice (all layers when the build can offload and sees a GPU, else none)."""
    policy: str | None = None
    """A system prompt of the chat model's own, after the messages' leading system messages: cached once,
    shared by every session of the engine that starts with it."""
    fields: list[FieldSpec] = Field(default_factory=list)
    """Declared mutable values (``kvagent.fields.FieldSpec``) rendered after the policy and skills. Change
    one with :meth:`set_fields` or through :class:`~langchain_kvagent.KVAgentStateRunnable`: an erratum line
    is appended (``edit_strategy``) and the cached prefix stays valid."""
    skills: list[str] = Field(default_factory=list)
    """Skill YAML files (or folders of them) placed in every session after the policy. A skill compiled for
    the model (``kvagent skills compile``) is transplanted, not computed."""
    skill_dirs: list[str] = Field(default_factory=list)
    """Skill YAML files or folders where names given to :meth:`include_skill` (or a state's ``skills`` key)
    are looked up, besides ``skills``."""
    compile_skills: bool = False
    """Compile a skill that is not compiled for the model on first use (one prefill, stored for every later
    process). False: such a skill is refused with :class:`SkillNotCompiledError` naming the command."""
    edit_strategy: str = "auto"
    """How a field change reaches the KV: ``auto`` (default: per model, prompt format and situation, the
    cheapest strategy measured to hold; see ``kvagent.edits.auto``), ``erratum`` (append a state-update
    line), ``recompute``, ``field_only``, ``selective`` or ``combined`` (see ``kvagent.edits``)."""
    eviction: InstanceOf[Eviction] | None = None
    """Eviction for new sessions (``kvagent.Eviction``): prune to a budget instead of refusing a long prompt.
    ``Eviction("window", budget=..., chunk=...)`` needs nothing more; policies that read hidden states
    (``surprise``, ``h2o``, ``tova``) need ``capture``."""
    capture: Literal["none", "native", "python"] = "none"
    """Activation capture of the engine (penultimate hidden states, for the eviction policies that read them):
    ``native`` (the C hook, ``kvagent native build``) or ``python``. Off by default: such sessions decode
    outside the shared batch."""
    timeout: float | None = Field(None, gt=0)
    """Seconds a call may take; past it the call is cancelled, its turn rolled back, and ``TimeoutError``
    raised. Async calls are cancelled at once; sync and streaming calls at their next generated piece."""
    max_retries: int = Field(0, ge=0)
    """Accepted for code written against hosted models; a local model has no transient network errors, so a
    failed call is never retried."""
    api_key: SecretStr | None = None
    """Accepted for code written against hosted models; a local model needs none (ignored)."""
    streaming: bool = False
    """Generate through :meth:`_stream` even on ``invoke`` (callbacks then see each token)."""

    _owner: str = PrivateAttr(default_factory=lambda: uuid.uuid4().hex)
    _catalog: dict[str, tuple[SkillSpec, Path]] | None = PrivateAttr(default=None)
    _finalizer: Any = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _check(self) -> ChatKVAgent:
        names = [spec.name for spec in self.fields]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"fields declared twice: {', '.join(duplicates)}; declare each FieldSpec once")
        if self.eviction is not None:
            self._check_eviction(self.eviction)
        return self

    def _check_eviction(self, eviction: Eviction) -> None:
        policy = get_policy(eviction.policy)  # an unknown name is refused with the valid ones
        if policy.needs_hidden and self.capture == "none":
            raise EvictionError(f"eviction policy {policy.name!r} reads hidden states captured while decoding: "
                                "construct ChatKVAgent(..., capture='native') (or 'python'), or use "
                                "Eviction('window', ...)")

    # -- LangChain's hooks ----------------------------------------------------------------------------
    @property
    def _llm_type(self) -> str:
        return "kvagent"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model": self.model, "temperature": self.temperature, "max_tokens": self.max_tokens, "top_p": self.top_p,
            "top_k": self.top_k, "seed": self.seed, "stop": self.stop, "n_ctx": self.n_ctx, "n_seq_max": self.n_seq_max,
            "n_gpu_layers": self.n_gpu_layers, "policy": self.policy, "fields": [f.name for f in self.fields],
            "skills": list(self.skills), "edit_strategy": self.edit_strategy,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="kvagent", ls_model_name=str(kwargs.get("model") or self.model), ls_model_type="chat",
            ls_temperature=kwargs.get("temperature", self.temperature),
            ls_max_tokens=kwargs.get("max_tokens", self.max_tokens),
        )
        if stop or self.stop:
            params["ls_stop"] = list(stop or self.stop or [])
        return params

    # -- the session key: LangChain drops config["configurable"] before _generate, so lift it here --------
    def session_key(self, config: RunnableConfig | None = None, session_id: str | None = None) -> str:
        """The session a call with ``config`` uses (see the module docstring for the order)."""
        if session_id is not None:
            return str(session_id)
        configurable = ensure_config(config).get("configurable") or {}
        for name in ("session_id", "thread_id"):
            if configurable.get(name) is not None:
                return str(configurable[name])
        return DEFAULT_SESSION

    def _lift(self, config: RunnableConfig | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        return {**kwargs, "session_id": self.session_key(config, kwargs.get("session_id"))}

    def invoke(self, input: LanguageModelInput, config: RunnableConfig | None = None, *,
               stop: list[str] | None = None, **kwargs: Any) -> AIMessage:
        return super().invoke(input, config, stop=stop, **self._lift(config, kwargs))

    async def ainvoke(self, input: LanguageModelInput, config: RunnableConfig | None = None, *,
                      stop: list[str] | None = None, **kwargs: Any) -> AIMessage:
        return await super().ainvoke(input, config, stop=stop, **self._lift(config, kwargs))

    def stream(self, input: LanguageModelInput, config: RunnableConfig | None = None, *,
               stop: list[str] | None = None, **kwargs: Any) -> Iterator[AIMessageChunk]:
        return super().stream(input, config, stop=stop, **self._lift(config, kwargs))

    def astream(self, input: LanguageModelInput, config: RunnableConfig | None = None, *,
                stop: list[str] | None = None, **kwargs: Any) -> AsyncIterator[AIMessageChunk]:
        return super().astream(input, config, stop=stop, **self._lift(config, kwargs))

    def stream_events(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        return super().stream_events(input, config, **self._lift(config, kwargs))

    def astream_events(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        return super().astream_events(input, config, **self._lift(config, kwargs))

    # (batch and abatch call invoke and ainvoke once per input with that input's config: lifted there)

    # -- generation ---------------------------------------------------------------------------------
    def _call(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]) -> _Call:
        kwargs = dict(kwargs)
        key = str(kwargs.pop("session_id", None) or DEFAULT_SESSION)
        kwargs.pop("stream", None)
        model = kwargs.pop("model", None)
        if model is not None and model != self.model:
            raise KVAgentError(f"ChatKVAgent does not switch models per call (got model={model!r}, this one runs "
                               f"{self.model!r}): construct another ChatKVAgent(model={model!r})")
        unknown = sorted(set(kwargs) - set(_SAMPLING))
        if unknown:
            raise KVAgentError(f"unknown call options {', '.join(unknown)}: ChatKVAgent takes session_id, stop, "
                               f"{', '.join(_SAMPLING)}")
        options = {
            "temperature": kwargs.get("temperature", self.temperature), "top_p": kwargs.get("top_p", self.top_p),
            "top_k": kwargs.get("top_k", self.top_k), "seed": kwargs.get("seed", self.seed),
            "stop": list(stop if stop is not None else self.stop or []),
        }
        return _Call(key, to_chat_messages(messages), int(kwargs.get("max_tokens", self.max_tokens)), options)

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        if self.timeout is not None:  # a sync call is cancelled between pieces: generate through the stream
            return generate_from_stream(self._stream(messages, stop, run_manager, **kwargs))
        call = self._call(messages, stop, kwargs)
        entry = self._acquire(call.key)
        try:
            gen = entry.live.generate(call.max_tokens, segments=entry.plan(call.messages), **call.options)
            turn = entry.commit(call.messages, gen)
        finally:
            entry.release()
        return self._result(gen, turn, call.key)

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        call = self._call(messages, stop, kwargs)
        entry = await self._aacquire(call.key)
        try:
            reply = entry.asession().arespond(entry.plan(call.messages), call.max_tokens, **call.options)
            try:
                gen = await (asyncio.wait_for(reply, self.timeout) if self.timeout is not None else reply)
            except asyncio.TimeoutError:
                raise TimeoutError(self._timeout_message()) from None
            turn = entry.commit(call.messages, gen)
        finally:
            entry.release()
        return self._result(gen, turn, call.key)

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        call = self._call(messages, stop, kwargs)
        deadline = time.monotonic() + self.timeout if self.timeout is not None else None
        entry = self._acquire(call.key)
        try:
            with entry.live.stream(call.max_tokens, segments=entry.plan(call.messages), **call.options) as stream:
                for piece in stream:
                    if deadline is not None and time.monotonic() > deadline:
                        raise TimeoutError(self._timeout_message())  # leaving the block rolls the turn back
                    yield ChatGenerationChunk(message=AIMessageChunk(content=piece))
            gen = self._finished(stream.result)
            turn = entry.commit(call.messages, gen)
        finally:
            entry.release()
        yield self._last_chunk(gen, turn, call.key)

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        call = self._call(messages, stop, kwargs)
        deadline = time.monotonic() + self.timeout if self.timeout is not None else None
        entry = await self._aacquire(call.key)
        try:
            segments = entry.plan(call.messages)
            async with entry.asession().astream(call.max_tokens, segments=segments, **call.options) as stream:
                async for piece in stream:
                    if deadline is not None and time.monotonic() > deadline:
                        raise TimeoutError(self._timeout_message())
                    yield ChatGenerationChunk(message=AIMessageChunk(content=piece))
            gen = self._finished(stream.result)
            turn = entry.commit(call.messages, gen)
        finally:
            entry.release()
        yield self._last_chunk(gen, turn, call.key)

    @staticmethod
    def _finished(result: Generation | None) -> Generation:
        if result is None:  # pragma: no cover - a stream that ended without error always has its result
            raise KVAgentError("the stream ended without a result (internal error)")
        return result

    def _timeout_message(self) -> str:
        return (f"ChatKVAgent call took longer than timeout={self.timeout}s: cancelled and rolled back; raise the "
                "timeout or lower max_tokens")

    def _metadata(self, gen: Generation, turn: Turn, key: str) -> dict[str, Any]:
        return {"model_name": self.model, "finish_reason": gen.finish_reason, "session_id": key,
                "reused": turn.reused, "computed": turn.computed, "transplanted": turn.transplanted,
                "ttft_s": round(turn.ttft_s, 6)}

    def _result(self, gen: Generation, turn: Turn, key: str) -> ChatResult:
        message = AIMessage(content=gen.text, usage_metadata=usage_metadata(turn),
                            response_metadata=self._metadata(gen, turn, key))
        info = {"finish_reason": gen.finish_reason}
        return ChatResult(generations=[ChatGeneration(message=message, generation_info=info)])

    def _last_chunk(self, gen: Generation, turn: Turn, key: str) -> ChatGenerationChunk:
        message = AIMessageChunk(content="", usage_metadata=usage_metadata(turn),
                                 response_metadata=self._metadata(gen, turn, key), chunk_position="last")
        return ChatGenerationChunk(message=message, generation_info={"finish_reason": gen.finish_reason})

    # -- engines and sessions -----------------------------------------------------------------------
    def _slot(self) -> EngineSlot:
        return slot(EngineKey(self.model, self.n_ctx, self.n_seq_max, self.n_gpu_layers, self.capture))

    def load_engine(self) -> Engine:
        """The kvagent :class:`~kvagent.engine.Engine` this chat model runs on (shared; loaded on first use)."""
        return self._slot().load()

    def _entry(self, key: str) -> SessionEntry:
        found = self._slot()
        if self._finalizer is None:  # once this chat model is gone its sessions are the first to close
            self._finalizer = weakref.finalize(self, found.orphan, self._owner)
        return found.entry(self._owner, key, lambda: SessionEntry(
            self._owner, key, tuple(self.fields), {spec.name: spec.initial for spec in self.fields},
            eviction=self.eviction))

    def _open(self, entry: SessionEntry) -> None:
        """Open ``entry``'s session (loading the engine, resolving the chat model's skills on first use).
        Call while holding the entry's lock."""
        found = self._slot()
        found.load()
        if entry.prologue is None:
            policy = [Segment.policy(self.policy, id="chat-model-policy")] if self.policy else []
            skills = [self._skill_segment(spec, path) for spec, path in self._files(self.skills)]
            entry.prologue = [*policy, *skills]
        found.open(entry, edit_strategy=self.edit_strategy)

    def _acquire(self, key: str) -> SessionEntry:
        """The entry of session ``key``, locked and open; the caller releases it."""
        entry = self._entry(key).acquire()
        try:
            if entry.session is None or entry.session.closed:
                self._open(entry)
        except BaseException:
            entry.release()
            raise
        return entry

    async def _aacquire(self, key: str) -> SessionEntry:
        """:meth:`_acquire`, awaited (loading the model and opening the session in a thread, not on the loop)."""
        entry = await self._entry(key).aacquire()
        try:
            if entry.session is None or entry.session.closed:
                await asyncio.to_thread(self._open, entry)
        except BaseException:
            entry.release()
            raise
        return entry

    @contextmanager
    def _locked(self, key: str) -> Iterator[SessionEntry]:
        entry = self._acquire(key)
        try:
            yield entry
        finally:
            entry.release()

    @asynccontextmanager
    async def _alocked(self, key: str) -> AsyncIterator[SessionEntry]:
        entry = await self._aacquire(key)
        try:
            yield entry
        finally:
            entry.release()

    def session(self, key: str | None = None) -> Session:
        """The kvagent :class:`~kvagent.session.Session` of session ``key`` (default: this model's default one).

        Raises :class:`UnknownSessionError` when this chat model has not opened that session (or closed it to
        free a sequence)."""
        key = DEFAULT_SESSION if key is None else str(key)
        found = self._slot().find(self._owner, key)
        if found is None or found.session is None or found.session.closed:
            open_ = ", ".join(repr(k) for k in self.session_ids()) or "none"
            reason = ("it was closed to free a sequence for another (raise n_seq_max to keep more open); it "
                      "reopens on its next call") if found is not None else "sessions open on their first call"
            raise UnknownSessionError(
                f"no open session {key!r} on this ChatKVAgent: {reason}, e.g. model.invoke(messages, "
                f"session_id={key!r}); open sessions: {open_}")
        return found.session

    def session_ids(self) -> list[str]:
        """Keys of this chat model's open sessions."""
        found = self._slot()
        return [k for k in found.keys(self._owner) if (e := found.find(self._owner, k)) and e.session is not None]

    def messages(self, key: str | None = None) -> list[BaseMessage]:
        """The history session ``key`` holds (its messages and the replies it generated), as LangChain messages."""
        found = self._slot().find(self._owner, DEFAULT_SESSION if key is None else str(key))
        return [to_langchain(m) for m in found.log.messages] if found is not None else []

    def turns(self, key: str | None = None) -> list[Turn]:
        """What each generation on session ``key`` cost, oldest first."""
        found = self._slot().find(self._owner, DEFAULT_SESSION if key is None else str(key))
        return list(found.turns) if found is not None else []

    def last_turn(self, key: str | None = None) -> Turn | None:
        """What the latest generation on session ``key`` cost (None before the first)."""
        turns = self.turns(key)
        return turns[-1] if turns else None

    def close_session(self, key: str | None = None) -> bool:
        """Close session ``key`` and forget its conversation; False if it was not open."""
        return self._slot().close_entry(self._owner, DEFAULT_SESSION if key is None else str(key))

    # -- fields ---------------------------------------------------------------------------------------
    def _checked(self, changes: Mapping[str, object]) -> dict[str, object]:
        specs = {spec.name: spec for spec in self.fields}
        unknown = [name for name in changes if name not in specs]
        if unknown:
            declared = ", ".join(sorted(specs)) or "none"
            raise UndeclaredFieldError(
                f"field {unknown[0]!r} is not declared on this ChatKVAgent (declared: {declared}): add "
                f"FieldSpec(name={unknown[0]!r}, initial=...) to ChatKVAgent(fields=[...])")
        return {name: specs[name].check(value) for name, value in changes.items()}

    def field_values(self, session_id: str | None = None) -> dict[str, object]:
        """Current value of each declared field in a session (initial values before its first call)."""
        found = self._slot().find(self._owner, DEFAULT_SESSION if session_id is None else str(session_id))
        if found is None:
            return {spec.name: spec.initial for spec in self.fields}
        return found.field_values()

    def set_fields(self, changes: Mapping[str, object], *, session_id: str | None = None) -> EditReport | None:
        """Change declared fields of a session: one ``set_many`` (``edit_strategy``, auto by default) once it
        holds a conversation; before that the values simply render into its first prompt (returns None)."""
        checked = self._checked(changes)
        with self._locked(DEFAULT_SESSION if session_id is None else str(session_id)) as entry:
            changed = {k: v for k, v in checked.items() if entry.field_values().get(k) != v}
            if not changed:
                return None
            if entry.fresh:
                entry.values.update(changed)
                return None
            report = entry.live.set_many(changed)
            entry.charge(report.computed)
            return report

    async def aset_fields(self, changes: Mapping[str, object], *, session_id: str | None = None) -> EditReport | None:
        """:meth:`set_fields`, awaited."""
        checked = self._checked(changes)
        async with self._alocked(DEFAULT_SESSION if session_id is None else str(session_id)) as entry:
            changed = {k: v for k, v in checked.items() if entry.field_values().get(k) != v}
            if not changed:
                return None
            if entry.fresh:
                entry.values.update(changed)
                return None
            report = await entry.asession().aset_many(changed)
            entry.charge(report.computed)
            return report  # type: ignore[no-any-return]

    # -- skills ---------------------------------------------------------------------------------------
    @staticmethod
    def _files(paths: Sequence[str | Path]) -> list[tuple[SkillSpec, Path]]:
        """(spec, file) of every skill in ``paths`` (files, or folders of ``*.yaml``/``*.yml``)."""
        files: list[Path] = []
        for p in map(Path, paths):
            files += sorted([*p.glob("*.yaml"), *p.glob("*.yml")]) if p.is_dir() else [p]
        return list(zip(load_skills(files), files))

    def skill_catalog(self) -> dict[str, tuple[SkillSpec, Path]]:
        """Skills known by name: those of ``skills`` and ``skill_dirs`` (read once)."""
        if self._catalog is None:
            self._catalog = {spec.name: (spec, path) for spec, path in self._files([*self.skills, *self.skill_dirs])}
        return self._catalog

    def _skill(self, skill: str | Path | SkillSpec) -> tuple[SkillSpec, Path | None]:
        if isinstance(skill, SkillSpec):
            return skill, None
        catalog = self.skill_catalog()
        if str(skill) in catalog:
            return catalog[str(skill)]
        path = Path(skill)
        if path.suffix in (".yaml", ".yml") or path.exists():
            return load_skill(path), path
        names = ", ".join(sorted(catalog)) or "none"
        raise UnknownSkillError(f"no skill named {str(skill)!r} (known: {names}): give a YAML path, or add its file "
                                "or folder to ChatKVAgent(skill_dirs=[...])")

    def _skill_segment(self, spec: SkillSpec, path: Path | None) -> Segment:
        """``spec``'s segment, checked compiled for the model (or compiled, with ``compile_skills``)."""
        found = self._slot()

        def resolve() -> Segment:
            engine = found.load()
            renderer, library = engine.renderer(True), engine.skills
            if self.compile_skills:
                return library.segment(spec, renderer)
            tokens = renderer.segment_tokens(spec.segment())
            if library.lookup(tokens) is None and not library.store.has(library.key(library.sink(renderer), tokens)):
                where = str(path) if path is not None else "SKILL.yaml"
                raise SkillNotCompiledError(
                    f"skill {spec.name!r} is not compiled for {engine.model.name}: run `kvagent skills compile {where} "
                    f"--model {self.model}` once, or construct ChatKVAgent(..., compile_skills=True)")
            return spec.segment()

        return found.on_worker(resolve)

    def _include(self, entry: SessionEntry, skill: str | Path | SkillSpec) -> tuple[SkillSpec, Segment] | None:
        spec, path = self._skill(skill)
        if any(s.name == spec.name for s in [*(entry.prologue or []), *entry.skills]):
            return None  # already in the prompt
        return spec, self._skill_segment(spec, path)

    def include_skill(self, skill: str | Path | SkillSpec, *, session_id: str | None = None) -> bool:
        """Place a skill (a name from ``skills``/``skill_dirs``, a YAML path or a spec) in a session: in the
        prompt's head before its first call, else at its end (transplanted when compiled). False if it is
        already there."""
        with self._locked(DEFAULT_SESSION if session_id is None else str(session_id)) as entry:
            found = self._include(entry, skill)
            if found is None:
                return False
            spec, segment = found
            if not entry.fresh:
                report = entry.live.include(spec)
                entry.charge(report.computed, report.transplanted)
            entry.skills.append(segment)
            return True

    async def ainclude_skill(self, skill: str | Path | SkillSpec, *, session_id: str | None = None) -> bool:
        """:meth:`include_skill`, awaited."""
        async with self._alocked(DEFAULT_SESSION if session_id is None else str(session_id)) as entry:
            found = await asyncio.to_thread(self._include, entry, skill)
            if found is None:
                return False
            spec, segment = found
            if not entry.fresh:
                report = await entry.asession().ainclude(spec)
                entry.charge(report.computed, report.transplanted)
            entry.skills.append(segment)
            return True

    # -- eviction, save, load -------------------------------------------------------------------------
    async def aset_eviction(self, eviction: Eviction | None, *, session_id: str | None = None) -> None:
        """Give a session another eviction policy (or none): a new session with it takes over the prompt,
        starting from the old one's cached prefix. Refused (nothing changed) when the policy is invalid."""
        if eviction is not None:
            self._check_eviction(eviction)
        async with self._alocked(DEFAULT_SESSION if session_id is None else str(session_id)) as entry:
            old, log_, before = entry.live, entry.log, entry.eviction
            entry.eviction = eviction
            try:
                await asyncio.to_thread(self._slot().open, entry, edit_strategy=self.edit_strategy)
            except BaseException:
                entry.eviction, entry.session = before, old
                raise
            entry.log = log_
            try:
                if old.segments:
                    await entry.asession().areplace(old.segments)
            except BaseException:
                new, entry.session, entry.eviction = entry.live, old, before
                await asyncio.to_thread(new.close)
                raise
            await asyncio.to_thread(old.close)

    async def asave_session(self, path: str | Path, *, session_id: str | None = None) -> int:
        """Write a session (its KV, prompt and history) to ``path``; returns the bytes written."""
        async with self._alocked(DEFAULT_SESSION if session_id is None else str(session_id)) as entry:
            blob = await entry.asession().asave()
            return snapshot.write(Path(path), blob, entry.live.segments, entry.log.messages,
                                  [s.name for s in entry.skills if s.name])

    async def aload_session(self, path: str | Path, *, session_id: str | None = None) -> None:
        """Restore a session written by :meth:`asave_session` (same model; checked before anything changes)."""
        blob, segments, messages, skill_names = snapshot.read(Path(path))
        async with self._alocked(DEFAULT_SESSION if session_id is None else str(session_id)) as entry:
            await entry.asession().arestore(blob, segments)
            entry.log.commit(messages)
            entry.skills = [s for s in segments if s.name in skill_names and s.kind.value == "skill"]
            entry.pending_computed = entry.pending_transplanted = 0


__all__ = ["DEFAULT_SESSION", "ChatKVAgent", "to_chat_messages", "to_langchain", "usage_metadata"]
