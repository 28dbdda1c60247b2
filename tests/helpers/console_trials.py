"""What the console's tests read: the three services running for real (in-process; SQLite unless
the datastore is given a database URL), and trials with the three actors of tests.helpers.datastore
(alice and bob of class1, carol of class2), class1's observations and actions being the demo's
messages (which the console decodes when given them), with rewards."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.demo.api import spec_pb2
from shared.api import common_pb2, datalog_pb2
from tests.helpers.datastore import send_acknowledged, trial_params
from tests.helpers.running import (
    RunningDatastore,
    RunningDirectory,
    RunningRegistry,
    make_datastore_factory,
    make_directory_factory,
    make_registry_factory,
)


@dataclass
class ConsoleSuite:
    directory: RunningDirectory
    registry: RunningRegistry
    datastore: RunningDatastore

    def endpoint(self, service: RunningDatastore | RunningRegistry) -> str:
        return f"grpc://127.0.0.1:{service.service.port}"


@asynccontextmanager
async def running_suite(
    tmp_path: Path, datastore_url: str | None = None, *datastore_flags: str
) -> AsyncIterator[ConsoleSuite]:
    """The directory, the registry and the datastore, on SQLite files in `tmp_path` (the
    datastore on `datastore_url` when given, with `datastore_flags`)."""
    async with (
        make_directory_factory(f"sqlite+aiosqlite:///{tmp_path / 'directory.db'}")() as directory,
        make_registry_factory(
            "--database_url", f"sqlite+aiosqlite:///{tmp_path / 'registry.db'}",
            "--archive_dir", str(tmp_path / "blobs"),
        )() as registry,
        make_datastore_factory(datastore_url or f"sqlite+aiosqlite:///{tmp_path / 'datastore.db'}")(
            *datastore_flags
        ) as datastore,
    ):  # fmt: skip
        yield ConsoleSuite(directory, registry, datastore)


async def record(
    datastore: RunningDatastore, trial_id: str, samples: list[datalog_pb2.DatalogSample], **properties: str
) -> None:
    """A trial logged as the orchestrator does, its stream closed once every sample is stored."""
    call = datastore.datalog.RunTrialDatalog(metadata=(("trial-id", trial_id), ("user-id", "researcher")))
    await send_acknowledged(call, trial_inputs(samples, **properties))
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF


def observation(tick: int) -> bytes:
    return spec_pb2.Observation(values=[tick / 10, -1.0]).SerializeToString()


def sample(
    tick: int, state: int = common_pb2.RUNNING, rewards: dict[str, float] | None = None
) -> datalog_pb2.DatalogSample:
    message = datalog_pb2.DatalogSample(
        info=datalog_pb2.SampleInfo(tick_id=tick, timestamp=1000 + tick, state=state)
    )
    message.observations.observations.append(observation(tick))
    message.observations.actors_map.extend([0, 0, 0])
    action = common_pb2.Action(content=spec_pb2.Action(move=spec_pb2.RIGHT).SerializeToString())
    message.actions.extend([action] * 3)
    for receiver, value in (rewards or {}).items():
        source = common_pb2.RewardSource(sender_name="env", value=value, confidence=1)
        message.rewards.append(common_pb2.Reward(receiver_name=receiver, tick_id=tick, sources=[source]))
    return message


def rewarded_trial(ticks: int, seed: int = 0) -> list[datalog_pb2.DatalogSample]:
    """A trial that ends at its last tick, each actor rewarded at random every tick."""
    draw = random.Random(seed)
    return [
        sample(
            tick,
            common_pb2.ENDED if tick == ticks - 1 else common_pb2.RUNNING,
            {name: round(draw.uniform(-1, 1), 2) for name in ("alice", "bob", "carol")},
        )
        for tick in range(ticks)
    ]


def trial_inputs(
    samples: list[datalog_pb2.DatalogSample], with_params: bool = True, **properties: str
) -> list[datalog_pb2.RunTrialDatalogInput]:
    """What the orchestrator writes on a datalog stream: the parameters first (once), then samples."""
    inputs = [datalog_pb2.RunTrialDatalogInput(sample=one) for one in samples]
    if with_params:
        inputs.insert(0, datalog_pb2.RunTrialDatalogInput(trial_params=trial_params(**properties)))
    return inputs


def ended_trial(ticks: int) -> list[datalog_pb2.DatalogSample]:
    """A trial ending at its last tick, alice rewarded 1 and carol -0.5 every tick."""
    return [
        sample(
            tick, common_pb2.ENDED if tick == ticks - 1 else common_pb2.RUNNING, {"alice": 1.0, "carol": -0.5}
        )
        for tick in range(ticks)
    ]
