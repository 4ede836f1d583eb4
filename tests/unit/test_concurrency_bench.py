"""The concurrency benchmark's pure parts: decode windows, stall from tick times, rows (no model)."""

from __future__ import annotations

import asyncio
import math

import pytest

from kvagent_bench import concurrency as cb
from kvagent_bench.concurrency import Timed

pytestmark = pytest.mark.bench  # the kvagent-bench distribution: the full tier


def test_timed_first_end_and_decode_steps() -> None:
    t = Timed(start=10.0, ttft_s=0.5, total_s=2.5, generated=33)
    assert t.first == 10.5 and t.end == 12.5
    assert t.decode_steps == 32
    assert Timed(0.0, 0.1, 0.1, 0).decode_steps == 0


def test_sequential_window_sums_each_sessions_decode_time() -> None:
    runs = [Timed(0.0, 0.2, 1.2, 11), Timed(5.0, 0.1, 3.1, 21)]  # the gap between the calls does not count
    tokens, seconds = cb.decode_window(runs, "sequential")
    assert tokens == 10 + 20
    assert seconds == pytest.approx(1.0 + 3.0)


def test_batched_window_runs_from_the_last_first_token_to_the_last_end() -> None:
    runs = [Timed(0.0, 0.1, 2.0, 9), Timed(0.01, 0.29, 1.5, 9), Timed(0.02, 0.18, 2.2, 9)]
    tokens, seconds = cb.decode_window(runs, "batched")
    assert tokens == 24
    assert seconds == pytest.approx(2.22 - 0.30)  # max(end) - max(first): other sessions' prefill excluded


def test_decode_window_refuses_empty_and_unknown_mode() -> None:
    with pytest.raises(ValueError):
        cb.decode_window([], "batched")
    with pytest.raises(ValueError, match="unknown decode mode"):
        cb.decode_window([Timed(0, 0.1, 1, 2)], "parallel")


def test_max_stall_from_tick_timestamps() -> None:
    ticks = [0.0, 0.0101, 0.0203, 0.0653, 0.0755]  # one interval of 45 ms: a 35 ms stall
    assert cb.max_stall_ms(ticks) == pytest.approx(35.0)
    assert cb.max_stall_ms([0.0, 0.005, 0.010]) == 0.0  # early ticks are not negative stalls
    assert cb.max_stall_ms([1.0]) == 0.0 and cb.max_stall_ms([]) == 0.0
    assert cb.max_stall_ms([0.0, 0.1], period_s=0.05) == pytest.approx(50.0)


def test_p99_stall_ignores_a_single_outlier_among_many_ticks() -> None:
    ticks = [i * 0.011 for i in range(300)]
    ticks.append(ticks[-1] + 0.5)
    assert cb.max_stall_ms(ticks) == pytest.approx(490.0)
    assert cb.p99_stall_ms(ticks) == pytest.approx(1.0)


def test_rows_carry_the_common_keys_with_none_where_not_applicable() -> None:
    r = cb.row("m", "ttft", 2, "loaded", ttft_s=0.2, prefill_chunk=64, overlapped=3)
    common = ("model", "task", "sessions", "mode", "tokens_per_s", "ttft_s", "max_stall_ms", "prefill_chunk")
    assert all(k in r for k in common)
    assert r["tokens_per_s"] is None and r["max_stall_ms"] is None and r["overlapped"] == 3
    with pytest.raises(ValueError):
        cb.row("m", "latency", 1, "idle")


def test_decode_row_aggregates_sessions() -> None:
    runs = [Timed(0.0, 0.1, 2.1, 21, "length", (1, 2)), Timed(0.0, 0.1, 2.1, 21, "eos", (1, 3))]
    r = cb.decode_row("m", "batched", runs, prefill_chunk=64, mean_batch=2.0, same_tokens=0.5, max_tokens=21)
    assert r["task"] == "decode" and r["sessions"] == 2 and r["mode"] == "batched"
    assert r["decode_tokens"] == 40 and r["decode_s"] == pytest.approx(2.0)
    assert r["tokens_per_s"] == pytest.approx(20.0)
    assert r["ttft_s"] == pytest.approx(0.1) and r["eos_early"] == 1 and r["generated"] == 42
    assert r["max_stall_ms"] is None
    zero = cb.decode_row("m", "sequential", [Timed(0.0, 0.1, 0.1, 1)])
    assert math.isnan(zero["tokens_per_s"])


def test_token_agreement_and_speedups() -> None:
    a = [Timed(0, 0, 1, 2, token_ids=(1, 2)), Timed(0, 0, 1, 2, token_ids=(3, 4))]
    b = [Timed(0, 0, 1, 2, token_ids=(1, 2)), Timed(0, 0, 1, 2, token_ids=(3, 5))]
    assert cb.token_agreement(a, b) == 0.5
    with pytest.raises(ValueError):
        cb.token_agreement(a, b[:1])
    rows = [cb.row("m", "decode", 4, "batched", tokens_per_s=300.0),
            cb.row("m", "decode", 4, "sequential", tokens_per_s=100.0),
            cb.row("m", "prefill", 1, "alone", tokens_per_s=500.0)]
    assert cb.speedups(rows) == {("m", 4): pytest.approx(3.0)}


def test_prose_of_tokens_hits_the_length() -> None:
    text = " ".join(f"w{i}" for i in range(5000))
    tokenize = lambda s: s.split() * 2  # noqa: E731 - two tokens a word
    out = cb.prose_of_tokens(tokenize, 1000, text)
    assert abs(len(tokenize(out)) - 1000) <= 20
    assert text.startswith(out)
    assert cb.prose_of_tokens(tokenize, 10**6, "a b c") == "a b c"  # shorter than asked: the whole text


def test_prompts_are_distinct() -> None:
    assert len({cb.story_prompt(i) for i in range(max(cb.SESSION_COUNTS))}) == max(cb.SESSION_COUNTS)
    assert len({cb.short_message(i) for i in range(10)}) == 10


def test_ticker_records_ticks_and_a_blocking_call_shows_as_a_stall() -> None:
    import time

    async def main() -> cb.Ticker:
        async with cb.Ticker(0.01).running() as ticker:
            await asyncio.sleep(0.05)
            time.sleep(0.08)  # blocks the loop
            await asyncio.sleep(0.03)
        return ticker

    ticker = asyncio.run(main())
    assert len(ticker.ticks) >= 5
    assert ticker.max_stall_ms >= 60.0


def test_plans_keep_every_session_count() -> None:
    assert cb.SESSION_COUNTS == (1, 2, 4, 8, 16)
    quick, full = cb.Plan.of(True), cb.Plan.of(False)
    assert quick.max_tokens < full.max_tokens and quick.ttft_reps == 3 and full.ttft_reps == 5
    assert cb.ENGINE_SETTINGS["n_seq_max"] >= 18 and cb.ENGINE_SETTINGS["n_ctx"] >= 8192
