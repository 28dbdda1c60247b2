"""The web console over HTTP (httpx on its ASGI app) against the three services running for
real (in-process, SQLite): every page shows what the services hold, curves follow the rewards
(late ones at their tick), the inspector decodes with the given messages, a running trial's
events stream its new ticks, downloads carry the version's bytes, a service that is down is
shown as down while the others' pages work, unknown things are 404 pages, and the access token
guards another interface than the loopback."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import secrets
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from services.console import directory_pages
from services.console.app import build_app
from services.console.decode import DecoderError, Decoders
from services.console.errors import Busy
from services.console.service import ConfigurationError, ConsoleSettings
from services.console.sources import Sources, SourceSettings
from services.console.views import MIN_CURVE_BYTES, TRIAL_CURVE_BYTES, Console
from services.datastore.client.api import DatastoreClient
from services.directory.client.api import DirectoryClient
from services.model_registry.client.api import ModelRegistryClient
from shared.api import common_pb2, datalog_pb2, directory_pb2
from tests.helpers.console_trials import ConsoleSuite, ended_trial, observation, record, running_suite, sample
from tests.helpers.datastore import datalog_inputs, send_acknowledged, trial_params
from tests.helpers.running import (
    make_directory_factory,
    make_registry_factory,
)

pytestmark = pytest.mark.timeout(120)

DEMO_MESSAGES = ["class1=cogment_aux_demo.Observation,cogment_aux_demo.Action"]


@pytest.fixture
async def suite(tmp_path: Path) -> AsyncIterator[ConsoleSuite]:
    async with running_suite(tmp_path) as running:
        yield running


def console_app(
    suite: ConsoleSuite,
    *,
    decoders: Decoders | None = None,
    auth_token: str = "",
    discover: bool = False,
    curves_bytes: int = 16 * TRIAL_CURVE_BYTES,
):  # type: ignore[no-untyped-def]
    sources = Sources(
        SourceSettings(
            f"grpc://{suite.directory.address}",
            "" if discover else suite.endpoint(suite.registry),
            "" if discover else suite.endpoint(suite.datastore),
            "",
            None,
        )
    )
    return build_app(Console(sources, decoders or Decoders(), curves_bytes), auth_token), sources


@pytest.fixture
async def http(suite: ConsoleSuite) -> AsyncIterator[httpx.AsyncClient]:
    app, sources = console_app(suite, decoders=Decoders.load(["services.demo.api.spec_pb2"], DEMO_MESSAGES))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://console") as client:
        yield client
    await sources.close()


def text_of(html: str, element_id: str) -> str:
    match = re.search(rf'id="{element_id}"[^>]*>([^<]*)<', html)
    assert match, f"no element {element_id}"
    return match[1].strip()


async def test_overview_trials_and_a_trial_page(suite: ConsoleSuite, http: httpx.AsyncClient) -> None:
    await record(suite.datastore, "first", ended_trial(5), run="a")
    late = ended_trial(4)
    # A late reward for tick 1, stored after tick 2: it counts at tick 1.
    source = common_pb2.RewardSource(sender_name="env", value=10, confidence=1)
    late.insert(
        3,
        datalog_pb2.DatalogSample(
            info=datalog_pb2.SampleInfo(tick_id=1, timestamp=2000, state=common_pb2.RUNNING),
            rewards=[common_pb2.Reward(receiver_name="bob", tick_id=1, sources=[source])],
        ),
    )
    await record(suite.datastore, "second", late, run="b")
    interrupted = suite.datastore.datalog.RunTrialDatalog(metadata=(("trial-id", "third"), ("user-id", "u")))
    await send_acknowledged(interrupted, datalog_inputs(trial_params(), [sample(0)]))
    await interrupted.done_writing()
    assert await interrupted.read() is grpc.aio.EOF

    overview = (await http.get("/")).text
    assert overview.count('class="up"') == 3
    assert "3</span> trials" in overview and "2 ended" in overview and "1 interrupted" in overview

    page = await http.get("/trials")
    assert page.status_code == 200
    order = re.findall(r'<tr data-trial="([^"]+)"', page.text)
    assert order == ["third", "second", "first"]  # newest first
    assert re.search(r'data-trial="third">.*?class="state interrupted"', page.text, re.S)
    first_row = page.text.split('data-trial="first"')[1].split("</tr>")[0]
    assert "class1: 5" in first_row and "class2: -2.5" in first_row  # alice's 5 ticks; carol's
    filtered = await http.get("/trials", params={"state": "interrupted"})
    assert re.findall(r'<tr data-trial="([^"]+)"', filtered.text) == ["third"]
    by_property = await http.get("/trials", params={"properties": "run=b"})
    assert re.findall(r'<tr data-trial="([^"]+)"', by_property.text) == ["second"]
    assert (await http.get("/trials", params={"state": "sleeping"})).status_code == 400

    detail = await http.get("/trials/second")
    assert detail.status_code == 200 and 'data-running="false"' in detail.text
    snapshots = await curve_snapshots(http, "second")
    final = snapshots[-1]
    assert final["done"] and final["ticks"] == 4 and final["state"] == "ended"
    by_actor = {curve["actor"]: curve for curve in final["curves"]}
    assert by_actor["bob"]["ticks"] == [0, 1, 2, 3]  # one point per tick
    assert by_actor["bob"]["reward_max"] == [0, 10, 0, 0]  # the late reward, at tick 1
    assert by_actor["alice"]["returns"] == [1, 2, 3, 4]
    assert final["returns"] == {"class1": 14, "class2": -2}  # alice's 4 and bob's 10; carol's

    tick = (await http.get("/api/trials/first/ticks/2")).json()
    assert tick["tick"] == 2
    alice = tick["actors"][0]
    assert alice["actor"] == "alice" and alice["reward"] == 1.0
    assert alice["observation"]["decoded"] == "values: 0.2 values: -1.0"
    assert alice["action"]["decoded"] == "move: RIGHT"
    carol = tick["actors"][2]  # class2: no messages given, size and hex
    assert carol["observation"]["decoded"] == "" and carol["observation"]["size"] == len(observation(2))
    assert carol["observation"]["preview"] == observation(2).hex(" ")
    assert (await http.get("/api/trials/first/ticks/99")).status_code == 404

    compare = await http.get("/compare", params=[("trial", "first"), ("trial", "second")])
    series = json.loads(re.search(r'id="compare-data">(.*?)</script>', compare.text, re.S)[1])  # type: ignore[index]
    assert {one["name"] for one in series} >= {"first / alice", "second / bob"}


async def test_unknown_things_are_404_pages_and_nothing_answers_with_a_traceback(
    suite: ConsoleSuite, http: httpx.AsyncClient
) -> None:
    for path in ("/trials/nope", "/models/nope", "/api/trials/nope/ticks/0", "/models/nope/versions/1/data"):
        response = await http.get(path)
        assert response.status_code == 404, path
        assert "Traceback" not in response.text
    assert (await http.get("/trials", params={"before": "x"})).status_code == 400


async def test_models_versions_and_downloads(suite: ConsoleSuite, http: httpx.AsyncClient) -> None:
    data = secrets.token_bytes(300_000)
    async with ModelRegistryClient(suite.endpoint(suite.registry)) as registry:
        await registry.create_model("policy", {"algorithm": "dqn"})
        await registry.publish_version("policy", data, user_data={"step": "100"})
        await registry.publish_version("policy", b"small", archived=False)
    models = await http.get("/models")
    assert 'data-model="policy"' in models.text and "algorithm=dqn" in models.text
    page = (await http.get("/models/policy")).text
    assert re.findall(r'data-version="(\d+)"', page) == ["2", "1"]
    assert hashlib.sha256(data).hexdigest() in page and "transient" in page and "step=100" in page
    download = await http.get("/models/policy/versions/1/data")
    assert download.status_code == 200
    assert hashlib.sha256(download.content).hexdigest() == hashlib.sha256(data).hexdigest()
    assert "policy-v1.bin" in download.headers["content-disposition"]


async def curve_snapshots(http: httpx.AsyncClient, trial_id: str) -> list[dict[str, Any]]:
    """The snapshots of a trial's curves its page receives, until the stream ends."""
    snapshots = []
    async with http.stream("GET", f"/api/trials/{trial_id}/curves") as stream:
        async for line in stream.aiter_lines():
            if line.startswith("data: ") and line != "data: {}":
                snapshots.append(json.loads(line.removeprefix("data: ")))
    return snapshots


