"""A TCP proxy for tests, between a service and its PostgreSQL (or S3), that injects faults.

Issue 29's tests need failures a real server does not produce on demand: connections cut, a network
that swallows every byte, a slow link, and above all a commit that the server made but whose answer
never reached the client, which then cannot know whether it committed. `FaultProxy` runs in the
test's event loop, so the client under test must not block that loop (psycopg's async connection,
or a sync one in a thread).

To find that commit, the proxy reads PostgreSQL's protocol (v3) on the side: bytes are forwarded as
they arrive, never held until a message is complete. Anything else (S3's HTTP, a session encrypted
with TLS or GSS, a CancelRequest) is told apart and merely forwarded.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Callable, Coroutine
from typing import Any
from urllib.parse import urlsplit, urlunsplit

__all__ = ["HOST", "FaultProxy", "LostAnswer"]

HOST = "127.0.0.1"
_CHUNK = 65536
_QUEUED_CHUNKS = 64  # per direction; beyond, reading waits, which pushes back on the sender
_SSL_REQUEST, _GSSENC_REQUEST = 80877103, 80877104
_MAX_STARTUP = 10000  # the server's own limit on a startup packet

_Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]
_Queue = asyncio.Queue[tuple[float, bytes]]  # (when due, chunk); b"" is the end of the stream


class LostAnswer:
    """A lost answer armed by `FaultProxy.arm_lost_commit`: `await wait()` for its cut."""

    def __init__(self, proxy: FaultProxy, match: bytes) -> None:
        self.match = match
        self.matched = False
        # Set once the connection is cut: True if the server committed, False if it rolled back.
        self.cut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._proxy = proxy

    async def wait(self, timeout_s: float = 10.0) -> bool:
        """True once the connection was cut after the server committed, False if the server answered
        with an error (the transaction rolled back). TimeoutError after `timeout_s` (disarmed then,
        if nothing had matched)."""
        try:
            return await asyncio.wait_for(asyncio.shield(self.cut), timeout_s)
        except asyncio.TimeoutError:
            if not self.matched:
                self._proxy._armed.remove(self)
            what = "its transaction did not end" if self.matched else "nothing executed it"
            raise TimeoutError(f"lost answer to {self.match!r}: {what} within {timeout_s:g} s") from None


class FaultProxy:
    """`async with FaultProxy(target_port) as proxy`: a proxy on 127.0.0.1:`proxy.port` to the target,
    forwarding until told otherwise. `postgres=False` skips reading PostgreSQL's protocol (a lost
    answer then never matches); with it, other protocols are recognised and just forwarded."""

    def __init__(self, target_port: int, target_host: str = HOST, *, postgres: bool = True) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.postgres = postgres
        self.port = 0
        self._delay = 0.0
        self._blackholed = False
        self._listener: socket.socket | None = None
        self._listening = False
        self._links: set[_Link] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._armed: list[LostAnswer] = []
        self._lost: list[LostAnswer] = []  # every one armed: cancelled at exit if still pending
        self._errors: list[BaseException] = []

    @property
    def connections(self) -> int:
        """Proxied connections open now."""
        return len(self._links)

    async def __aenter__(self) -> FaultProxy:
        self._listener = self._bind(0)
        self.port = self._listener.getsockname()[1]
        self._listen()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cut()
        assert self._listener is not None
        self._listener.close()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.sleep(0)  # aborted transports close their sockets on the loop's next turn
        for lost in self._lost:
            lost.cut.cancel()
        if self._errors and exc[0] is None:
            raise self._errors[0]

    def url_for(self, url: str) -> str:
        """`url` (scheme://[user[:password]@]host[:port]/...) with the proxy's host and port instead."""
        parts = urlsplit(url)
        user, at, _ = parts.netloc.rpartition("@")
        return urlunsplit(parts._replace(netloc=f"{user}{at}{HOST}:{self.port}"))

    def delay(self, seconds: float) -> None:
        """From now on, every chunk read in either direction is forwarded `seconds` late, in order."""
        self._delay = seconds

    def blackhole(self) -> None:
        """Until `restore()`, drop every byte (and every end of stream) in both directions, on old and
        new connections alike: they stay open, nothing answers."""
        self._blackholed = True

    def cut(self) -> None:
        """Close every connection now, both sides, and refuse new ones until `restore()`."""
        if self._listening and self._listener is not None:
            asyncio.get_running_loop().remove_reader(self._listener.fileno())
            self._listener.close()
            # Bound but not listening: connects are refused, and the port stays ours for restore().
            self._listener = self._bind(self.port)
            self._listening = False
        for link in list(self._links):
            link.close()
        for task in list(self._tasks):
            task.cancel()  # connections still being set up

    def restore(self) -> None:
        """Forward normally again: no delay, no black hole, listening on the same port."""
        self._delay = 0.0
        self._blackholed = False
        if not self._listening:
            self._listen()

    def arm_lost_commit(self, match: bytes) -> LostAnswer:
        """Lose the answer to the next execution, on any connection, of SQL containing `match`: the
        server gets it, but from then on the client hears nothing, and the connection is closed (both
        sides) once the server reports it idle (ReadyForQuery 'I': committed or rolled back).

        Executed inside a transaction block, the statement is answered, and the answer lost is its
        block's COMMIT's (the block rolled back instead: `wait()` says False, nothing cut). Encrypted
        connections are not seen into. `match` is a substring: b"COMMIT" also matches SQLAlchemy's
        `BEGIN ISOLATION LEVEL READ COMMITTED`, whose answer is then lost; match a statement of
        the transaction instead."""
        lost = LostAnswer(self, match)
        self._armed.append(lost)
        self._lost.append(lost)
        return lost

    async def lose_commit_answer(self, match: bytes, timeout_s: float = 10.0) -> bool:
        """`arm_lost_commit(match).wait(timeout_s)`: for an execution in another task or thread."""
        return await self.arm_lost_commit(match).wait(timeout_s)

    # -- internals ---------------------------------------------------------------------------------

    def _bind(self, port: int) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # After a cut the port is bound again while its old connections linger in TIME_WAIT.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setblocking(False)
        sock.bind((HOST, port))
        return sock

    def _listen(self) -> None:
        assert self._listener is not None
        self._listener.listen(128)
        # A reader callback rather than asyncio's server: it stops at once, without awaiting.
        asyncio.get_running_loop().add_reader(self._listener.fileno(), self._accept)
        self._listening = True

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                client, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue  # the client gave up while waiting in the backlog
            client.setblocking(False)
            self._spawn(self._connect(client))

    async def _connect(self, client: socket.socket) -> None:
        accepted: _Streams | None = None
        try:
            accepted = await asyncio.open_connection(sock=client)
            server = await asyncio.open_connection(self.target_host, self.target_port)
        except BaseException:  # refused by the target, or cut meanwhile
            if accepted is None:
                client.close()
            else:
                accepted[1].transport.abort()
            raise
        _Link(self, accepted, server)

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._forget)
        return task

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        # A peer's reset or refusal ends a task normally; anything else is a bug here: raised at exit.
        if not task.cancelled() and (error := task.exception()) and not isinstance(error, OSError):
            self._errors.append(error)

    def _claim(self, sql: bytes) -> LostAnswer | None:
        for lost in self._armed:
            if lost.match in sql:
                self._armed.remove(lost)
                lost.matched = True
                return lost
        return None


