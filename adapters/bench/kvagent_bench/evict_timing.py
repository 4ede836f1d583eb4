"""The eviction benchmark's timings (``kvagent bench evict``): one cycle per policy, and what eviction adds
to decoding.

- :func:`latency`: one scoring cycle at a cache of ``n`` cells, timed the same way for every policy (an
  incremental policy keeps state between calls): the policy first scores the cache's first ``n - 64``
  cells and is told they were all kept, then one cycle over all ``n`` cells, the last 64 new, is timed.
  The prefill of the ``n`` tokens (with capture) is timed in the same run, for scale.
- :func:`overhead`: greedy decoding of ``D`` tokens through an :class:`~kvagent.eviction.Evictor` (capture
  and cycles included) against the same tokens teacher-forced with no eviction and no capture.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvagent.eviction import Eviction, Evictor
from kvagent.policies import CacheView, FullSurprise
from kvagent_bench.common import median
from kvagent_bench.evict_agent import bench_eviction, registry_or_variant
from kvagent_bench.evict_report import row
from kvagent_bench.evict_stream import Stream, greedy
from kvagent_bench.evict_suite import make_stream_texts

log = logging.getLogger(__name__)

NEW = 64  # tokens decoded since the previous cycle in a timed cycle (the benchmark's chunk)


def cache_view(ids: list[int], hidden: np.ndarray, texts: tuple[str, ...], model_path: Any, n: int,
               new_from: int) -> CacheView:
    """The view a cycle gets of contiguous cells ``0..n-1`` holding ``ids[:n]``, those from ``new_from`` on
    new; ``query_hidden`` / ``previous`` are the row and token at ``p - 1`` (NaN / -1 for the first), as
    :meth:`~kvagent.eviction.Evictor.cycle` fills them."""
    pos = np.arange(n)
    rows = hidden[:n]
    return CacheView(
        tokens=np.asarray(ids[:n], dtype=np.int64), positions=pos, pinned=np.zeros(n, bool), new=pos >= new_from,
        hidden=rows, model_path=model_path,
        query_hidden=np.vstack([np.full((1, rows.shape[1]), np.nan, np.float32), rows[:-1]]),
        previous=np.concatenate([[-1], np.asarray(ids[: n - 1], dtype=np.int64)]), texts=texts[:n],
    )


def time_cycle(name: str, before: CacheView, view: CacheView) -> float:
    """ms of one ``score`` of a fresh policy ``name`` on ``view``, after it scored (or, for the full
    surprise pass, mirrored) ``before`` and was told every cell of it was kept."""
    policy = registry_or_variant(name)
    inner = getattr(policy, "inner", policy)
    if isinstance(inner, FullSurprise):
        inner.update_mirror(before)  # the mirror cache exists before a cycle; a cycle only extends it
    else:
        policy.score(before)
    policy.kept(before.positions)
    start = time.perf_counter()
    policy.score(view)
    return (time.perf_counter() - start) * 1000


def latency(engine: Any, sizes: tuple[int, ...], policies: tuple[str, ...],
            progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """Rows per cache size ``n``: one cycle per policy, ``policy="prefill"`` (decoding the ``n`` tokens with
    capture, ms), and the ratios ``full/fast`` (surprise-full over surprise) and ``fast/prefill``."""
    backend, model = engine.backend, engine.model.name
    text = make_stream_texts(1, max(sizes), lambda s: len(backend.tokenize(s, special=False)), 7)[0]
    rows = []
    for n in sizes:
        ids = (backend.bos_ids + backend.tokenize(text, special=False))[:n]
        recorder = Evictor(Eviction("surprise", budget=n - NEW, chunk=NEW), backend, engine.model.path)
        with engine.scratch() as seq:
            progress(f"{model} latency: prefill of {n} tokens with capture")
            start = time.perf_counter()
            recorder.decode(ids, range(n), [seq] * n, [False] * (n - 1) + [True])
            prefill_ms = (time.perf_counter() - start) * 1000
        hidden = recorder.hidden_rows(np.arange(n))
        texts = recorder.texts(np.asarray(ids))
        before = cache_view(ids, hidden, texts, engine.model.path, n - NEW, 0)
        view = cache_view(ids, hidden, texts, engine.model.path, n, n - NEW)
        by = {"prefill": prefill_ms}
        for name in policies:
            progress(f"{model} latency: {name} at n={n}")
            by[name] = time_cycle(name, before, view)
        rows += [row(model, "latency", name, None, None, n, ms) for name, ms in by.items()]
        if "surprise-token" in by and "surprise-full" in by:  # the paper's comparison: both token-level passes
            rows.append(row(model, "latency", "full/fast", None, by["surprise-full"] / by["surprise-token"], n, None))
        if "surprise" in by:  # the default policy's cycle (span-level over the incremental pass)
            rows.append(row(model, "latency", "fast/prefill", None, by["surprise"] / prefill_ms, n, None))
        log.info("latency n=%d: %s", n, {k: round(v, 1) for k, v in by.items()})
    return rows


def overhead(engine: Any, policies: tuple[str, ...], budget: int, chunk: int, steps: int, seed: int,
             progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """Per policy: a prompt of ``budget + chunk`` tokens (its cycle is not timed), then ``steps`` greedy
    decode steps through the Evictor, timed with their capture and cycles; the baseline, on a second
    sequence, decodes the same prompt and is teacher-forced the same tokens with no eviction and no capture.
    The two runs alternate step by step, so that both see the same load of a shared machine.
    ``overhead_share`` (also the score) = (evicting time - baseline time) / baseline time; ``cycle_ms`` the
    median cycle among the steps, ``cycle_ms_total`` their sum."""
    backend, model = engine.backend, engine.model.name
    length = budget + chunk
    text = make_stream_texts(1, length, lambda s: len(backend.tokenize(s, special=False)), seed)[0]
    ids = (backend.bos_ids + backend.tokenize(text, special=False))[:length]
    rows = []
    for name in policies:
        progress(f"{model} overhead: {name}, {steps} decode steps")
        evictor = Evictor(bench_eviction(name, budget, chunk), backend, engine.model.path)
        with engine.scratch() as seq, engine.scratch() as base_seq:
            evicting, plain = Stream(backend, seq, evictor, chunk), Stream(backend, base_seq, None, chunk)
            logits, base_logits = _feed_prompt(evicting, ids), _feed_prompt(plain, ids)
            prompt_cycles = len(evicting.cycle_ms)
            evict_s = base_s = 0.0
            for _ in range(steps):
                start = time.perf_counter()
                token = greedy(backend, logits[-1])
                logits = evicting.feed([token], outputs=False)
                mid = time.perf_counter()
                greedy(backend, base_logits[-1])  # the same work; the token is the evicting run's (teacher-forced)
                base_logits = plain.feed([token], outputs=False)
                evict_s, base_s = evict_s + mid - start, base_s + time.perf_counter() - mid
            cycles = evicting.cycle_ms[prompt_cycles:]
        share = (evict_s - base_s) / base_s
        rows.append(row(model, "overhead", name, budget, share, steps, median(cycles) if cycles else None,
                        overhead_share=share, budget_tokens=budget, cycles=len(cycles), cycle_ms_total=sum(cycles),
                        decode_ms=evict_s * 1000, baseline_ms=base_s * 1000))
        log.info("overhead %s: %.1f%% (%d cycles, %.0f ms)", name, 100 * share, len(cycles), sum(cycles))
    return rows


def _feed_prompt(stream: Stream, prompt: list[int]) -> np.ndarray:
    """Feed ``prompt`` (the first token pinned, as every benchmark stream); the last token's logits."""
    stream.feed(prompt[:1], outputs=False, pin=True)
    return stream.feed(prompt[1:], outputs=False)