async def test_new_versions_and_a_running_trials_ticks_stream(
    suite: ConsoleSuite, http: httpx.AsyncClient
) -> None:
    call = suite.datastore.datalog.RunTrialDatalog(metadata=(("trial-id", "live"), ("user-id", "u")))
    await send_acknowledged(call, datalog_inputs(trial_params(), [sample(0, rewards={"alice": 1})]))
    page = await http.get("/trials/live")
    assert 'data-running="true"' in page.text

    reading = asyncio.create_task(curve_snapshots(http, "live"))
    for tick in (1, 2):
        await send_acknowledged(
            call, [datalog_pb2.RunTrialDatalogInput(sample=sample(tick, rewards={"alice": tick}))]
        )
    await send_acknowledged(call, [datalog_pb2.RunTrialDatalogInput(sample=sample(3, common_pb2.ENDED))])
    await call.done_writing()
    snapshots = await asyncio.wait_for(reading, 30)
    assert [snapshot["done"] for snapshot in snapshots][-1] is True
    assert snapshots[-1]["state"] == "ended" and snapshots[-1]["ticks"] == 4
    alice = next(curve for curve in snapshots[-1]["curves"] if curve["actor"] == "alice")
    assert alice["reward_max"] == [1.0, 1.0, 2.0, 0.0]


