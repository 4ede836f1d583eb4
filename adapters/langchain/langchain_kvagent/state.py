"""KVAgentStateRunnable: a chain's or graph's state dict in, the chat model's reply out, errata for free.

Each call reads the state: the chat model's declared fields whose values changed since the last call on
that session become one ``set_many`` (an erratum line by default: the cached prompt stays valid), the
``skills`` key's skills are included (transplanted when compiled), then the messages go to the chat model
on the same session (``session_id`` keyword, else ``configurable.session_id``, else ``thread_id``). A
LangGraph app gets errata without writing any:

    graph = StateGraph(SupportState)            # messages: Annotated[list, add_messages]; order_status: str
    graph.add_node("agent", KVAgentStateRunnable(model))
    app.invoke({"messages": [("user", "Where is my tent?")], "order_status": "shipped"},
               {"configurable": {"thread_id": "alice"}})
"""

from __future__ import annotations

from typing import Any, Literal, Mapping, Sequence

from langchain_core.callbacks import AsyncCallbackManagerForChainRun, CallbackManagerForChainRun
from langchain_core.messages import AIMessage
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.runnables.config import patch_config

from langchain_kvagent.chat_models import ChatKVAgent
from langchain_kvagent.operations import undeclared


class KVAgentStateRunnable(Runnable[Mapping[str, Any], Any]):
    """Runs a :class:`ChatKVAgent` on a state dict.

    ``messages_key``: the state key holding the conversation; ``skills_key``: the key holding skills to
    include (names from the chat model's ``skills``/``skill_dirs``, or YAML paths); ``fields``: the state
    keys read as fields (default: every field the chat model declares, its head memory blocks included; a name it
    does not declare is refused here, with the fix); its tail memory blocks are read by label too; ``output``: ``"update"`` returns ``{messages_key: [reply]}`` (a LangGraph
    node's update), ``"message"`` the reply itself (an LCEL chain's last step).
    """

    def __init__(self, model: ChatKVAgent, *, messages_key: str = "messages", skills_key: str = "skills",
                 fields: Sequence[str] | None = None, output: Literal["update", "message"] = "update") -> None:
        declared = [spec.name for spec in model.declared_fields()]  # head memory blocks too
        if fields is not None:
            undeclared(fields, declared)
        if output not in ("update", "message"):
            raise ValueError(f"output must be 'update' or 'message', got {output!r}")
        self.model, self.messages_key, self.skills_key, self.output = model, messages_key, skills_key, output
        self.fields = tuple(fields if fields is not None else declared)

    def _changes(self, state: Mapping[str, Any]) -> dict[str, object]:
        return {name: state[name] for name in self.fields if name in state and state[name] is not None}

    def _tail(self, state: Mapping[str, Any]) -> dict[str, str]:
        """Tail memory blocks the state holds (a changed one is rewritten: ``memory_rethink``)."""
        if self.model.memory_position != "tail":
            return {}
        return {b.label: str(state[b.label]) for b in self.model.memory if state.get(b.label) is not None}

    def _messages(self, state: Mapping[str, Any]) -> Any:
        if self.messages_key not in state:
            raise KeyError(f"the state has no {self.messages_key!r} key (keys: {', '.join(map(str, state))}): pass "
                           f"the conversation there, or construct KVAgentStateRunnable(model, messages_key=...)")
        return state[self.messages_key]

    def _skills(self, state: Mapping[str, Any]) -> list[Any]:
        skills = state.get(self.skills_key) or []
        return [skills] if isinstance(skills, str) else list(skills)

    def _wrap(self, reply: AIMessage) -> Any:
        return reply if self.output == "message" else {self.messages_key: [reply]}

    def invoke(self, input: Mapping[str, Any], config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        return self._call_with_config(self._run, input, config, **kwargs)

    async def ainvoke(self, input: Mapping[str, Any], config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        return await self._acall_with_config(self._arun, input, config, **kwargs)

    def _run(self, state: Mapping[str, Any], run_manager: CallbackManagerForChainRun, config: RunnableConfig,
             **kwargs: Any) -> Any:
        key = self.model.session_key(config, kwargs.pop("session_id", None))
        messages = self._messages(state)
        changes = self._changes(state)
        if changes:
            self.model.set_fields(changes, session_id=key)
        for label, value in self._tail(state).items():
            self.model.edit_memory(label, "rethink", session_id=key, new_value=value)
        for skill in self._skills(state):
            self.model.include_skill(skill, session_id=key)
        child = patch_config(config, callbacks=run_manager.get_child())
        return self._wrap(self.model.invoke(messages, child, session_id=key, **kwargs))

    async def _arun(self, state: Mapping[str, Any], run_manager: AsyncCallbackManagerForChainRun,
                    config: RunnableConfig, **kwargs: Any) -> Any:
        key = self.model.session_key(config, kwargs.pop("session_id", None))
        messages = self._messages(state)
        changes = self._changes(state)
        if changes:
            await self.model.aset_fields(changes, session_id=key)
        for label, value in self._tail(state).items():
            await self.model.aedit_memory(label, "rethink", session_id=key, new_value=value)
        for skill in self._skills(state):
            await self.model.ainclude_skill(skill, session_id=key)
        child = patch_config(config, callbacks=run_manager.get_child())
        return self._wrap(await self.model.ainvoke(messages, child, session_id=key, **kwargs))


__all__ = ["KVAgentStateRunnable"]
