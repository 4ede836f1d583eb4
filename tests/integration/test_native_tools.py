"""The model's own tool format, on the tool-trained Qwen2.5-Coder-0.5B-Instruct (``qwen2.5-coder-0.5b``): the format
read off the chat template in its GGUF, prompts rendered as that template renders them, calls under a grammar that
takes ``<tool_call>`` (one special token) as a token, bare-JSON calls, and transplanted tools re-rotated by kvagent.

The lean subset in the fast tier; the model is optional (``make setup`` installs it), so these skip, naming the
command, where it is missing."""

from __future__ import annotations

import json
from typing import Any, Iterator

import pytest

from kvagent import Engine, Segment
from kvagent.chat_format import compile_template
from kvagent.errors import ModelNotFoundError
from kvagent.messages import ChatMessage, to_segments
from kvagent.skills.fidelity import logit_cosine
from kvagent.tools import ToolCall, ToolSet
from kvagent.tools.format import HERMES, ToolFormat, attach, format_of, openai_tool
from kvagent.tools.stream import CallSplitter
from tests.tool_cases import TOOLS, family_template

QWEN = "qwen2.5-coder-0.5b"
POLICY = "You are the support agent of Northwind Outdoor. Be brief."


@pytest.fixture(scope="module")
def qwen() -> Iterator[Engine]:
    try:
        eng = Engine.load(QWEN, n_ctx=2048, n_seq_max=4)
    except ModelNotFoundError as exc:
        pytest.skip(f"{exc} (make setup installs it)")
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def qwen_format(qwen: Engine) -> ToolFormat:
    found = format_of(qwen.renderer(True))
    assert found is not HERMES
    return found


def template_text(engine: Engine, messages: list[dict[str, Any]], tools: ToolSet, gen: bool) -> str:
    """The GGUF's own template rendering of ``messages`` with ``tools`` (as transformers and llama.cpp render it)."""
    return str(compile_template(engine.backend.chat_template).render(
        messages=messages, tools=[openai_tool(t) for t in tools], add_generation_prompt=gen, bos_token="",
        eos_token=""))


