"""The concurrent runtime on the real llama.cpp backend, both models: batched decode against the
sequential path, isolation of concurrent sessions, cancellation and rollback, skills found in the
store, answer prefixes, whole-history calls. Timings are measured in ``kvagent bench concurrency``."""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from kvagent import Engine, KVAgentError, Segment
from kvagent.aio import AsyncEngine
from kvagent.generation import Decoder, generation_work
from kvagent.skills.fidelity import cosine
from kvagent.skills.spec import SkillSpec
from kvagent.skills.store import SkillStore
from tests.integration.test_skills import FIDELITY


@pytest.fixture(scope="module")
def wide(engine: Engine) -> Iterator[Engine]:
    """The same model with room for 16 concurrent sessions."""
    with Engine.load(engine.settings.model, n_ctx=4096, n_seq_max=18) as eng:
        yield eng


def cold_logits(engine: Engine, segments: list[Segment]) -> np.ndarray:
    with engine.session(segments, share_prefix=False) as s:
        return s.logits()


class Forced:
    """A sampler that emits given tokens in order and records the logits it was shown (teacher forcing)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.seen = list(tokens), []  # type: list[int], list[np.ndarray]

    def __call__(self, logits: np.ndarray) -> int:
        self.seen.append(logits.copy())
        return self.tokens[len(self.seen) - 1]


PROMPTS = [f"Write one sentence about the number {n} and a {animal}." for n, animal in
           zip(range(8), ["cat", "dog", "fox", "owl", "bee", "cow", "eel", "yak"])]


# Gemma-3 with fewer sessions and steps (its float32 copy decodes ~3x slower than SmolLM2's): 11 s instead of 31
@pytest.mark.parametrize(("model", "n_sessions", "steps"), [("smollm2-135m", 8, 12), ("gemma3-270m", 4, 8)])
def test_batched_decode_matches_the_sequential_path(model: str, n_sessions: int, steps: int) -> None:
    """Sessions teacher-forced on the same tokens: batched logits vs each session decoding alone.

    On the float32 copy of the weights: with the shipped Q4 weights llama.cpp quantizes activations, and
    the same tokens decoded into other KV cells already move logits (SmolLM2: min cosine 0.9957 decoding
    each session alone but interleaved, 0.992 batched, against 1.0 for two identical runs), which would
    hide a real batching error behind kernel noise.
    """
    pytest.importorskip("gguf")
    from kvagent.models import resolve_model
    from kvagent.reference.export import export_f32

    prompts = PROMPTS[:n_sessions]
    with Engine.load(str(export_f32(resolve_model(model))), n_ctx=4096, n_seq_max=18) as engine:
        forced: list[list[int]] = []
        for p in prompts:  # the tokens to force: each prompt's own greedy continuation (never an end token)
            with engine.session([Segment.user(p)], share_prefix=False) as s:
                ids = list(s.generate(steps).token_ids)
            forced.append((ids + [engine.backend.tokenize(" yes", special=False)[0]] * steps)[:steps])

        def run(batched: bool) -> list[list[np.ndarray]]:
            sessions = [engine.session([Segment.user(p)], share_prefix=False) for p in prompts]
            samplers = [Forced(f) for f in forced]
            try:
                decoders = [Decoder(s, steps, sm, (), ()) for s, sm in zip(sessions, samplers)]
                if batched:
                    jobs = [engine.scheduler.submit(s, generation_work(d)) for s, d in zip(sessions, decoders)]
                    for job in jobs:
                        job.future.result()
                else:
                    for s, d in zip(sessions, decoders):
                        engine.scheduler.run(s, generation_work(d))
            finally:
                for s in sessions:
                    s.close()
            return [sm.seen for sm in samplers]

        sequential = run(False)
        rounds, batched_before = engine.scheduler.rounds, engine.scheduler.batched_tokens
        batched = run(True)
        # the batched run really batched: about one round per step for all sessions
        assert engine.scheduler.batched_tokens - batched_before >= len(prompts) * (steps - 1)
        assert engine.scheduler.rounds - rounds < 4 * steps
    assert all(len(s) == steps for s in batched)
    worst = min(cosine(a, b) for seq_s, bat_s in zip(sequential, batched) for a, b in zip(seq_s, bat_s))
    assert worst >= 0.999, f"batched logits drift from the sequential path: min cosine {worst:.5f}"


@pytest.mark.full  # 18 s; the fast tier keeps the server's 32 concurrent sessions that never see each other's secrets
def test_concurrent_sessions_never_see_each_other(wide: Engine) -> None:
    """16 sessions with distinct secret values, chatting concurrently from threads."""
    rng = random.Random(7)
    secrets = [str(rng.randrange(1000, 9999)) for _ in range(16)]
    eng = wide
    if True:
        sessions = [eng.session([Segment.policy("You guard one secret code. Reply with the code only."),
                                 Segment.field("secret_code", code)]) for code in secrets]
        replies: list[str] = [""] * 16

        def ask(i: int) -> None:
            replies[i] = sessions[i].chat("What is the secret code?", max_tokens=8).text

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, s in enumerate(sessions):
            others = [c for j, c in enumerate(secrets) if j != i]
            assert not any(c in replies[i] for c in others), f"session {i} replied {replies[i]!r}"
            assert s.field_values == {"secret_code": secrets[i]}
            assert [sp.segment_id for sp in s.spans] == [seg.id for seg in s.segments]
            assert s.tokens == s.rendered.tokens
        finals = [(list(s.segments), s.logits()) for s in sessions]
        for s in sessions:
            s.close()
        for segments, logits in finals:
            assert cosine(logits, cold_logits(eng, segments)) >= 0.999
        assert eng.pool.free == 18


# 20 cancellations in the fast tier; 200 as a soak in the full tier
@pytest.mark.parametrize("rounds", [20, pytest.param(200, marks=pytest.mark.e2e)])
def test_cancelled_streams_roll_back_and_leak_nothing(engine: Engine, rounds: int) -> None:
    free = engine.pool.free
    with engine.session([Segment.policy("You are a counting machine.")]) as s:
        s.prefill()
        rest = s.tokens
        for i in range(rounds):
            stream = s.stream(16, user=f"Count from {i} to {i + 40}.")
            next(stream)
            stream.close()
            assert s.tokens == s.rendered.tokens == rest and len(s.segments) == 1
        reply = s.chat("Say hi.", max_tokens=4)  # the session still works after all that
        assert reply.generated > 0 and s.tokens == s.rendered.tokens
    assert engine.pool.free == free


def test_async_cancellation_rolls_back(engine: Engine) -> None:
    async def main() -> None:
        aeng = AsyncEngine(engine)
        s = await aeng.session([Segment.policy("You are a counting machine.")])
        await s.aprefill()
        rest = s.tokens
        task = asyncio.create_task(s.achat("Count from 1 to 200, separated by commas.", max_tokens=200))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert s.tokens == s.rendered.tokens == rest and len(s.segments) == 1
        async with s.astream(64, user="Count from 1 to 50.") as stream:
            async for _ in stream:
                break
        assert s.tokens == s.rendered.tokens == rest
        reply = await s.achat("Say hi.", max_tokens=4)
        assert reply.generated > 0
        segments, logits = list(s.segments), await s.alogits()
        await s.aclose()
        assert cosine(logits, cold_logits(engine, segments)) >= 0.999

    free = engine.pool.free
    asyncio.run(main())
    assert engine.pool.free == free


def test_answer_prefix_is_cached_with_the_turn(engine: Engine) -> None:
    with engine.session([Segment.user("Is the sky blue? Answer yes or no.")]) as s:
        g = s.chat("Is grass green? Answer yes or no.", max_tokens=6, prefix="Answer:")
        assert g.prefix == "Answer:" and not g.text.startswith("Answer:")
        assert s.segments[-1].text == "Answer:" + g.text and s.tokens == s.rendered.tokens
        segments, logits = list(s.segments), s.logits()
    assert cosine(logits, cold_logits(engine, segments)) >= 0.999


def test_whole_history_call_reuses_the_cache(engine: Engine) -> None:
    """A client that resends the whole history (OpenAI style) computes only what is new."""
    history = [Segment.policy("You are brief."), Segment.user("Name a fruit.")]
    with engine.session() as s:
        g1 = engine.scheduler.run(s, generation_work(s.decoder(8, segments=history)))
        history += [Segment.assistant(g1.text), Segment.user("Another one?")]
        g2 = engine.scheduler.run(s, generation_work(s.decoder(8, segments=history)))
        new_turn = len(s.renderer.segment_tokens(history[-1])) + len(s.renderer.segment_tokens(Segment.reply()))
        assert g2.computed <= new_turn + 1 and g2.reused > 0
        assert s.tokens == s.rendered.tokens


def test_reading_a_stream_and_calling_the_session_in_one_thread_is_refused(engine: Engine) -> None:
    with engine.session([Segment.user("Count from 1 to 30.")]) as s:
        stream = s.stream(16)
        next(stream)
        with pytest.raises(KVAgentError, match="read it to the end or close"):
            s.extend(Segment.user("more"))
        stream.close()
        s.extend(Segment.user("Thanks."))
        assert s.tokens == s.rendered.tokens


def test_a_skill_compiled_elsewhere_is_transplanted(engine: Engine, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`kvagent skills compile` (or another process) compiled the skill; this engine never called compile."""
    spec = SkillSpec(name="returns", version="1", kind="rules",
                     text="Returns are accepted within 30 days with a receipt. Refunds take 5 business days.")
    store = tmp_path / "skills"
    with Engine.load(engine.settings.model, n_ctx=1024, n_seq_max=2) as other:  # "another process"
        other.skills = other.skill_library(SkillStore(store))
        other.skills.compile(spec, other.renderer(True))
    saved = engine._skills
    try:
        engine.skills = engine.skill_library(SkillStore(store))
        prompt = [Segment.policy("You are a support agent."), spec.segment(), Segment.user("Can I return shoes?")]
        with engine.session(prompt, share_prefix=False) as s:
            report = s.prefill()
            assert report.transplanted > 0
        engine.skills = engine.skill_library(SkillStore(tmp_path / "empty"))
        with caplog.at_level(logging.WARNING, logger="kvagent.skills.library"):
            for _ in range(2):
                with engine.session(prompt, share_prefix=False) as s:
                    assert s.prefill().transplanted == 0
        warnings = [r.getMessage() for r in caplog.records if "not compiled" in r.getMessage()]
        assert len(warnings) == 1 and "kvagent skills compile" in warnings[0]
    finally:
        if saved is not None:
            engine.skills = saved


