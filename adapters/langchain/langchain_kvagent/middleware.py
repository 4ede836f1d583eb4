"""``KVCacheMiddleware``: a LangChain v1 agent (``create_agent``) whose local model keeps its KV cache per thread.

The agent's prompt changes between model calls: a dynamic system prompt (a clock, a profile), tool results cleared by
``ContextEditingMiddleware``, old turns replaced by ``SummarizationMiddleware``'s summary, a tool subset chosen by
``LLMToolSelectorMiddleware``. ``ChatKVAgent`` already turns a resent prompt that changed inside into edits of the
cached one (``kvagent.kv.rebase``: a replaced span decoded in place, a deleted span's cells removed, the cells after
moved). The middleware adds what only the agent knows:

- **the thread**: each LangGraph thread (``config["configurable"]["thread_id"]``) is one kvagent session, keyed by the
  middleware; calls a side middleware makes with the same chat model on that thread's config (a tool selector's, a
  summarizer's) go to a session of their own (``f"{thread}#side"``), so they never replace the agent's prompt;
- **the tools**: the prompt describes every tool the agent has (the first request's, which is the agent's whole set
  when this middleware is outermost, plus any seen later, plus ``tools`` given here), and a call's subset only holds
  the grammar to the tools it may call; a changed subset leaves the prompt, and its cache, as they were;
- **state fields**: declared agent-state keys map to the chat model's declared fields (``FieldSpec``); a changed
  value is an edit with the chat model's ``edit_strategy`` (``auto``) instead of a rewritten system prompt;
- **the run's ends**: ``before_agent`` loads the model, restores the thread's snapshot from a
  :class:`~langchain_kvagent.checkpoint.KVCheckpointer` when the session is not open (a restarted process, another
  worker, a time-travelled thread) and compiles the tools; ``after_agent`` parks the session: its signed snapshot
  goes to the checkpointer with the run's last checkpoint;
- **what each call cost**: :meth:`KVCacheMiddleware.calls` per thread, and a custom callback event
  ``kvagent_model_call`` (``on_custom_event``) with the tokens reused, computed and transplanted.

Order: put it first in ``middleware=[...]`` (outermost), so it sees the agent's whole tool set before a selector
narrows it; the other middlewares' rewrites reach the model after it either way.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping, NotRequired, Sequence, TypedDict

from cachetools import FIFOCache
from langchain.agents.middleware import AgentMiddleware, ModelRequest
from langchain_core.callbacks import adispatch_custom_event, dispatch_custom_event
from langchain_core.messages import AIMessage
from langchain_core.runnables import ensure_config
from langchain_core.utils.function_calling import convert_to_openai_tool

from kvagent.errors import KVAgentError

from langchain_kvagent import operations as ops
from langchain_kvagent.chat_models import ChatKVAgent
from langchain_kvagent.convert import DEFAULT_SESSION
from langchain_kvagent.errors import UndeclaredFieldError

if TYPE_CHECKING:
    from langchain_kvagent.checkpoint import KVCheckpointer

log = logging.getLogger(__name__)
EVENT = "kvagent_model_call"
CALLS_KEPT = 256
THREADS_KEPT = 1024


class NotKVAgentModelError(KVAgentError, TypeError):
    """The agent's model is not a ``ChatKVAgent`` (or not the one the middleware was built for)."""


@dataclass(frozen=True)
class ModelCall:
    """What one model call of an agent cost: ``reused + computed + transplanted == input_tokens``; ``edits``: the
    kinds of the implicit edits the call made (``replace``, ``delete``, ``insert``, ``fallback``)."""

    thread: str
    input_tokens: int
    reused: int
    computed: int
    transplanted: int
    output_tokens: int
    ttft_s: float
    edits: tuple[str, ...]
    restored: bool = False


def _reply(response: Any) -> AIMessage | None:
    """The AI message of a model call's response (``ModelResponse``, an ``AIMessage``, an extended response)."""
    if isinstance(response, AIMessage):
        return response
    inner = getattr(response, "model_response", None)
    if inner is not None:
        return _reply(inner)
    return next((m for m in reversed(getattr(response, "result", None) or []) if isinstance(m, AIMessage)), None)


def _state_schema(keys: Sequence[str]) -> type:
    """The agent state with ``keys`` (any value, optional) added, so an invoke's input keeps them."""
    return TypedDict("KVCacheState", {k: NotRequired[Any] for k in keys})  # type: ignore[operator]


