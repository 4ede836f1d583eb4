"""Async sessions: the same engine and sessions, awaited from an event loop.

:class:`AsyncEngine` wraps an :class:`~kvagent.engine.Engine`; every coroutine hands its work to the
engine's scheduler (one worker thread makes every native call) and awaits the result, so the event loop
never waits on a lock or a decode. Calls on one session run in order; calls on different sessions run
together, their decode steps batched. Cancelling a task (or closing an :class:`AsyncGenerationStream`
early) stops its generation at the next token and rolls the turn back.

    engine = await AsyncEngine.load("smollm2-135m")
    session = await engine.session([Segment.policy("Be brief.")])
    reply = await session.achat("Hello")
    async with session.astream(user="And then?") as stream:
        async for piece in stream:
            ...
    await engine.aclose()
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence, TypeVar

import numpy as np

from kvagent.engine import Engine
from kvagent.generation import Generation, GenerationStream
from kvagent.kv.work import Work
from kvagent.kv.sync import PrefillReport
from kvagent.scheduler import Job, Scheduler, on_done
from kvagent.segments import Segment
from kvagent.session import Session

if TYPE_CHECKING:
    from kvagent.edits import EditReport
    from kvagent.skills.spec import SkillSpec

T = TypeVar("T")


def _notify(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
    """Run ``callback`` on ``loop`` from the worker; a loop that has closed meanwhile has nobody to tell."""
    try:
        loop.call_soon_threadsafe(callback)
    except RuntimeError:  # the event loop is closed (e.g. a stream abandoned at shutdown)
        pass


async def _await(scheduler: Scheduler, job: Job) -> Any:
    """The job's result, awaited without blocking the loop; cancelling the awaiting task cancels the job."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        def apply() -> None:
            if waiter.done():
                return
            if error is not None:
                waiter.set_exception(error)
            else:
                waiter.set_result(result)
        _notify(loop, apply)

    on_done(job, settle)
    try:
        return await asyncio.shield(waiter)
    except asyncio.CancelledError:
        scheduler.cancel(job)
        try:  # return once the job has stopped and rolled back, so the caller sees the session at rest
            await waiter
        except BaseException:
            pass
        raise


