"""Tool formats read off the chat templates of the common local agent families, and the prompts kvagent writes
with them, against the templates' own rendering.

The templates are the models' own (``tests.tool_cases.family_template``). Rendering uses a tokenizer of
one token per character, so the prompt's text is compared to the character."""

from __future__ import annotations

from typing import Any

import pytest

from kvagent.chat_format import ChatFormat, compile_template
from kvagent.messages import to_segments
from kvagent.openai_shape import chat_messages
from kvagent.segments import Renderer, Segment
from kvagent.tools import ToolCall
from kvagent.tools.format import ToolFormat, openai_tool
from kvagent.tools.stream import CallSplitter
from kvagent.tools.template import tool_format_of
from tests.tool_cases import TOOLS, family_template

CALLS = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
         {"id": "call_2", "type": "function", "function": {"name": "lookup_order", "arguments": {"order_id": "A-1042"}}}]
RESULTS = [{"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "4 C, rain"},
           {"role": "tool", "tool_call_id": "call_2", "name": "lookup_order", "content": "shipped on 3 Dec"}]


EOS = "</s>"  # the model's EOS text, which Mistral's templates write after each assistant turn


def read(name: str) -> tuple[ChatFormat, ToolFormat | None]:
    source = family_template(name)
    chat = ChatFormat.from_template(source, name, EOS)
    return chat, tool_format_of(source, chat, name)


class Characters:
    """A tokenizer of one token per character: a prompt's tokens spell its text."""

    bos_ids: list[int] = []

    def tokenize(self, text: str, *, special: bool) -> list[int]:
        return [ord(c) for c in text]


# (template, how kvagent reads it: None = its own Hermes-style format, else (where the tools go, how a call holds its
# arguments, calls tagged, several calls per turn, results))
CASES = [
    ("Qwen-Qwen2.5-7B-Instruct", ("system", "arguments", True, True, "user turn")),
    ("Qwen-Qwen3-0.6B", ("system", "arguments", True, True, "user turn")),
    ("meta-llama-Llama-3.1-8B-Instruct", ("user", "parameters", False, False, "own turn, JSON")),
    ("meta-llama-Llama-3.2-3B-Instruct", ("user", "parameters", False, False, "own turn, JSON")),
    ("meta-llama-Llama-3.3-70B-Instruct", ("user", "parameters", False, False, "own turn, JSON")),
    ("unsloth-mistral-Devstral-Small-2507", ("own message", "[ARGS]", True, True, "own turn")),
    ("mistralai-Ministral-3-14B-Reasoning-2512", ("own message", "[ARGS]", True, True, "own turn")),
    # a system message of their own before the caller's, results in a ``tool`` role
    ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use", None),
    ("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use", None),
    # the tools move to the last user message every turn
    ("mistralai-Mistral-Nemo-Instruct-2407", None),
    ("Mistral-Small-3.2-24B-Instruct-2506", None),
]
READ = [name for name, shape in CASES if shape is not None]


@pytest.mark.parametrize("name, shape", CASES)
def test_the_format_read_off_each_family_template(name: str, shape: tuple[Any, ...] | None) -> None:
    _, found = read(name)
    if shape is None:
        assert found is None
        return
    assert found is not None
    results = "user turn" if not found.result_turn else "own turn, JSON" if found.result_json else "own turn"
    where = "user" if found.in_user else "own message" if found.own_message else "system"
    assert (where, found.call_name_close or found.arguments_key, found.tagged, not found.single_call,
            results) == shape


def conversation(parallel: bool) -> list[dict[str, Any]]:
    calls, results = (CALLS, RESULTS) if parallel else (CALLS[:1], RESULTS[:1])
    return [{"role": "system", "content": "You are the support agent of Northwind Outdoor."},
            {"role": "user", "content": "Weather in Oslo, and where is order A-1042?"},
            {"role": "assistant", "content": "", "tool_calls": calls}, *results,
            {"role": "assistant", "content": "It rains in Oslo; A-1042 shipped on 3 Dec."},
            {"role": "user", "content": "Thanks!"}]


def kvagent_text(chat: ChatFormat, found: ToolFormat, messages: list[dict[str, Any]], *,
                 tools: bool = True) -> str:
    segs = to_segments(chat_messages(messages), tool_format=found)
    prompt = [segs[0], *(found.segments(TOOLS) if tools else []), *segs[1:], Segment.reply()]
    return "".join(map(chr, Renderer(Characters(), chat, tools=found).render(prompt).tokens))


@pytest.mark.parametrize("name", READ)
def test_a_conversation_with_tools_is_written_as_the_template_writes_it(name: str) -> None:
    """Tools, a call turn (two calls where the template takes them), the results, an answer and the next user
    message: kvagent's prompt is the template's, to the character."""
    chat, found = read(name)
    assert found is not None
    messages = conversation(parallel=not found.single_call)
    cold = compile_template(family_template(name)).render(messages=messages, tools=[openai_tool(t) for t in TOOLS],
                                                   add_generation_prompt=True, bos_token="", eos_token=EOS)
    assert kvagent_text(chat, found, messages) == cold


@pytest.mark.parametrize("name", READ)
def test_without_tools_the_prompt_is_the_template_s_too(name: str) -> None:
    chat, found = read(name)
    assert found is not None
    messages = [m for m in conversation(parallel=False) if m["role"] != "tool" and not m.get("tool_calls")]
    cold = compile_template(family_template(name)).render(messages=messages, add_generation_prompt=True, bos_token="",
                                                          eos_token=EOS)
    assert kvagent_text(chat, found, messages, tools=False) == cold


def test_a_llama_tool_block_with_no_user_turn_after_it_is_closed() -> None:
    """A prompt that ends with the tools (a warmed prefix) closes the user message they open; the first user turn
    continues it once it comes."""
    chat, found = read("meta-llama-Llama-3.2-3B-Instruct")
    assert found is not None
    renderer = Renderer(Characters(), chat, tools=found)
    warm = "".join(map(chr, renderer.render([Segment.policy("Be brief."), *found.segments(TOOLS)]).tokens))
    turn = "".join(map(chr, renderer.render([Segment.policy("Be brief."), *found.segments(TOOLS), Segment.user("Hi"),
                                             Segment.reply()]).tokens))
    assert warm.endswith("\n\n<|eot_id|>") and turn.startswith(warm.removesuffix("<|eot_id|>"))
    assert turn.endswith("\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    joined = found.attach([Segment.policy("Be brief."), *found.segments(TOOLS), Segment.user("Hi")])
    assert found.attach(joined) == joined  # idempotent


@pytest.mark.parametrize("reply, calls", [
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', [("get_weather", {"city": "Oslo"})]),
    ('<|python_tag|>{"name": "lookup_order", "parameters": {"order_id": "A-7"}}', [("lookup_order", {"order_id": "A-7"})]),
    ('{"name": "get_weather", "arguments": {"city": "Oslo"}}', [("get_weather", {"city": "Oslo"})]),
    ('{"name": "book_flight", "parameters": {"to": "Oslo"}}', []),  # not bound: text
    ('{"city": "Oslo"}', []),  # an ordinary JSON reply
    ("It rains in Oslo.", []),
])
def test_llama_calls_are_read_as_the_model_writes_them(reply: str, calls: list[Any]) -> None:
    _, found = read("meta-llama-Llama-3.2-3B-Instruct")
    assert found is not None and not found.starts_call(reply)
    assert [(c.name, dict(c.arguments)) for c in found.untagged_calls(reply, TOOLS)] == calls


def test_a_streamed_llama_call_is_held_and_given_as_its_call() -> None:
    _, found = read("meta-llama-Llama-3.2-3B-Instruct")
    assert found is not None
    splitter = CallSplitter(found)
    text = "".join(splitter.feed(p)[0] for p in ['{"name": "get_', 'weather", "parameters": {"city": "Oslo"}}'])
    rest, deltas = splitter.finish([ToolCall("get_weather", {"city": "Oslo"}, "call_1")])
    assert (text, rest, [(d.name, d.arguments) for d in deltas]) == ("", "", [("get_weather", '{"city": "Oslo"}')])


@pytest.mark.parametrize("name, turns", [
    ("Qwen-Qwen3-0.6B", ("<|im_start|>user\n", "<|im_end|>\n", "<|im_start|>assistant\n")),  # a think block last
    ("Mistral-Small-3.2-24B-Instruct-2506", ("[INST]", "[/INST]", "")),  # no generation prompt
    ("mistralai-Mistral-Nemo-Instruct-2407", ("[INST]", "[/INST]", "")),  # the system text moves: a user turn
    ("Apertus-8B-Instruct", None),  # wrappers that would not write its turns: refused, not misread
])
def test_chat_turns_read_off_the_families_templates(name: str, turns: tuple[str, str, str] | None) -> None:
    from kvagent.errors import ChatTemplateError

    if turns is None:
        with pytest.raises(ChatTemplateError, match="chat=False|does not write turns"):
            ChatFormat.from_template(family_template(name), name)
        return
    chat = ChatFormat.from_template(family_template(name), name)
    assert (chat.user.open, chat.user.close, chat.generation_prompt) == turns


@pytest.mark.parametrize("reply, calls", [
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}', [("get_weather", {"city": "Oslo"})]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]lookup_order[ARGS]{"order_id": "A-7"}',
     [("get_weather", {"city": "Oslo"}), ("lookup_order", {"order_id": "A-7"})]),
    ('[TOOL_CALLS]lookup_order[ARGS]{"order_id": "A-', []),  # cut short: no call
])
def test_mistral_calls_are_read_as_the_model_writes_them(reply: str, calls: list[Any]) -> None:
    _, found = read("unsloth-mistral-Devstral-Small-2507")
    assert found is not None and found.starts_call(reply)
    got = found.parse_calls(reply, TOOLS, complete=bool(calls))
    assert [(c.name, dict(c.arguments)) for c in got] == calls
    if calls:
        assert found.render_calls(got) == reply


def test_a_mistral_call_naming_an_unbound_tool_is_an_error_naming_it() -> None:
    from kvagent.errors import ToolCallError

    _, found = read("unsloth-mistral-Devstral-Small-2507")
    assert found is not None
    with pytest.raises(ToolCallError, match="book_flight"):
        found.parse_calls('[TOOL_CALLS]book_flight[ARGS]{"to": "Oslo"}', TOOLS)


def test_a_streamed_mistral_call_is_given_as_its_name_and_arguments() -> None:
    _, found = read("unsloth-mistral-Devstral-Small-2507")
    assert found is not None
    splitter = CallSplitter(found)
    pieces = ["[TOOL_CALLS]", "get_wea", "ther[ARGS]", '{"city": ', '"Oslo"}', "[TOOL_CALLS]lookup_order[ARGS]",
              '{"order_id": "A-7"}']
    deltas = [d for p in pieces for d in splitter.feed(p)[1]] + splitter.finish()[1]
    names = [d.name for d in deltas if d.name is not None]
    args = ["".join(d.arguments for d in deltas if d.index == i) for i in range(2)]
    assert (names, args) == (["get_weather", "lookup_order"], ['{"city": "Oslo"}', '{"order_id": "A-7"}'])
