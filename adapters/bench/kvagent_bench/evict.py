"""``kvagent bench evict``: eviction policies on real prose (counter-causal surprise, "Back from the Future",
Gould and van den Hengel, 2026, and its baselines).

Four tasks per model, every policy run in the same process so ratios compare like with like:

- ``retention``: facts mentioned once (codes, names, numbers, dates, ...) in public-domain prose
  (``kvagent/data/prose``, cases from :mod:`kvagent_bench.evict_suite`: 1, 2 or 4 facts, the asked one
  early, in the middle or late), streamed through a sequence with chunked cycles (decode ``chunk`` tokens,
  prune to the budget), then the question (pinned) as a cloze and a greedy answer of a few tokens; accuracy
  per policy and budget (a share of the prompt) next to the full cache, with a 95% Wilson interval. Every
  policy sees the same cells until its first cycle, so that prefix is decoded once per case and budget and
  forked into each policy's sequence (:mod:`kvagent_bench.evict_stream`).
- ``perplexity``: streaming perplexity of real continuations, the cache pruned in cycles while the text is
  decoded in chunks; every token's log-probability is scored with the cache it saw; a 95% bootstrap
  interval over 64-token blocks.
- ``latency`` and ``overhead`` (:mod:`kvagent_bench.evict_timing`): one cycle per policy at a cache size,
  next to the prefill of as many tokens; the share of decode time that eviction (capture and cycles) adds.

JSON rows (:func:`kvagent_bench.evict_report.row`) carry ``model, task, policy, budget, score, n, cycle_ms,
ci_low, ci_high, overhead_share``; they are written after every task, so a long run keeps what it measured.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvagent.eviction import Eviction, Evictor
from kvagent_bench.common import RESULTS_DIR, bootstrap_perplexity_interval, median, wilson_interval, write_json
from kvagent_bench.evict_agent import bench_eviction, registry_or_variant
from kvagent_bench.evict_report import breakdown, plot, row
from kvagent_bench.evict_stream import Stream, prefix_length
from kvagent_bench.evict_suite import RetentionCase, make_retention_cases, make_stream_texts, score_answer
from kvagent_bench.evict_timing import latency, overhead

log = logging.getLogger(__name__)

DEFAULT_JSON = RESULTS_DIR / "evict.json"
# surprise-full runs in the latency task only: on 2 CPU cores one full pass over ~640 cells costs ~3 s
POLICIES = ("window", "h2o", "tova", "surprise-token", "surprise")
QUICK_POLICIES = ("window", "surprise-token", "surprise")
LATENCY_POLICIES = ("surprise-token", "surprise-full", "h2o", "tova", "surprise")
BUDGETS = (0.25, 0.5)


@dataclass(frozen=True)
class Plan:
    """What a run measures: retention ``cases`` of ``tokens`` tokens at ``budgets`` (shares of the prompt)
    and perplexity over ``texts`` texts of ``text_tokens``, for ``policies``; latency at cache ``sizes`` (for
    :data:`LATENCY_POLICIES`); overhead at ``overhead_budget`` cells over ``overhead_steps`` decode steps (for
    :data:`POLICIES`); ``chunk`` tokens per cycle."""

    cases: int
    tokens: int
    budgets: tuple[float, ...]
    policies: tuple[str, ...]
    texts: int
    text_tokens: int
    sizes: tuple[int, ...]
    overhead_budget: int
    overhead_steps: int
    chunk: int = 64

    @classmethod
    def for_run(cls, quick: bool, cases: int | None = None) -> Plan:
        """The full plan or the ``--quick`` one (a few minutes per model on 2 cores); ``cases`` overrides."""
        if quick:
            return cls(cases or 3, 512, (0.25,), QUICK_POLICIES, 1, 512, (512,), 256, 128)
        return cls(cases or 30, 1024, BUDGETS, POLICIES, 2, 1024, (512, 4096), 1024, 320)

    @property
    def n_ctx(self) -> int:
        """Cells the retention / perplexity / overhead engine needs: a prompt with its question and answer (and
        the shared prefix beside a fork); for the overhead, the evicting sequence (budget + chunk + margin) and
        the baseline's uncapped cache side by side in one pool."""
        overhead = (self.overhead_budget + self.chunk + 64) + (self.overhead_budget + self.chunk + self.overhead_steps + 64)
        return max(2 * max(self.tokens, self.text_tokens) + 512, overhead)