async def test_curves_drawn_at_once_stay_within_their_memory(suite: ConsoleSuite) -> None:
    """A trial page's curves hold their share of --curves_bytes while open; past the limit a page
    is told to try again (a 503, or a failure event on the stream), and a closed page's share
    comes back."""
    await record(suite.datastore, "ended", ended_trial(3))
    call = suite.datastore.datalog.RunTrialDatalog(metadata=(("trial-id", "live"), ("user-id", "u")))
    await send_acknowledged(call, datalog_inputs(trial_params(), [sample(0, rewards={"alice": 1})]))
    app, sources = console_app(suite, curves_bytes=TRIAL_CURVE_BYTES + MIN_CURVE_BYTES)
    console: Console = app.state.console
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://console") as http:
        live = console.curve_snapshots("live")  # a page left open on a running trial
        assert (await anext(live))["ticks"] == 1
        assert console.curve_memory.used == TRIAL_CURVE_BYTES
        # What is left draws a second trial, in fewer slots: still every tick of this one.
        compared = await http.get("/compare", params={"trial": "ended"})
        assert compared.status_code == 200 and '"returns": [-0.5, -1.0, -1.5]' in compared.text
        second = console.curve_snapshots("ended")
        assert (await anext(second))["ticks"] == 3
        assert console.curve_memory.used == TRIAL_CURVE_BYTES + MIN_CURVE_BYTES
        busy = await http.get("/compare", params={"trial": "ended"})
        assert busy.status_code == 503 and "--curves_bytes" in busy.text
        failure = await http.get("/api/trials/ended/curves")
        assert "event: failure" in failure.text and "try again in a moment" in failure.text
        with pytest.raises(Busy):
            await anext(console.curve_snapshots("ended"))
        await second.aclose()
        await live.aclose()
        assert console.curve_memory.used == 0
        assert (await http.get("/compare", params={"trial": "ended"})).status_code == 200
    await call.done_writing()
    await sources.close()


async def test_a_service_down_shows_as_down_and_the_others_work(tmp_path: Path) -> None:
    async with AsyncExitStack() as stack:
        directory = await stack.enter_async_context(
            make_directory_factory(f"sqlite+aiosqlite:///{tmp_path / 'directory.db'}")()
        )
        registry = await stack.enter_async_context(
            make_registry_factory(
                "--database_url", f"sqlite+aiosqlite:///{tmp_path / 'registry.db'}",
                "--archive_dir", str(tmp_path / "b"),
            )()
        )  # fmt: skip
        closed = f"grpc://127.0.0.1:{_closed_port()}"
        sources = Sources(
            SourceSettings(
                f"grpc://{directory.address}", f"grpc://127.0.0.1:{registry.service.port}", closed, "", None
            )
        )
        app = build_app(Console(sources, Decoders()), "")
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://console"
        ) as http:
            overview = await http.get("/")
            assert overview.status_code == 200
            assert 'data-service="trial_datastore"' in overview.text
            assert (
                overview.text.count('class="up"') == 2 and "cannot reach the trial datastore" in overview.text
            )
            trials = await http.get("/trials")
            assert trials.status_code == 503 and "trial datastore is unavailable" in trials.text.lower()
            assert (await http.get("/models")).status_code == 200
            assert (await http.get("/directory")).status_code == 200
        await sources.close()


