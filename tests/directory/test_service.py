"""Directory behaviour over real gRPC connections, on SQLite and on PostgreSQL."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator

import grpc
import pytest
from sqlalchemy import select

from services.directory import entry_writes
from services.directory.entry_sql import PROPERTY_COUNT_CAP
from services.directory.model import Endpoint, Registration
from services.directory.store import DirectoryStore
from shared import schema
from shared.api import common_pb2, directory_pb2
from shared.db import Database
from shared.handlers import UNDECODABLE_MESSAGE
from shared.validation import MAX_PROPERTIES
from tests.helpers.directory import (
    ACTOR,
    COGMENT,
    ENVIRONMENT,
    FAILED,
    GRPC,
    GRPC_SSL,
    OK,
    OTHER,
    deregister,
    inquire,
    register,
    register_ok,
    request,
    visible_ids,
)
from tests.helpers.eventually import eventually
from tests.helpers.fake_services import FakeCogmentService, FakeTcpService, free_port
from tests.helpers.running import DirectoryFactory, RunningDirectory

FAST_CHECKS = ("--health_check_interval", "0.2")


# ---- registration and inquiry ----


async def test_one_reply_per_request_in_order_and_inquiry_by_id(directory: RunningDirectory) -> None:
    replies = await register(
        directory,
        request(ACTOR, {"__actor_class": "a"}),
        directory_pb2.RegisterRequest(),  # invalid: the stream goes on
        request(ENVIRONMENT, {"__implementation": "e"}),
    )
    assert [reply.status for reply in replies] == [OK, FAILED, OK]
    found = await inquire(directory, service_id=replies[0].service_id)
    assert len(found) == 1
    data = found[0]
    assert data.service_id == replies[0].service_id
    assert data.endpoint.protocol == COGMENT and data.endpoint.host == "client"
    assert data.details.type == ACTOR and dict(data.details.properties) == {"__actor_class": "a"}
    assert not data.permanent


@pytest.mark.parametrize(
    ("bad_request", "message"),
    [
        (directory_pb2.RegisterRequest(details=directory_pb2.ServiceDetails(type=ACTOR)), "Missing endpoint"),
        (
            directory_pb2.RegisterRequest(
                endpoint=directory_pb2.ServiceEndpoint(protocol=GRPC, host="h", port=1)
            ),
            "Missing details",
        ),
        (request(host=""), "Empty host"),
        (request(protocol=0), "Invalid protocol [0]"),
        (request(protocol=7), "Invalid protocol [7]"),
        (request(service_type=0), "Invalid service type [0]"),
        (request(service_type=42), "Invalid service type [42]"),
        (request(port=70000), "Invalid port [70000]"),
        (request(host="a\x00b"), "NUL"),
        (request(properties={"k": "v\x00"}), "NUL"),
        (request(properties={f"p{index}": "v" for index in range(65)}), "MAX_PROPERTIES"),
        (request(host="h" * (256 * 1024 + 1)), "MAX_ID_BYTES"),
    ],
)
async def test_invalid_registrations_fail_with_a_message_and_the_stream_stays_usable(
    directory: RunningDirectory, bad_request: directory_pb2.RegisterRequest, message: str
) -> None:
    replies = await register(directory, bad_request, request(), bad_request)
    assert [reply.status for reply in replies] == [FAILED, OK, FAILED]
    assert message in replies[0].error_msg
    assert replies[0].service_id == 0 and replies[0].secret == ""


async def test_ids_are_random_63_bit_and_secrets_strong_url_safe(directory: RunningDirectory) -> None:
    replies = await register(directory, *(request() for _ in range(50)))
    ids = [reply.service_id for reply in replies]
    secrets = [reply.secret for reply in replies]
    assert all(0 < sid < 2**63 for sid in ids) and len(set(ids)) == len(ids)
    assert max(ids) > 2**56  # drawn from the whole 63-bit range
    assert all(re.fullmatch(r"[A-Za-z0-9_-]{22,}", secret) for secret in secrets)
    assert len(set(secrets)) == len(secrets)


async def test_inquiry_by_details_matches_type_and_property_subset(directory: RunningDirectory) -> None:
    actor_a, actor_ab, env_a, actor_empty = await register_ok(
        directory,
        request(ACTOR, {"a": "1"}),
        request(ACTOR, {"a": "1", "b": "2"}),
        request(ENVIRONMENT, {"a": "1"}),
        request(ACTOR, {"a": ""}),
    )
    assert set(await visible_ids(directory, service_type=ACTOR, properties={"a": "1"})) == {actor_a, actor_ab}
    assert await visible_ids(directory, service_type=ACTOR, properties={"a": "1", "b": "2"}) == [actor_ab]
    assert await visible_ids(directory, service_type=ACTOR, properties={"b": "3"}) == []
    # UNKNOWN_SERVICE matches every type; no properties matches everything of the type.
    assert set(await visible_ids(directory, properties={"a": "1"})) == {actor_a, actor_ab, env_a}
    assert set(await visible_ids(directory, service_type=ACTOR)) == {actor_a, actor_ab, actor_empty}
    # An inquired empty value needs the property present with an empty value.
    assert await visible_ids(directory, properties={"a": ""}) == [actor_empty]
    assert await visible_ids(directory, properties={"b": ""}) == []


async def test_inquiries_up_to_the_property_limit_match_exactly(directory: RunningDirectory) -> None:
    full = {f"p{index}": f"v{index}" for index in range(MAX_PROPERTIES)}
    one_differs = dict(full, p7="other")
    one_missing = {name: value for name, value in full.items() if name != "p63"}
    full_id, differs_id, missing_id = await register_ok(
        directory, request(ACTOR, full), request(ACTOR, one_differs), request(ACTOR, one_missing)
    )
    assert await visible_ids(directory, properties=full) == [full_id]
    assert await visible_ids(directory, properties=one_differs) == [differs_id]
    assert await visible_ids(directory, properties=one_missing) == [missing_id, full_id]
    without_p7 = {name: value for name, value in one_missing.items() if name != "p7"}
    assert set(await visible_ids(directory, properties=without_p7)) == {full_id, differs_id, missing_id}


async def test_most_recently_registered_first(directory: RunningDirectory) -> None:
    ids = []
    for _ in range(5):
        ids += await register_ok(directory, request(ACTOR, {"order": "x"}))
    assert await visible_ids(directory, properties={"order": "x"}) == list(reversed(ids))


async def test_a_repeated_inquiry_sees_every_change(directory: RunningDirectory) -> None:
    """The same request bytes, asked again and again (answered from the remembered answer while
    nothing changed), see each registration, removal and token at once."""
    (first,) = await register(directory, request(ACTOR, {"repeat": "x"}))
    for _ in range(3):
        assert await visible_ids(directory, properties={"repeat": "x"}) == [first.service_id]
    assert await visible_ids(directory, properties={"repeat": "x"}, token="team") == []
    (second,) = await register(directory, request(ACTOR, {"repeat": "x"}))
    assert await visible_ids(directory, properties={"repeat": "x"}) == [second.service_id, first.service_id]
    (team,) = await register(directory, request(ACTOR, {"repeat": "x"}), token="team")
    assert await visible_ids(directory, properties={"repeat": "x"}, token="team") == [team.service_id]
    assert await visible_ids(directory, properties={"repeat": "x"}) == [second.service_id, first.service_id]
    (removed,) = await deregister(directory, (second.service_id, second.secret))
    assert removed.status == OK
    assert await visible_ids(directory, properties={"repeat": "x"}) == [first.service_id]
    assert await visible_ids(directory, service_id=second.service_id) == []


async def test_undecodable_inquiry_bytes_are_invalid_argument(directory: RunningDirectory) -> None:
    raw = directory.channel.unary_stream("/cogmentAPI.DirectorySP/Inquire")
    with pytest.raises(grpc.aio.AioRpcError) as error:
        _ = [reply async for reply in raw(b"\xff\xff\xff")]
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details() == UNDECODABLE_MESSAGE


async def test_no_match_is_an_empty_ok_stream(directory: RunningDirectory) -> None:
    assert await inquire(directory, properties={"nothing": "here"}) == []
    assert await inquire(directory, service_id=12345) == []
    assert await inquire(directory, service_id=0) == []
    assert await inquire(directory, service_id=2**64 - 1) == []


async def test_malformed_inquiries_are_invalid_argument(directory: RunningDirectory) -> None:
    many = {f"p{index}": "v" for index in range(65)}
    for bad in (
        directory_pb2.InquireRequest(),
        directory_pb2.InquireRequest(details=directory_pb2.ServiceDetails(type=42)),  # type: ignore[arg-type]
        directory_pb2.InquireRequest(details=directory_pb2.ServiceDetails(properties=many)),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as error:
            _ = [reply async for reply in directory.stub.Inquire(bad)]
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.details()


# ---- tokens and secrets ----


async def test_token_scopes_visibility_and_removal(directory: RunningDirectory) -> None:
    (public,) = await register(directory, request(ACTOR, {"k": "v"}))
    (team,) = await register(directory, request(ACTOR, {"k": "v"}), token="team-token")
    assert await visible_ids(directory, properties={"k": "v"}) == [public.service_id]
    assert await visible_ids(directory, properties={"k": "v"}, token="") == [public.service_id]
    assert await visible_ids(directory, properties={"k": "v"}, token="team-token") == [team.service_id]
    assert await visible_ids(directory, service_id=team.service_id) == []
    assert await visible_ids(directory, service_id=team.service_id, token="other") == []

    wrong_token, wrong_secret, unknown = await deregister(
        directory, (team.service_id, team.secret), (team.service_id, public.secret), (999, "x"), token="nope"
    )
    assert wrong_token.status == FAILED and "Authentication failure" in wrong_token.error_msg
    assert wrong_secret.status == FAILED and "Authentication failure" in wrong_secret.error_msg
    assert unknown.status == FAILED and "Unknown service ID [999]" in unknown.error_msg
    (bad_secret,) = await deregister(directory, (team.service_id, public.secret), token="team-token")
    assert bad_secret.status == FAILED
    assert await visible_ids(directory, service_id=team.service_id, token="team-token") == [team.service_id]

    (ok,) = await deregister(directory, (team.service_id, team.secret), token="team-token")
    assert ok.status == OK
    assert await visible_ids(directory, service_id=team.service_id, token="team-token") == []
    (again,) = await deregister(directory, (team.service_id, team.secret), token="team-token")
    assert again.status == FAILED


async def test_secrets_and_tokens_are_not_stored_in_clear(directory: RunningDirectory) -> None:
    token = "a-distinctive-authentication-token"
    (reply,) = await register(directory, request(ACTOR, {"p": "q"}), token=token)
    database: Database = directory.service.database
    dump = []
    for table in schema.metadata.sorted_tables:
        dump += [repr(tuple(row)) for row in await database.fetch(select(table))]
    text = "\n".join(dump)
    assert str(reply.service_id) in text  # the dump does hold the entry
    assert reply.secret not in text
    assert token not in text


# ---- permanent entries ----


async def test_permanent_reregistration_updates_the_entry_in_place(directory: RunningDirectory) -> None:
    props = {"__actor_class": "c", "__implementation": "i"}
    (first,) = await register(directory, request(ACTOR, props, host="old", permanent=True))
    (second,) = await register(directory, request(ACTOR, props, host="new", permanent=True))
    assert (second.service_id, second.secret) == (first.service_id, first.secret)
    (data,) = await inquire(directory, properties=props)
    assert data.endpoint.host == "new" and data.permanent

    # Any difference in token, type or full property map is another entry; nothing is deleted.
    others = await register_ok(
        directory,
        request(ACTOR, {"__actor_class": "c"}, permanent=True),
        request(ENVIRONMENT, props, permanent=True),
    )
    (other_token,) = await register(directory, request(ACTOR, props, permanent=True), token="t")
    assert len({first.service_id, *others, other_token.service_id}) == 4
    assert len(await inquire(directory, properties={"__actor_class": "c"})) == 3

    # Non-permanent registrations never de-duplicate.
    transient = await register_ok(directory, request(ACTOR, {"x": "1"}), request(ACTOR, {"x": "1"}))
    assert len(set(transient)) == 2
    # The permanent secret still deregisters the updated entry.
    (ok,) = await deregister(directory, (first.service_id, first.secret))
    assert ok.status == OK


async def test_force_permanent_makes_registrations_permanent(directory_factory: DirectoryFactory) -> None:
    async with directory_factory("--force_permanent", *FAST_CHECKS) as d:
        dead_port = free_port()
        first, second = await register_ok(
            d,
            request(ACTOR, {"a": "1"}, protocol=GRPC, host="127.0.0.1", port=dead_port),
            request(ACTOR, {"a": "1"}, protocol=GRPC, host="127.0.0.1", port=dead_port),
        )
        assert first == second
        await asyncio.sleep(1.0)  # several check intervals: permanent entries are never checked
        (data,) = await inquire(d, service_id=first)
        assert data.permanent


# ---- health checking ----


async def test_unreachable_service_is_hidden_then_removed(directory: RunningDirectory) -> None:
    (sid,) = await register_ok(directory, request(ACTOR, protocol=GRPC, host="127.0.0.1", port=free_port()))

    async def hidden() -> bool:
        return await visible_ids(directory, service_id=sid) == []

    await eventually(hidden)

    async def removed() -> bool:
        return await directory.service.store.credentials(sid) is None

    await eventually(removed)


async def test_entries_are_answered_only_once_a_check_passed(directory_factory: DirectoryFactory) -> None:
    live = await FakeCogmentService("ServiceActorSP").start()
    silent = await FakeTcpService(silent=True).start()  # accepts, never answers gRPC
    try:
        async with directory_factory("--registration_check_wait", "0.5") as directory:

            async def register_and_inquire(port: int) -> list[int]:
                registration = request(ACTOR, {"port": str(port)}, protocol=GRPC, host="127.0.0.1", port=port)
                # Register waits for the first check at most its bound: well within this deadline
                # even for an endpoint whose check takes 14 s (DEADLINE_EXCEEDED otherwise).
                call = directory.stub.Register(iter([registration]), timeout=5)
                (reply,) = [reply async for reply in call]
                assert reply.status == OK
                return await visible_ids(directory, properties={"port": str(port)})

            (live_id,) = await register_and_inquire(live.port)  # inquirable as soon as Register returns
            assert await register_and_inquire(free_port()) == []  # refused: never handed out
            assert await register_and_inquire(silent.port) == []  # silent: not until a check passes
            assert await visible_ids(directory, service_id=live_id) == [live_id]
    finally:
        await live.stop()
        await silent.stop()


async def test_healthy_services_stay_visible_with_their_load(directory: RunningDirectory) -> None:
    with_status = await FakeCogmentService("ServiceActorSP", load="42").start()
    version_only = await FakeCogmentService("EnvironmentSP", with_status=False).start()
    tcp = await FakeTcpService().start()
    try:
        ids = await register_ok(
            directory,
            request(ACTOR, {"h": "1"}, protocol=GRPC, host="127.0.0.1", port=with_status.port),
            request(ENVIRONMENT, {"h": "1"}, protocol=GRPC, host="127.0.0.1", port=version_only.port),
            request(OTHER, {"h": "1"}, protocol=GRPC, host="127.0.0.1", port=tcp.port),
            request(ACTOR, {"h": "1"}, protocol=GRPC_SSL, host="127.0.0.1", port=tcp.port),
        )

        async def checked_several_times() -> bool:
            return with_status.status_calls >= 3 and version_only.version_calls >= 3 and tcp.connections >= 6

        await eventually(checked_several_times)
        assert set(await visible_ids(directory, properties={"h": "1"})) == set(ids)
        assert with_status.version_calls == 0  # Status answered: no fallback
        rows = await directory.service.database.fetch(
            select(schema.directory_services.c.service_id, schema.directory_services.c.load)
        )
        loads = dict((service_id, load) for service_id, load in rows)
        assert loads[ids[0]] == 42
    finally:
        for fake in (with_status, version_only, tcp):
            await fake.stop()


async def test_a_tcp_service_that_resets_what_it_accepts_stays_visible(directory: RunningDirectory) -> None:
    """A connection that was accepted is a listening service, even when the server resets it at
    once (as a server shedding load does): the TCP check counts it as up."""
    tcp = await FakeTcpService(resets=True).start()
    try:
        (sid,) = await register_ok(
            directory, request(OTHER, {"r": "1"}, protocol=GRPC, host="127.0.0.1", port=tcp.port)
        )
        await eventually(lambda: tcp.connections >= 3, "three checks")
        assert await visible_ids(directory, service_id=sid) == [sid]
    finally:
        await tcp.stop()


async def test_stopped_tcp_service_is_removed(directory: RunningDirectory) -> None:
    tcp = await FakeTcpService().start()
    (sid,) = await register_ok(directory, request(OTHER, protocol=GRPC, host="127.0.0.1", port=tcp.port))

    async def checked() -> bool:
        return tcp.connections >= 1

    await eventually(checked)
    assert await visible_ids(directory, service_id=sid) == [sid]
    await tcp.stop()

    async def removed() -> bool:
        return await directory.service.store.credentials(sid) is None

    await eventually(removed)


async def test_cogment_endpoints_and_permanent_entries_are_never_checked(directory: RunningDirectory) -> None:
    client, permanent = await register_ok(
        directory,
        request(ACTOR, protocol=COGMENT, host="client"),
        request(ACTOR, protocol=GRPC, host="127.0.0.1", port=free_port(), permanent=True),
    )
    await asyncio.sleep(1.0)  # five check intervals
    assert await visible_ids(directory, service_id=client) == [client]
    assert await visible_ids(directory, service_id=permanent) == [permanent]


async def test_check_on_inquire_drops_a_dead_service_at_once(directory_factory: DirectoryFactory) -> None:
    async with directory_factory("--check_on_inquire", "--health_check_interval", "3600") as d:
        service = await FakeCogmentService("ServiceActorSP").start()
        (sid,) = await register_ok(
            d, request(ACTOR, {"c": "1"}, protocol=GRPC, host="127.0.0.1", port=service.port)
        )

        async def first_check_done() -> bool:
            return service.status_calls >= 1

        await eventually(first_check_done)
        await asyncio.sleep(0.15)  # older than the 100 ms reuse window
        before = service.status_calls
        assert await visible_ids(d, properties={"c": "1"}) == [sid]
        assert service.status_calls == before + 1  # checked again at inquiry
        await service.stop()
        await asyncio.sleep(0.15)
        assert await visible_ids(d, properties={"c": "1"}) == []


async def test_load_balancing_prefers_the_least_loaded(directory_factory: DirectoryFactory) -> None:
    async with directory_factory("--load_balancing", *FAST_CHECKS) as d:
        fakes = [
            await FakeCogmentService("ServiceActorSP", load=load).start() for load in ("3", "12", "30", "255")
        ]
        try:
            ids = await register_ok(
                d, *(request(ACTOR, {"lb": "1"}, protocol=GRPC, host="127.0.0.1", port=f.port) for f in fakes)
            )

            async def all_checked() -> bool:
                return all(f.status_calls >= 1 for f in fakes)

            await eventually(all_checked)
            await asyncio.sleep(0.3)
            assert set(await visible_ids(d, properties={"lb": "1"})) == {ids[0], ids[1]}
            status = await d.stub.Status(common_pb2.StatusRequest(names=["load_balancing"]))
            assert status.statuses["load_balancing"] == "enabled"
        finally:
            for fake in fakes:
                await fake.stop()


async def test_registration_lag_waits_for_a_late_registration(directory_factory: DirectoryFactory) -> None:
    async with directory_factory("--registration_lag", "3") as d:
        inquiry = asyncio.create_task(visible_ids(d, properties={"late": "1"}))
        await asyncio.sleep(0.5)
        (sid,) = await register_ok(d, request(ACTOR, {"late": "1"}))
        assert await asyncio.wait_for(inquiry, 5) == [sid]


# ---- persistence and status ----


async def test_entries_survive_a_restart(directory_factory: DirectoryFactory) -> None:
    async with directory_factory() as d:
        first, second = await register(
            d, request(ACTOR, {"r": "1"}), request(ACTOR, {"r": "1"}, permanent=True)
        )
    async with directory_factory() as d:
        assert await visible_ids(d, properties={"r": "1"}) == [second.service_id, first.service_id]
        assert [reply.status for reply in await deregister(d, (first.service_id, first.secret))] == [OK]
        (again,) = await register(d, request(ACTOR, {"r": "1"}, host="moved", permanent=True))
        assert (again.service_id, again.secret) == (second.service_id, second.secret)


async def test_status_reports_entries(directory: RunningDirectory) -> None:
    assert (await directory.stub.Status(common_pb2.StatusRequest())).statuses == {}
    await register_ok(directory, request(), request())
    reply = await directory.stub.Status(common_pb2.StatusRequest(names=["*"]))
    assert reply.statuses["nb_entries"] == "2"
    assert reply.statuses["load_balancing"] == "disabled"
    assert 0 <= int(reply.statuses["overall_load"]) <= 100


async def test_discovery_token_property_is_the_token_not_a_property(directory: RunningDirectory) -> None:
    (sid,) = await register_ok(directory, request(ACTOR, {"d": "1"}), token="secret-team")
    with_property = {"d": "1", "__authentication-token": "secret-team"}
    assert await visible_ids(directory, service_type=ACTOR, properties=with_property) == [sid]
    assert await visible_ids(directory, service_type=ACTOR, properties={**with_property, "d": "2"}) == []
    assert await visible_ids(directory, properties={"d": "1", "__authentication-token": "other"}) == []
    # The metadata token, when present, is the one used.
    assert await visible_ids(directory, properties=with_property, token="other") == []


async def test_an_unexpected_error_is_internal_and_the_server_keeps_serving(
    directory: RunningDirectory, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(*_args: object) -> AsyncIterator[list[object]]:
        raise RuntimeError("a detail for the logs only")
        yield []  # an async generator, as `find` is: the error comes from iterating it

    # Whichever answers: the in-memory index, or the store when the index is not current.
    monkeypatch.setattr(directory.service.store, "find", broken)
    monkeypatch.setattr(directory.service.index, "find", broken)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await inquire(directory, service_id=1)
    assert error.value.code() == grpc.StatusCode.INTERNAL
    assert "detail for the logs" not in (error.value.details() or "")
    monkeypatch.undo()
    assert await inquire(directory, service_id=1) == []


async def test_inquiries_drive_from_their_rarest_property(database_url: str) -> None:
    database = Database(database_url)
    await database.migrate()
    store = DirectoryStore(database)
    try:
        endpoint = Endpoint(GRPC, "127.0.0.1", 1)
        for index in range(PROPERTY_COUNT_CAP + 20):
            await store.add(Registration(endpoint, ACTOR, {"common": "x", "n": str(index)}, True), "", index)
        await store.add(Registration(endpoint, ACTOR, {"common": "x", "rare": "y"}, True), "", 0)
        # The capped counts tell them apart (the plan, not the result, depends on it).
        assert await store._rarest({"common": "x", "rare": "y"}) == ("rare", "y")
    finally:
        await database.close()


async def test_a_dead_service_is_hidden_in_time_whatever_else_is_registered(
    directory_factory: DirectoryFactory,
) -> None:
    live = await FakeCogmentService("ServiceActorSP").start()
    silent = await FakeTcpService(silent=True).start()  # accepts connections, never answers gRPC
    try:
        interval = 2.0
        flags = ("--health_check_interval", str(interval), "--registration_check_wait", "0")
        async with directory_factory(*flags) as directory:
            await register_ok(
                directory, request(ACTOR, {"live": "1"}, protocol=GRPC, host="127.0.0.1", port=live.port)
            )

            async def visible() -> bool:
                return bool(await visible_ids(directory, properties={"live": "1"}))

            await eventually(visible)
            # A flood of endpoints whose every check runs into its deadline.
            flood = [
                request(ACTOR, {"n": str(n)}, protocol=GRPC, host="127.0.0.1", port=silent.port)
                for n in range(300)
            ]
            await register_ok(directory, *flood)
            await live.stop()

            async def hidden() -> bool:
                return not await visible()

            # Its interval plus one check's deadline (3 s), with room to spare: with checks run in
            # batches waiting for their slowest members, this took minutes.
            await eventually(hidden, timeout_s=interval + 3 + 10)
            assert await directory.service.store.count() == 301  # the flood is still there
    finally:
        await live.stop()
        await silent.stop()


async def test_a_colliding_id_is_drawn_again(
    directory: RunningDirectory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """New ids are random: one that is taken (one chance in 2^63) is drawn again, for new and
    permanent entries alike, on both databases' write paths."""
    draws = iter([41, 41, 42, 41, 43])
    monkeypatch.setattr(entry_writes.secrets, "randbelow", lambda _bound: next(draws))
    (first,) = await register_ok(directory, request(ACTOR, {"c": "1"}))
    (second,) = await register_ok(directory, request(ACTOR, {"c": "2"}))
    (third,) = await register_ok(directory, request(ACTOR, {"c": "3"}, protocol=GRPC, port=1, permanent=True))
    assert (first, second, third) == (42, 43, 44)