def load_engine(model: str, n_ctx: int) -> Any:
    """The benchmark's engine: native capture; three sequences (a shared prefix, a policy's fork, spare)."""
    from kvagent.engine import Engine

    return Engine.load(model, n_ctx=n_ctx, n_seq_max=3, capture="native")


# --- retention -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """One policy's answer to one case: ``policy`` ("full": no eviction) at ``budget`` (share of the prompt,
    None for the full cache), the answer's first line, each cycle's ms and the positions kept after it."""

    policy: str
    budget: float | None
    text: str
    cycle_ms: tuple[float, ...]
    kept: tuple[tuple[int, ...], ...]


def case_prompt(backend: Any, case: RetentionCase) -> tuple[list[int], list[int], int]:
    """``(prompt ids, cloze ids, answer tokens)``: the cloze is ``Question: What is <key>?\\nAnswer: <Key>
    is``; up to as many tokens as the answer with its full stop, plus two, are generated."""
    fact = case.asked_fact
    cloze = f"\n\nQuestion: What is {fact.key}?\nAnswer: {fact.key[0].upper() + fact.key[1:]} is"
    max_new = len(backend.tokenize(f" {fact.value}.", special=False)) + 2
    return (backend.bos_ids + backend.tokenize(case.prompt, special=False), backend.tokenize(cloze, special=False),
            max_new)


def ask(backend: Any, stream: Stream, cloze: list[int], max_new: int) -> str:
    """Feed the cloze (pinned), then generate greedily (pinned too) until an end token, a new line, a full
    stop or ``max_new`` tokens; the first line of the answer, stripped."""
    logits = stream.feed(cloze, outputs=False, pin=True)
    out: list[int] = []
    for _ in range(max_new):
        token = int(np.argmax(logits[-1]))
        if backend.is_eog(token):
            break
        out.append(token)
        text = b"".join(backend.token_bytes(t) for t in out).decode("utf-8", "replace")
        if "\n" in text or text.strip().endswith("."):
            break
        logits = stream.feed([token], outputs=False, pin=True)
    return b"".join(backend.token_bytes(t) for t in out).decode("utf-8", "replace").split("\n")[0].strip()


def _advance(stream: Stream, ids: list[int], end: int) -> None:
    """Feed ``ids[stream.next_pos:end]`` (nothing if the stream is there already)."""
    if end > stream.next_pos:
        stream.feed(ids[stream.next_pos : end], outputs=False)


def _recorder(engine: Any, policies: tuple[str, ...], chunk: int) -> Evictor:
    """An Evictor that only records (its stream never cycles): it captures the hidden states when a policy
    needs them, with the first such policy, else it is a window that captures nothing."""
    made = (registry_or_variant(p) for p in policies)
    policy = next((p for p in made if p.needs_hidden), registry_or_variant("window"))
    return Evictor(Eviction(policy, budget=2, chunk=chunk), engine.backend, engine.model.path)


def case_answers(engine: Any, case: RetentionCase, policies: tuple[str, ...], budgets: tuple[float, ...],
                 chunk: int) -> list[Answer]:
    """Every policy's answer at every budget, then the full cache's, sharing the prefix: one base sequence
    decodes the prompt (first token pinned, then ``chunk`` at a time) up to each budget's first cycle, and
    each policy forks from it; the base then finishes the prompt and answers as the full cache."""
    backend = engine.backend
    ids, cloze, max_new = case_prompt(backend, case)
    answers = []
    with engine.scratch() as base_seq:
        base = Stream(backend, base_seq, _recorder(engine, policies, chunk), chunk, cycles=False)
        base.feed(ids[:1], outputs=False, pin=True)
        for budget in sorted(budgets):
            cells = int(budget * len(ids))
            _advance(base, ids, prefix_length(cells, chunk, len(ids)))
            for policy in policies:
                evictor = Evictor(bench_eviction(policy, cells, chunk), backend, engine.model.path)
                with engine.scratch() as seq:
                    stream = base.fork(seq, evictor)
                    _advance(stream, ids, len(ids))
                    text = ask(backend, stream, cloze, max_new)
                answers.append(Answer(policy, budget, text, tuple(stream.cycle_ms), tuple(stream.kept)))
        _advance(base, ids, len(ids))
        answers.append(Answer("full", None, ask(backend, base, cloze, max_new), (), ()))
    return answers


def case_answer_alone(engine: Any, case: RetentionCase, policy: str | None, budget: float | None, chunk: int,
                      hold_prefix: bool = False) -> Answer:
    """One policy's answer decoded from scratch, without a shared prefix (``policy=None``: the full cache);
    what :func:`case_answers` must reproduce.

    llama.cpp's results depend slightly on which cells of the pool hold the tokens, and a shared run places
    later tokens in other cells (its base sequence keeps the prefix's cells, so evicted ones are not reused).
    ``hold_prefix``: a second sequence keeps this run's prefix cells from its first cycle on, as the base
    does, so that both runs use the same cells and must agree exactly.
    """
    backend = engine.backend
    ids, cloze, max_new = case_prompt(backend, case)
    cells = int(budget * len(ids)) if policy is not None and budget is not None else None
    evictor = None if cells is None else Evictor(bench_eviction(policy, cells, chunk), backend, engine.model.path)
    with engine.scratch() as seq, engine.scratch() as holder:  # the holder stays empty unless hold_prefix
        stream = Stream(backend, seq, evictor, chunk, cycles=not hold_prefix)
        stream.feed(ids[:1], outputs=False, pin=True)
        if hold_prefix and cells is not None:
            _advance(stream, ids, prefix_length(cells, chunk, len(ids)))
            backend.seq_cp(seq, holder, 0, -1)
        stream.cycles = True
        stream.cycle_if_due()  # the cycle the last chunk made due, as in a stream that cycled all along
        _advance(stream, ids, len(ids))
        text = ask(backend, stream, cloze, max_new)
    return Answer(policy or "full", budget, text, tuple(stream.cycle_ms), tuple(stream.kept))


def retention(engine: Any, plan: Plan, seed: int, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """Fact-retention accuracy per policy and budget, and of the full cache (``policy="full"``), with 95%
    Wilson intervals; each row lists its ``answers`` (expected, got, ok, depth, kind, band, facts) and the
    accuracy ``by_band``, ``by_kind`` and ``by_facts`` (``[correct, n]``)."""
    backend = engine.backend
    suite = make_retention_cases(plan.cases, plan.tokens, lambda s: len(backend.tokenize(s, special=False)), seed)
    records: dict[tuple[str, float | None], list[dict[str, Any]]] = {}
    cycles: dict[tuple[str, float | None], list[float]] = {}
    for i, case in enumerate(suite):
        progress(f"{engine.model.name} retention case {i + 1}/{len(suite)}")
        for answer in case_answers(engine, case, plan.policies, plan.budgets, plan.chunk):
            key = (answer.policy, answer.budget)
            records.setdefault(key, []).append({
                "expected": case.answer, "got": answer.text, "ok": score_answer(answer.text, case.answer),
                "depth": case.asked_depth, "kind": case.asked_kind, "band": case.band, "facts": len(case.facts),
            })
            cycles.setdefault(key, []).extend(answer.cycle_ms)
    rows = []
    for policy, budget in sorted(records, key=lambda key: key[0] != "full"):  # the full cache first
        answers = records[policy, budget]
        correct = sum(a["ok"] for a in answers)
        rows.append(row(
            engine.model.name, "retention", policy, budget, correct / len(answers), len(answers),
            median(cycles[policy, budget]) if cycles[policy, budget] else None, wilson_interval(correct, len(answers)),
            budget_tokens=None if budget is None else int(budget * plan.tokens), answers=answers,
            by_band=breakdown(answers, "band"), by_kind=breakdown(answers, "kind"),
            by_facts=breakdown(answers, "facts"),
        ))
        log.info("retention %s %s: %d/%d", policy, budget, correct, len(answers))
    return rows


# --- perplexity ----------------------------------------------------------------------------------------------


def perplexity(engine: Any, plan: Plan, seed: int, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """Streaming perplexity with chunked cycles (the full cache as ``policy="full"``): every token is scored
    with the cache it saw when it was decoded; a 95% bootstrap interval over 64-token blocks (seeded)."""
    backend = engine.backend
    tokens = plan.text_tokens
    streams = [
        (backend.bos_ids + backend.tokenize(t, special=False))[:tokens]
        for t in make_stream_texts(plan.texts, tokens, lambda s: len(backend.tokenize(s, special=False)), seed)
    ]
    runs: list[tuple[str, float | None]] = [("full", None)] + [(p, b) for b in plan.budgets for p in plan.policies]
    rows = []
    for policy, budget in runs:
        nll, cycle_ms = [], []
        for i, ids in enumerate(streams):
            progress(f"{engine.model.name} perplexity {policy} {budget or ''} text {i + 1}/{len(streams)}")
            evictor = (Evictor(bench_eviction(policy, int(budget * tokens), plan.chunk),
                               backend, engine.model.path, engine.pool.scratch) if budget else None)
            with engine.scratch() as seq:
                stream = Stream(backend, seq, evictor, plan.chunk)
                first = stream.feed(ids[:1], outputs=True, pin=True)
                logits = np.vstack([first, stream.feed(ids[1:], outputs=True)])
            nll.append(token_nll(logits, ids))
            cycle_ms += stream.cycle_ms
        count = sum(len(x) for x in nll)
        rows.append(row(
            engine.model.name, "perplexity", policy, budget, math.exp(sum(float(x.sum()) for x in nll) / count),
            len(streams), median(cycle_ms) if cycle_ms else None, bootstrap_perplexity_interval(nll, seed=seed),
            budget_tokens=None if budget is None else int(budget * tokens), tokens=count,
        ))
        log.info("perplexity %s %s: %.2f", policy, budget, rows[-1]["score"])
    return rows


def token_nll(logits: np.ndarray, ids: list[int]) -> np.ndarray:
    """``[len(ids) - 1]`` negative log-likelihood (nats) of each token after the first; row t of ``logits``
    predicts token t + 1."""
    lp = logits[:-1].astype(np.float64)
    top = lp.max(1, keepdims=True)
    lse = np.log(np.exp(lp - top).sum(1)) + top[:, 0]
    return lse - lp[np.arange(len(ids) - 1), ids[1:]]


# --- the run -------------------------------------------------------------------------------------------------


TASKS = ("retention", "perplexity", "overhead", "latency")


def run(models: list[str], quick: bool, json_path: Path, command: str,
        progress: Callable[[str], None] = lambda _: None, cases: int | None = None,
        tasks: tuple[str, ...] = TASKS, policies: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    """``tasks`` on every model; writes the JSON after each task (the caller plots). Rows already in
    ``json_path`` (from a run of the same kind, quick or not) for other models or other tasks are kept, so
    models and tasks can be run one at a time; with ``policies`` (every task runs those instead of its own list:
    retention and perplexity next to the full cache, latency next to the prefill), so are the other policies' rows
    of those tasks."""
    unknown = set(tasks) - set(TASKS)
    if unknown:
        raise ValueError(f"unknown eviction benchmark task(s) {sorted(unknown)}: use {', '.join(TASKS)}")
    plan = Plan.for_run(quick, cases)
    if policies:
        plan = replace(plan, policies=tuple(policies))
    rows = _kept_rows(json_path, quick, models, tasks, None if not policies else ("full", "prefill", *policies))

    def save() -> None:
        write_json(json_path, command, rows, quick=quick, chunk=plan.chunk, retention_tokens=plan.tokens,
                   cases=plan.cases, plan=asdict(plan))

    for model in models:
        if set(tasks) - {"latency"}:
            with load_engine(model, plan.n_ctx) as engine:
                if "retention" in tasks:
                    rows += retention(engine, plan, 11, progress)
                    save()
                if "perplexity" in tasks:
                    rows += perplexity(engine, plan, 5, progress)
                    save()
                if "overhead" in tasks:
                    rows += overhead(engine, tuple(policies or POLICIES), plan.overhead_budget, plan.chunk,
                                     plan.overhead_steps, 3, progress)
                    save()
        if "latency" in tasks:
            with load_engine(model, max(plan.sizes) + 256) as engine:
                rows += latency(engine, plan.sizes, tuple(policies or LATENCY_POLICIES), progress)
                save()
    return rows


def _kept_rows(json_path: Path, quick: bool, models: list[str], tasks: tuple[str, ...],
               policies: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    """The rows of ``json_path`` (if it is a run of the same kind) that this run does not measure again: of
    another model, of a task not in ``tasks``, or (``policies`` given) of another policy. Latency's ratio rows
    (``full/fast``, ``fast/prefill``) go with the prefill they divide by."""
    if not json_path.is_file():
        return []
    try:
        old = json.loads(json_path.read_text())
        if old.get("quick") != quick:
            return []
        def measured(r: dict[str, Any]) -> bool:
            if r["task"] not in tasks or not any(r["model"].startswith(m) for m in models):
                return False
            return policies is None or r["policy"] in policies or (r["task"] == "latency" and "/" in r["policy"])

        return [r for r in old["rows"] if not measured(r)]
    except (ValueError, KeyError):
        log.warning("%s is not a benchmark JSON: its rows are not kept", json_path)
        return []


__all__ = [
    "DEFAULT_JSON", "Plan", "case_answer_alone", "case_answers", "load_engine", "perplexity", "plot", "retention", "run",
]