async def test_a_model_page_is_a_503_not_a_404_while_the_registry_is_down(suite: ConsoleSuite) -> None:
    sources = Sources(
        SourceSettings(
            f"grpc://{suite.directory.address}", f"grpc://127.0.0.1:{_closed_port()}", "", "", None
        )
    )
    app = build_app(Console(sources, Decoders()), "")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://console") as http:
        for path in ("/models/policy", "/api/models/policy/events", "/models/policy/versions/1/data"):
            answer = await http.get(path)
            assert answer.status_code == 503 and "model registry is unavailable" in answer.text.lower(), path
    await sources.close()


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_endpoints_not_given_are_discovered_through_the_directory(suite: ConsoleSuite) -> None:
    for service_type, running in (
        (directory_pb2.DATASTORE_SERVICE, suite.datastore),
        (directory_pb2.MODEL_REGISTRY_SERVICE, suite.registry),
    ):
        request = directory_pb2.RegisterRequest(
            endpoint=directory_pb2.ServiceEndpoint(
                protocol=directory_pb2.ServiceEndpoint.GRPC, host="127.0.0.1", port=running.service.port
            ),
            details=directory_pb2.ServiceDetails(type=service_type),
            permanent=True,
        )
        [reply] = [reply async for reply in suite.directory.stub.Register(iter([request]))]
        assert reply.status == directory_pb2.RegisterReply.OK
    app, sources = console_app(suite, discover=True)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://console") as http:
        overview = (await http.get("/")).text
        assert overview.count('class="up"') == 3
        assert f"grpc://127.0.0.1:{suite.datastore.service.port}" in overview
        directory = (await http.get("/directory")).text
        assert directory.count("<tr data-entry=") == 2 and "secret" not in directory.lower()
    await sources.close()