class _Link:
    """One proxied connection. Per direction, a task reads (and watches) chunks and another writes
    them when due, so that a delayed chunk does not make the next one later still."""

    def __init__(self, proxy: FaultProxy, client: _Streams, server: _Streams) -> None:
        self._proxy = proxy
        self._writers = (client[1], server[1])
        self.watch = _PgWatch(proxy._claim) if proxy.postgres else None
        self._ended = 0
        upstream: _Queue = asyncio.Queue(_QUEUED_CHUNKS)
        downstream: _Queue = asyncio.Queue(_QUEUED_CHUNKS)
        self._tasks = [
            proxy._spawn(self._read(client[0], upstream, from_client=True)),
            proxy._spawn(self._write(upstream, server[1], to_client=False)),
            proxy._spawn(self._read(server[0], downstream, from_client=False)),
            proxy._spawn(self._write(downstream, client[1], to_client=True)),
        ]
        proxy._links.add(self)

    def close(self) -> None:
        self._proxy._links.discard(self)
        for writer in self._writers:
            writer.transport.abort()
        for task in self._tasks:
            task.cancel()

    async def _read(self, reader: asyncio.StreamReader, queue: _Queue, *, from_client: bool) -> None:
        loop = asyncio.get_running_loop()
        try:
            while chunk := await reader.read(_CHUNK):
                if self.watch is not None:
                    if from_client:
                        self.watch.from_client(chunk)
                    elif self.watch.from_server(chunk):
                        self._lose_answer(self.watch)
                        return
                await queue.put((loop.time() + self._proxy._delay, chunk))
        except OSError:
            self.close()
            return
        await queue.put((loop.time() + self._proxy._delay, b""))

    async def _write(self, queue: _Queue, writer: asyncio.StreamWriter, *, to_client: bool) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                due, chunk = await queue.get()
                if due > loop.time():
                    await asyncio.sleep(due - loop.time())
                # Checked when due: a black hole swallows what was already on its way.
                lost = to_client and self.watch is not None and self.watch.lost is not None
                dropped = self._proxy._blackholed or lost
                if not chunk:
                    break
                if not dropped:
                    writer.write(chunk)
                    await writer.drain()
            if not dropped:
                writer.write_eof()
        except OSError:
            self.close()
            return
        self._ended += 1
        if self._ended == 2:
            self.close()

    def _lose_answer(self, watch: _PgWatch) -> None:
        self.close()
        assert watch.lost is not None
        if not watch.lost.cut.done():
            watch.lost.cut.set_result(not watch.lost_error)