def test_a_prefix_shared_into_a_skill_span_still_transplants_the_skill(engine: Engine, tmp_path: Path) -> None:
    """Another session's prompt shares the policy and the opening tag of the next system message: the
    shared prefix ends inside the skill's span, and the skill is transplanted whole, not decoded."""
    spec = SkillSpec(name="hours", version="1", kind="rules", text="The shop opens at nine and closes at six, "
                     "Monday to Saturday. On Sundays it is closed. Holidays follow the city calendar.")
    saved = engine._skills
    try:
        engine.skills = engine.skill_library(SkillStore(tmp_path / "skills"))
        engine.skills.compile(spec, engine.renderer(True))
        policy = Segment.policy("You are the assistant of a small shop.")
        with engine.session([policy, Segment.memory("The customer likes tea.")]) as a:
            a.prefill()
            with engine.session([policy, spec.segment(), Segment.user("When do you open?")]) as b:
                report = b.prefill()
                assert report.shared > 0 and report.transplanted > 0
                segments, logits = list(b.segments), b.logits()
        engine.skills = engine.skill_library(SkillStore(tmp_path / "empty"))  # the oracle prefills everything
        assert cosine(logits, cold_logits(engine, segments)) >= FIDELITY[engine.settings.model]
    finally:
        if saved is not None:
            engine.skills = saved


