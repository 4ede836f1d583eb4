"""A tool loop in a format read off another family's template, on a real model: SmolLM2-135M loaded with
Llama-3.2's or Devstral's own chat template in place of its GGUF's (``tests/unit/test_template_formats.py`` reads
them). The tokens are SmolLM2's (the other families' control tokens are text to it), so this checks kvagent's side
of the loop, not what those models would answer: a call to a named tool in the template's format, its result as
the template's own turn, and the next turn appended to the cache, an exact replay of the prompt."""

from __future__ import annotations

from typing import Iterator

import numpy as np
import pytest

from kvagent import Engine, Segment
from kvagent.backends.llama_cpp import LlamaCppBackend
from kvagent.skills.fidelity import logit_cosine
from kvagent.tools.format import HERMES, format_of
from tests.tool_cases import TOOLS, family_template

# (template, how the call's result is written in the prompt)
FAMILIES = [
    ("meta-llama-Llama-3.2-3B-Instruct", '<|start_header_id|>ipython<|end_header_id|>\n\n"shipped on 3 Dec"<|eot_id|>'),
    ("unsloth-mistral-Devstral-Small-2507", "[TOOL_RESULTS]shipped on 3 Dec[/TOOL_RESULTS]"),
]


# the second family's loop in the full tier (the fast tier's budget): the first one checks the same code path
@pytest.fixture(scope="module", params=[pytest.param(f, id=f[0], marks=[pytest.mark.full] if i else [])
                                        for i, f in enumerate(FAMILIES)])
def templated(request: pytest.FixtureRequest) -> Iterator[tuple[Engine, str]]:
    name, result = request.param
    source = family_template(name)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LlamaCppBackend, "chat_template", property(lambda self: source))
        eng = Engine.load("smollm2-135m", n_ctx=4096, n_seq_max=2)
        eng.renderer(True)  # the formats are read now, while the template is the family's
    yield eng, result
    eng.close()


def test_a_tool_loop_in_the_family_s_format_appends_and_replays_exactly(templated: tuple[Engine, str]) -> None:
    eng, result_text = templated
    renderer = eng.renderer(True)
    fmt = format_of(renderer)
    assert fmt is not HERMES
    prompt = [Segment.policy("You are the support agent of Northwind Outdoor."), *eng.tool_segments(TOOLS),
              Segment.user("Where is my order A-1042?")]
    with eng.session(prompt, share_prefix=False) as s:
        first = s.generate(48, tools=TOOLS, tool_choice="lookup_order")
        assert [c.name for c in first.tool_calls] == ["lookup_order"] and first.finish_reason == "tool_calls"
        assert first.text == fmt.render_calls(first.tool_calls)  # the template's own call text
        call = first.tool_calls[0]
        turn = [*prompt, Segment.assistant(fmt.render_calls(first.tool_calls)),
                fmt.result_segment(call.name, call.id, "shipped on 3 Dec")]
        held = len(s.tokens)
        second = s.generate(24, segments=turn)
        assert second.reused >= held  # the call turn stays cached: only the result and the answer are computed
        full = [s.replies.resolve(x) for x in [*turn, Segment.assistant(second.text, token_ids=second.token_ids)]]
        assert s.tokens == renderer.render(full).tokens  # an exact replay of the prompt (the call as generated)
        text = b"".join(eng.backend.token_bytes(t) for t in s.tokens).decode()
        assert result_text in text
        ours = s.logits()
    eng.pool.clear_retained()  # the first session's cells given back: the replay lands where they were
    with eng.session(prompt, share_prefix=False) as again:  # the same turns again: the same cells, bit for bit
        again.generate(48, tools=TOOLS, tool_choice="lookup_order")
        again.generate(24, segments=turn)
        assert np.array_equal(again.logits(), ours)
    # against a cold prefill of the same tokens: the call's tokens were decoded one at a time, so the cells differ
    # from a batched prefill's in their last bits (measured 0.9984-0.9992 here); a misplaced cell scores far lower
    with eng.session(full, share_prefix=False) as cold:
        want = cold.logits()
    assert logit_cosine(ours, want) > 0.99 and ours.argmax() == want.argmax()