CONVERSATION = [
    {"role": "system", "content": POLICY},
    {"role": "user", "content": "Weather in Oslo, and where is order A-1042?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
        {"id": "call_2", "type": "function", "function": {"name": "lookup_order", "arguments": {"order_id": "A-1042"}}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "4 C, rain"},
    {"role": "tool", "tool_call_id": "call_2", "name": "lookup_order", "content": "shipped on 3 Dec"},
    {"role": "assistant", "content": "It rains in Oslo (4 C); A-1042 shipped on 3 Dec."},
    {"role": "user", "content": "Thanks!"},
]


def as_chat(messages: list[dict[str, Any]]) -> list[ChatMessage]:
    out = []
    for m in messages:
        calls = tuple(ToolCall(c["function"]["name"], c["function"]["arguments"], c["id"]) for c in m.get("tool_calls", ()))
        out.append(ChatMessage(m["role"], m["content"], name=m.get("name"), tool_calls=calls,
                               tool_call_id=m.get("tool_call_id")))
    return out


def test_a_conversation_with_tools_renders_as_the_template_renders_it(qwen: Engine) -> None:
    """Tools, parallel calls, two results and a reply: the prompt's text is the template's, to the character, and
    its tokens differ only where the system text meets the tool block (kvagent tokenizes each segment on its own:
    the template's ``.\\n\\n`` is one token, kvagent's two)."""
    renderer = qwen.renderer(True)
    chat = to_segments(as_chat(CONVERSATION), tool_format=format_of(renderer))
    segments = attach(renderer, [chat[0], *qwen.tool_segments(TOOLS), *chat[1:], Segment.reply()])
    ours = renderer.render(segments).tokens
    cold_text = template_text(qwen, CONVERSATION, TOOLS, gen=True)
    assert b"".join(qwen.backend.token_bytes(t) for t in ours).decode() == cold_text.replace("<|im_start|>", "").replace(
        "<|im_end|>", "")  # control tokens render as nothing
    cold = qwen.backend.tokenize(cold_text, special=True)
    at = next(i for i, (a, b) in enumerate(zip(ours, cold)) if a != b)
    assert ours[at + 2:] == tuple(cold[at + 1:])  # one cold token is two of ours, nothing else differs
    assert [qwen.backend.token_bytes(t) for t in ours[at: at + 2]] == [b".", b"\n\n"]
    assert qwen.backend.token_bytes(cold[at]) == b".\n\n"


def test_tool_segments_are_the_tokens_of_a_cold_render(qwen: Engine) -> None:
    """Each tool's segment (compiled once, transplanted) holds exactly the tokens a cold render has at its place."""
    renderer = qwen.renderer(True)
    segments = attach(renderer, [Segment.policy(POLICY), *qwen.tool_segments(TOOLS), Segment.user("Hi"), Segment.reply()])
    rendered = renderer.render(segments)
    cold = qwen.backend.tokenize(template_text(qwen, [{"role": "system", "content": POLICY},
                                                      {"role": "user", "content": "Hi"}], TOOLS, gen=True), special=True)
    shift = len(cold) - len(rendered.tokens)  # the system text's boundary (one token)
    checked = 0
    for span in rendered.spans:
        if span.segment_id.startswith("tool-") or span.segment_id in ("tools", "tools-end"):
            first = span.first + (span.segment_id == "tools")  # the instructions' "\n\n" is the boundary's token
            assert rendered.tokens[first: span.last + 1] == tuple(cold[first + shift: span.last + 1 + shift])
            checked += 1
    assert checked == len(TOOLS) + 2 and shift == -1


def test_without_a_system_message_the_template_default_opens_the_tool_block(qwen: Engine) -> None:
    renderer = qwen.renderer(True)
    segments = attach(renderer, [*qwen.tool_segments(TOOLS), Segment.user("Hi"), Segment.reply()])
    text = b"".join(qwen.backend.token_bytes(t) for t in renderer.render(segments).tokens).decode()
    cold = template_text(qwen, [{"role": "user", "content": "Hi"}], TOOLS, gen=True)
    assert text == cold.replace("<|im_start|>", "").replace("<|im_end|>", "")
    assert attach(renderer, segments) == segments  # idempotent


@pytest.mark.parametrize("choice, question, name", [
    ("required", "What's the weather in Paris?", "get_weather"),
    ({"type": "function", "function": {"name": "lookup_order"}}, "Where is my order A-1042?", "lookup_order"),
])
def test_required_and_named_calls_are_valid_with_the_special_token(qwen: Engine, choice: Any, question: str,
                                                                     name: str) -> None:
    """The model writes ``<tool_call>`` as its special token (id 151657) and the grammar takes it: a valid call,
    in the template's own text, streamed as it is returned."""
    segments = [Segment.policy(POLICY), *qwen.tool_segments(TOOLS), Segment.user(question)]
    with qwen.session(segments, share_prefix=False) as s:
        gen = s.generate(48, tools=TOOLS, tool_choice=choice)
        assert qwen.backend.tokenize("<tool_call>", special=False)[0] in gen.token_ids
        assert [c.name for c in gen.tool_calls] == [name] and gen.finish_reason == "tool_calls"
        assert gen.text == format_of(qwen.renderer(True)).render_calls(gen.tool_calls)
    with qwen.session(segments, share_prefix=False) as s:
        splitter = CallSplitter(format_of(qwen.renderer(True)))
        stream = s.stream(48, tools=TOOLS, tool_choice=choice)
        deltas = [d for piece in stream for d in splitter.feed(piece)[1]] + splitter.finish()[1]
        assert deltas[0].name == name
        assert json.loads("".join(d.arguments for d in deltas)) == dict(stream.result.tool_calls[0].arguments)


def test_auto_reads_the_bare_json_call_this_model_writes(qwen: Engine) -> None:
    """Under ``auto`` Qwen2.5-Coder answers with a fenced bare-JSON call: read as the call it is; small talk stays
    text."""
    rows = []
    for question in ("What's the weather in Paris?", "Hi! How are you today?"):
        with qwen.session([Segment.policy(POLICY), *qwen.tool_segments(TOOLS), Segment.user(question)],
                          share_prefix=False) as s:
            gen = s.generate(64, tools=TOOLS, tool_choice="auto")
            rows.append([(c.name, dict(c.arguments)) for c in gen.tool_calls])
    assert rows == [[("get_weather", {"city": "Paris"})], []]


@pytest.mark.full  # 10 s: compiles the tools; the fast tier keeps the format and call checks
def test_tools_are_prefilled_and_a_transplant_of_them_is_re_rotated(qwen: Engine, tmp_path: Any) -> None:
    """The template format's tools are prefilled where they stand (transplanted, they broke this model's tool choice:
    ``kvagent.tools.template``). Transplanted anyway, as SKILL segments, qwen2 keys are re-rotated by kvagent (NEOX
    mode, not ``seq_add``): the next-token logits against a cold prefill of the same prompt."""
    from dataclasses import replace

    from kvagent.segments import SegmentKind
    from kvagent.skills.store import SkillStore

    tools = qwen.tool_segments(TOOLS)
    assert {s.kind for s in tools} == {SegmentKind.MEMORY}
    question = Segment.user("Where is my order A-1042?")
    with qwen.session([Segment.policy(POLICY), *tools, question], share_prefix=False) as s:
        assert s.prefill().transplanted == 0
        cold = s.logits()
    assert qwen.backend.rope_layout() is not None
    saved = qwen.skills
    qwen.skills = qwen.skill_library(SkillStore(tmp_path / "skills"))
    try:
        skills = [replace(t, kind=SegmentKind.SKILL) for t in tools]
        for segment in skills:
            qwen.skills.compile_segment(segment, qwen.renderer(True))
        with qwen.session([Segment.policy(POLICY), *skills, question], share_prefix=False) as s:
            assert s.prefill().transplanted > 100
            ours = s.logits()
    finally:
        qwen.skills = saved
    print(f"\n[{QWEN}] transplanted tools vs prefilled: shift-invariant logit cosine {logit_cosine(ours, cold):.4f}")
    assert logit_cosine(ours, cold) >= 0.95


@pytest.mark.parametrize("reply, accepted", [
    ("Hello! How can I help?", True),
    ('{"name": "get_weather", "arguments": {"city": "Oslo"}}', True),
    ('```json\n{\n  "name": "lookup_order",\n  "arguments": {\n    "order_id": "A-1"\n  }\n}\n```\n', True),
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', True),  # the other key this model writes
    ('{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}', False),  # a near miss: decoded as the call
    ('{"name": "get_weather", "arguments": {}}', False),  # a required argument missing
    ('```json\n{"name": "lookup_order", "arguments": {"order_id": "A-1"}}', False),  # a fence opened and not closed
    ('{"name": "tell_joke", "arguments": {"joke": "..."}}', True),  # a made-up tool stays text
    ('{"name": "get_weather_now", "arguments": {}}', True),  # a bound name's prefix is another name
    ('{"answer": 42}', True),  # an ordinary JSON reply
    ("```python\nprint({'name': 1})\n```", True),
    ('Sure: {"name": "get_weather", "arguments": {"city": "Oslo"}}', True),  # prose first: text, read as none
])
def test_auto_holds_a_reply_that_opens_a_bound_bare_call_to_a_valid_one(qwen: Engine, qwen_format: ToolFormat,
                                                                       reply: str, accepted: bool) -> None:
    """Under ``auto`` a reply that opens a JSON object naming a bound tool (bare or fenced) must be that call with
    valid arguments; anything else may be text."""
    from kvagent.tools.choice import ToolChoice, turn_grammar
    from kvagent.tools.grammar import accepts

    grammar = turn_grammar(TOOLS, ToolChoice("auto"), None, qwen_format, qwen.backend)
    assert accepts(qwen.backend, grammar, reply) is accepted


@pytest.mark.parametrize("reply, accepted", [
    ("Your order A-1042 shipped on 3 Dec.", True),
    ('{"name": "get_weather", "arguments": {"city": "Oslo"}}', True),  # a tool not called yet
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', True),
    ('{"name": "lookup_order", "arguments": {"order_id": "A-1042"}}', False),  # the call just answered
    ('<tool_call>\n{"name": "lookup_order", "arguments": {"order_id": "A-1042"}}\n</tool_call>', False),
    ('```json\n```json\n{"name}: lookup_order", "arguments": {}}\n```', False),  # what the model tried instead
    ('{"status": "shipped"}', False),
])
def test_once_a_tool_is_spent_the_reply_neither_calls_it_nor_writes_a_call_as_text(
        qwen: Engine, qwen_format: ToolFormat, reply: str, accepted: bool) -> None:
    """``ToolChoice(spent=...)`` (``auto_tools="once"``): after its result, the tool may not be called again, and
    the text holds no JSON object (this model otherwise writes the call again as text)."""
    from kvagent.tools.choice import ToolChoice, turn_grammar
    from kvagent.tools.grammar import accepts

    choice = ToolChoice("auto", spent=frozenset({"lookup_order"}))
    grammar = turn_grammar(TOOLS, choice, None, qwen_format, qwen.backend)
    assert accepts(qwen.backend, grammar, reply) is accepted


def llama_format() -> ToolFormat:
    """The format read off Llama-3.2's own template (``tests/unit/test_template_formats.py`` reads the families')."""
    from kvagent.chat_format import ChatFormat
    from kvagent.tools.template import tool_format_of

    source = family_template("meta-llama-Llama-3.2-3B-Instruct")
    found = tool_format_of(source, ChatFormat.from_template(source), "llama-3.2")
    assert found is not None and not found.tagged
    return found


@pytest.mark.parametrize("choice, reply, accepted", [
    ("required", '{"name": "get_weather", "parameters": {"city": "Oslo"}}', True),
    ("required", '{"name": "get_weather", "arguments": {"city": "Oslo"}}', False),  # the template's key only
    ("required", '{"name": "get_weather", "parameters": {"city": "Oslo"}} {"name": "get_weather", '
                 '"parameters": {"city": "Rome"}}', False),  # one call per turn, as the template takes
    ("required", "It rains.", False),
    ("lookup_order", '{"name": "lookup_order", "parameters": {"order_id": "A-1"}}', True),
    ("lookup_order", '{"name": "get_weather", "parameters": {"city": "Oslo"}}', False),
    ("auto", '{"name": "get_weather", "parameters": {"city": "Oslo"}}', True),
    ("auto", "It rains in Oslo.", True),
    ("auto", '{"name": "get_weather", "parameters": {}}', False),  # a bound call must be valid
    ("none", '{"name": "get_weather", "parameters": {"city": "Oslo"}}', False),
])
def test_a_format_of_bare_calls_is_held_to_one_call_in_its_own_key(qwen: Engine, choice: str, reply: str,
                                                                   accepted: bool) -> None:
    """Llama-3.x writes a call as bare ``{"name": ..., "parameters": ...}``, one per turn: the grammar of each
    ``tool_choice`` on that format (this model's tokenizer spells the text; the format has no special tokens)."""
    from kvagent.tools.choice import ToolChoice, turn_grammar
    from kvagent.tools.grammar import accepts

    grammar = turn_grammar(TOOLS, ToolChoice.of(choice, TOOLS, parallel=True), None, llama_format(), qwen.backend)
    assert accepts(qwen.backend, grammar, reply) is accepted


@pytest.mark.parametrize("choice, reply, accepted", [
    ("required", '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}', True),
    ("required", '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]lookup_order[ARGS]{"order_id": "A-1"}',
     True),  # parallel calls, joined as the template joins them
    ("required", '[TOOL_CALLS]get_weather[ARGS]{"town": "Oslo"}', False),  # the schema's keys only
    ("required", '[TOOL_CALLS]{"name": "get_weather", "arguments": {"city": "Oslo"}}', False),
    ("lookup_order", '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}', False),
    ("auto", "It rains in Oslo.", True),
    ("auto", '[TOOL_CALLS]lookup_order[ARGS]{"order_id": "A-1"}', True),
])
def test_a_format_that_names_the_tool_before_its_arguments(qwen: Engine, choice: str, reply: str,
                                                           accepted: bool) -> None:
    """Mistral's ``[TOOL_CALLS]name[ARGS]{...}`` (read off Devstral's template): the grammar of each
    ``tool_choice`` (this model's tokenizer spells ``[TOOL_CALLS]`` as text; Mistral's has it as one token)."""
    from kvagent.chat_format import ChatFormat
    from kvagent.tools.choice import ToolChoice, turn_grammar
    from kvagent.tools.grammar import accepts
    from kvagent.tools.template import tool_format_of

    source = family_template("unsloth-mistral-Devstral-Small-2507")
    found = tool_format_of(source, ChatFormat.from_template(source, "devstral", "</s>"), "devstral")
    assert found is not None and found.call_name_close == "[ARGS]"
    grammar = turn_grammar(TOOLS, ToolChoice.of(choice, TOOLS, parallel=True), None, found, qwen.backend)
    assert accepts(qwen.backend, grammar, reply) is accepted


@pytest.mark.parametrize("reply, calls", [
    ('{"name": "get_weather", "arguments": {"city": "Oslo"}}', [("get_weather", {"city": "Oslo"})]),
    ('```json\n{\n  "name": "lookup_order",\n  "arguments": {"order_id": "A-1"}\n}\n```', [("lookup_order", {"order_id": "A-1"})]),
    ('[{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "lookup_order", "arguments": {"order_id": "B"}}]',
     [("get_weather", {"city": "Rome"}), ("lookup_order", {"order_id": "B"})]),
    ('{"name": "Ada", "age": 36}', []),  # an ordinary JSON reply: other keys
    ('{"name": "book_flight", "arguments": {}}', []),  # a tool that is not bound
    ('{"name": "get_weather", "arguments": "Oslo"}', []),  # arguments not an object
    ('{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": 3}', []),  # more than a call
    ('Call {"name": "get_weather", "arguments": {"city": "Oslo"}} now', []),  # prose around it
    ('{"name": "get_weather", "arguments": {"city": "Os', []),  # cut short
])
def test_bare_json_calls_and_ordinary_json_replies(qwen_format: ToolFormat, reply: str, calls: list[Any]) -> None:
    assert [(c.name, dict(c.arguments)) for c in qwen_format.untagged_calls(reply, TOOLS)] == calls
    assert HERMES.untagged_calls(reply, TOOLS) == []  # kvagent's own format never reads them


@pytest.mark.parametrize("pieces, made, text, names", [
    (["```json\n{", '"name": "get_weather", "arguments": {"city": "Oslo"}}\n```'],
     [ToolCall("get_weather", {"city": "Oslo"})], "", ["get_weather"]),
    (['{"name": "Ada"', ', "age": 36}'], [], '{"name": "Ada", "age": 36}', []),
    (["<tool_call>\n", '{"name": "lookup_order", "arguments": {"order_id": "A"}}\n</tool_call>'], [], "",
     ["lookup_order"]),
    (["Sure", ", here it is."], [], "Sure, here it is.", []),
])
def test_a_streamed_reply_that_may_be_a_bare_call_is_held_to_the_end(qwen_format: ToolFormat, pieces: list[str],
                                                                      made: list[ToolCall], text: str,
                                                                      names: list[str]) -> None:
    splitter = CallSplitter(qwen_format)
    fed = [splitter.feed(p) for p in pieces]
    end = splitter.finish(made)
    assert "".join(t for t, _ in fed) + end[0] == text
    assert [d.name for _, ds in [*fed, end] for d in ds if d.name] == names
