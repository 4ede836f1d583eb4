"""Session on the real llama.cpp backend, both models: every KV result against a full recompute."""

from __future__ import annotations

import numpy as np
import pytest

from kvagent import (
    ContextOverflowError,
    Engine,
    KVBlobError,
    Segment,
    SegmentOrderError,
    SessionClosedError,
)
from kvagent.demo import POLICY
from kvagent.skills.fidelity import cosine

FIELDS = [Segment.field("customer", "Alice Moreau"), Segment.field("order_status", "processing")]


def support_prompt(question: str = "Can I still cancel my order?") -> list[Segment]:
    return [Segment.policy(POLICY), *FIELDS, Segment.user(question)]


def cold_logits(engine: Engine, segments: list[Segment]) -> np.ndarray:
    """Next-token logits of a full prefill in a fresh session that shares no cell with another one."""
    with engine.session(segments, share_prefix=False) as s:
        report = s.prefill()
        assert report.reused == 0 and report.computed == len(s.tokens)
        return s.logits()


def test_logits_match_llama_cpp_python_high_level(engine: Engine) -> None:
    from llama_cpp import Llama  # the reference: llama-cpp-python's own facade on the same file

    with engine.session(support_prompt()) as s:
        ours = s.logits()
        tokens = list(s.tokens)
    assert len(tokens) > 150
    flash = engine.settings.backend_config().flash_attn  # the same kernels on both sides
    llm = Llama(str(engine.model.path), n_ctx=2048, n_batch=512, logits_all=True, flash_attn=flash, verbose=False)
    try:
        llm.eval(tokens)
        ref = np.array(llm.scores[len(tokens) - 1])
    finally:
        llm.close()
    assert cosine(ours, ref) >= 0.999
    assert int(ours.argmax()) == int(ref.argmax())


def test_prefix_reuse_matches_cold_prefill(engine: Engine) -> None:
    first = support_prompt()
    longer = [*first, Segment.assistant("Yes, it is still processing."), Segment.user("Then cancel it please.")]
    with engine.session(first) as s:
        assert s.prefill().computed == len(s.tokens)
        n_first = len(s.tokens)
        report = s.replace(longer)
        assert report.reused == n_first and report.computed == len(s.tokens) - n_first
        warm = s.logits()
        # a prompt that diverges inside the last turn reuses everything before it
        diverged = [*first[:-1], Segment.user("Can I still change my order?")]
        report2 = s.replace(diverged)
        assert 0 < report2.reused < len(s.tokens) and report2.computed > 0
        warm2 = s.logits()
    assert cosine(warm, cold_logits(engine, longer)) >= 0.999
    assert cosine(warm2, cold_logits(engine, diverged)) >= 0.999


def test_second_session_shares_the_first_ones_prefix(engine: Engine) -> None:
    other = [Segment.policy(POLICY), *FIELDS, Segment.user("How long does a refund take?")]
    with engine.session(support_prompt()) as a:
        a.prefill()
        with engine.session(other) as b:
            report = b.prefill()
            shared_expected = engine.renderer(True).render(other[:-1]).tokens
            assert report.shared == report.reused >= len(shared_expected)
            logits_b = b.logits()
        logits_a_after = a.logits()
    assert cosine(logits_b, cold_logits(engine, other)) >= 0.999
    assert cosine(logits_a_after, cold_logits(engine, support_prompt())) >= 0.999


def test_save_restore_round_trip(engine: Engine) -> None:
    segments = support_prompt()
    follow_up = Segment.assistant("Yes."), Segment.user("Then please cancel it and refund me.")
    with engine.session(segments) as s:
        before = s.logits()
        blob = s.save()
        s.extend(*follow_up)
        continued = s.logits()  # the same suffix decoded on top of the original KV
    with engine.session(share_prefix=False) as t:  # the follow-up decoded on top of the restored KV, not shared
        t.restore(blob, segments)
        assert t.tokens == engine.renderer(True).render(segments).tokens
        assert np.array_equal(t.logits(), before)
        report = t.extend(*follow_up)  # decoded on top of the restored KV
        assert report.reused == len(engine.renderer(True).render(segments).tokens)
        assert cosine(t.logits(), continued) >= 0.999


def test_refused_blob_leaves_the_session_untouched(engine: Engine) -> None:
    segments = support_prompt()
    with engine.session(segments) as s:
        blob = s.save()
        before, tokens = s.logits(), s.tokens
        corrupt = blob[:-1] + bytes([blob[-1] ^ 0xFF])
        with pytest.raises(KVBlobError, match="checksum"):
            s.restore(corrupt, segments)
        with pytest.raises(Exception, match="differ from the given segments"):
            s.restore(blob, support_prompt("Something else entirely?"))
        assert s.tokens == tokens
        assert cosine(s.logits(), before) >= 0.9999


def test_blob_from_the_other_model_is_refused() -> None:
    blobs = {}
    for name in ("smollm2-135m", "gemma3-270m"):
        with Engine.load(name, n_ctx=512, n_seq_max=1) as eng, eng.session([Segment.user("hello")]) as s:
            blobs[name] = (s.save(), eng)
    with Engine.load("gemma3-270m", n_ctx=512, n_seq_max=1) as eng, eng.session([Segment.user("hello")]) as s:
        with pytest.raises(KVBlobError, match="made by model .* recompute it on this model"):
            s.restore(blobs["smollm2-135m"][0], [Segment.user("hello")])


