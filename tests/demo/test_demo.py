"""`cogment-aux demo` against real services (in this process, SQLite, real gRPC): the trials it
records have the 2.x orchestrator's shape once stored, the registry holds its policy's versions,
the directory its environment; running it again duplicates neither; flags scale it; a service it
cannot reach is one line naming it."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from services.datastore.client.api import DatastoreClient
from services.datastore.client.cli import main as datastore_cli
from services.demo.api import spec_pb2
from services.demo.cli import OPTIONS, main
from services.demo.orchestration import ENVIRONMENT_IMPLEMENTATION, TrialCounts, TrialPlan, players_of
from services.demo.publishing import DEFAULT_MODEL_ID, local_policies
from services.demo.report import TrialsReport
from services.demo.run import Clients, next_commands
from services.demo.world import GOAL_BONUS, STAGES, THANKS_VALUE, policy_weights, trial_seed
from services.model_registry.client.api import ModelRegistryClient
from shared.api import common_pb2, directory_pb2, model_registry_pb2
from shared.api import trial_datastore_pb2 as ds
from shared.config import parse_options
from tests.demo.helpers import Suite, command_environment, python_module, run_command, run_demo
from tests.helpers.fake_services import free_port
from tests.helpers.running import make_datastore_factory
from tests.helpers.services import PROJECT_ROOT
from tests.helpers.tls import make_pki, openssl_available

USER = "the-demo-user"


async def stored_trials(suite: Suite, trial_ids: list[str]) -> dict[str, ds.StoredTrialInfo]:
    reply = await suite.datastore.stub.RetrieveTrials(ds.RetrieveTrialsRequest(trial_ids=trial_ids))
    return {info.trial_id: info for info in reply.trial_infos}


async def stored_samples(suite: Suite, trial_id: str) -> list[ds.StoredTrialSample]:
    call = suite.datastore.stub.RetrieveSamples(ds.RetrieveSamplesRequest(trial_ids=[trial_id]), timeout=30)
    return [reply.trial_sample async for reply in call]


def expected_counts(seed: int, index: int, ticks: int, actors: int) -> TrialCounts:
    """What the demo sends of its `index`-th trial for `seed`, counted offline."""
    players = players_of(index, actors, local_policies(DEFAULT_MODEL_ID))
    counts = TrialCounts()
    for _ in TrialPlan(f"t{index}", trial_seed(seed, index), ticks, players).datalog_inputs(counts):
        pass
    return counts


async def environment_entries(suite: Suite) -> list[directory_pb2.FullServiceData]:
    inquiry = directory_pb2.InquireRequest(
        details=directory_pb2.ServiceDetails(
            type=directory_pb2.ENVIRONMENT_SERVICE,
            properties={"__implementation": ENVIRONMENT_IMPLEMENTATION},
        )
    )
    return [reply.data async for reply in suite.directory.stub.Inquire(inquiry)]


async def registry_models(suite: Suite) -> list[model_registry_pb2.ModelInfo]:
    reply = await suite.registry.stub.RetrieveModels(model_registry_pb2.RetrieveModelsRequest())
    return list(reply.model_infos)


async def model_versions(suite: Suite) -> list[model_registry_pb2.ModelVersionInfo]:
    reply = await suite.registry.stub.RetrieveVersionInfos(
        model_registry_pb2.RetrieveVersionInfosRequest(model_id=DEFAULT_MODEL_ID)
    )
    return list(reply.version_infos)


async def test_trials_are_stored_as_the_orchestrator_logs_them(suite: Suite) -> None:
    report = (
        await run_demo(suite, "--seed", "7", "--trials", "3", "--ticks", "40", "--user_id", USER)
    ).report
    trials = report["trials"]
    trial_ids = trials["trial_ids"]
    run_id = report["run_id"]
    assert trial_ids == [f"demo-{run_id}-{index}" for index in range(3)]
    infos = await stored_trials(suite, trial_ids)
    # Recorded concurrently: the datastore lists them in the order their streams opened.
    assert sorted(infos) == trial_ids
    published = {version["stage"]: version["version_number"] for version in report["model"]["versions"]}

    total_late = total_samples = total_messages = 0
    for index, trial_id in enumerate(trial_ids):
        info = infos[trial_id]
        expected = expected_counts(7, index, 40, 3)
        assert info.last_state == common_pb2.ENDED
        assert info.user_id == USER
        assert info.samples_count == expected.samples == 40 + expected.late_rewards
        assert dict(info.params.properties) == {"demo": "cogment-aux", "run": run_id}
        assert [actor.name for actor in info.params.actors] == ["player-1", "player-2", "player-3"]
        configs = [spec_pb2.ActorConfig.FromString(actor.config.content) for actor in info.params.actors]
        assert all(config.model_version == published[config.policy_stage] for config in configs)
        assert info.params.environment.implementation == ENVIRONMENT_IMPLEMENTATION

        samples = await stored_samples(suite, trial_id)
        assert len(samples) == expected.samples
        assert {sample.user_id for sample in samples} == {USER}
        assert {sample.trial_id for sample in samples} == {trial_id}
        last_tick, late = -1, 0
        goal_reached: dict[int, set[int]] = {}
        for sample in samples:
            if sample.tick_id > last_tick:  # a tick's own sample
                assert sample.tick_id == last_tick + 1
                last_tick = sample.tick_id
                final = sample.tick_id == 39
                assert sample.state == (common_pb2.ENDED if final else common_pb2.RUNNING)
                assert [actor.actor for actor in sample.actor_samples] == [0, 1, 2]
                for actor in sample.actor_samples:
                    observation = spec_pb2.Observation.FromString(sample.payloads[actor.observation])
                    assert len(observation.values) == 5
                    action = sample.payloads[actor.action]
                    if final:
                        assert action == b"" and not actor.HasField("reward")
                    else:
                        spec_pb2.Action.FromString(action)
                        assert actor.HasField("reward")  # the environment's, every tick
                goal_reached[sample.tick_id] = {
                    actor.actor for actor in sample.actor_samples if actor.reward == GOAL_BONUS
                }
                total_messages += sum(len(actor.received_messages) for actor in sample.actor_samples)
                continue
            # A late reward: its own row, for a tick one or two back, no state, only the reward.
            late += 1
            assert last_tick - 1 <= sample.tick_id <= last_tick
            assert sample.state == common_pb2.UNKNOWN
            (receiver,) = [actor for actor in sample.actor_samples if actor.received_rewards]
            assert receiver.actor in goal_reached[sample.tick_id]
            assert receiver.reward == THANKS_VALUE
            assert all(not actor.HasField("observation") for actor in sample.actor_samples)
        assert last_tick == 39
        assert late == expected.late_rewards > 0
        total_late += late
        total_samples += len(samples)
    assert (trials["samples"], trials["late_rewards"], trials["ticks"]) == (total_samples, total_late, 120)
    assert trials["messages"] == total_messages > 0

    # The datastore's command-line client lists them ENDED, with their sample counts.
    out, err = io.StringIO(), io.StringIO()
    argv = ["list_trials", "--properties", f"run={run_id}", "--endpoint", suite.datastore_endpoint]
    assert await asyncio.to_thread(datastore_cli, argv, {}, out, err) == 0, err.getvalue()
    rows = {line.split()[0]: line.split() for line in out.getvalue().splitlines()[1:-1]}
    assert {trial_id: (rows[trial_id][2], int(rows[trial_id][3])) for trial_id in trial_ids} == {
        trial_id: ("ENDED", infos[trial_id].samples_count) for trial_id in trial_ids
    }


async def test_the_same_seed_records_the_same_trials(suite: Suite) -> None:
    first = (await run_demo(suite, "--seed", "99", "--trials", "1", "--ticks", "25")).report
    second = (await run_demo(suite, "--seed", "99", "--trials", "1", "--ticks", "25")).report
    assert first["trials"]["trial_ids"] != second["trials"]["trial_ids"]

    def content(samples: list[ds.StoredTrialSample]) -> list[tuple[Any, ...]]:
        return [(s.tick_id, s.state, list(s.payloads), [a.reward for a in s.actor_samples]) for s in samples]

    one = await stored_samples(suite, first["trials"]["trial_ids"][0])
    other = await stored_samples(suite, second["trials"]["trial_ids"][0])
    assert content(one) == content(other)


async def test_policy_versions_and_environment_entry_are_not_duplicated(suite: Suite) -> None:
    first = (await run_demo(suite, "--trials", "1", "--ticks", "5")).report
    versions = await model_versions(suite)
    assert [info.version_number for info in versions] == [1, 2, 3]
    registry = ModelRegistryClient(suite.registry_endpoint)
    try:
        for info, stage in zip(versions, STAGES, strict=True):
            data = policy_weights(stage).SerializeToString(deterministic=True)
            assert info.data_hash == base64.b64encode(hashlib.sha256(data).digest()).decode()
            assert info.archived and info.user_data["stage"] == stage.name
            _, stored = await registry.retrieve_version(DEFAULT_MODEL_ID, info.version_number)
            assert spec_pb2.PolicyWeights.FromString(stored) == policy_weights(stage)
    finally:
        await registry.close()
    assert [(v["stage"], v["version_number"], v["published"]) for v in first["model"]["versions"]] == [
        ("untrained", 1, True),
        ("halfway", 2, True),
        ("greedy", 3, True),
    ]
    (entry,) = await environment_entries(suite)
    assert entry.permanent and entry.service_id == first["environment"]["service_id"]
    assert (entry.endpoint.host, entry.endpoint.port) == ("localhost", 9001)
    assert entry.details.properties["demo"] == "cogment-aux"

    # Again, the environment registered elsewhere: no new version, the same entry updated.
    second = (
        await run_demo(suite, "--trials", "1", "--ticks", "5", "--environment_endpoint", "grpc://env:9101")
    ).report
    assert [info.version_number for info in await model_versions(suite)] == [1, 2, 3]
    assert [(v["version_number"], v["published"]) for v in second["model"]["versions"]] == [
        (1, False),
        (2, False),
        (3, False),
    ]
    (entry,) = await environment_entries(suite)
    assert entry.service_id == first["environment"]["service_id"] == second["environment"]["service_id"]
    assert (entry.endpoint.host, entry.endpoint.port) == ("env", 9101)


@pytest.mark.parametrize(("trials", "ticks", "actors"), [(5, 12, 6), (1, 1, 1)])
async def test_flags_scale_the_trials(suite: Suite, trials: int, ticks: int, actors: int) -> None:
    flags = ["--trials", str(trials), "--ticks", str(ticks), "--actors", str(actors), "--concurrency", "2"]
    report = (await run_demo(suite, "--seed", "3", *flags)).report
    trial_ids = report["trials"]["trial_ids"]
    assert len(trial_ids) == trials and report["trials"]["ticks"] == trials * ticks
    infos = await stored_trials(suite, trial_ids)
    for index, trial_id in enumerate(trial_ids):
        info = infos[trial_id]
        assert len(info.params.actors) == actors and info.last_state == common_pb2.ENDED
        assert info.samples_count == expected_counts(3, index, ticks, actors).samples
        samples = await stored_samples(suite, trial_id)
        assert len([s for s in samples if s.state != common_pb2.UNKNOWN]) == ticks
        assert all(len(sample.actor_samples) == actors for sample in samples)


async def test_skipped_services_are_left_alone(suite: Suite) -> None:
    skipped = ["--model_registry_endpoint", "", "--directory_endpoint", ""]
    report = (await run_demo(suite, "--trials", "1", "--ticks", "3", *skipped)).report
    assert report["model"] is None and report["environment"] is None
    (info,) = (await stored_trials(suite, report["trials"]["trial_ids"])).values()
    configs = [spec_pb2.ActorConfig.FromString(actor.config.content) for actor in info.params.actors]
    assert {config.model_version for config in configs} == {0}
    assert await registry_models(suite) == []
    assert await environment_entries(suite) == []
    # The variables skip them too; nothing left is a usage error.
    environ = {"COGMENT_MODEL_REGISTRY_ENDPOINT": "", "COGMENT_DIRECTORY_ENDPOINT": ""}
    out = io.StringIO()
    flags = ["--trial_datastore_endpoint", suite.datastore_endpoint, "--trials", "1", "--ticks", "2"]
    argv = [*flags, "--console_output", "json"]
    assert await asyncio.to_thread(main, argv, "demo", environ, out, io.StringIO()) == 0
    assert '"model": null' in out.getvalue()
    with pytest.raises(SystemExit) as usage:
        main(["--trial_datastore_endpoint", ""], "demo", environ, io.StringIO(), io.StringIO())
    assert usage.value.code == 2


async def test_existing_trial_ids_are_refused(suite: Suite) -> None:
    flags = ["--trials", "2", "--ticks", "4", "--trial_id_prefix", "mine-"]
    first = (await run_demo(suite, *flags)).report
    assert first["trials"]["trial_ids"] == ["mine-0", "mine-1"]
    before = (await stored_trials(suite, ["mine-0"]))["mine-0"].samples_count
    run = await run_demo(suite, *flags)
    assert run.code == 1 and run.out == ""
    assert run.err == (
        f"Error: trials [mine-0, mine-1] already exist in the trial datastore at {suite.datastore_endpoint}: "
        "choose another --trial_id_prefix\n"
    )
    assert (await stored_trials(suite, ["mine-0"]))["mine-0"].samples_count == before


@pytest.mark.parametrize(
    ("service", "flag"),
    [
        ("trial datastore", "--trial_datastore_endpoint"),
        ("model registry", "--model_registry_endpoint"),
        ("directory", "--directory_endpoint"),
    ],
)
async def test_an_unreachable_service_is_one_line_naming_it(suite: Suite, service: str, flag: str) -> None:
    closed = f"grpc://127.0.0.1:{free_port()}"
    command = python_module("services.demo", *suite.endpoint_flags(), flag, closed, "--timeout", "10")
    result = await run_command(command)
    assert result.returncode == 1
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"Error: cannot reach the {service} at {closed} (")
    # Nothing was written to the services that answered.
    assert not (await suite.datastore.stub.RetrieveTrials(ds.RetrieveTrialsRequest())).trial_infos
    assert await registry_models(suite) == []
    assert await environment_entries(suite) == []


async def test_the_installed_command_and_its_text_output(suite: Suite, tmp_path: Path) -> None:
    command = [str(Path(sys.executable).parent / "cogment-aux"), "demo", "--trials", "2", "--ticks", "6"]
    environ = {
        "COGMENT_TRIAL_DATASTORE_ENDPOINT": suite.datastore_endpoint,
        "COGMENT_MODEL_REGISTRY_ENDPOINT": suite.registry_endpoint,
        "COGMENT_DIRECTORY_ENDPOINT": suite.directory_endpoint,
    }
    result = await run_command(command, cwd=tmp_path, env=environ)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    recorded = (
        f"Recorded 2 trials of 6 ticks and 3 players in the trial datastore at {suite.datastore_endpoint}"
    )
    assert lines[0].startswith(recorded)
    next_commands = lines[lines.index("Next, try:") + 1 : lines.index("", lines.index("Next, try:"))]
    # Then the web console's page of these trials.
    run_id = next_commands[0].split("run=")[1].split()[0]
    assert lines[-1] == (
        "In a browser (the web console): http://127.0.0.1:9010/trials?properties="
        f"demo%3Dcogment-aux%2Crun%3D{run_id}"
    )
    client = "  cogment-aux client"
    assert next_commands[0].startswith(
        f"{client} trial_datastore list_trials --properties demo=cogment-aux,run="
    )
    assert " export " in next_commands[1] and "--format parquet --file demo-dataset" in next_commands[1]
    assert next_commands[2].startswith(f"{client} model_registry list_versions {DEFAULT_MODEL_ID}")
    assert next_commands[3].startswith(f"{client} directory inquire --type environment")
    # The suggested commands run as printed.
    for suggested in next_commands:
        program, *words = suggested.split()
        listed = await run_command(
            [str(Path(sys.executable).parent / program), *words], cwd=tmp_path, env=environ
        )
        assert listed.returncode == 0, (suggested, listed.stderr)
    assert (tmp_path / "demo-dataset" / "steps.parquet").exists()


async def test_output_closed_early_stops_quietly_with_141(suite: Suite) -> None:
    """`cogment-aux demo | head -1`, its reader gone before the report is written: exit status
    141, as a program SIGPIPE ended, and nothing on standard error (Python flushes standard output
    again at exit, which would print "Exception ignored ... BrokenPipeError"). The trials are
    recorded all the same."""
    command = python_module("services.demo", *suite.endpoint_flags(), "--trials", "1", "--ticks", "3")
    read_end, write_end = os.pipe()
    os.close(read_end)  # as `head` exits after its line: every later write fails
    try:
        result = await asyncio.to_thread(
            subprocess.run,
            command,
            cwd=PROJECT_ROOT,
            env=command_environment(),
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert (result.returncode, result.stderr) == (141, "")
    assert len((await suite.datastore.stub.RetrieveTrials(ds.RetrieveTrialsRequest())).trial_infos) == 1


async def test_tls_flags_reach_a_datastore_serving_tls(tmp_path: Path) -> None:
    if not openssl_available():
        pytest.skip("openssl is needed to make certificates")
    pki = make_pki(tmp_path / "pki")
    database = f"sqlite+aiosqlite:///{tmp_path / 'tls.db'}"
    tls = ["--tls_cert", str(pki.server.cert), "--tls_key", str(pki.server.key)]
    async with make_datastore_factory(database)(*tls) as datastore:
        port = datastore.service.port
        skipped = ["--model_registry_endpoint", "", "--directory_endpoint", ""]
        flags = [*skipped, "--trials", "1", "--ticks", "4", "--console_output", "json"]
        # `localhost`: the name the server's certificate holds.
        secure = ["--trial_datastore_endpoint", f"grpcs://localhost:{port}", "--tls_ca", str(pki.ca)]
        out, err = io.StringIO(), io.StringIO()
        assert await asyncio.to_thread(main, [*secure, *flags], "demo", {}, out, err) == 0, err.getvalue()
        report = json.loads(out.getvalue())
        assert report["trials"]["ticks"] == 4
        # The suggested commands reach it as the demo did.
        assert report["next_commands"][0].endswith(f" --endpoint grpcs://localhost:{port} --tls_ca {pki.ca}")
        # Plaintext against it, as a user runs it (grpc's own log lines would go to the process's
        # standard error): one line, saying what to change.
        plain = ["--trial_datastore_endpoint", f"grpc://localhost:{port}"]
        result = await run_command(python_module("services.demo", *plain, *flags))
        assert (result.returncode, result.stdout) == (1, "")
        (line,) = result.stderr.splitlines()
        assert line.startswith(f"Error: cannot reach the trial datastore at grpc://localhost:{port} (")
        assert "--tls_ca" in line


def summary_of(trial_ids: list[str]) -> TrialsReport:
    properties = {"demo": "cogment-aux", "run": "r"}
    return TrialsReport("grpc://localhost:9003", "u", 1, trial_ids, properties, 5, 3, 0, 0, 0, 0)


async def test_the_suggested_export_names_every_trial() -> None:
    values = parse_options(OPTIONS, [], prog="demo", description="", environ={})
    many = [f"demo-r-{index}" for index in range(12)]
    async with DatastoreClient() as datastore:
        clients = Clients(datastore, None, None)
        (_, export) = next_commands(values, "cogment-aux demo", clients, summary_of(many), None, None)
    assert export == (
        "cogment-aux client trial_datastore export demo-r-{0..11} --format parquet --file demo-dataset"
        "  # bash and zsh expand {a..b} into every trial id"
    )
    values = parse_options(
        OPTIONS, ["--trial_id_prefix", "my trial "], prog="demo", description="", environ={}
    )
    odd = [f"my trial {index}" for index in range(12)]
    async with DatastoreClient("grpcs://store:443") as datastore:
        clients = Clients(datastore, None, None)
        (listing, export) = next_commands(
            values, "python -m services.demo", clients, summary_of(odd), None, None
        )
    assert listing.startswith("python -m services.datastore.client list_trials ")
    assert shlex.split(export) == [
        "python", "-m", "services.datastore.client", "export", *odd,
        "--format", "parquet", "--file", "demo-dataset", "--endpoint", "grpcs://store:443",
    ]  # fmt: skip
