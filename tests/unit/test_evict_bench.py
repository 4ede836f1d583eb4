"""The eviction benchmark's machinery without a model: where the shared prefix ends, forking a stream on the
fake backend (same answers and kept positions as a run from scratch), the views the latency task builds,
per-token NLL, the rows and the figures."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvagent.backends.fake import FakeBackend
from kvagent.engine import Engine, EngineSettings
from kvagent_bench import evict
from kvagent_bench.evict_agent import (
    COMPACT,
    bench_policy_names,
    calibration_variants,
    compact_positions,
    make_policy,
    split_compact,
)
from kvagent_bench.evict_report import row
from kvagent_bench.evict_stream import prefix_length
from kvagent_bench.evict_suite import make_retention_cases
from kvagent_bench.evict_timing import cache_view

pytestmark = pytest.mark.bench  # the kvagent-bench distribution: the full tier

# (budget, chunk, prompt tokens, tokens decoded before the first cycle): the first token, then whole chunks
# until budget + chunk cells are cached
PREFIXES = [
    (100, 64, 1000, 193),
    (128, 64, 1000, 193),
    (129, 64, 1000, 193),
    (130, 64, 1000, 257),
    (256, 64, 1000, 321),
    (256, 64, 300, 300),  # the prompt ends first
    (2, 1, 10, 3),
]


@pytest.mark.parametrize(("budget", "chunk", "total", "expected"), PREFIXES)
def test_prefix_length(budget: int, chunk: int, total: int, expected: int) -> None:
    got = prefix_length(budget, chunk, total)
    assert got == expected
    if got < total:  # a cycle is due after the last chunk, and was not one chunk earlier
        assert (got - 1) % chunk == 0 and got >= budget + chunk > got - chunk


@pytest.fixture
def fake_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Engine]:
    """An engine on the fake backend (no capture: only policies without hidden states run)."""
    monkeypatch.setenv("KVAGENT_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "fake-model.gguf"
    model.write_bytes(b"GGUF" + bytes(range(60)))
    eng = Engine(EngineSettings(model=str(model), n_ctx=1024, n_seq_max=3), backend=FakeBackend(n_ctx=1024, n_seq_max=3))
    yield eng
    eng.close()


# (policies, budgets, chunk)
SHARED = [
    (("window", "random"), (0.25,), 64),
    (("window", "random"), (0.5, 0.25), 32),
    (("random",), (0.3,), 7),
    # Eviction(compact=True): each fork copies its shared cells before it moves them (else the base's would move)
    (("window/compact", "random/compact", "window"), (0.25,), 64),
    (("random/compact",), (0.5, 0.25), 32),
]


@pytest.mark.parametrize(("policies", "budgets", "chunk"), SHARED)
def test_a_shared_prefix_changes_nothing(fake_engine: Engine, policies: tuple[str, ...], budgets: tuple[float, ...],
                                         chunk: int) -> None:
    """The fake's logits hash every cached cell's content, so equal answers mean equal caches."""
    case = make_retention_cases(1, 300, lambda s: len(fake_engine.backend.tokenize(s, special=False)), 4)[0]
    shared = evict.case_answers(fake_engine, case, policies, budgets, chunk)
    assert [(a.policy, a.budget) for a in shared] == [(p, b) for b in sorted(budgets) for p in policies] + [("full", None)]
    for answer in shared:
        alone = evict.case_answer_alone(fake_engine, case, None if answer.policy == "full" else answer.policy,
                                        answer.budget, chunk)
        assert (answer.text, answer.kept, len(answer.cycle_ms)) == (alone.text, alone.kept, len(alone.cycle_ms))
        assert answer.policy == "full" or len(answer.kept) >= 2
    assert fake_engine.pool.free == 3  # every scratch sequence went back
    compacted = {a.policy: a.text for a in shared if a.budget == 0.25}
    if "window/compact" in compacted:  # the renumbered cells answer otherwise (the fake hashes positions)
        assert compacted["window/compact"] != compacted["window"]


def test_cache_view_shifts_queries_and_previous_tokens_by_one() -> None:
    ids = [5, 6, 7, 8, 9]
    hidden = np.arange(15, dtype=np.float32).reshape(5, 3)
    view = cache_view(ids, hidden, tuple("abcde"), Path("m.gguf"), 4, 2)
    assert view.tokens.tolist() == [5, 6, 7, 8] and view.positions.tolist() == [0, 1, 2, 3]
    assert view.new.tolist() == [False, False, True, True] and not view.pinned.any()
    assert np.isnan(view.query_hidden[0]).all() and np.array_equal(view.query_hidden[1:], hidden[:3])
    assert view.previous.tolist() == [-1, 5, 6, 7] and view.texts == ("a", "b", "c", "d")


def test_token_nll_is_the_negative_log_softmax_of_the_next_token() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 11)).astype(np.float32) * 4
    ids = rng.integers(0, 11, size=6).tolist()
    probs = np.exp(logits.astype(np.float64)) / np.exp(logits.astype(np.float64)).sum(1, keepdims=True)
    expected = [-np.log(probs[t, ids[t + 1]]) for t in range(5)]
    assert evict.token_nll(logits, ids) == pytest.approx(expected)


def test_every_row_has_the_common_keys() -> None:
    r = row("m", "latency", "h2o", None, None, 512, 3.5, method="x")
    assert {k: r[k] for k in ("ci_low", "ci_high", "overhead_share", "method")} == {
        "ci_low": None, "ci_high": None, "overhead_share": None, "method": "x"}
    assert row("m", "retention", "window", 0.25, 0.5, 30, None, (0.3, 0.7))["ci_high"] == 0.7


@pytest.mark.parametrize("quick", [True, False])
def test_plans_fit_their_engine(quick: bool) -> None:
    plan = evict.Plan.for_run(quick)
    assert plan.n_ctx >= plan.tokens + 64  # a prompt, its question and answer, in the full cache
    assert plan.n_ctx >= plan.overhead_budget + plan.chunk + plan.overhead_steps  # the uncapped baseline
    assert evict.Plan.for_run(quick, cases=7).cases == 7


def sample_rows() -> list[dict[str, Any]]:
    rows = []
    for model in ("a", "b"):
        rows.append(row(model, "retention", "full", None, 1.0, 30, None, (0.88, 1.0)))
        for budget in (0.25, 0.5):
            for i, policy in enumerate(("window", "surprise")):
                rows.append(row(model, "retention", policy, budget, 0.2 * (i + 1), 30, 1.0, (0.1, 0.6)))
                rows.append(row(model, "perplexity", policy, budget, 30.0 + i, 2, 1.0, (25.0, 36.0)))
        rows.append(row(model, "overhead", "window", 1024, 0.02, 320, 0.5, overhead_share=0.02))
        rows += [row(model, "latency", p, None, None, n, 10.0 * n) for p in ("prefill", "h2o") for n in (512, 4096)]
        rows.append(row(model, "latency", "fast/prefill", None, 0.1, 512, None))
    return rows


@pytest.mark.parametrize(("stem", "want"), [(None, "evict"), ("evict-overhead-rerun", "evict-overhead-rerun")])
def test_plot_writes_one_figure_per_task_named_after_its_json(tmp_path: Path, stem: str | None, want: str) -> None:
    paths = evict.plot(sample_rows(), tmp_path) if stem is None else evict.plot(sample_rows(), tmp_path, stem)
    assert sorted(p.name for p in paths) == [f"{want}-{t}.png" for t in ("latency", "overhead", "perplexity", "retention")]
    assert all(p.stat().st_size > 1000 for p in paths)


LATENCY_ROWS = {("m", "latency", p) for p in ("h2o", "prefill", "fast/prefill", "contrast")}


@pytest.mark.parametrize(("tasks", "policies", "kept"), [
    (("perplexity",), None, {("m", "retention", "window"), ("other", "perplexity", "window")} | LATENCY_ROWS),
    (("perplexity",), ("full", "hybrid"), {("m", "retention", "window"), ("other", "perplexity", "window"),
                                           ("m", "perplexity", "window")} | LATENCY_ROWS),
    (("overhead",), ("full", "hybrid"), {("m", "retention", "window"), ("other", "perplexity", "window"),
                                         ("m", "perplexity", "window"), ("m", "perplexity", "full"),
                                         ("m", "perplexity", "hybrid")} | LATENCY_ROWS),
    # latency with chosen policies: their rows, the prefill and the ratios over it go; other policies' rows stay
    (("latency",), ("full", "prefill", "contrast"), {("m", "retention", "window"), ("other", "perplexity", "window"),
                                                    ("m", "perplexity", "window"), ("m", "perplexity", "full"),
                                                    ("m", "perplexity", "hybrid"), ("m", "latency", "h2o")}),
])
def test_a_run_replaces_only_the_rows_it_measures(tmp_path: Path, tasks: tuple[str, ...],
                                                  policies: tuple[str, ...] | None, kept: set[tuple[str, str, str]]) -> None:
    import json

    old = [{"model": m, "task": t, "policy": p} for m, t, p in [
        ("m", "retention", "window"), ("m", "perplexity", "window"), ("m", "perplexity", "full"),
        ("m", "perplexity", "hybrid"), ("other", "perplexity", "window"), ("m", "latency", "h2o"),
        ("m", "latency", "prefill"), ("m", "latency", "fast/prefill"), ("m", "latency", "contrast")]]
    path = tmp_path / "evict.json"
    path.write_text(json.dumps({"quick": False, "rows": old}))
    got = evict._kept_rows(path, False, ["m"], tasks, policies)
    assert {(r["model"], r["task"], r["policy"]) for r in got} == kept


@pytest.mark.parametrize("name", ["contrast", "hybrid-contrast@0.5", "window"])
def test_the_compact_suffix_names_the_same_policy(name: str) -> None:
    assert split_compact(name + COMPACT) == (name, True)
    assert split_compact(name) == (name, False)
    variants = calibration_variants(shared=False)
    assert make_policy(name + COMPACT, variants).name == make_policy(name, variants).name
    assert name + COMPACT in bench_policy_names(compact=True)
    assert name + COMPACT not in bench_policy_names()


# (tokens decoded, positions evicted): compacting renumbers the kept cells 0..k-1 in order
COMPACTIONS = [
    (12, [3, 4, 5, 8]),
    (12, [0, 1]),  # a gap at the start
    (12, [11]),  # at the end: nothing moves
    (12, []),
    (40, list(range(4, 30, 2))),  # a gap every other position
]


@pytest.mark.parametrize(("n", "evicted"), COMPACTIONS)
def test_compact_positions_renumbers_the_kept_cells_in_order(n: int, evicted: list[int]) -> None:
    fake = FakeBackend(n_ctx=256, n_seq_max=3)
    tokens = [fake.tokenize(f"w{i}", special=False)[0] for i in range(n)]
    fake.decode(tokens, list(range(n)), [0] * n, [False] * n)
    fake.seq_cp(0, 1, 0, -1)
    for p in evicted:
        fake.seq_rm(1, p, p + 1)
    fake.seq_restore(1, fake.seq_save(1))  # own cells, as the benchmark makes them before it shifts
    kept = [p for p in range(n) if p not in evicted]
    at = compact_positions(fake, 1, kept)
    assert at == len(kept)
    assert fake.seq_positions(1) == list(range(at))
    cells = json.loads(fake.seq_save(1))["cells"]
    assert [token for _, token, _ in cells] == [tokens[p] for p in kept]
    assert fake.seq_positions(0) == list(range(n))  # the sequence it was copied from did not move
