"""Registrations whose write's outcome the directory could not know (the connection broke after
the COMMIT was sent), on SQLite and on PostgreSQL: the client gets one answer, OK, and exactly one
entry exists, whose secret deregisters it, whether the first write committed, did not, or committed
only while the directory had already given up on it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from services.directory import entry_writes
from services.directory.model import Endpoint, Registration
from services.directory.store import DirectoryStore
from shared.api import directory_pb2
from shared.db import Database
from tests.fixtures.postgres import ProxiedDatabase
from tests.helpers.directory import ACTOR, COGMENT, OK, deregister, register, request, visible_ids
from tests.helpers.lost_answers import break_before_commit, commit_late, lose_an_answer
from tests.helpers.running import DirectoryFactory, RunningDirectory, make_directory_factory

Inject = Callable[[pytest.MonkeyPatch, Any], list[Any]]
INJECTIONS: dict[str, Inject] = {
    "committed": lose_an_answer,
    "not-committed": break_before_commit,
    "committed-late": commit_late,
}


async def registered_once(
    directory: RunningDirectory, inject: Inject, *registrations: directory_pb2.RegisterRequest
) -> list[directory_pb2.RegisterReply]:
    """Register `registrations` in one stream while `inject` disturbs the first write; each is
    answered OK, and served once."""
    with pytest.MonkeyPatch.context() as patch:
        disturbed = inject(patch, directory.service.database)
        replies = await register(directory, *registrations)
    assert disturbed, "no write was disturbed"
    assert [reply.status for reply in replies] == [OK] * len(registrations), replies
    for registration, reply in zip(registrations, replies, strict=True):
        properties = dict(registration.details.properties)
        assert await visible_ids(directory, properties=properties) == [reply.service_id]
    # Nothing else either, healthy or not.
    assert await directory.service.store.count() == len(registrations)
    return replies


async def deregistered(directory: RunningDirectory, replies: list[directory_pb2.RegisterReply]) -> None:
    removed = await deregister(directory, *((reply.service_id, reply.secret) for reply in replies))
    assert [reply.status for reply in removed] == [OK] * len(replies)
    assert await directory.service.store.count() == 0


@pytest.mark.parametrize("outcome", list(INJECTIONS))
async def test_new_entries(directory: RunningDirectory, outcome: str) -> None:
    replies = await registered_once(
        directory, INJECTIONS[outcome], *(request(ACTOR, {"lost": outcome, "n": str(n)}) for n in range(3))
    )
    await deregistered(directory, replies)


@pytest.mark.parametrize("outcome", list(INJECTIONS))
async def test_a_permanent_entry(directory: RunningDirectory, outcome: str) -> None:
    """Its upsert on its identity, written again, finds the entry the first write made: the same
    id and secret as a re-registration would get."""
    registration = request(ACTOR, {"lost": outcome}, permanent=True)
    (reply,) = await registered_once(directory, INJECTIONS[outcome], registration)
    (again,) = await register(directory, registration)
    assert (again.service_id, again.secret) == (reply.service_id, reply.secret)
    await deregistered(directory, [reply])


async def test_an_id_taken_by_another_entry_is_drawn_again_once_the_unknown_outcome_is_known(
    directory: RunningDirectory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first write failed before reaching the database, with an id that another entry holds
    (one chance in 2^63): read back, the id is another entry's, so that write can never commit,
    and a fresh id is drawn."""
    draws = iter([41, 41, 42])  # ids 42, 42 (taken), 43
    monkeypatch.setattr(entry_writes.secrets, "randbelow", lambda _bound: next(draws))
    (first,) = await register(directory, request(ACTOR, {"n": "1"}))
    with pytest.MonkeyPatch.context() as patch:
        broken = break_before_commit(patch, directory.service.database)
        (second,) = await register(directory, request(ACTOR, {"n": "2"}))
    assert broken and second.status == OK, second.error_msg
    assert (first.service_id, second.service_id) == (42, 43)
    assert await directory.service.store.count() == 2
    await deregistered(directory, [first, second])