class KVCacheMiddleware(AgentMiddleware):
    """Keeps a ``ChatKVAgent``'s KV cache per LangGraph thread across an agent's model calls (see the module).

    ``model``: the agent's chat model; optional (learnt from the first call), needed for ``before_agent`` to load,
    restore and compile before the first call. ``state_fields``: agent-state keys that are the chat model's declared
    fields (a list: the same names; a mapping: state key -> field name). ``tools``: tools the prompt describes besides
    those the agent binds (e.g. when this middleware cannot be outermost). ``checkpointer``: the
    :class:`~langchain_kvagent.checkpoint.KVCheckpointer` the agent is compiled with, to restore and park snapshots.
    """

    def __init__(self, model: ChatKVAgent | None = None, *, state_fields: Mapping[str, str] | Sequence[str] = (),
                 tools: Sequence[Any] = (), checkpointer: KVCheckpointer | None = None) -> None:
        super().__init__()
        if model is not None and not isinstance(model, ChatKVAgent):
            raise NotKVAgentModelError(f"KVCacheMiddleware keeps a ChatKVAgent's cache, got {type(model).__name__}: "
                                       "pass the agent's ChatKVAgent (or no model)")
        self.model = model
        self.fields = dict(state_fields) if isinstance(state_fields, Mapping) else {k: k for k in state_fields}
        if model is not None:
            self._check_fields(model)
        if self.fields:
            self.state_schema = _state_schema(list(self.fields))  # type: ignore[assignment]
        self.checkpointer = checkpointer
        self._universe: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._add_tools(tools)
        # the threads called last; a read (calls()) changes nothing, and they iterate least recently called first
        self._calls: FIFOCache[str, deque[ModelCall]] = FIFOCache(maxsize=THREADS_KEPT)
        self._calls_lock = threading.Lock()  # sync calls of several threads may run at once (a batch, parallel nodes)
        self._restored: set[str] = set()

    # -- the model and the thread -------------------------------------------------------------------
    def _check_fields(self, model: ChatKVAgent) -> None:
        declared = {spec.name for spec in model.declared_fields()}
        missing = sorted(set(self.fields.values()) - declared)
        if missing:
            raise UndeclaredFieldError(
                f"state_fields name {', '.join(missing)}, which the ChatKVAgent does not declare (its fields: "
                f"{', '.join(sorted(declared)) or 'none'}): declare them, ChatKVAgent(fields=[FieldSpec(...)])")

    def _model_of(self, request: ModelRequest) -> ChatKVAgent:
        model = request.model
        if not isinstance(model, ChatKVAgent):
            raise NotKVAgentModelError(
                f"KVCacheMiddleware keeps a ChatKVAgent's KV cache, and this agent's model is {type(model).__name__}: "
                "create_agent(ChatKVAgent(model=...), ...), or remove the middleware")
        if self.model is None:
            self._check_fields(model)
            self.model = model
        elif model is not self.model:
            raise NotKVAgentModelError(
                "this KVCacheMiddleware was built for another ChatKVAgent than the one the agent calls (a fallback "
                "or router middleware swapped it?): give each model its own agent, or build the middleware with the "
                "agent's model")
        return model

    @staticmethod
    def thread() -> str:
        """The running thread's id (LangGraph's ``thread_id``; none: the chat model's default session)."""
        configurable = ensure_config().get("configurable") or {}
        thread = configurable.get("thread_id")
        return DEFAULT_SESSION if thread is None else str(thread)

    def calls(self, thread: str | None = None) -> list[ModelCall]:
        """What each model call of ``thread`` (default: every thread) cost, oldest first (the last 256 calls of each of
        the 1,024 threads called last)."""
        with self._calls_lock:
            if thread is not None:
                return list(self._calls.get(str(thread), ()))
            return [c for kept in self._calls.values() for c in kept]

    # -- tools ----------------------------------------------------------------------------------------
    def _add_tools(self, tools: Sequence[Any]) -> list[dict[str, Any]] | None:
        """Add ``tools`` to the ones the prompt describes; None when one cannot be written as a function (a
        provider's built-in tool): the call then goes as the agent built it."""
        converted = []
        for tool in tools:
            try:
                converted.append(convert_to_openai_tool(tool))
            except (ValueError, TypeError, KeyError):
                return None
        for tool in converted:
            self._universe[tool["function"]["name"]] = tool
        return list(self._universe.values())

    def _settings(self, request: ModelRequest, key: str) -> dict[str, Any]:
        settings = {**request.model_settings, "session_id": key}
        universe = self._add_tools(request.tools)
        if universe:
            settings["tool_universe"] = universe
        return settings

    # -- before and after a call ----------------------------------------------------------------------
    def _prepare(self, request: ModelRequest) -> tuple[ChatKVAgent, str, dict[str, object]]:
        model = self._model_of(request)
        key = self.thread()
        model.conversations.claim(key)
        self._restore(model, key)
        values = {field: request.state[k] for k, field in self.fields.items() if k in request.state}
        held = model.field_values(session_id=key)
        return model, key, {f: v for f, v in values.items() if held.get(f) != v}

    def _record(self, key: str, response: Any) -> dict[str, Any] | None:
        reply = _reply(response)
        meta = reply.response_metadata if reply is not None else {}
        usage = (reply.usage_metadata or {}) if reply is not None else {}
        if "computed" not in meta:
            return None
        call = ModelCall(key, int(usage.get("input_tokens", 0)), int(meta["reused"]), int(meta["computed"]),
                         int(meta["transplanted"]), int(usage.get("output_tokens", 0)), float(meta.get("ttft_s", 0)),
                         tuple(str(e.get("kind")) for e in meta.get("edits", [])), key in self._restored)
        self._restored.discard(key)
        with self._calls_lock:
            kept = self._calls.pop(key, None)
            if kept is None:
                kept = deque(maxlen=CALLS_KEPT)
            kept.append(call)
            self._calls[key] = kept  # inserted afresh, so the newest: the cache drops in insertion order
        return asdict(call)

    def wrap_model_call(self, request: ModelRequest, handler: Callable[[ModelRequest], Any]) -> Any:
        model, key, changes = self._prepare(request)
        if changes:
            model.set_fields(changes, session_id=key)
        response = handler(request.override(model_settings=self._settings(request, key)))
        event = self._record(key, response)
        if event is not None:
            try:
                dispatch_custom_event(EVENT, event)
            except RuntimeError:  # no callback run to attach it to (a call outside a graph)
                pass
        return response

    async def awrap_model_call(self, request: ModelRequest, handler: Callable[[ModelRequest], Awaitable[Any]]) -> Any:
        model, key, changes = await asyncio.to_thread(self._prepare, request)
        if changes:
            await model.aset_fields(changes, session_id=key)
        response = await handler(request.override(model_settings=self._settings(request, key)))
        event = self._record(key, response)
        if event is not None:
            try:
                await adispatch_custom_event(EVENT, event)
            except RuntimeError:
                pass
        return response

    # -- the run's ends -------------------------------------------------------------------------------
    def _restore(self, model: ChatKVAgent, key: str) -> None:
        """Restore the thread's snapshot from the checkpointer when its session is not open (checked before
        anything changes)."""
        found = model.conversations.find(key)
        if self.checkpointer is None or (found is not None and found.active):
            return
        snapshot = self.checkpointer.snapshot(key, model)
        if snapshot is not None:
            model.conversations.apply(key, lambda e: ops.restore(e, snapshot))
            self._restored.add(key)
            log.info("thread %s: restored its session (%d messages) from the checkpointer", key,
                     len(snapshot.messages))

    def _warm(self) -> None:
        model = self.model
        if model is None:
            return
        key = self.thread()
        model.conversations.claim(key)
        self._restore(model, key)
        model.conversations.apply(key, ops.opened)  # the session opens: its prologue is prefilled
        if self._universe:
            model.conversations.toolsets().get(list(self._universe.values()))

    def before_agent(self, state: Any, runtime: Any) -> dict[str, Any] | None:
        self._warm()
        return None

    async def abefore_agent(self, state: Any, runtime: Any) -> dict[str, Any] | None:
        await asyncio.to_thread(self._warm)
        return None

    def _park(self) -> None:
        model, checkpointer = self.model, self.checkpointer
        if model is None or checkpointer is None:
            return
        key = self.thread()
        found = model.conversations.find(key)
        if found is None or not found.active or not found.conversation.messages:
            return
        snapshot = model.conversations.apply(key, lambda e: ops.snapshot(e, checkpointer.meta(model)))
        checkpointer.park(key, snapshot)

    def after_agent(self, state: Any, runtime: Any) -> dict[str, Any] | None:
        self._park()
        return None

    async def aafter_agent(self, state: Any, runtime: Any) -> dict[str, Any] | None:
        await asyncio.to_thread(self._park)
        return None


__all__ = ["EVENT", "KVCacheMiddleware", "ModelCall", "NotKVAgentModelError"]