def test_interleaved_sessions_keep_independent_outputs(engine: Engine) -> None:
    """Two generations stepped alternately: each one's KV stays exactly its own.

    Greedy texts are not compared with solo runs: on these Q4 models the same tokens decoded into other
    KV cells give logits that differ by up to ~1 (cosine ~0.9995), enough to flip a near-tie.
    Isolation is checked exactly instead (A's saved KV bytes do not change while B works) and each
    session's final logits are checked against a cold recompute of its own tokens.
    """
    prompts = [support_prompt("Can I still cancel my order?"), [Segment.user("Write a haiku about the sea.")]]
    sa, sb = engine.session(prompts[0]), engine.session(prompts[1])
    try:
        sa.prefill()
        a_bytes = sa.save()
        sb.generate(8)  # B's prefill and generation must not touch A's cells
        assert sa.save() == a_bytes
        streams = [sa.stream(16), sb.stream(16)]
        pieces: list[list[str]] = [[], []]
        live = [True, True]
        while any(live):  # step the two generations alternately, one token each
            for i, st in enumerate(streams):
                if live[i]:
                    try:
                        pieces[i].append(next(st))
                    except StopIteration:
                        live[i] = False
        assert [st.result.text for st in streams] == ["".join(p) for p in pieces]  # type: ignore[union-attr]
        finals = [(list(s.segments), s.logits()) for s in (sa, sb)]
    finally:
        sa.close()
        sb.close()
    for segments, logits in finals:
        assert cosine(logits, cold_logits(engine, segments)) >= 0.999


def test_span_table_matches_the_cache(engine: Engine) -> None:
    with engine.session(support_prompt()) as s:
        s.generate(8)
        s.chat("Thanks. And how long does a refund take?", max_tokens=8)
        spans = s.spans
        covered = [p for sp in spans for p in range(sp.first, sp.last + 1)]
        assert covered == list(range(len(s.tokens)))
        assert [sp.segment_id for sp in spans] == [seg.id for seg in s.segments]
        assert engine.backend.seq_pos_range(s.seq) == (0, len(s.tokens) - 1)
        assert [sp.kind.value for sp in spans][-4:] == ["turn"] * 4


def test_streaming_pieces_add_up_and_stop_strings_cut(engine: Engine) -> None:
    with engine.session([Segment.user("Count from 1 to 20, separated by commas.")]) as s:
        stream = s.stream(24)
        text = "".join(stream)
        assert stream.result is not None and text == stream.result.text and stream.result.ttft_s > 0
        first = stream.result
    assert first.generated > 0
    stop = first.text[len(first.text) // 2 :][:2]
    with engine.session([Segment.user("Count from 1 to 20, separated by commas.")]) as s:
        cut = s.generate(24, stop=[stop])
        assert cut.finish_reason == "stop" and stop not in cut.text and first.text.startswith(cut.text)
        assert s.segments[-1].text == cut.text  # the cached turn ends where the text was cut


def test_seeded_sampling_reproduces(engine: Engine) -> None:
    texts = []
    for _ in range(2):
        with engine.session([Segment.user("Tell me a short story.")]) as s:
            texts.append(s.generate(12, temperature=0.9, top_p=0.9, seed=123).text)
    assert texts[0] == texts[1] and texts[0]


def test_context_overflow_is_refused_and_nothing_changes(engine: Engine) -> None:
    with engine.session(support_prompt()) as s:
        s.prefill()
        tokens, logits = s.tokens, s.logits()
        long_text = "word " * 3000
        with pytest.raises(ContextOverflowError, match="does not fit the context of 2048.*nothing was cut"):
            s.extend(Segment.memory(long_text))
        assert s.tokens == tokens and len(s.segments) == 4
        assert cosine(s.logits(), logits) >= 0.9999


def test_generation_that_fills_the_context_rolls_back(engine: Engine) -> None:
    with Engine.load(engine.settings.model, n_ctx=64, n_seq_max=1) as small:
        with small.session([Segment.user("Count from 1 to 100, separated by commas.")]) as s:
            s.prefill()
            tokens = s.tokens
            with pytest.raises(ContextOverflowError, match="rolled back") as info:
                s.generate(1000)  # llama.cpp rounds n_ctx up to 256
            assert info.value.partial and s.tokens == tokens and len(s.segments) == 1


def test_invalid_order_changes_nothing(engine: Engine) -> None:
    with engine.session(support_prompt()) as s:
        s.prefill()
        tokens = s.tokens
        with pytest.raises(SegmentOrderError, match="policies must come before"):
            s.extend(Segment.policy("Be terse."))
        assert s.tokens == tokens and len(s.segments) == 4


def test_closed_session_refuses_calls(engine: Engine) -> None:
    s = engine.session(support_prompt())
    s.prefill()
    s.close()
    for call in (lambda: s.generate(4), s.prefill, s.logits, s.save, lambda: s.chat("hi")):
        with pytest.raises(SessionClosedError, match="closed"):
            call()
    assert engine.open_sessions == 0
