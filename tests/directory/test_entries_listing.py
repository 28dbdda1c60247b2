"""The directory's own ListEntries (cogment_aux.api.DirectoryEntriesSP): every entry a token sees
with its health, those inquiries do not answer included, newest first, paged by handles; bad
requests are INVALID_ARGUMENT; a directory without it is told apart by its client."""

from __future__ import annotations

import grpc
import pytest

from services.directory.client.api import DirectoryClient
from shared.api import directory_entries_pb2, directory_entries_pb2_grpc
from tests.helpers.directory import ACTOR, ENVIRONMENT, GRPC, metadata, register_ok, request
from tests.helpers.fake_services import FakeCogmentService, FakeTcpService, free_port
from tests.helpers.running import DirectoryFactory, RunningDirectory

HEALTH = directory_entries_pb2.EntryHealth


async def list_entries(
    directory: RunningDirectory, count: int = 0, handle: str = "", token: str | None = None
) -> directory_entries_pb2.ListEntriesReply:
    stub = directory_entries_pb2_grpc.DirectoryEntriesSPStub(directory.channel)
    reply: directory_entries_pb2.ListEntriesReply = await stub.ListEntries(
        directory_entries_pb2.ListEntriesRequest(count=count, handle=handle), metadata=metadata(token)
    )
    return reply


async def test_every_entry_with_its_health_newest_first(directory_factory: DirectoryFactory) -> None:
    live = await FakeCogmentService("ServiceActorSP", load="7").start()
    silent = await FakeTcpService(silent=True).start()  # accepts, never answers: no check ends
    try:
        async with directory_factory("--registration_check_wait", "0.5") as directory:
            registered = {}
            for name, registration in [
                ("not checked (permanent)", request(ENVIRONMENT, {"n": "1"}, permanent=True)),
                ("not checked (client)", request(ACTOR, {"n": "2"})),
                ("healthy", request(ACTOR, {"n": "3"}, protocol=GRPC, host="127.0.0.1", port=live.port)),
                ("failing", request(ACTOR, {"n": "4"}, protocol=GRPC, host="127.0.0.1", port=free_port())),
                ("awaiting", request(ACTOR, {"n": "5"}, protocol=GRPC, host="127.0.0.1", port=silent.port)),
            ]:
                (registered[name],) = await register_ok(directory, registration, token="team")
            (other,) = await register_ok(directory, request(ACTOR, {"n": "6"}), token="someone else")

            reply = await list_entries(directory, token="team")
            assert reply.next_handle == ""
            by_id = {entry.data.service_id: entry for entry in reply.entries}
            assert [entry.data.service_id for entry in reply.entries] == list(reversed(registered.values()))
            assert other not in by_id
            health = {name: HEALTH.Name(by_id[sid].health) for name, sid in registered.items()}
            assert health == {
                "not checked (permanent)": "ENTRY_HEALTH_NOT_CHECKED",
                "not checked (client)": "ENTRY_HEALTH_NOT_CHECKED",
                "healthy": "ENTRY_HEALTH_HEALTHY",
                "failing": "ENTRY_HEALTH_FAILING",
                "awaiting": "ENTRY_HEALTH_AWAITING_FIRST_CHECK",
            }
            healthy, failing = by_id[registered["healthy"]], by_id[registered["failing"]]
            assert (healthy.load, healthy.failed_checks) == (7, 0) and healthy.last_check_at > 0
            assert failing.failed_checks >= 1 and failing.last_check_at > 0
            assert by_id[registered["awaiting"]].last_check_at == 0
            assert dict(by_id[registered["failing"]].data.details.properties) == {"n": "4"}
            assert all(entry.registered_at > 0 for entry in reply.entries)
            # What the other token sees; no token sees nothing of these.
            assert [
                e.data.service_id for e in (await list_entries(directory, token="someone else")).entries
            ] == [other]
            assert list((await list_entries(directory)).entries) == []

            # Pages of two, by handles: every entry once, in the same order.
            paged, handle = [], ""
            while True:
                page = await list_entries(directory, count=2, handle=handle, token="team")
                assert len(page.entries) <= 2
                paged += [entry.data.service_id for entry in page.entries]
                handle = page.next_handle
                if not handle:
                    break
            assert paged == [entry.data.service_id for entry in reply.entries]

            # The client: the same listing.
            async with DirectoryClient(f"grpc://{directory.address}", token="team") as client:
                listed = await client.list_entries()
                assert listed is not None and list(listed.entries) == list(reply.entries)
    finally:
        await live.stop()
        await silent.stop()


@pytest.mark.parametrize(
    ("count", "handle", "message"),
    [
        (1001, "", "count [1001] is over 1000"),
        (0, "not-a-handle", "Invalid handle [not-a-handle]"),
        (0, "12:", "Invalid handle [12:]"),
        (0, "12:x", "Invalid value for `handle` [x]"),
        (0, "١٢:3", "Invalid value for `handle`"),  # decimal, but not ASCII
    ],
)
async def test_bad_listings_are_invalid_argument(
    directory: RunningDirectory, count: int, handle: str, message: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await list_entries(directory, count=count, handle=handle)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (raised.value.details() or "")


async def test_a_handle_past_every_entry_answers_none(directory: RunningDirectory) -> None:
    await register_ok(directory, request(ACTOR), token="t")
    reply = await list_entries(directory, handle="9" * 30 + ":1", token="t")  # clamped, not INTERNAL
    assert len(reply.entries) == 1 and reply.next_handle == ""


async def test_the_client_tells_a_directory_without_the_listing() -> None:
    """A Cogment 2.x directory (here: a server of another service) does not serve it: None, so
    that a caller falls back to inquiries."""
    other = await FakeCogmentService("DirectorySP").start()
    try:
        async with DirectoryClient(f"grpc://127.0.0.1:{other.port}") as client:
            assert await client.list_entries() is None
    finally:
        await other.stop()
