"""LangChain's standard test suites (``langchain-tests``, pinned) on the default model, SmolLM2-135M.

Capability flags say what is true of the chat model on a 135M text model: tool calling, tool choice, structured
output and JSON mode (all decoded under a grammar); no images, no per-call model override; usage metadata, with
cache-read details.
"""

from __future__ import annotations

from typing import Any

from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, SystemMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from langchain_kvagent import ChatKVAgent

from lc_helpers import SETTINGS

# 80 tokens: a tool call fits, one with a Chinese name too (byte-level tokens; a call cut by max_tokens is no
# call). auto_tools each_once: what a 135M model needs to call tools under tool_choice auto (see ChatKVAgent).
PARAMS = {**SETTINGS, "max_tokens": 80, "auto_tools": "each_once"}


class _Flags:
    @property
    def chat_model_class(self) -> type[ChatKVAgent]:
        return ChatKVAgent

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supports_image_inputs(self) -> bool:
        return False

    @property
    def supports_model_override(self) -> bool:
        return False

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self) -> dict[str, list[str]]:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}


class TestChatKVAgentUnit(_Flags, ChatModelUnitTests):
    @property
    def chat_model_params(self) -> dict[str, Any]:
        return dict(SETTINGS)  # the suite adds max_tokens itself


class TestChatKVAgentIntegration(_Flags, ChatModelIntegrationTests):
    @property
    def chat_model_params(self) -> dict[str, Any]:
        return dict(PARAMS)

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        """A follow-up on one session: its first turn comes from the cache."""
        model = ChatKVAgent(**PARAMS)
        history = [SystemMessage("You are a terse assistant of Northwind Outdoor."), HumanMessage("Hello")]
        history += [model.invoke(history), HumanMessage("And what do you sell?")]
        if not stream:
            return model.invoke(history)
        full: AIMessageChunk | None = None
        for chunk in model.stream(history):
            full = chunk if full is None else full + chunk
        assert full is not None
        return full  # type: ignore[return-value]
