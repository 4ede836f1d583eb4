"""The load benchmark's pure parts (``kvagent_bench.server.load``): arrivals, per-point figures, the stop rule and
the erratum / inplace comparison, without a server."""

from __future__ import annotations

import math

import pytest

from kvagent_bench.server.load import (
    TurnRecord,
    arrivals,
    common_prefix,
    compare,
    field_change,
    percentile,
    saturated,
    summarise,
)

pytestmark = pytest.mark.bench  # the kvagent-bench distribution: the full tier


def test_poisson_arrivals_start_at_zero_and_have_the_asked_rate() -> None:
    times = arrivals(2.0, 4000, seed=7)
    assert times[0] == 0.0 and times == sorted(times)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(0.5, rel=0.05)
    assert arrivals(2.0, 10, seed=7) == times[:10]  # seeded


def test_each_turn_changes_a_field_to_a_value_unique_to_agent_and_turn() -> None:
    changes = {field_change(a, t) for a in range(20) for t in range(6)}
    assert len(changes) == 120
    assert [field_change(0, t)[0] for t in range(4)] == ["order_status", "customer_tier", "ticket_id", "order_status"]


def test_percentile_and_common_prefix() -> None:
    assert percentile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.5
    assert percentile([1.0] * 9 + [11.0], 0.9) == pytest.approx(2.0)
    assert math.isnan(percentile([], 0.9))
    assert common_prefix((1, 2, 3), (1, 2, 4, 5)) == 2 and common_prefix((), (1,)) == 0


def record(agent: int, turn: int, start: float, ttft: float, end: float | None, prompt: int = 100, reused: int = 90,
           error: str | None = None) -> TurnRecord:
    return TurnRecord(agent, turn, start, start + ttft if end is not None else None, end, prompt, reused, error)


def test_summarise_counts_completed_errors_and_cut_turns() -> None:
    records = [
        record(0, 0, 0.0, 0.1, 1.0), record(0, 1, 1.0, 0.2, 2.0),
        record(1, 0, 0.5, 0.3, 1.5), record(1, 1, 1.5, 0.0, None, error="RuntimeError: 503"),
        record(2, 0, 2.0, 0.0, None, error="cancelled"),  # cut while waiting since t=2.0
    ]
    row = summarise("erratum", "serve", 1.0, records, arrival=[0.0, 0.5, 2.0], cut_at=6.0, agent_time_s=2.0,
                    turns_per_agent=2, hit_source="server")
    assert row["completed"] == 3 and row["errors"] == 1 and row["censored"] == 1
    assert row["prompt_tokens"] == 300 and row["reused_tokens"] == 270 and row["hit_rate"] == pytest.approx(0.9)
    assert row["offered_rps"] == pytest.approx(6 / (2.0 + 2.0))
    assert row["throughput_rps"] == pytest.approx(3 / 6.0)  # cut at 6 s with a turn still waiting
    assert row["ttft_p90_s"] == pytest.approx(percentile([0.1, 0.2, 0.3, 4.0], 0.9))  # the cut turn waited 4 s
    for key in ("arm", "target", "rate", "hit_rate", "hit_rate_source", "ttft_p50_s", "ttft_p90_s", "throughput_rps",
                "errors", "completed", "prompt_tokens", "reused_tokens"):
        assert key in row


def test_the_sweep_stops_when_throughput_falls_behind_or_ttft_is_too_long() -> None:
    assert not saturated({"throughput_rps": 0.95, "offered_rps": 1.0, "ttft_p90_s": 1.0})
    assert saturated({"throughput_rps": 0.85, "offered_rps": 1.0, "ttft_p90_s": 1.0})
    assert saturated({"throughput_rps": 1.0, "offered_rps": 1.0, "ttft_p90_s": 31.0})
    assert saturated({"throughput_rps": 1.0, "offered_rps": 1.0, "ttft_p90_s": float("nan")})


def test_compare_at_the_highest_rate_both_arms_ran() -> None:
    rows = [
        {"arm": "erratum", "rate": 0.25, "ttft_p90_s": 0.2, "throughput_rps": 1.4, "hit_rate": 0.98},
        {"arm": "erratum", "rate": 0.5, "ttft_p90_s": 0.3, "throughput_rps": 2.8, "hit_rate": 0.98},
        {"arm": "inplace", "rate": 0.25, "ttft_p90_s": 20.0, "throughput_rps": 0.14, "hit_rate": 0.05},
    ]
    out = compare(rows)
    assert out["rate"] == 0.25 and out["ttft_p90_ratio"] == pytest.approx(100.0)
    assert out["throughput_ratio"] == pytest.approx(20.0)
