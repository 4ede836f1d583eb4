"""A prefill chunk larger than the usual one, given up when other work arrives (``CachedSequence.decode_run``
with ``alone_chunk``): pure logic on the fake backend, whose decode a wrapper makes preemptible. The real
abort (llama.cpp's callback in kvagent's native library) is checked in ``tests/integration/test_runtime.py``."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import numpy as np
import pytest

from kvagent.backends.fake import FakeBackend
from kvagent.errors import DecodeAborted
from kvagent.kv.pool import SequencePool
from kvagent.kv.sequence import CachedSequence
from kvagent.kv.work import PAUSE
from kvagent.segments import Rendered


class Preemptible:
    """The fake backend with ``preemptible()``: the ``abort_at``-th preemptible decode raises (nothing decoded)."""

    def __init__(self, abort_at: set[int]) -> None:
        self.inner = FakeBackend()
        self.abort_at, self.calls, self.armed = abort_at, [], False
        self._big = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @contextlib.contextmanager
    def preemptible(self) -> Iterator[None]:
        self.armed = True
        try:
            yield
        finally:
            self.armed = False

    def decode(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[int],
               outputs: Sequence[bool]) -> np.ndarray:
        if self.armed:
            self._big += 1
            if self._big in self.abort_at:
                self.calls.append(("aborted", len(tokens)))
                raise DecodeAborted("preempted")
        self.calls.append(("big" if self.armed else "usual", len(tokens)))
        return self.inner.decode(tokens, positions, seq_ids, outputs)


def run(work: Any) -> tuple[Any, int]:
    pauses = 0
    try:
        step = next(work)
        while True:
            assert step is PAUSE
            pauses += 1
            step = work.send(None)
    except StopIteration as done:
        return done.value, pauses


CASES = [  # alone (per chunk), aborts (which big decodes), expected decode calls
    ("alone throughout", [True] * 8, set(), [("big", 256), ("big", 44)]),
    ("other work waits", [False] * 8, set(), [("usual", 64)] * 4 + [("usual", 44)]),
    ("preempted, then usual chunks", [True, False, False, False, False, False], {1},
     [("aborted", 256)] + [("usual", 64)] * 4 + [("usual", 44)]),
    ("preempted, alone again", [True, True, True], {1}, [("aborted", 256), ("big", 256), ("big", 44)]),
]


@pytest.mark.parametrize(("name", "alone", "aborts", "calls"), CASES, ids=[c[0] for c in CASES])
def test_a_larger_chunk_while_alone_gives_way_to_new_work(name: str, alone: list[bool], aborts: set[int],
                                                          calls: list[tuple[str, int]]) -> None:
    backend = Preemptible(aborts)
    pool = SequencePool(backend)  # type: ignore[arg-type]
    answers = iter(alone)
    seq = pool.take("a test")
    cache = CachedSequence(pool, seq, chunk=64, alone_chunk=256, alone=lambda: next(answers))
    tokens = [int(t) % 50 + 3 for t in range(300)]
    logits, _pauses = run(cache.decode_run(tokens, 0, len(tokens), Rendered(tuple(tokens), ())))
    assert backend.calls == calls
    assert cache.tokens == tuple(tokens) and backend.seq_positions(seq) == list(range(300))
    assert logits.shape == (1, backend.n_vocab) and cache.preempted == len(aborts)


def test_without_alone_chunk_the_usual_chunks_run_unarmed() -> None:
    backend = Preemptible(set())
    pool = SequencePool(backend)  # type: ignore[arg-type]
    cache = CachedSequence(pool, pool.take("a test"), chunk=64, alone_chunk=None, alone=lambda: True)
    run(cache.decode_run(list(range(3, 103)), 0, 100, Rendered(tuple(range(3, 103)), ())))
    assert backend.calls == [("usual", 64), ("usual", 36)]