async def test_the_directory_page_shows_failing_entries_too(
    suite: ConsoleSuite, http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    def registration(port: int, permanent: bool) -> directory_pb2.RegisterRequest:
        return directory_pb2.RegisterRequest(
            endpoint=directory_pb2.ServiceEndpoint(
                protocol=directory_pb2.ServiceEndpoint.GRPC, host="127.0.0.1", port=port
            ),
            details=directory_pb2.ServiceDetails(type=directory_pb2.ACTOR_SERVICE),
            permanent=permanent,
        )

    replies = [
        reply
        async for reply in suite.directory.stub.Register(
            iter([registration(_closed_port(), False), registration(1, True)])
        )
    ]
    failing, permanent = (reply.service_id for reply in replies)
    page = (await http.get("/directory")).text
    assert re.search(rf'data-entry="{failing}" data-health="failing"', page)
    assert re.search(rf'data-entry="{permanent}" data-health="not checked"', page)
    assert " in a row)" in page and "last check" in page
    assert text_of((await http.get("/")).text, "entries-count") == "2"
    # A Cogment 2.x directory lists nothing but what inquiries answer: the page says so.
    monkeypatch.setattr(DirectoryClient, "list_entries", _not_served)
    page = (await http.get("/directory")).text
    assert f'data-entry="{failing}"' not in page and f'data-entry="{permanent}" data-health="healthy"' in page
    assert "this directory does not list the others" in page


async def test_the_directory_page_lists_the_newest_entries_at_most(
    suite: ConsoleSuite, http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(directory_pages, "MAX_ENTRIES", 3)
    monkeypatch.setattr(directory_pages, "ENTRIES_PAGE", 2)

    async def register(count: int) -> None:
        permanent = directory_pb2.RegisterRequest(
            endpoint=directory_pb2.ServiceEndpoint(
                protocol=directory_pb2.ServiceEndpoint.GRPC, host="h", port=1
            ),
            details=directory_pb2.ServiceDetails(type=directory_pb2.ACTOR_SERVICE),
            permanent=True,
        )
        for number in range(count):
            permanent.details.properties["n"] = f"{number}-{secrets.token_hex(4)}"
            replies = [r.status async for r in suite.directory.stub.Register(iter([permanent]))]
            assert replies == [directory_pb2.RegisterReply.OK]

    await register(3)  # exactly as many as shown: complete
    assert text_of((await http.get("/")).text, "entries-count") == "3"
    await register(1)
    assert text_of((await http.get("/")).text, "entries-count") == "3+"
    assert "The 3 newest are shown." in (await http.get("/directory")).text


async def _not_served(*_args: object, **_kwargs: object) -> None:
    return None


async def test_the_inspector_shows_each_ticks_own_sample_among_late_ones(
    suite: ConsoleSuite, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first sample of a tick, as reading the trial from its start finds it, late samples of
    earlier ticks in between (some of them after the trial's last tick)."""
    samples = ended_trial(300)
    for position, tick in [(250, 100), (200, 199), (150, 2), (151, 2), (100, 99), (20, 0)]:
        late = sample(tick, rewards={"alice": 5.0})
        late.info.out_of_sync = True
        samples.insert(position, late)
    samples += [sample(tick, rewards={"alice": 7.0}) for tick in range(300)]  # rewards after the end
    await record(suite.datastore, "late", samples)
    app, sources = console_app(suite)
    console: Console = app.state.console
    ticks = sorted({*range(0, 300, 13), 0, 2, 99, 100, 101, 199, 200, 299})
    scanned = {tick: await console._scanned_sample_of_tick("late", tick, len(samples)) for tick in ticks}
    monkeypatch.setattr(Console, "_scanned_sample_of_tick", _not_to_be_called)  # the datastore finds them
    for tick in ticks:
        found = await console._sample_of_tick("late", tick, len(samples))
        assert found == scanned[tick] and found is not None and found.timestamp == 1000 + tick, tick
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://console") as http:
        view = (await http.get("/api/trials/late/ticks/299")).json()
        assert (view["tick"], view["state"]) == (299, "ended")
        assert (await http.get("/api/trials/late/ticks/300")).status_code == 404
        # A datastore without the ranges (a Cogment 2.x one): read from the start, the same tick.
        monkeypatch.undo()
        monkeypatch.setattr(DatastoreClient, "sample_range", _not_served)
        assert (await http.get("/api/trials/late/ticks/299")).json() == view
    await sources.close()


async def _not_to_be_called(*_args: object, **_kwargs: object) -> None:
    raise AssertionError("the trial was read from its start")


async def test_trials_are_counted_by_the_datastore_or_by_listing_them(
    suite: ConsoleSuite, http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    for trial_id in ("a", "b"):
        await record(suite.datastore, trial_id, ended_trial(2))
    await record(suite.datastore, "cut", [sample(0)])  # its stream closed before it ended
    call = suite.datastore.datalog.RunTrialDatalog(metadata=(("trial-id", "live"), ("user-id", "u")))
    await send_acknowledged(call, datalog_inputs(trial_params(), [sample(0)]))
    counted = (await http.get("/")).text
    assert re.findall(r'state=(\w+)">(\d+)', counted) == [
        ("ended", "2"),
        ("interrupted", "1"),
        ("running", "1"),
    ]
    # A Cogment 2.x datastore cannot count them: every trial is listed, the same counts.
    monkeypatch.setattr(DatastoreClient, "trial_counts", _not_served)
    assert (await http.get("/")).text == counted
    await call.done_writing()


async def test_the_access_token(suite: ConsoleSuite) -> None:
    app, sources = console_app(suite, auth_token="s3cret")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://console") as http:
        assert (await http.get("/trials", headers={"accept": "application/json"})).status_code == 401
        redirected = await http.get("/trials", headers={"accept": "text/html"})
        assert redirected.status_code == 303 and redirected.headers["location"].startswith("/login")
        assert (await http.get("/static/console.css")).status_code == 200
        # The probes' address answers without the token and shows nothing.
        health = await http.get("/healthz")
        assert (health.status_code, health.text) == (200, "ok\n")
        assert (await http.get("/trials", headers={"authorization": "Bearer s3cret"})).status_code == 200
        wrong = await http.post("/login", data={"token": "nope"})
        assert wrong.status_code == 401
        login = await http.post("/login?next=/models", data={"token": "s3cret"})
        assert login.status_code == 303 and login.headers["location"] == "/models"
        assert (await http.get("/models")).status_code == 200  # the cookie
    await sources.close()


def test_another_interface_needs_a_token_or_an_explicit_opt_out() -> None:
    with pytest.raises(ConfigurationError, match="--auth_token"):
        ConsoleSettings(host="0.0.0.0").check()
    ConsoleSettings(host="0.0.0.0", auth_token="t").check()
    ConsoleSettings(host="0.0.0.0", allow_anyone_on_the_network=True).check()
    ConsoleSettings(host="127.0.0.1").check()
    ConsoleSettings(host="localhost").check()


def test_bad_decoder_settings_say_what_to_fix() -> None:
    with pytest.raises(DecoderError, match="cannot import --proto_module"):
        Decoders.load(["no.such.module"], [])
    with pytest.raises(DecoderError, match="expected CLASS=OBSERVATION_MESSAGE,ACTION_MESSAGE"):
        Decoders.load([], ["player"])
    with pytest.raises(DecoderError, match="no message"):
        Decoders.load([], ["player=no.Such,"])
