"""The fault proxy (`tests.helpers.fault_proxy`) between psycopg and a real PostgreSQL: each fault does
to the client what issue 29's tests rely on, and a lost commit answer leaves the server's transaction
over, committed or rolled back, while the client only sees its connection drop."""

from __future__ import annotations

import asyncio
import os
import struct
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import psycopg
import pytest
from psycopg.conninfo import make_conninfo
from psycopg.rows import TupleRow
from sqlalchemy.engine import make_url

from tests.fixtures.postgres import PostgresCluster
from tests.helpers.eventually import eventually
from tests.helpers.fault_proxy import HOST, FaultProxy

Connection = psycopg.AsyncConnection[TupleRow]


@dataclass
class Target:
    """The test's database, reached directly: `conninfo` for psycopg, `url` for libpq as a URL."""

    conninfo: str
    url: str
    port: int
    dbname: str


@pytest.fixture
async def target(postgres_url: str, postgres_cluster: PostgresCluster) -> Target:
    """A fresh database holding `t (id int PRIMARY KEY)`."""
    url = make_url(postgres_url)
    assert url.database is not None and url.port is not None
    target = Target(
        postgres_cluster.conninfo(url.database),
        url.set(drivername="postgresql").render_as_string(hide_password=False),
        url.port,
        url.database,
    )
    async with await psycopg.AsyncConnection.connect(target.conninfo, autocommit=True) as conn:
        await conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
    return target


@pytest.fixture
async def proxy(target: Target) -> AsyncIterator[FaultProxy]:
    async with FaultProxy(target.port) as proxy:
        yield proxy
    assert proxy.connections == 0


async def connect(proxy: FaultProxy, target: Target) -> Connection:
    """Through the proxy; without SSL, so the first bytes are the StartupMessage."""
    conninfo = make_conninfo(target.conninfo, port=proxy.port, sslmode="disable", connect_timeout=10)
    return await psycopg.AsyncConnection.connect(conninfo, autocommit=True)


async def ids(target: Target) -> list[int]:
    """The rows of `t`, read directly: what the server committed."""
    async with await psycopg.AsyncConnection.connect(target.conninfo) as conn:
        return [row[0] for row in await (await conn.execute("SELECT id FROM t ORDER BY id")).fetchall()]


async def select_one(conn: Connection) -> object:
    row = await (await conn.execute("SELECT 1")).fetchone()
    return None if row is None else row[0]


async def test_forwards_queries_after_the_ssl_request(proxy: FaultProxy, target: Target) -> None:
    # libpq's default sslmode (prefer) first sends an SSLRequest, answered 'N' by this server.
    async with await psycopg.AsyncConnection.connect(proxy.url_for(target.url), autocommit=True) as conn:
        assert proxy.connections == 1
        assert conn.info.port == proxy.port and not conn.pgconn.ssl_in_use
        await conn.execute("INSERT INTO t VALUES (%s), (%s)", [1, 2])
        cursor = await conn.execute("SELECT id FROM t ORDER BY id; SELECT 'x' || repeat('y', 200000)")
        assert await cursor.fetchall() == [(1,), (2,)]
        assert cursor.nextset() and len((await cursor.fetchall())[0][0]) == 200001
    await eventually(lambda: proxy.connections == 0, "the closed connection to be gone")
    assert await ids(target) == [1, 2]


def test_url_for_swaps_only_host_and_port() -> None:
    proxy = FaultProxy(5432)
    proxy.port = 40000
    url = "postgresql+psycopg://user:p%40ss@db.example:5432/name?sslmode=disable"
    assert proxy.url_for(url) == f"postgresql+psycopg://user:p%40ss@{HOST}:40000/name?sslmode=disable"
    assert proxy.url_for("http://127.0.0.1:9000") == f"http://{HOST}:40000"


async def test_cut_closes_connections_and_refuses_new_ones_until_restored(
    proxy: FaultProxy, target: Target
) -> None:
    conn = await connect(proxy, target)
    assert await select_one(conn) == 1
    port = proxy.port
    proxy.cut()
    assert proxy.connections == 0
    with pytest.raises(psycopg.OperationalError):
        await select_one(conn)
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection(HOST, port)
    with pytest.raises(psycopg.OperationalError):
        await connect(proxy, target)
    await conn.close()
    proxy.restore()
    assert proxy.port == port
    async with await connect(proxy, target) as again:
        assert await select_one(again) == 1


