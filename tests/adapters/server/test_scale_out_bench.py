"""The scale-out benchmarks' pure parts, without an engine: vLLM's counters read from its Prometheus text
(``kvagent_bench.server.vllm``), the held-out agent's prompt and summary (``proxy_bench``), the load target's
prompt (``load_vllm``) and the fidelity summary (``kvagent_bench.proxy_fidelity``)."""

from __future__ import annotations

import pytest

from kvagent_bench.proxy_fidelity import summarise as fidelity_summary
from kvagent_bench.server.load_vllm import system_prompt as load_prompt
from kvagent_bench.server.proxy_bench import summarise, system_prompt
from kvagent_bench.server.vllm import missing_reason, parse_metrics

pytestmark = pytest.mark.bench

METRICS = """# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="smollm2-135m"} 2932.0
vllm:prefix_cache_queries_total{engine="1",model_name="smollm2-135m"} 68.0
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="smollm2-135m"} 2816.0
vllm:prefix_cache_hits_created 1.7e9
"""


def test_vllms_prefix_cache_counters_are_summed_over_their_labels() -> None:
    assert parse_metrics(METRICS) == {"queries": 3000.0, "hits": 2816.0}
    assert parse_metrics("") == {"queries": 0.0, "hits": 0.0}


def test_a_missing_vllm_is_named_with_the_command_that_builds_it(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: object) -> None:
    monkeypatch.setenv("KVAGENT_VLLM_VENV", str(tmp_path))
    reason = missing_reason()
    assert reason is not None and "make vllm" in reason


def test_only_the_clock_line_changes_between_turns() -> None:
    a, b = system_prompt(3, "doc").split("\n"), system_prompt(4, "doc").split("\n")
    assert [i for i, (x, y) in enumerate(zip(a, b)) if x != y] == [1] and len(a) == len(b)
    assert load_prompt({"order_status": "shipped"}, "doc").split("\n")[1] == "order_status: shipped"


def test_the_summary_skips_the_cold_first_turn_and_reads_the_engines_counters() -> None:
    rows = [{"arm": arm, "turn": t, "ttft_s": ttft, "prompt_tokens": 100, "cached_tokens": hits,
             "vllm_queries": 100.0, "vllm_hits": float(hits)}
            for arm, ttft, hits in (("direct", 2.0, 0), ("proxy", 0.5, 96)) for t in range(3)]
    rows[0]["ttft_s"] = rows[3]["ttft_s"] = 9.0  # turn 0: cold on both, left out
    got = summarise(rows)
    assert got["direct"]["hit_rate"] == 0.0 and got["proxy"]["hit_rate"] == 0.96
    assert got["proxy"]["hit_rate_source"] == "vllm-metrics"
    assert got["ttft_median_ratio"] == 4.0


def test_the_fidelity_summary_counts_flips_and_recoveries_per_model() -> None:
    rows = [{"model": "m", "template": "t", "oracle": o, "proxy": p, "stale": s, "truth": o,
             "flipped": o != s, "recovered": o != s and p == o, "agree": p == o}
            for o, p, s in (("yes", "yes", "no"), ("yes", "no", "no"), ("no", "no", "no"), ("no", "yes", "no"))]
    overall = next(r for r in fidelity_summary(rows) if r["template"] == "all")
    assert (overall["cases"], overall["flips"], overall["recovered"]) == (4, 2, 1)
    assert overall["recovery"] == 0.5 and overall["agree"] == 0.5 and overall["proxy_right"] == 0.5