@pytest.mark.slow  # 19 s; the fast tier keeps the preemption checks that run in seconds
def test_a_larger_prefill_chunk_gives_way_to_a_short_request(engine: Engine) -> None:
    """``prefill_chunk_alone``: a long prefill alone on the engine decodes 256-token chunks; a short request that
    arrives meanwhile aborts the chunk in flight (llama.cpp's abort callback), runs, and the prefill goes on. The
    long session ends with every position once and logits close to a cold prefill's; the short reply is the one
    it gets on an idle engine."""
    long_text = " ".join(f"Line {i}: the parcel left depot {i % 7} at {i % 24}:00 and reached the hub." for i in range(90))
    with Engine.load(engine.settings.model, n_ctx=4096, n_seq_max=4, prefill_chunk_alone=256) as eng:
        if eng._alone_chunk is None:
            pytest.skip("this backend cannot preempt a decode (no native library)")
        with eng.session(share_prefix=False) as idle:
            expected = idle.chat("Say hello.", 4, temperature=0.0).text
        with eng.session([Segment.user(long_text)], chat=False, share_prefix=False) as long:
            n = len(long.rendered.tokens)
            assert n > 1500
            done = threading.Event()
            errors: list[BaseException] = []

            def prefill() -> None:
                try:
                    long.prefill()
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)
                finally:
                    done.set()

            thread = threading.Thread(target=prefill)
            thread.start()
            while len(long.tokens) < 256 and not done.is_set():  # the first big chunk is in; the next runs
                threading.Event().wait(0.005)
            with eng.session(share_prefix=False) as short:
                got = short.chat("Say hello.", 4, temperature=0.0).text
            thread.join(timeout=300)
            assert not errors, errors
            assert got == expected
            assert long.cache.preempted >= 1, "the short request arrived after the long prefill: no chunk preempted"
            assert long.tokens == long.rendered.tokens and eng.backend.seq_positions(long.seq) == list(range(n))
            warm = long.logits()
        with eng.session([Segment.user(long_text)], chat=False, share_prefix=False) as alone:
            cold = alone.logits()
    # the long prompt's cells interleave with the short session's: Gemma-3 Q4 measured 0.9990 (SmolLM2 1.0000)
    assert cosine(warm, cold) > 0.998