async def test_blackhole_answers_nothing_until_restored(proxy: FaultProxy, target: Target) -> None:
    conn = await connect(proxy, target)
    proxy.blackhole()
    query = asyncio.create_task(select_one(conn))
    connecting = asyncio.create_task(connect(proxy, target))
    done, _ = await asyncio.wait({query, connecting}, timeout=0.5)
    assert not done
    assert proxy.connections == 2  # the new one is accepted, its bytes dropped
    proxy.restore()
    async with await connect(proxy, target) as again:
        assert await select_one(again) == 1
    # The two caught in the black hole lost bytes for good: they wait until cut.
    assert not query.done() and not connecting.done()
    proxy.cut()
    with pytest.raises(psycopg.OperationalError):
        await query
    with pytest.raises(psycopg.OperationalError):
        await connecting
    await conn.close()


async def test_delay_holds_each_chunk_back(proxy: FaultProxy, target: Target) -> None:
    async with await connect(proxy, target) as conn:
        proxy.delay(0.5)
        start = time.monotonic()
        assert await select_one(conn) == 1
        assert time.monotonic() - start >= 0.99  # the query late, then its answer late
        proxy.restore()
        start = time.monotonic()
        assert await select_one(conn) == 1
        assert time.monotonic() - start < 0.5


async def test_lost_commit_answer_after_an_explicit_transaction(proxy: FaultProxy, target: Target) -> None:
    # Default sslmode: the SSLRequest and its answer must not confuse the reading of the protocol.
    async with await psycopg.AsyncConnection.connect(proxy.url_for(target.url), autocommit=True) as conn:
        armed = proxy.arm_lost_commit(b"COMMIT")
        with pytest.raises(psycopg.OperationalError):
            async with conn.transaction():
                await conn.execute("INSERT INTO t VALUES (1)")
                await conn.execute("INSERT INTO t VALUES (2)")
        assert await armed.wait(5) is True
        assert proxy.connections == 0
    assert await ids(target) == [1, 2]


async def test_a_statement_matched_inside_a_transaction_loses_its_commits_answer(
    proxy: FaultProxy, target: Target
) -> None:
    async with await connect(proxy, target) as conn:
        armed = proxy.arm_lost_commit(b"VALUES (2)")
        with pytest.raises(psycopg.OperationalError):
            async with conn.transaction():
                await conn.execute("INSERT INTO t VALUES (1)")
                await conn.execute("INSERT INTO t VALUES (2)")  # answered
                await conn.execute("INSERT INTO t VALUES (3)")
        assert await armed.wait(5) is True
    assert await ids(target) == [1, 2, 3]


async def test_a_transaction_matched_then_rolled_back_loses_nothing(
    proxy: FaultProxy, target: Target
) -> None:
    async with await connect(proxy, target) as conn:
        armed = proxy.arm_lost_commit(b"VALUES (1)")
        with pytest.raises(ZeroDivisionError):
            async with conn.transaction():
                await conn.execute("INSERT INTO t VALUES (1)")
                raise ZeroDivisionError
        assert await armed.wait(5) is False
        await conn.execute("INSERT INTO t VALUES (4)")  # the connection was not cut
    assert await ids(target) == [4]


async def test_lost_answer_to_a_prepared_statement(proxy: FaultProxy, target: Target) -> None:
    async with await connect(proxy, target) as conn:
        for row in range(7):
            await conn.execute("INSERT INTO t (id) VALUES (%s)", [row])
        # Prepared by now: executions are a Bind naming the statement, without its text. (This
        # query's parameter makes it replace the unnamed statement, which held the INSERT's text.)
        sql = "SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE %s"
        assert await (await conn.execute(sql, ["INSERT INTO t%"])).fetchone() == (1,)
        armed = proxy.arm_lost_commit(b"INTO t (id)")
        with pytest.raises(psycopg.OperationalError):
            await conn.execute("INSERT INTO t (id) VALUES (%s)", [7])
        assert await armed.wait(5) is True
    assert await ids(target) == list(range(8))


async def test_lost_answer_to_a_failing_statement(proxy: FaultProxy, target: Target) -> None:
    async with await psycopg.AsyncConnection.connect(target.conninfo, autocommit=True) as direct:
        await direct.execute("INSERT INTO t VALUES (1)")
    conninfo = make_conninfo(target.conninfo, port=proxy.port, sslmode="disable")
    # A sync client, in a thread while the proxy runs in this loop, with the awaitable form.
    conn: psycopg.Connection[TupleRow] = await asyncio.to_thread(
        lambda: psycopg.connect(conninfo, autocommit=True)
    )

    def violate() -> None:
        with pytest.raises(psycopg.OperationalError):  # not UniqueViolation: that answer is lost
            conn.execute("INSERT INTO t VALUES (2), (1)")

    try:
        # gather starts its tasks in order: the answer is armed before the thread executes.
        committed, _ = await asyncio.gather(
            proxy.lose_commit_answer(b"VALUES (2), (1)"), asyncio.to_thread(violate)
        )
    finally:
        await asyncio.to_thread(conn.close)
    assert committed is False
    assert await ids(target) == [1]


