"""A tool loop in a format read off another family's template, on a real model: SmolLM2-135M loaded with
Llama-3.2's own chat template in place of its GGUF's (``tests/unit/test_template_formats.py`` reads it). The tokens
are SmolLM2's (Llama-3's header tokens are text to it), so this checks kvagent's side of the loop, not what a
Llama model would answer: a call under ``required`` in the template's bare format, its result as an ``ipython``
turn, and the next turn appended to the cache, an exact replay of the prompt."""

from __future__ import annotations

from typing import Iterator

import pytest

from kvagent import Engine, Segment
from kvagent.backends.llama_cpp import LlamaCppBackend
from kvagent.skills.fidelity import logit_cosine
from kvagent.tools.format import format_of
from tests.tool_cases import TOOLS, family_template

@pytest.fixture(scope="module")
def llama_templated() -> Iterator[Engine]:
    source = family_template("meta-llama-Llama-3.2-3B-Instruct")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LlamaCppBackend, "chat_template", property(lambda self: source))
        eng = Engine.load("smollm2-135m", n_ctx=4096, n_seq_max=2)
        eng.renderer(True)  # the formats are read now, while the template is Llama-3.2's
    yield eng
    eng.close()


def test_a_tool_loop_in_llama_s_format_appends_and_replays_exactly(llama_templated: Engine) -> None:
    eng = llama_templated
    renderer = eng.renderer(True)
    fmt = format_of(renderer)
    assert fmt.in_user and not fmt.tagged and fmt.result_turn
    prompt = [Segment.policy("You are the support agent of Northwind Outdoor."), *eng.tool_segments(TOOLS),
              Segment.user("Where is my order A-1042?")]
    with eng.session(prompt, share_prefix=False) as s:
        first = s.generate(48, tools=TOOLS, tool_choice="lookup_order")
        assert [c.name for c in first.tool_calls] == ["lookup_order"] and first.finish_reason == "tool_calls"
        assert first.text == fmt.render_calls(first.tool_calls)  # the template's own call text
        call = first.tool_calls[0]
        turn = [*prompt, Segment.assistant(fmt.render_calls(first.tool_calls)),
                fmt.result_segment(call.name, call.id, "shipped on 3 Dec"), Segment.reply()]
        held = len(s.tokens)
        second = s.generate(24, segments=turn[:-1])
        assert second.reused >= held  # the call turn stays cached: only the result and the answer are computed
        full = [*turn[:-1], Segment.assistant(second.text, token_ids=second.token_ids)]
        # an exact replay of the prompt (the call turn as its generated tokens, as a resent history maps to them)
        assert s.tokens == renderer.render([s.replies.resolve(x) for x in full]).tokens
        text = b"".join(eng.backend.token_bytes(t) for t in s.tokens).decode()
        assert '<|start_header_id|>ipython<|end_header_id|>\n\n"shipped on 3 Dec"<|eot_id|>' in text
        ours = s.logits()
        full = [s.replies.resolve(x) for x in full]
    with eng.session(full, share_prefix=False) as cold:
        assert logit_cosine(ours, cold.logits()) >= 0.999
