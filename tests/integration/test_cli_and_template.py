"""The CLI on the real default model, and our chat rendering against llama-cpp-python's own."""

from __future__ import annotations

import re

from typer.testing import CliRunner

from kvagent import Engine, Segment
from kvagent.cli import app


def test_help_lists_commands() -> None:
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "demo" in result.output and "models" in result.output


def test_demo_reports_reuse_per_turn() -> None:
    result = CliRunner().invoke(app, ["demo", "--max-tokens", "8"])
    assert result.exit_code == 0, result.output
    rows = re.findall(r"reused (\d+) tokens from cache, computed (\d+)", result.output)
    assert len(rows) == 4
    reused = [int(r) for r, _ in rows]
    assert reused[0] == 0 and all(r > 0 for r in reused[1:])  # turns 2+ and the 2nd customer hit the cache
    assert "came from the cache" in result.output


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