class AsyncGenerationStream(GenerationStream):
    """Async iterator of text pieces; :attr:`result` holds the :class:`Generation` at the end.

    Use it as ``async with session.astream(...) as stream: async for piece in stream``: leaving the block
    early (or cancelling the task) cancels the generation and rolls its turn back.
    """

    def __init__(self) -> None:
        super().__init__()
        self._loop = asyncio.get_running_loop()
        self._ready = asyncio.Event()

    def push(self, piece: str) -> None:
        super().push(piece)
        _notify(self._loop, self._ready.set)

    def end(self, result: Generation | None, error: BaseException | None) -> None:
        super().end(result, error)
        _notify(self._loop, self._ready.set)

    def __aiter__(self) -> AsyncGenerationStream:
        return self

    async def __anext__(self) -> str:
        try:
            while self.backlog == 0 and not self._closed:
                self._ready.clear()
                if self.backlog:
                    break
                await self._ready.wait()
        except asyncio.CancelledError:
            self.close(wait=False)
            raise
        if self.backlog == 0:
            raise StopAsyncIteration
        try:
            return self.__next__()  # an item is there: does not block
        except StopIteration:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        """Stop early; returns once the generation is cancelled and its turn rolled back."""
        job, scheduler = self._job, self._scheduler
        self.close(wait=False)
        if job is not None and scheduler is not None and not job.future.done():
            try:
                await _await(scheduler, job)
            except Exception:  # Cancelled (expected), or the error it ended with
                pass

    async def __aenter__(self) -> AsyncGenerationStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AsyncSession:
    """Coroutines over one :class:`Session`; the session itself stays usable from threads (same order)."""

    def __init__(self, session: Session, scheduler: Scheduler | None = None) -> None:
        self.session = session
        self._scheduler = scheduler if scheduler is not None else session.scheduler

    def __getattr__(self, name: str) -> Any:  # read-only state: tokens, segments, spans, field_values, ...
        return getattr(self.session, name)

    async def run(self, work: Work[T], *, timeout: float | None = None) -> T:
        """Await a unit of work built from the session's ``*_work`` verbs (in order with its other calls).
        ``timeout``: cancel it (rolled back) and raise ``TimeoutError`` past that many seconds."""
        job = self._scheduler.submit(self.session, work)
        try:
            return await asyncio.wait_for(_await(self._scheduler, job), timeout)  # type: ignore[no-any-return]
        except asyncio.TimeoutError:  # the job was cancelled and rolled back by _await's handler
            raise TimeoutError(f"the call took longer than {timeout} s: cancelled and rolled back") from None

    async def aprefill(self) -> PrefillReport:
        return await self.run(self.session.prefill_work())

    async def areplace(self, segments: Sequence[Segment]) -> PrefillReport:
        return await self.run(self.session.replace_work(segments))

    async def aextend(self, *segments: Segment) -> PrefillReport:
        return await self.run(self.session.extend_work(segments))

    async def agenerate(self, max_tokens: int = 128, **options: Any) -> Generation:
        """As ``Session.generate``: ``user``, ``prefix``, ``segments`` (the whole prompt first), sampling."""
        return await self.run(self.session.respond_work(max_tokens, **options))

    async def achat(self, user_text: str, max_tokens: int = 128, **options: Any) -> Generation:
        return await self.agenerate(max_tokens, user=user_text, **options)

    async def arespond(self, segments: Sequence[Segment], max_tokens: int = 128, **options: Any) -> Generation:
        """Make ``segments`` the prompt and generate the reply, in one call whose TTFT covers both (for
        clients that resend the whole history: the cached prefix is reused)."""
        return await self.agenerate(max_tokens, segments=segments, **options)

    def astream(self, max_tokens: int = 128, **options: Any) -> AsyncGenerationStream:
        """As ``Session.stream``, as an async iterator (see :class:`AsyncGenerationStream`)."""
        stream = self.session.open_stream(AsyncGenerationStream(), max_tokens, **options)
        return stream  # type: ignore[return-value]

    async def aset(self, name: str, value: object, *, strategy: Any = None) -> EditReport:
        return await self.aset_many({name: value}, strategy=strategy)

    async def aset_many(self, changes: Mapping[str, object], *, strategy: Any = None) -> EditReport:
        return await self.run(self.session.set_many_work(changes, strategy=strategy))

    async def ainclude(self, skill: SkillSpec) -> PrefillReport:
        return await self.run(self.session.include_work(skill))

    async def alogits(self) -> np.ndarray:
        return await self.run(self.session.logits_work())

    async def asave(self) -> bytes:
        return await self.run(self.session.save_work())

    async def arestore(self, blob: bytes, segments: Sequence[Segment], *, share: bool = False) -> None:
        await self.run(self.session.restore_work(blob, segments, share=share))

    async def aclose(self) -> None:
        stream = self.session._stream[1]() if self.session._stream is not None else None
        if stream is not None:
            stream.close(wait=False)
        await self.run(self.session.close_work())

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AsyncEngine:
    """An :class:`Engine` used from an event loop. ``await AsyncEngine.load(...)`` or ``AsyncEngine(engine)``."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @classmethod
    async def load(cls, model: str | None = None, **settings: Any) -> AsyncEngine:
        """Load the model in a thread (seconds of file I/O), not on the loop."""
        return cls(await asyncio.to_thread(Engine.load, model, **settings))

    async def session(self, segments: Iterable[Segment] = (), **options: Any) -> AsyncSession:
        """Open a session (options as in ``Engine.session``)."""
        scheduler = self.engine.scheduler
        session = await _await(scheduler, scheduler.submit(None, self.engine.session_work(list(segments), **options)))
        return AsyncSession(session, scheduler)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.engine.close)

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
