"""Scheduler: one worker thread that makes every native call, batching sessions' decode steps.

Every operation on a session is a unit of work (a generator, ``kv.work``) submitted with its owner. The
worker keeps one FIFO per owner, so calls on one session run in the order they were made, and runs the
heads of all FIFOs together: each head advances to its next yield (a prefill advances one chunk of at
most ``chunk`` tokens, so a long prefill no longer blocks short requests); every :class:`DecodeStep`
yielded in a round is decoded in one ``llama_decode`` (continuous batching: one token per generating
session per round). Work that arrived since the last round goes first, so a short request's prefill is
not queued behind a long one's next chunk. Callers wait on a future: a thread blocks on it, a coroutine
awaits it (``kvagent.aio``), and nobody waits on the pool's lock while a decode runs.

Cancelling a job throws :class:`Cancelled` into its generator at its next step, whose handlers roll back.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
from collections import deque
from typing import Any, Callable, Hashable, TypeVar

import numpy as np

from kvagent.errors import KVAgentError
from kvagent.kv.pool import SequencePool
from kvagent.kv.work import DecodeStep, Work, drive

log = logging.getLogger(__name__)
T = TypeVar("T")


class Cancelled(KVAgentError):
    """The work was cancelled (a closed stream, a cancelled task) and rolled back."""


class EngineClosedError(KVAgentError):
    """The engine was closed while work was queued."""


class Job:
    """One unit of work, its owner and its result (a ``concurrent.futures.Future``)."""

    _ids = itertools.count()

    def __init__(self, owner: Hashable, work: Work[Any], ready: Callable[[], bool] | None) -> None:
        self.owner = owner
        self.work = work
        self.ready = ready or (lambda: True)
        self.future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.id = next(self._ids)
        self.started = False
        self.cancel_requested = False
        self.pending: DecodeStep | None = None  # waiting for the shared batch
        self.value: Any = None  # what to send at the next advance
        self.error: BaseException | None = None  # what to throw at the next advance (a failed batch)


def on_done(job: Job, callback: Callable[[Any, BaseException | None], None]) -> None:
    """Call ``callback(result, error)`` when ``job`` ends (at once if it has; from the worker otherwise)."""
    def settle(future: concurrent.futures.Future[Any]) -> None:
        error = future.exception()
        callback(None if error is not None else future.result(), error)
    job.future.add_done_callback(settle)


class Scheduler:
    """Runs work for many owners on one thread; see the module docstring. Started on first use."""

    def __init__(self, pool: SequencePool, *, name: str = "kvagent-engine") -> None:
        self.pool = pool
        self._cond = threading.Condition()
        self._queues: dict[Hashable, deque[Job]] = {}
        self._thread: threading.Thread | None = None
        self._closing = False
        self._name = name
        self._current: Hashable | None = None  # the owner of the job being advanced
        self.rounds = 0  # scheduling rounds run (for tests and benchmarks)
        self.batched_tokens = 0  # decode steps decoded in shared batches

    # -- submitting ---------------------------------------------------------------------------------
    def alone(self) -> bool:
        """Whether the job being advanced is the only work there is (no other owner has a job queued, none waits
        for the shared batch): a prefill may then take larger chunks, nobody waits behind them. Read without the
        lock: a job that arrives as this is read waits one chunk more, as it would have anyway."""
        current = self._current
        return all(not q or owner == current for owner, q in list(self._queues.items()))

    @property
    def on_worker(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, owner: Hashable, work: Work[Any], ready: Callable[[], bool] | None = None) -> Job:
        """Queue ``work`` behind ``owner``'s earlier work; returns the job (its ``future`` holds the result)."""
        job = Job(owner, work, ready)
        with self._cond:
            if self._closing:
                work.close()
                raise EngineClosedError("the engine is closed: load it again")
            self._queues.setdefault(owner, deque()).append(job)
            self._start()
            self._cond.notify_all()
        if self._current is not None and owner != self._current:
            # a prefill chunk larger than the usual one may be running for another owner: stop it (it is retried
            # in usual chunks after this job's first step; only a decode made preemptible can be stopped)
            request = getattr(self.pool.backend, "request_preemption", None)
            if request is not None:
                request()
        return job

    def run(self, owner: Hashable, work: Work[T], *, timeout: float | None = None) -> T:
        """Run ``work`` and return its result: inline when called from the worker itself (a nested call,
        e.g. an edit strategy calling ``session.extend``), else through the queue, blocking this thread.
        ``timeout`` (seconds, not inline): past it the job is cancelled, rolled back, and ``TimeoutError`` raised."""
        if self.on_worker:
            return drive(work, self.pool.backend)
        job = self.submit(owner, work)
        try:
            return job.future.result(timeout)  # type: ignore[no-any-return]
        except concurrent.futures.TimeoutError:
            self.cancel(job, wait=True)
            error = job.future.exception()
            if error is None:  # it finished in between: keep its result
                return job.future.result()  # type: ignore[no-any-return]
            if isinstance(error, Cancelled):
                raise TimeoutError(f"the call took longer than {timeout} s: cancelled and rolled back") from None
            raise error from None

    def cancel(self, job: Job, *, wait: bool = False) -> None:
        """Stop ``job`` at its next step (rolled back by its own handlers); its future raises Cancelled.
        ``wait``: return once it has stopped (not from the worker itself, where it would wait forever)."""
        with self._cond:
            job.cancel_requested = True
            self._cond.notify_all()
        if wait and not self.on_worker:
            concurrent.futures.wait([job.future])

    def active(self, owner: Hashable) -> Job | None:
        """The job of ``owner`` that runs now (the head of its queue), if any."""
        with self._cond:
            queue = self._queues.get(owner)
            return queue[0] if queue else None

    def wake(self) -> None:
        """Something a ``ready`` predicate reads has changed."""
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        """Fail queued work, stop the worker and wait for it."""
        with self._cond:
            self._closing = True
            for queue in self._queues.values():
                for job in queue:
                    job.cancel_requested = True
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=60)

    # -- the worker -------------------------------------------------------------------------------
    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()

    def _runnable(self) -> list[Job]:
        heads = [queue[0] for queue in self._queues.values() if queue]
        out = [j for j in heads if j.cancel_requested or j.error is not None or (j.pending is None and j.ready())]
        return sorted(out, key=lambda j: (j.started, j.id))  # new work first, then in arrival order

    def _loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    runnable = self._runnable()
                    if runnable or (self._closing and not any(self._queues.values())):
                        break
                    self._cond.wait(0.25 if self._closing else 5.0)
                if not runnable:
                    return
            self.rounds += 1
            for job in runnable:
                if job.started and self._arrived():
                    break  # new work goes first: a short request does not wait behind another chunk
                with self.pool.lock:
                    self._current = job.owner
                    try:
                        self._advance(job)
                    finally:
                        self._current = None
            with self._cond:
                waiting = [q[0] for q in self._queues.values() if q and q[0].pending is not None]
            if waiting:
                with self.pool.lock:
                    self._decode_batch(waiting)

    def _arrived(self) -> bool:
        """Whether work that has not started yet is ready to run."""
        with self._cond:
            return any(q[0] is not None and not q[0].started and q[0].ready() for q in self._queues.values() if q)

    def _advance(self, job: Job) -> None:
        """Send the job its value (or throw Cancelled) and run it to its next yield."""
        try:
            if job.cancel_requested:
                job.pending = None
                if not job.started:
                    job.work.close()
                    raise Cancelled("cancelled before it started")
                step = job.work.throw(Cancelled("cancelled"))
            elif job.error is not None:
                error, job.error = job.error, None
                step = job.work.throw(error)
            else:
                job.started = True
                value, job.value = job.value, None
                step = job.work.send(value)
        except StopIteration as done:
            self._finish(job, result=done.value)
            return
        except BaseException as exc:  # the work's own handlers rolled back; the caller gets the error
            self._finish(job, error=exc)
            return
        job.started = True
        if isinstance(step, DecodeStep):
            job.pending = step

    def _decode_batch(self, jobs: list[Job]) -> None:
        """One shared decode for every pending step (split only past ``n_batch``)."""
        steps = [j.pending for j in jobs if j.pending is not None]
        backend = self.pool.backend
        try:
            logits = backend.decode(
                [s.token for s in steps], [s.position for s in steps], [s.seq for s in steps], [True] * len(steps)
            )
        except BaseException as exc:
            log.warning("a batched decode of %d steps failed: %s", len(steps), exc)
            for job in jobs:  # each job gets the error at its next advance and rolls back
                job.pending, job.error = None, exc
            return
        self.batched_tokens += len(steps)
        for job, row in zip(jobs, logits):
            job.pending, job.value = None, np.asarray(row)

    def _finish(self, job: Job, *, result: Any = None, error: BaseException | None = None) -> None:
        with self._cond:
            queue = self._queues.get(job.owner)
            if queue and queue[0] is job:
                queue.popleft()
            if queue is not None and not queue:
                del self._queues[job.owner]
            self._cond.notify_all()
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)
