"""Gemma-3: is a splice behind the sliding window exact on this llama-cpp-python build? (native/README.md)

A field, ~900 tokens of notes after it (more than the 512-token window), a field-only edit, a memory line
appended, then splices refreshing every downstream position; the refusal is bypassed so the splice runs
even on an unpatched build. Prints the SWA cache's first position after each step and the cosine of the
final logits against a cold run of the same prompt. Measured (2 cores, 2026-11-30): unpatched 0.3.36, the
first position jumps to 28 after the append and the cosine is 0.991 with another argmax; patched
(0.3.36+kvagent.5fbbeac2), it stays 0 and the cosine is 0.9996, same argmax.

Run: .venv/bin/python -m scripts.swa_splice_probe [model]   (from the repository root)
"""

from __future__ import annotations

import sys

import numpy as np

import kvagent.session as session_module
from kvagent import Engine, EngineSettings, Segment
from kvagent.edits import Selective
from kvagent.skills.fidelity import cosine
from tests.integration.test_edits import POLICY, STATUS, _long_notes, question_segments


def main(model: str = "gemma3-270m") -> None:
    import llama_cpp

    session_module.splice_refusal = lambda *args, **kwargs: None  # type: ignore[assignment]  # splice regardless
    engine = Engine(EngineSettings(model=model, n_ctx=4096))
    print(f"llama-cpp-python {llama_cpp.__version__}, n_swa {engine.backend.n_swa}")
    with engine.session([POLICY, STATUS.segment(), _long_notes(engine, 900)], chat=False, fields=[STATUS],
                        share_prefix=False) as s:
        s.prefill()
        first = lambda: engine.backend.seq_pos_range(s.seq)[0]  # noqa: E731
        s.set("order_status", "shipped", strategy="field_only")
        print("after field_only: first position", first())
        s.extend(Segment.memory("Note: the customer called twice."))
        print("after an append: first position", first())
        for value in ("cancelled", "delivered"):
            s.set("order_status", value, strategy=Selective(k=10**6))
        s.extend(*question_segments("Question: What is the order status?\nAnswer:"))
        got, segments = s.logits(), list(s.segments)
    with engine.session(segments, chat=False, share_prefix=False) as c:
        want = c.logits()
    print(f"cosine vs cold {cosine(got, want):.4f}; argmax {int(np.argmax(got))} vs {int(np.argmax(want))}")
    engine.close()


if __name__ == "__main__":
    main(*sys.argv[1:2])
