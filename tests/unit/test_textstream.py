"""Incremental detokenization: split UTF-8, stop strings across pieces, held-back text."""

from __future__ import annotations

import pytest

from kvagent.textstream import TextAssembler

CASES = [
    # (pieces, stop strings, expected text, stopped)
    ([b"Hello", b" world"], [], "Hello world", False),
    (["é".encode()[:1], "é".encode()[1:], b"!"], [], "é!", False),
    ([b"Answer: 4", b"\nUs", b"er: more"], ["\nUser:"], "Answer: 4", True),
    ([b"abc", b"<|e", b"nd|>", b"tail"], ["<|end|>"], "abc", True),
    ([b"a<", b"b"], ["<|end|>"], "a<b", False),
    ([b"STOP"], ["STOP"], "", True),
]


@pytest.mark.parametrize(("pieces", "stop", "text", "stopped"), CASES)
def test_assembler(pieces: list[bytes], stop: list[str], text: str, stopped: bool) -> None:
    out = TextAssembler(stop)
    shown = "".join(out.feed(p) for p in pieces) + out.flush()
    assert (shown, out.text, out.stopped) == (text, text, stopped)


def test_partial_stop_is_held_back_until_resolved() -> None:
    out = TextAssembler(["</s>"])
    assert out.feed(b"hi </") == "hi "
    assert out.feed(b"x") == "</x"