async def raw_connect(proxy: FaultProxy, target: Target) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A client speaking the protocol itself, to send what libpq does not: queries before answers."""
    reader, writer = await asyncio.open_connection(HOST, proxy.port)
    startup = b"user\0postgres\0database\0" + target.dbname.encode() + b"\0\0"
    writer.write(struct.pack("!ii", 8 + len(startup), 196608) + startup)
    await reader.readuntil(b"Z\0\0\0\x05I")
    return reader, writer


def query(sql: bytes) -> bytes:
    """A simple Query message."""
    return b"Q" + struct.pack("!i", 4 + len(sql) + 1) + sql + b"\0"


async def test_lost_answer_waits_for_the_answers_owed_before_it(proxy: FaultProxy, target: Target) -> None:
    # Two queries in one write: the first one's ReadyForQuery ('I' too) comes before the lost
    # statement has run, and must not cut.
    async with await psycopg.AsyncConnection.connect(target.conninfo, autocommit=True) as direct:
        await direct.execute("INSERT INTO t VALUES (1)")
    reader, writer = await raw_connect(proxy, target)
    armed = proxy.arm_lost_commit(b"VALUES (2), (1)")
    writer.write(query(b"SELECT pg_sleep(0.2)") + query(b"INSERT INTO t VALUES (2), (1)"))
    assert await armed.wait(5) is False
    assert await reader.read() == b""  # nor did the first query's answer come through
    writer.close()
    await writer.wait_closed()
    assert await ids(target) == [1]


async def test_lost_answer_waits_for_the_end_of_the_transaction_block(
    proxy: FaultProxy, target: Target
) -> None:
    reader, writer = await raw_connect(proxy, target)
    armed = proxy.arm_lost_commit(b"VALUES (1)")
    writer.write(query(b"BEGIN; INSERT INTO t VALUES (1)"))
    await asyncio.sleep(0.3)
    assert not armed.cut.done() and proxy.connections == 1  # its ReadyForQuery said 'T'
    writer.write(query(b"COMMIT"))
    assert await armed.wait(5) is True
    assert await reader.read() == b""
    writer.close()
    await writer.wait_closed()
    assert await ids(target) == [1]


async def test_an_unmatched_lost_answer_times_out_and_is_disarmed(proxy: FaultProxy, target: Target) -> None:
    async with await connect(proxy, target) as conn:
        armed = proxy.arm_lost_commit(b"INSERT INTO t")
        with pytest.raises(TimeoutError, match="nothing executed it"):
            await armed.wait(0.2)
        await conn.execute("INSERT INTO t VALUES (1)")
        assert proxy.connections == 1
    assert await ids(target) == [1]


@pytest.mark.parametrize("postgres", [True, False])
async def test_other_protocols_pass_through(postgres: bool) -> None:
    # Reading PostgreSQL's protocol on (the default), HTTP is told apart by its first 8 bytes.
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
        writer.close()

    server = await asyncio.start_server(echo, HOST, 0)
    request = b"PUT /bucket/key HTTP/1.1\r\nHost: s3\r\n\r\n" + bytes(range(256)) * 1000
    async with server, FaultProxy(server.sockets[0].getsockname()[1], postgres=postgres) as proxy:
        reader, writer = await asyncio.open_connection(HOST, proxy.port)
        writer.write(request)
        writer.write_eof()
        assert await reader.read() == request
        writer.close()
        await writer.wait_closed()


async def test_exit_closes_every_connection_socket_and_task(target: Target) -> None:
    open_files = len(os.listdir("/proc/self/fd"))
    async with FaultProxy(target.port) as proxy:
        idle = await connect(proxy, target)
        busy = await connect(proxy, target)
        armed = proxy.arm_lost_commit(b"never executed")
        proxy.blackhole()
        stuck = asyncio.create_task(select_one(busy))
        await asyncio.sleep(0.1)  # its query sent, and swallowed
        assert proxy.connections == 2
    assert proxy.connections == 0 and armed.cut.cancelled()
    with pytest.raises(psycopg.OperationalError):
        await stuck
    with pytest.raises(psycopg.OperationalError):
        await select_one(idle)
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection(HOST, proxy.port)
    await idle.close()
    await busy.close()
    assert asyncio.all_tasks() == {asyncio.current_task()}
    assert len(os.listdir("/proc/self/fd")) == open_files
    async with await psycopg.AsyncConnection.connect(target.conninfo) as conn:

        async def no_backends() -> bool:
            sql = (
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            row = await (await conn.execute(sql)).fetchone()
            await conn.rollback()  # a fresh snapshot of the statistics each time
            return row == (0,)

        closed: bool = await eventually(no_backends, "the server's side of the connections to close")
        assert closed