async def test_a_registration_that_outlasts_the_outage_bound_is_unavailable(
    directory_factory: DirectoryFactory,
) -> None:
    """Every write fails for longer than `--outage_bound`: the client is told UNAVAILABLE, a status
    it retries on (a FAILED reply reads as a refusal), and nothing was registered."""
    async with directory_factory("--outage_bound", "0.5") as directory:
        with pytest.MonkeyPatch.context() as patch:
            broken = break_before_commit(patch, directory.service.database, every=True)
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await register(directory, request(ACTOR, {"never": "written"}))
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "--outage_bound" in (failed.value.details() or "")
        assert len(broken) > 1  # written again while the bound lasted
        assert await directory.service.store.count() == 0


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[DirectoryStore]:
    database = Database(database_url)
    await database.migrate()
    try:
        yield DirectoryStore(database)
    finally:
        await database.close()


@pytest.mark.parametrize("outcome", list(INJECTIONS))
async def test_a_batch_of_new_and_permanent_entries(store: DirectoryStore, outcome: str) -> None:
    """Registrations that arrive together are written in one batch (on SQLite, new and permanent
    entries in one transaction; on PostgreSQL, the new ones in one statement): each is answered
    with the entry written for it, created once."""
    endpoint = Endpoint(COGMENT, "client", 0)
    registrations = [
        Registration(endpoint, ACTOR, {"new": "1"}, permanent=False),
        Registration(endpoint, ACTOR, {"permanent": "1"}, permanent=True),
        Registration(endpoint, ACTOR, {"new": "2"}, permanent=False),
        Registration(endpoint, ACTOR, {"permanent": "2"}, permanent=True),
    ]
    with pytest.MonkeyPatch.context() as patch:
        disturbed = INJECTIONS[outcome](patch, store.db)
        written = await asyncio.gather(
            *(store.add(registration, "token", 1) for registration in registrations)
        )
    assert disturbed, "no write was disturbed"
    assert [created for _, _, created in written] == [True] * len(registrations)
    assert await store.count() == len(registrations)
    for service_id, nonce, _ in written:
        assert await store.credentials(service_id) == ("token", nonce)


@pytest.mark.parametrize("permanent", [False, True], ids=["new", "permanent"])
async def test_a_registration_whose_commit_answer_was_lost_on_the_wire_is_made_once(
    proxied_database: ProxiedDatabase, permanent: bool
) -> None:
    """PostgreSQL committed the entry, the connection broke before its answer came back (the fault
    proxy): new entries' one statement, or the transaction of a permanent one. The directory reads
    the entry back and answers OK once, with the one entry made."""
    async with make_directory_factory(proxied_database.url)() as directory:
        lost = proxied_database.proxy.arm_lost_commit(b"INSERT INTO directory_services")
        registration = request(properties={"answer": "lost"}, permanent=permanent)
        [reply] = await register(directory, registration)
        assert reply.status == OK, reply
        assert await lost.wait(10), "the entry was rolled back, not committed"
        assert await visible_ids(directory, properties={"answer": "lost"}) == [reply.service_id]
        assert await directory.service.store.count() == 1
        await deregistered(directory, [reply])


async def test_a_registration_given_up_on_before_its_write_is_not_written(
    proxied_database: ProxiedDatabase,
) -> None:
    """Its client's deadline passes while another registration's write hangs (PostgreSQL silent
    behind a black hole): not written once the database answers again, so that the client, told
    DEADLINE_EXCEEDED, registering again, makes the only entry."""
    async with make_directory_factory(proxied_database.url)() as directory:
        proxied_database.proxy.blackhole()
        first = asyncio.create_task(register(directory, request(properties={"order": "first"})))
        await asyncio.sleep(0.5)  # its batch is being written
        stream = directory.stub.Register(iter([request(properties={"order": "given-up"})]), timeout=1)
        with pytest.raises(grpc.aio.AioRpcError) as given_up:
            [reply async for reply in stream]
        assert given_up.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        proxied_database.proxy.restore()
        [reply] = await asyncio.wait_for(first, 30)
        assert reply.status == OK
        assert await visible_ids(directory, properties={"order": "first"}) == [reply.service_id]
        assert await visible_ids(directory, properties={"order": "given-up"}) == []
        assert await directory.service.store.count() == 1
