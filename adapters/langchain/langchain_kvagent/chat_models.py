"""ChatKVAgent: a LangChain chat model on kvagent, whose KV cache stays alive across a conversation's turns.

Each conversation is one kvagent session, chosen per call by its *session key*: a ``session_id`` keyword
(``model.invoke(msgs, session_id="a")``), else ``config["configurable"]["session_id"]``, else
``config["configurable"]["thread_id"]`` (LangGraph), else one default session per chat model instance.
Clients resend the whole history each call; the messages the session already holds are reused from its
cache and only new ones are computed (``kvagent.messages``). The chat model's own ``policy``, ``skills`` and
``fields`` follow the leading system messages, so a value that changes goes in a declared field (an edit, the
prefix stays cached) instead of the top of the system prompt. Every verb exists sync and async, both driving
one operation (``langchain_kvagent.operations``); the sessions are the chat model's ``conversations``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, AsyncIterator, Iterator, Literal, Mapping, Sequence

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams, LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableConfig, ensure_config
from langchain_core.tools import BaseTool
from pydantic import Field, InstanceOf, PrivateAttr, SecretStr, model_validator

from kvagent.aio import AsyncSession
from kvagent.edits.base import EditReport
from kvagent.engine import Engine
from kvagent.errors import EvictionError
from kvagent.eviction import Eviction
from kvagent.fields import FieldSpec
from kvagent.memory import MemoryBlock
from kvagent.models import DEFAULT_MODEL
from kvagent.policies import get_policy
from kvagent.session import Session
from kvagent.skills.spec import SkillSpec

from langchain_kvagent import memory
from langchain_kvagent import operations as ops
from langchain_kvagent import structured
from langchain_kvagent.convert import (DEFAULT_SESSION, Call, Chunks, chat_result, last_chunk, parse_call,
                                      to_chat_messages, to_langchain, usage_metadata)
from langchain_kvagent.conversations import Conversations
from langchain_kvagent.registry import Turn
from langchain_kvagent.skills import find_skill, skill_files


class ChatKVAgent(BaseChatModel):
    """A local llama.cpp model whose KV cache stays alive across each conversation's turns
    (``pip install -e 'adapters/langchain'``).

    .. code-block:: python

        model = ChatKVAgent(model="smollm2-135m", policy="You are a support agent. Be brief.",
                            fields=[FieldSpec(name="order_status", initial="processing")])
        reply = model.invoke("Can I cancel?", session_id="alice")    # usage_metadata: cache_read
        model.set_fields({"order_status": "shipped"}, session_id="alice")   # an edit, the prefix kept
        for chunk in model.stream("And the refund?", config={"configurable": {"thread_id": "t1"}}): ...
        await model.ainvoke("Hi", session_id="bob")   # native async: sessions decode in one batch
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
    memory: list[InstanceOf[MemoryBlock]] = Field(default_factory=list)
    """Memory blocks (``kvagent.memory.MemoryBlock``) every session starts with; the model edits them with the
    memory tools (:meth:`memory_tools`), the application with :meth:`edit_memory`."""
    memory_position: Literal["head", "tail"] = "head"
    """``head``: after the policy, as fields (an edit is a kvagent edit, the conversation after it stays cached);
    ``tail``: after the trajectory, as transplanted skills (an edit recomputes only the tail on the next turn)."""
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
    auto_tools: Literal["free", "once", "each_once"] = "free"
    """How ``tool_choice="auto"`` (what agents bind by default) is decoded: ``free``: the model answers in text or
    calls, its first token decides (measured: neither shipped model ever starts a call that way); ``once``: as
    ``free``, but a tool called since the last user message may not be called again (its result is in the prompt;
    measured: Qwen2.5-Coder-0.5B repeats its call after the result, and a ``create_agent`` loop never ends);
    ``each_once``: after a user message it must call a tool it has not called since, and answers in text once each
    was called (an agent loop on a model too small to choose: ``create_react_agent`` then runs its tools to a final
    answer)."""
    streaming: bool = False
    """Generate through :meth:`_stream` even on ``invoke`` (callbacks then see each token)."""

    _catalog: dict[str, tuple[SkillSpec, Path]] | None = PrivateAttr(default=None)
    _conversations: Conversations = PrivateAttr()

    @model_validator(mode="after")
    def _check(self) -> ChatKVAgent:
        names = [spec.name for spec in self.declared_fields()]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"fields declared twice: {', '.join(duplicates)}; declare each FieldSpec once")
        if self.eviction is not None:
            self._check_eviction(self.eviction)
        return self

    def declared_fields(self) -> list[FieldSpec]:
        """``fields`` and the ``head`` memory blocks, as fields."""
        return memory.declared_fields(self.fields, self.memory, self.memory_position)

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
        names = ("model", "temperature", "max_tokens", "top_p", "top_k", "seed", "stop", "n_ctx", "n_seq_max",
                 "n_gpu_layers", "policy", "skills", "edit_strategy")
        return {**{n: getattr(self, n) for n in names}, "fields": [f.name for f in self.fields]}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="kvagent", ls_model_name=str(kwargs.get("model") or self.model), ls_model_type="chat",
            ls_temperature=kwargs.get("temperature", self.temperature),
            ls_max_tokens=kwargs.get("max_tokens", self.max_tokens),
        )
        if stop or self.stop:
            params["ls_stop"] = list(stop or self.stop or [])
        return params

    # -- tools and structured output (``langchain_kvagent.structured``) -------------------------------
    def bind_tools(self, tools: Sequence[Any], *, tool_choice: Any = None, parallel_tool_calls: bool | None = None,
                   **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (LangChain tools, functions, pydantic models, OpenAI dicts), checked now; calls are decoded
        under a grammar, so they always parse and match the tools' schemas. ``tool_choice``: ``auto``, ``none``,
        ``any``/``required`` or a tool's name; ``parallel_tool_calls``: several calls in one turn."""
        return structured.bind_tools(self, tools, tool_choice, parallel_tool_calls, **kwargs)

    def with_structured_output(self, schema: Any, *, include_raw: bool = False, **kwargs: Any) -> Runnable[Any, Any]:
        """Replies that follow ``schema`` (pydantic model, JSON schema, TypedDict, OpenAI tool); ``method``:
        ``json_schema`` (default: the reply decoded under the schema), ``function_calling`` or ``json_mode``."""
        return structured.structured_output(self, schema, include_raw=include_raw, **kwargs)

    # -- the session key: LangChain drops config["configurable"] before _generate, so lift it here --------
    def session_key(self, config: RunnableConfig | None = None, session_id: str | None = None) -> str:
        """The session a call with ``config`` uses (see the module docstring for the order)."""
        if session_id is not None:
            return str(session_id)
        configurable = ensure_config(config).get("configurable") or {}
        if configurable.get("session_id") is not None:
            return str(configurable["session_id"])
        if configurable.get("thread_id") is not None:
            return self.conversations.thread_key(str(configurable["thread_id"]))
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
    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        call = self._parse(messages, stop, kwargs)
        with self.conversations.entered(call.key) as entry:
            plan = entry.plan(call.messages, call.max_tokens, call.segments)
            gen, cost = entry.conversation.respond(entry.live, plan, call.options, timeout=self.timeout)
        return chat_result(self.model, gen, cost, call.key, plan.tool_format)

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        call = await asyncio.to_thread(self._parse, messages, stop, kwargs)  # may load the model, compile tools
        async with self.conversations.aentered(call.key) as entry:
            plan = entry.plan(call.messages, call.max_tokens, call.segments)
            gen, cost = await entry.conversation.arespond(AsyncSession(entry.live), plan, call.options,
                                                          timeout=self.timeout)
        return chat_result(self.model, gen, cost, call.key, plan.tool_format)

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        call = self._parse(messages, stop, kwargs)
        deadline = self.conversations.deadline()
        with self.conversations.entered(call.key) as entry:
            plan = entry.plan(call.messages, call.max_tokens, call.segments)
            chunks = Chunks(call.tools is not None, plan.tool_format)
            with entry.conversation.stream(entry.live, plan, call.options) as pieces:
                for piece in pieces:
                    deadline.check()
                    yield from chunks.feed(piece)
            yield from chunks.finish(pieces.result)
            gen, cost = entry.conversation.finish(plan, pieces)
        yield last_chunk(self.model, call, gen, cost)

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        call = await asyncio.to_thread(self._parse, messages, stop, kwargs)
        deadline = self.conversations.deadline()
        async with self.conversations.aentered(call.key) as entry:
            plan = entry.plan(call.messages, call.max_tokens, call.segments)
            chunks = Chunks(call.tools is not None, plan.tool_format)
            async with entry.conversation.astream(AsyncSession(entry.live), plan, call.options) as pieces:
                async for piece in pieces:
                    deadline.check()
                    for chunk in chunks.feed(piece):
                        yield chunk
            for chunk in chunks.finish(pieces.result):
                yield chunk
            gen, cost = entry.conversation.finish(plan, pieces)
        yield last_chunk(self.model, call, gen, cost)

    def _parse(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]) -> Call:
        return parse_call(self, messages, stop, kwargs, self.conversations.toolsets())

    # -- engines and sessions (``langchain_kvagent.conversations``) ---------------------------------
    def model_post_init(self, context: Any) -> None:
        self._conversations = Conversations(self)

    conversations = property(lambda self: self._conversations, doc="This chat model's sessions and the drivers of "
                             "its operations (``langchain_kvagent.conversations``).")

    def load_engine(self) -> Engine:
        """The kvagent :class:`~kvagent.engine.Engine` this chat model runs on (shared; loaded on first use)."""
        return self.conversations.engine()

    def session(self, key: str | None = None) -> Session:
        """The kvagent :class:`~kvagent.session.Session` of session ``key`` (default: this model's default one);
        :class:`UnknownSessionError` when this chat model has not opened it (or closed it to free a sequence)."""
        return self.conversations.session(key)

    def session_ids(self) -> list[str]:
        """Keys of this chat model's open sessions."""
        return self.conversations.ids()

    def messages(self, key: str | None = None) -> list[BaseMessage]:
        """The history session ``key`` holds (its messages and the replies it generated), as LangChain messages."""
        return self.conversations.messages(key)

    def turns(self, key: str | None = None) -> list[Turn]:
        """What each generation on session ``key`` cost, oldest first."""
        return self.conversations.turns(key)

    def last_turn(self, key: str | None = None) -> Turn | None:
        """What the latest generation on session ``key`` cost (None before the first)."""
        return next(reversed(self.turns(key)), None)

    def close_session(self, key: str | None = None, *, retain: bool = True) -> bool:
        """Close session ``key`` and forget its conversation; False if it was not open. Its KV is retained for later
        sessions of the engine (a new session id, a new thread) unless ``retain`` is False (docs/runtime.md, "How
        long KV lives")."""
        return self.conversations.close(key, retain=retain)

    # -- fields, skills, eviction, save and load: one operation each, a sync and an async driver ------
    def field_values(self, session_id: str | None = None) -> dict[str, object]:
        """Current value of each declared field in a session (initial values before its first call)."""
        found = self.conversations.find(session_id)
        return found.field_values() if found is not None else {f.name: f.initial for f in self.declared_fields()}

    def set_fields(self, changes: Mapping[str, object], *, session_id: str | None = None) -> EditReport | None:
        """Change declared fields of a session: one ``set_many`` (``edit_strategy``, auto by default) once it
        holds a conversation; before that the values simply render into its first prompt (returns None)."""
        checked = ops.check_fields(self.declared_fields(), changes)
        return self.conversations.apply(session_id, lambda e: ops.set_fields(e, checked))  # type: ignore

    async def aset_fields(self, changes: Mapping[str, object], *, session_id: str | None = None) -> EditReport | None:
        checked = ops.check_fields(self.declared_fields(), changes)  # refused before the lock is awaited
        return await self.conversations.aapply(session_id, lambda e: ops.set_fields(e, checked))  # type: ignore

    def edit_memory(self, label: str, op: str, *, session_id: str | None = None, **args: str) -> str:
        """Edit memory block ``label`` of a session (``op``: replace / append / rethink, as the memory tools);
        returns what the block holds now. :class:`MemoryEditError` (nothing changed) for a refused edit."""
        return self.conversations.apply(session_id, lambda e: ops.edit_memory(e, label, op, args))  # type: ignore

    async def aedit_memory(self, label: str, op: str, *, session_id: str | None = None, **args: str) -> str:
        return await self.conversations.aapply(session_id, lambda e: ops.edit_memory(e, label, op, args))  # type: ignore

    def memory_tools(self, *, session_id: str | None = None) -> list[BaseTool]:
        """``memory_replace``, ``memory_append``, ``memory_rethink`` as LangChain tools editing session
        ``session_id``'s memory (bind them with the agent's other tools)."""
        ops_of = {"memory_replace": "replace", "memory_append": "append", "memory_rethink": "rethink"}
        return memory.langchain_tools(self.memory, lambda name, a: self.edit_memory(
            str(a.pop("label", "")), ops_of[name], session_id=session_id, **{k: str(v) for k, v in a.items()}))

    def recall_tools(self, pages: Sequence[SkillSpec], *, session_id: str | None = None) -> list[BaseTool]:
        """``memory_recall`` / ``memory_drop`` over ``pages`` (skills of long memory) on session ``session_id``."""
        return memory.recall_tools(pages, lambda spec: self.include_skill(spec, session_id=session_id),
                                   lambda name: self.drop_skill(name, session_id=session_id))

    def skill_catalog(self) -> dict[str, tuple[SkillSpec, Path]]:
        """Skills known by name: those of ``skills`` and ``skill_dirs`` (read once)."""
        if self._catalog is None:
            self._catalog = {spec.name: (spec, path) for spec, path in skill_files([*self.skills, *self.skill_dirs])}
        return self._catalog

    def _include(self, skill: str | Path | SkillSpec) -> Any:
        spec, path = find_skill(self.skill_catalog(), skill)
        return lambda entry: ops.include(entry, spec, lambda: self.conversations.skill_segment(spec, path))

    def include_skill(self, skill: str | Path | SkillSpec, *, session_id: str | None = None) -> bool:
        """Place a skill (a name from ``skills``/``skill_dirs``, a YAML path or a spec) in a session: in the
        prompt's head before its first call, else at its end (transplanted when compiled). False if it is
        already there."""
        return self.conversations.apply(session_id, self._include(skill))  # type: ignore[no-any-return]

    async def ainclude_skill(self, skill: str | Path | SkillSpec, *, session_id: str | None = None) -> bool:
        return await self.conversations.aapply(session_id, self._include(skill))  # type: ignore[no-any-return]

    def drop_skill(self, name: str, *, session_id: str | None = None) -> bool:
        """Take an included skill (a recalled memory page) out of a session's prompt; False if it is not there."""
        return self.conversations.apply(session_id, lambda e: ops.drop(e, name))  # type: ignore[no-any-return]

    def _eviction(self, eviction: Eviction | None) -> Any:
        if eviction is not None:
            self._check_eviction(eviction)
        slot, strategy = self.conversations.slot(), self.edit_strategy
        return lambda e: ops.set_eviction(e, eviction, lambda: slot.open(e, edit_strategy=strategy))

    def set_eviction(self, eviction: Eviction | None, *, session_id: str | None = None) -> None:
        """Give a session another eviction policy (or none): a new session with it takes over the prompt,
        starting from the old one's cached prefix. Refused (nothing changed) when the policy is invalid."""
        self.conversations.apply(session_id, self._eviction(eviction))

    async def aset_eviction(self, eviction: Eviction | None, *, session_id: str | None = None) -> None:
        await self.conversations.aapply(session_id, self._eviction(eviction))

    def save_session(self, path: str | Path, *, session_id: str | None = None) -> int:
        """Write a session (its KV, prompt and history: ``kvagent.sessions.Snapshot``) to ``path``; returns the
        bytes written."""
        return self.conversations.apply(session_id, lambda e: ops.save(e, Path(path)))  # type: ignore[no-any-return]

    async def asave_session(self, path: str | Path, *, session_id: str | None = None) -> int:
        return await self.conversations.aapply(session_id, lambda e: ops.save(e, Path(path)))  # type: ignore

    def load_session(self, path: str | Path, *, session_id: str | None = None) -> None:
        """Restore a session written by :meth:`save_session` (same model; checked before anything changes)."""
        self.conversations.apply(session_id, lambda e: ops.load(e, Path(path)))

    async def aload_session(self, path: str | Path, *, session_id: str | None = None) -> None:
        await self.conversations.aapply(session_id, lambda e: ops.load(e, Path(path)))


__all__ = ["DEFAULT_SESSION", "ChatKVAgent", "to_chat_messages", "to_langchain", "usage_metadata"]
