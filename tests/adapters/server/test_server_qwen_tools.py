"""The tool-trained model behind ``kvagent serve`` (``--model qwen2.5-coder-0.5b --auto-tools once``), driven by the
official ``openai`` client: under ``tool_choice="auto"`` the model's own calls come back as ``tool_calls`` (returned
and streamed), and a tool loop ends in a text answer. The model is optional (``make setup`` installs it): these
skip, naming the command, where it is missing."""

from __future__ import annotations

import json
from typing import Any, Iterator

import pytest

from server_helpers import free_port, process

QWEN = "qwen2.5-coder-0.5b"
POLICY = ("You are the support agent of a shop. Use a tool when you need data; once the tool results answer the "
          "question, reply to the customer in one sentence.")
LOOKUP = {"type": "function", "function": {
    "name": "lookup_order", "description": "Look up an order by its number: its status and its carrier.",
    "parameters": {"type": "object", "properties": {"order_number": {"type": "string", "description": "like A-1042"}},
                   "required": ["order_number"]}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOLS = [LOOKUP, WEATHER]
QUESTION = [{"role": "system", "content": POLICY}, {"role": "user", "content": "Where is my order A-1042?"}]


@pytest.fixture(scope="module")
def oa(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    import sys

    import openai

    from kvagent.errors import ModelNotFoundError
    from kvagent.models import resolve_model

    try:
        resolve_model(QWEN)
    except ModelNotFoundError as exc:
        pytest.skip(f"{exc} (make setup installs it)")
    port = free_port()
    log = tmp_path_factory.mktemp("serve-qwen") / "serve.log"
    args = [sys.executable, "-m", "kvagent.cli", "serve", "--host", "127.0.0.1", "--port", str(port), "--model", QWEN,
            "--n-ctx", "4096", "--n-seq-max", "4", "--auto-tools", "once", "--log-level", "warning"]
    with process(args, f"http://127.0.0.1:{port}/health", log=log):
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)


def test_auto_returns_the_models_own_call_as_tool_calls_returned_and_streamed(oa: Any) -> None:
    """Where llama-server and llama-cpp-python return this model's calls as text (it writes bare JSON), the server
    returns ``tool_calls`` with arguments the tool's schema accepts, the same when streamed."""
    r = oa.chat.completions.create(model=QWEN, messages=QUESTION, tools=TOOLS, max_tokens=64)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    [call] = choice.message.tool_calls
    assert call.function.name == "lookup_order" and json.loads(call.function.arguments) == {"order_number": "A-1042"}
    streamed: dict[str, str] = {"name": "", "arguments": ""}
    finishes = []
    for chunk in oa.chat.completions.create(model=QWEN, messages=QUESTION, tools=TOOLS, max_tokens=64, stream=True):
        for item in chunk.choices[0].delta.tool_calls or []:
            streamed["name"] += item.function.name or ""
            streamed["arguments"] += item.function.arguments or ""
        if chunk.choices[0].finish_reason:
            finishes.append(chunk.choices[0].finish_reason)
    assert finishes == ["tool_calls"]
    assert streamed["name"] == "lookup_order" and json.loads(streamed["arguments"]) == {"order_number": "A-1042"}


RESULTS = {"lookup_order": {"status": "shipped", "carrier": "DHL"}, "get_weather": {"sky": "clear", "celsius": 12}}


@pytest.mark.full  # up to three more requests on a 400-token prompt
def test_a_tool_loop_under_once_ends_in_a_text_answer(oa: Any) -> None:
    """Calls and results until an answer: with ``--auto-tools once`` no tool is called twice for the question, so
    the loop ends in text within one request per tool plus one (free, this model calls the looked-up order again
    after its result); every request after the first reads its prompt from the cache."""
    key, messages, called = "qwen-loop", list(QUESTION), []
    for _ in range(len(TOOLS) + 1):
        r = oa.chat.completions.create(model=QWEN, messages=messages, tools=TOOLS, max_tokens=64,
                                       prompt_cache_key=key)
        message = r.choices[0].message
        if len(messages) > len(QUESTION):
            assert r.usage.prompt_tokens_details.cached_tokens >= 0.8 * r.usage.prompt_tokens, r.usage
        if not message.tool_calls:
            break
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            called.append(call.function.name)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(RESULTS[call.function.name])})
    assert called[0] == "lookup_order" and len(called) == len(set(called)), called
    assert not message.tool_calls and message.content and r.choices[0].finish_reason in ("stop", "length"), r