class _Framer:
    """Typed messages (type byte, int32 length counting itself, body) out of arbitrary chunks. Only
    the bodies of the `kept` types are buffered; the others are skipped as they pass."""

    def __init__(self, kept: bytes) -> None:
        self.kept = kept
        self.buffer = bytearray()
        self._skip = 0

    def next(self) -> tuple[int, bytes | None] | None:
        """The next message (its body None if not kept), or None until more bytes come."""
        if self._skip:
            skipped = min(self._skip, len(self.buffer))
            del self.buffer[:skipped]
            self._skip -= skipped
            if self._skip:
                return None
        if len(self.buffer) < 5:
            return None
        kind = self.buffer[0]
        (length,) = struct.unpack_from("!i", self.buffer, 1)
        if length < 4:
            raise ValueError("not PostgreSQL's protocol")
        if kind not in self.kept:
            self._skip = 1 + length
            return kind, None
        if len(self.buffer) < 1 + length:
            return None
        body = bytes(self.buffer[5 : 1 + length])
        del self.buffer[: 1 + length]
        return kind, body


class _PgWatch:
    """What one connection's PostgreSQL protocol says: which SQL the client executes, and which of
    the server's ReadyForQuery messages ends the transaction of a lost answer."""

    def __init__(self, claim: Callable[[bytes], LostAnswer | None]) -> None:
        self._claim = claim
        self.opaque = False  # encrypted, a CancelRequest, or not PostgreSQL: nothing more to read
        self._started = False  # past the StartupMessage: the client's messages are typed
        self._answers_owed = 0  # the server's one-byte answers to SSLRequest and GSSENCRequest
        self._ready_owed = 0  # ReadyForQuery messages the client asked for and has not had yet
        self._statements: dict[bytes, bytes] = {}  # prepared statement name ("" too) -> its SQL
        self._client = _Framer(b"QPBC")
        self._server = _Framer(b"Z")
        self.lost: LostAnswer | None = None
        self.lost_error = False  # the server answered with an ErrorResponse: it rolled back
        # Matched inside a transaction block: its COMMIT's answer is the one lost.
        self._pending: LostAnswer | None = None
        self._pending_error = False
        self._status = b"I"  # of the last ReadyForQuery: "T" inside a transaction block
        self._ready_before_lost = 0  # owed for what the client sent before the lost execution

    def from_client(self, chunk: bytes) -> None:
        framer = self._client
        if self.opaque:
            return
        framer.buffer += chunk
        while not self.opaque:
            if not self._started:
                if len(framer.buffer) < 8:
                    return
                length, code = struct.unpack_from("!ii", framer.buffer)
                if not 8 <= length <= _MAX_STARTUP:  # HTTP, or TLS sent directly (its 0x16 first)
                    self.opaque = True
                    return
                if len(framer.buffer) < length:
                    return
                del framer.buffer[:length]
                if code in (_SSL_REQUEST, _GSSENC_REQUEST):
                    self._answers_owed += 1
                elif code >> 16 == 3:  # a StartupMessage (3.0, or 3.2 since PostgreSQL 18)
                    self._started = True
                    self._ready_owed = 1  # the one that ends the startup
                else:  # a CancelRequest: the server answers nothing and closes
                    self.opaque = True
                continue
            try:
                message = framer.next()
                if message is None:
                    return
                self._client_message(*message)
            except ValueError:
                self.opaque = True

    def _client_message(self, kind: int, body: bytes | None) -> None:
        if body is None:  # Sync and FunctionCall, of the types not kept, are answered ReadyForQuery
            self._ready_owed += kind in b"SF"
        elif kind == ord("Q"):
            self._executes(body.partition(b"\0")[0])
            self._ready_owed += 1
        elif kind == ord("P"):
            name, sql, _ = body.split(b"\0", 2)
            self._statements[name] = sql
        elif kind == ord("B"):  # an execution (portal name, then statement name)
            _, name, _ = body.split(b"\0", 2)
            self._executes(self._statements.get(name, b""))
        elif kind == ord("C") and body[:1] == b"S":
            self._statements.pop(body[1:].partition(b"\0")[0], None)

    def _executes(self, sql: bytes) -> None:
        start = sql.lstrip()[:8].upper()
        commits = start.startswith((b"COMMIT", b"END"))
        if self._pending is not None:
            if commits:
                self._lose(self._pending)
                self.lost_error, self._pending = self._pending_error, None
            elif start.startswith(b"ROLLBACK"):
                if not self._pending.cut.done():
                    self._pending.cut.set_result(False)
                self._pending = None
        elif self.lost is None and (lost := self._claim(sql)) is not None:
            if self._status == b"T" and not commits:
                self._pending = lost
            else:
                self._lose(lost)

    def _lose(self, lost: LostAnswer) -> None:
        self.lost = lost
        self._ready_before_lost = self._ready_owed

    def from_server(self, chunk: bytes) -> bool:
        """True when the lost answer's transaction is over: the connection is to be cut now."""
        framer = self._server
        if self.opaque:
            return False
        framer.buffer += chunk
        while not self.opaque:
            if self._answers_owed:
                if not framer.buffer:
                    return False
                self.opaque = framer.buffer[0] in b"SG"  # TLS or GSS encryption follows
                del framer.buffer[:1]
                self._answers_owed -= 1
                continue
            if not self._started:  # more bytes than answers before the StartupMessage: not PostgreSQL
                self.opaque = bool(framer.buffer)
                return False
            try:
                message = framer.next()
            except ValueError:
                self.opaque = True
                return False
            if message is None:
                return False
            kind, body = message
            if kind == ord("Z"):
                self._ready_owed -= 1
                self._status = body or b"I"
                if self.lost is not None:
                    if self._ready_before_lost:
                        self._ready_before_lost -= 1
                    elif body == b"I":
                        return True
            elif kind == ord("E") and self.lost is not None and not self._ready_before_lost:
                self.lost_error = True
            elif kind == ord("E") and self._pending is not None:
                self._pending_error = True
        return False
