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
    """

    def __init__(
        self,
        name: str,
        connect: Callable[[], C],
        recover: Callable[[C], C | None],
        close: Callable[[C], None],
        finish: Callable[[], None] | None = None,
    ) -> None:
        self._name = name
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

    def submit(self, work: Callable[[C], T]) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        with self._lock:
            if self._closed:
                future.set_exception(ConnectionError("the database is closed"))
                return future
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
                self._thread.start()
            self._queue.put((loop, future, work))
        return future

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
                        outcome = (future, work(connection), None)
                    except Exception as error:
                        connection = self._recovered(connection)
                        outcome = (future, None, error)
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
