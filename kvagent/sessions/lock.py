"""EntryLock: a mutex held by one caller at a time, taken from a thread (blocking) or a coroutine (awaited).

Adapters hold a session entry's lock for a whole request. Threads block on a ``threading.Event``; coroutines
await a future of their own loop, so a waiting request takes no executor thread (a request queue behind a
long generation must not exhaust the loop's default executor, which parking also needs). ``release`` hands
the lock to the longest waiter directly (FIFO); a waiter whose task was cancelled passes it on.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque


class EntryLock:
    """A FIFO mutex for threads and coroutines alike; ``waiting`` counts callers queued for it."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._held = False
        self._waiters: deque[threading.Event | tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = deque()

    @property
    def locked(self) -> bool:
        return self._held

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def try_acquire(self) -> bool:
        """Take the lock if nobody holds it or waits for it; never blocks."""
        with self._mutex:
            if self._held or self._waiters:
                return False
            self._held = True
            return True

    def acquire(self) -> None:
        """Take the lock, blocking this thread until it is handed over."""
        with self._mutex:
            if not self._held:
                self._held = True
                return
            event = threading.Event()
            self._waiters.append(event)
        event.wait()  # release() hands the lock over: it stays held, now by this thread

    async def aacquire(self) -> None:
        """Take the lock, awaiting it without blocking the loop or taking a thread."""
        loop = asyncio.get_running_loop()
        with self._mutex:
            if not self._held:
                self._held = True
                return
            future: asyncio.Future[None] = loop.create_future()
            self._waiters.append((loop, future))
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # handed over just as the task was cancelled: pass it on
                self.release()
            else:
                with self._mutex:
                    try:
                        self._waiters.remove((loop, future))
                    except ValueError:  # release() already took it from the queue: _grant will pass it on
                        pass
            raise

    def release(self) -> None:
        """Hand the lock to the longest waiter, or free it."""
        with self._mutex:
            while self._waiters:
                waiter = self._waiters.popleft()
                if isinstance(waiter, threading.Event):
                    waiter.set()
                    return
                loop, future = waiter
                try:
                    loop.call_soon_threadsafe(self._grant, future)
                    return
                except RuntimeError:  # that loop is closed: nobody there waits any more
                    continue
            self._held = False

    def _grant(self, future: asyncio.Future[None]) -> None:
        """On the waiter's loop: give it the lock, or pass the lock on if it stopped waiting."""
        if future.cancelled():
            self.release()
        else:
            future.set_result(None)
