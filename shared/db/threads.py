"""A thread with a database connection of its own, running units of work for the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")
C = TypeVar("C")
_Work = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[[Any], Any]]


class ConnectionThread(Generic[C]):
    """Runs work on one thread with its own database connection, for the event loop.

    aiosqlite hops threads once per cursor operation (about ten per query), each hop a round
    trip of the GIL; psycopg's async connections wait for the server in Python, through the
    event loop, several times per statement. This thread instead runs a whole unit of work per
    hop (a statement, or a transaction) on a blocking connection, whose waits release the GIL,
    and runs every unit queued since its last wake-up before handing all their results back
    with one event-loop callback: under load the hand-off is paid per batch.

    `connect` makes the connection (on first use, and again after a failure or a `reset`, never
    at start-up, when a migration may hold the database); `recover` gives the connection to keep
    after failed work (None: connect again); `close` closes it; `finish` runs as the thread
    ends. The thread starts with the first work.

    `interrupt` (from any thread) breaks the connection of the work under way, which then fails at
    once: a connection whose peer went silent while the network still acknowledges what is sent
    (a stuck proxy, a frozen host behind one) would otherwise hold the thread, and all the work
    queued behind it, for ever. `submit(work, deadline_s)` interrupts work that runs longer.
    """

    def __init__(
        self,
        name: str,
        connect: Callable[[], C],
        recover: Callable[[C], C | None],
        close: Callable[[C], None],
        finish: Callable[[], None] | None = None,
        interrupt: Callable[[C], None] | None = None,
    ) -> None:
        self._name = name
        self._interrupt = interrupt
        # The work under way and its connection (guarded by _lock): what `interrupt` breaks.
        self._running: asyncio.Future[Any] | None = None
        self._connection: C | None = None
        self._connect = connect
        self._recover = recover
        self._close_connection = close
        self._finish = finish
        self._queue: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._reset = False
        self._closed = False
        # Closing and submitting from different threads: no work is queued behind the end.
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, work: Callable[[C], T], deadline_s: float | None = None) -> asyncio.Future[T]:
        """`work(connection)` on the thread; interrupted if it runs past `deadline_s` from now."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        if deadline_s is not None and self._interrupt is not None:
            timer = loop.call_later(deadline_s, self.interrupt, future)
            future.add_done_callback(lambda _: timer.cancel())
        with self._lock:
            if self._closed:
                future.set_exception(ConnectionError("the database is closed"))
                return future
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
                self._thread.start()
            self._queue.put((loop, future, work))
        return future

    def interrupt(self, work: asyncio.Future[Any] | None = None) -> None:
        """Break the connection of the work under way (only if it is `work`, when given)."""
        with self._lock:
            connection = self._connection if work is None or self._running is work else None
        if connection is not None and self._interrupt is not None:
            with contextlib.suppress(Exception):
                self._interrupt(connection)

    def reset(self) -> None:
        """Connect again before the next work: after an outage the connection is dead (work in
        flight on it fails by itself, through the connection's timeouts at worst)."""
        self._reset = True

    def close(self, timeout_s: float | None = None) -> None:
        """Blocking: run it off the event loop. Waits for the work under way `timeout_s` at most
        (the thread is a daemon: it does not hold the process)."""
        with self._lock:
            self._closed = True
            thread = self._thread
            self._queue.put(None)
        if thread is not None:
            thread.join(timeout_s)
        elif self._finish is not None:
            self._finish()

    def _serve(self) -> None:
        connection: C | None = None
        try:
            while (first := self._queue.get()) is not None:
                batch = [first]
                stopping = False
                while not self._queue.empty():
                    item = self._queue.get()
                    if item is None:
                        stopping = True
                        break
                    batch.append(item)
                outcomes: dict[asyncio.AbstractEventLoop, list[tuple[Any, Any, BaseException | None]]] = {}
                for loop, future, work in batch:
                    outcome: tuple[Any, Any, BaseException | None]
                    try:
                        if self._reset:
                            self._reset = False
                            self._drop(connection)
                            connection = None
                        connection = connection or self._connect()
                        with self._lock:
                            self._running, self._connection = future, connection
                        outcome = (future, work(connection), None)
                    except Exception as error:
                        with self._lock:
                            self._running = self._connection = None
                        connection = self._recovered(connection)
                        outcome = (future, None, error)
                    with self._lock:
                        self._running = self._connection = None
                    outcomes.setdefault(loop, []).append(outcome)
                for loop, delivered in outcomes.items():
                    with contextlib.suppress(RuntimeError):  # its loop closed meanwhile
                        loop.call_soon_threadsafe(_deliver, delivered)
                if stopping:
                    return
        finally:
            self._drop(connection)
            if self._finish is not None:
                self._finish()

    def _recovered(self, connection: C | None) -> C | None:
        if connection is None:
            return None
        try:
            return self._recover(connection)
        except Exception:  # the thread must go on: connect again
            self._drop(connection)
            return None

    def _drop(self, connection: C | None) -> None:
        if connection is not None:
            with contextlib.suppress(Exception):
                self._close_connection(connection)


def _deliver(outcomes: list[tuple[Any, Any, BaseException | None]]) -> None:
    for future, result, error in outcomes:
        if future.cancelled():
            continue
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
