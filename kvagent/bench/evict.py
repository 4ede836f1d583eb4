"""``kvagent bench evict``: eviction policies on real prose (source paper B and its baselines).

Three tasks per model, every policy run in the same process so ratios compare like with like:

- ``retention``: facts mentioned once (codes, names, numbers) at random depths of 2k tokens of
  public-domain prose (``kvagent/data/prose``), streamed through a session with chunked cycles
  (infer ``chunk`` tokens, prune to the budget), then the question (pinned) and a greedy answer of a
  few tokens; accuracy per policy and budget (25% / 50% of the prompt) next to the full cache.
- ``perplexity``: streaming perplexity of real continuations, the cache pruned in cycles while the
  text is decoded in chunks; every token's log-probability is scored with the cache it saw.
- ``latency``: one scoring cycle at cache sizes 512 and 4096 for surprise fast vs full (ratio in one
  run), H2O and TOVA. Full surprise's mirror cache is built before timing: a cycle only extends it.

JSON rows carry at least ``model, task, policy, budget, score, cycle_ms``.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from kvagent.bench.common import RESULTS_DIR, median, write_json

log = logging.getLogger(__name__)

DEFAULT_JSON = RESULTS_DIR / "evict.json"
# surprise-full runs in the latency task only: on 2 CPU cores one full pass over ~640 cells costs ~3 s,
# ~35 s per 2k-token case; its ranking is compared with the fast one in the tests (rank correlation)
POLICIES = ("window", "random", "importance", "h2o", "tova", "surprise", "surprise-paper")
QUICK_POLICIES = ("window", "h2o", "tova", "surprise")
BUDGETS = (0.25, 0.5)


def _engine(model: str, n_ctx: int) -> Any:
    from kvagent.engine import Engine

    return Engine.load(model, n_ctx=n_ctx, n_seq_max=3, capture="native")


class _Stream:
    """One sequence fed in chunks with eviction cycles (``evictor=None``: the full cache).

    Drives the :class:`~kvagent.eviction.Evictor` the way a session does (infer ``chunk`` tokens, prune
    to the budget), but lets the benchmark read every row of logits and pin chosen positions.
    """

    def __init__(self, backend: Any, seq: int, evictor: Any, chunk: int) -> None:
        self.backend, self.seq, self.evictor, self.chunk = backend, seq, evictor, chunk
        self.tokens: dict[int, int] = {}
        self.pinned: set[int] = set()
        self.cycle_ms: list[float] = []
        self.next_pos = 0

    def feed(self, ids: list[int], outputs: bool, pin: bool = False) -> np.ndarray:
        """Decode ``ids`` after what was fed; returns logits of every token (``outputs``) or the last."""
        rows = []
        for s in range(0, len(ids), self.chunk):
            part = ids[s : s + self.chunk]
            pos = list(range(self.next_pos, self.next_pos + len(part)))
            flags = [outputs] * (len(part) - 1) + [True]
            if self.evictor is not None:
                logits = self.evictor.decode(part, pos, self.seq, flags)
            else:
                logits = self.backend.decode(part, pos, [self.seq] * len(part), flags)
            rows.append(logits)
            self.tokens.update(zip(pos, part))
            if pin:
                self.pinned.update(pos)
            self.next_pos += len(part)
            if self.evictor is not None and self.evictor.due(len(self.tokens)):
                cells = sorted(self.tokens)
                report = self.evictor.cycle(self.seq, [self.tokens[p] for p in cells], cells,
                                            [p in self.pinned for p in cells])
                for p in report.evicted:
                    del self.tokens[p]
                self.cycle_ms.append(report.cycle_ms)
        return np.vstack(rows) if outputs else rows[-1][-1:]


def retention(engine: Any, policies: tuple[str, ...], budgets: tuple[float, ...], cases: int, tokens: int,
              chunk: int, seed: int, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """Fact-retention accuracy per policy and budget (plus the full cache, ``policy="full"``).

    The prose (with its facts) streams through the cache in cycles; then the question, pinned, as a
    cloze (``Question: What is <key>?\nAnswer: <Key> is``) and up to 8 greedy tokens, judged by
    ``evict_suite.score_answer``. The first token (the sink) is pinned too.
    """
    from kvagent.bench.evict_suite import make_retention_cases, score_answer
    from kvagent.eviction import Eviction, Evictor

    backend = engine.backend
    suite = make_retention_cases(cases, tokens, lambda s: len(backend.tokenize(s, special=False)), seed)
    runs: list[tuple[str, float | None]] = [("full", None)] + [(p, b) for b in budgets for p in policies]
    rows = []
    for policy, budget in runs:
        correct, cycle_ms, depths, answers = 0, [], [], []
        for i, case in enumerate(suite):
            progress(f"{engine.model.name} retention {policy} {budget or ''} case {i + 1}/{len(suite)}")
            ids = backend.bos_ids + backend.tokenize(case.prompt, special=False)
            fact = case.asked_fact
            cloze = f"\n\nQuestion: What is {fact.key}?\nAnswer: {fact.key[0].upper() + fact.key[1:]} is"
            evictor = (Evictor(Eviction(policy, budget=int(budget * len(ids)), chunk=chunk), backend, engine.model.path)
                       if budget else None)
            with engine.scratch() as seq:
                stream = _Stream(backend, seq, evictor, chunk)
                stream.feed(ids[:1], outputs=False, pin=True)
                stream.feed(ids[1:], outputs=False)
                logits = stream.feed(backend.tokenize(cloze, special=False), outputs=False, pin=True)
                out: list[int] = []
                for _ in range(8):
                    token = int(np.argmax(logits[-1]))
                    if backend.is_eog(token):
                        break
                    out.append(token)
                    text = b"".join(backend.token_bytes(t) for t in out).decode("utf-8", "replace")
                    if "\n" in text or text.strip().endswith("."):
                        break
                    logits = stream.feed([token], outputs=False, pin=True)
            answer = b"".join(backend.token_bytes(t) for t in out).decode("utf-8", "replace").split("\n")[0]
            cycle_ms += stream.cycle_ms
            ok = score_answer(answer, fact.value)
            correct += ok
            depths.append(case.asked_depth)
            answers.append({"expected": fact.value, "got": answer.strip(), "ok": ok, "depth": case.asked_depth})
        rows.append({
            "model": engine.model.name, "task": "retention", "policy": policy, "budget": budget,
            "budget_tokens": None if budget is None else int(budget * tokens), "score": correct / len(suite),
            "n": len(suite), "cycle_ms": median(cycle_ms) if cycle_ms else None, "answers": answers,
        })
        log.info("retention %s %s: %.2f", policy, budget, correct / len(suite))
    return rows


def perplexity(engine: Any, policies: tuple[str, ...], budgets: tuple[float, ...], texts: int, tokens: int,
               chunk: int, seed: int, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """Streaming perplexity with chunked cycles (the full cache as ``policy="full"``): every token is
    scored with the cache it saw when it was decoded."""
    from kvagent.bench.evict_suite import make_stream_texts
    from kvagent.eviction import Eviction, Evictor

    backend = engine.backend
    streams = [
        (backend.bos_ids + backend.tokenize(t, special=False))[:tokens]
        for t in make_stream_texts(texts, tokens, lambda s: len(backend.tokenize(s, special=False)), seed)
    ]
    runs: list[tuple[str, float | None]] = [("full", None)] + [(p, b) for b in budgets for p in policies]
    rows = []
    for policy, budget in runs:
        nll, count, cycle_ms = 0.0, 0, []
        for i, ids in enumerate(streams):
            progress(f"{engine.model.name} perplexity {policy} {budget or ''} text {i + 1}/{len(streams)}")
            evictor = Evictor(Eviction(policy, budget=int(budget * tokens), chunk=chunk), backend, engine.model.path) if budget else None
            with engine.scratch() as seq:
                stream = _Stream(backend, seq, evictor, chunk)
                first = stream.feed(ids[:1], outputs=True, pin=True)
                logits = np.vstack([first, stream.feed(ids[1:], outputs=True)])
            lp = logits[:-1].astype(np.float64)  # row t predicts token t+1
            lse = np.log(np.exp(lp - lp.max(1, keepdims=True)).sum(1)) + lp.max(1)
            nll += float((lse - lp[np.arange(len(ids) - 1), ids[1:]]).sum())
            count += len(ids) - 1
            cycle_ms += stream.cycle_ms
        rows.append({
            "model": engine.model.name, "task": "perplexity", "policy": policy, "budget": budget,
            "budget_tokens": None if budget is None else int(budget * tokens), "score": math.exp(nll / count),
            "n": len(streams), "tokens": count, "cycle_ms": median(cycle_ms) if cycle_ms else None,
        })
        log.info("perplexity %s %s: %.2f", policy, budget, rows[-1]["score"])
    return rows


def latency(model: str, sizes: tuple[int, ...], policies: tuple[str, ...], reps: int,
            progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """Time one scoring cycle per policy at each cache size, on hidden states captured from llama.cpp."""
    from kvagent.bench.evict_suite import make_stream_texts
    from kvagent.eviction import Eviction, Evictor
    from kvagent.policies import CacheView, FullSurprise, get_policy

    n_max = max(sizes)
    engine = _engine(model, n_max + 256)
    rows = []
    with engine:
        backend = engine.backend
        text = make_stream_texts(1, n_max, lambda s: len(backend.tokenize(s, special=False)), 7)[0]
        ids = (backend.bos_ids + backend.tokenize(text, special=False))[:n_max]
        recorder = Evictor(Eviction("surprise", budget=n_max, chunk=64), backend, engine.model.path)
        with engine.scratch() as seq:
            progress(f"{model} latency: decoding {n_max} tokens with capture")
            recorder.decode(ids, range(n_max), seq, [False] * (n_max - 1) + [True])
        hidden = recorder.hidden_rows(np.arange(n_max))
        for n in sizes:
            view = CacheView(np.array(ids[:n]), np.arange(n), np.zeros(n, bool), np.ones(n, bool), hidden[:n], engine.model.path)
            for name in policies:
                policy = get_policy(name)
                inner = getattr(policy, "inner", policy)
                if isinstance(inner, FullSurprise):
                    progress(f"{model} latency: building the full pass's mirror cache at n={n}")
                    inner.update_mirror(view)  # the cache exists before a cycle; a cycle only extends it
                else:
                    policy.score(view)  # warm-up (loads weights, allocates)
                times = []
                for _ in range(reps):
                    progress(f"{model} latency: {name} at n={n}")
                    start = time.perf_counter()
                    policy.score(replace(view, new=np.arange(n) >= n - 128))  # a cycle's new tokens
                    times.append((time.perf_counter() - start) * 1000)
                rows.append({"model": engine.model.name, "task": "latency", "policy": name, "budget": None,
                             "score": None, "n": n, "cycle_ms": median(times)})
        for n in sizes:  # the ratio, measured in this run
            by = {r["policy"]: r["cycle_ms"] for r in rows if r["n"] == n}
            if "surprise" in by and "surprise-full" in by:
                rows.append({"model": engine.model.name, "task": "latency", "policy": "full/fast", "budget": None,
                             "score": by["surprise-full"] / by["surprise"], "n": n, "cycle_ms": None})
    return rows


def run(models: list[str], quick: bool, json_path: Path, command: str,
        progress: Callable[[str], None] = lambda _: None, cases: int | None = None) -> list[dict[str, Any]]:
    """Every task on every model; writes JSON (and the caller plots). Rows already in ``json_path`` for
    other models are kept, so models can be run one at a time."""
    import json

    policies = QUICK_POLICIES if quick else POLICIES
    tokens = 1024 if quick else 2048
    cases = cases or (2 if quick else 5)
    chunk = 128
    rows: list[dict[str, Any]] = []
    if json_path.is_file():
        try:
            old = json.loads(json_path.read_text())
            if old.get("quick") == quick:
                rows = [r for r in old["rows"] if not any(r["model"].startswith(m) for m in models)]
        except (ValueError, KeyError):
            rows = []
    for model in models:
        engine = _engine(model, tokens + 512)
        with engine:
            rows += retention(engine, policies, (0.25,) if quick else BUDGETS, cases, tokens, chunk, 11, progress)
            rows += perplexity(engine, policies, (0.25,) if quick else BUDGETS, 1 if quick else 2,
                               512 if quick else 1024, 64, 5, progress)
        rows += latency(model, (512,) if quick else (512, 4096), ("surprise", "surprise-full", "h2o", "tova"),
                        1, progress)
        write_json(json_path, command, rows, quick=quick, chunk=chunk, retention_tokens=tokens, cases=cases)
    return rows


def plot(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """One PNG per task next to the JSON: ``evict-<task>.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for task, ylabel in (("retention", "accuracy"), ("perplexity", "perplexity"), ("latency", "ms per cycle")):
        sel = [r for r in rows if r["task"] == task and r["policy"] != "full/fast"]
        if not sel:
            continue
        # the full cache (budget None) is drawn inside every budget group, not as a group of its own
        groups = sorted({(r["model"], r["budget"] if task != "latency" else r["n"]) for r in sel
                         if task == "latency" or r["budget"] is not None}, key=str)
        policies = list(dict.fromkeys(r["policy"] for r in sel))
        fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups)), 4))
        width = 0.8 / max(len(policies), 1)
        for j, pol in enumerate(policies):
            vals = []
            for g in groups:
                hit = [r for r in sel if r["policy"] == pol and (r["model"], r["budget"] if task != "latency" else r["n"]) == g]
                if not hit and pol == "full":  # the full cache has no budget: draw it in every group
                    hit = [r for r in sel if r["policy"] == "full" and r["model"] == g[0]]
                vals.append(hit[0]["score" if task != "latency" else "cycle_ms"] if hit else np.nan)
            ax.bar(np.arange(len(groups)) + j * width, vals, width, label=pol)
        ax.set_xticks(np.arange(len(groups)) + 0.4 - width / 2)
        ax.set_xticklabels([f"{m}\n{'n=' if task == 'latency' else 'budget '}{b}" for m, b in groups], fontsize=8)
        ax.set_ylabel(ylabel)
        if task == "latency":
            ax.set_yscale("log")
        ax.set_title(f"eviction: {task}")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        path = out_dir / f"evict-{task}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
