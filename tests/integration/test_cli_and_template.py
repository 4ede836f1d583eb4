"""The CLI on the real default model, and our chat rendering against llama-cpp-python's own."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvagent import Engine, Segment
from kvagent.cli import app


def test_help_lists_commands() -> None:
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "demo" in result.output and "models" in result.output


@pytest.mark.e2e  # the whole demo, both sides: the full tier
def test_demo_compares_each_turn_with_llama_cpp_python(tmp_path: Path) -> None:
    import jsonschema

    from kvagent.demo import LOOKUP_ORDER

    out = tmp_path / "demo.json"
    result = CliRunner().invoke(app, ["demo", "--max-tokens", "8", "--json", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    ours = [int(n) for n in re.findall(r"kvagent +computed +(\d+) tokens", result.output)]
    theirs = [int(n) for n in re.findall(r"llama-cpp-python computed +(\d+) tokens", result.output)]
    assert len(ours) == len(theirs) == 6
    rows = json.loads(out.read_text())["rows"]  # the figures a reader quotes are the ones shown
    assert [r["kvagent"]["computed"] for r in rows] == ours and [r["baseline"]["computed"] for r in rows] == theirs
    assert "transplanted from the compiled skill" in result.output and ours[0] < theirs[0]  # the skill was copied
    assert ours[3] < 80 < theirs[3]  # the field change: an erratum line vs a rewritten system prompt
    cells = [int(n) for n in re.findall(r"(\d+) KV cells", result.output)]
    assert max(cells) <= 1024 + 64 + 16  # the eviction budget held (budget + chunk + margin)
    assert "as many" in result.output
    # the tool turn (turn 2): each side called lookup_order once, with arguments its schema accepts (checked here
    # with jsonschema, not with the demo's own check); kvagent's tool description was transplanted, not computed
    calls = re.findall(r"tool call (\w+)\((\{.*?\})\): (valid arguments|arguments not valid); computed (\d+) tokens"
                       r"[^\n]*?(?:, (\d+) tokens of the tool's description transplanted)?\n", result.output)
    assert [c[0] for c in calls] == ["lookup_order", "lookup_order"], result.output
    schema = LOOKUP_ORDER["function"]["parameters"]
    for name, arguments, shown, _, _ in calls:
        jsonschema.validate(json.loads(arguments), schema)
        assert shown == "valid arguments"
    (_, _, _, our_computed, copied), (_, _, _, _, none_copied) = calls
    assert int(copied) > int(our_computed) and none_copied == ""
    turn2 = result.output[result.output.index("turn 2"):result.output.index("turn 3")]
    assert "llama-cpp-python gets tools=" in turn2 and turn2.count("tool call lookup_order") == 2


def test_unknown_model_in_cli_is_a_clear_error() -> None:
    result = CliRunner().invoke(app, ["demo", "--model", "nope"])
    assert result.exit_code == 1 and "unknown model 'nope'" in result.output


def test_rendering_equals_llama_cpp_python_chat_formatter() -> None:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    with Engine.load("smollm2-135m", n_ctx=512, n_seq_max=1) as eng:
        formatter = Jinja2ChatFormatter(eng.backend.chat_template or "", eos_token="<|im_end|>", bos_token="")
        text = formatter(messages=messages).prompt
        theirs = eng.backend.tokenize(text, special=True)
        segments = [
            Segment.policy(messages[0]["content"]),
            Segment.user(messages[1]["content"]),
            Segment.assistant(messages[2]["content"]),
            Segment.user(messages[3]["content"]),
        ]
        pending = Segment(Segment.user("x").kind, "", role="assistant", complete=False)
        ours = eng.renderer(True).render([*segments, pending]).tokens
    assert list(ours) == theirs
