"""Trial data for datastore tests: parameters, datalog samples, and calls that ingest and read them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from google.protobuf import any_pb2

from shared.api import common_pb2, datalog_pb2
from shared.api import environment_pb2 as env
from shared.api import trial_datastore_pb2 as ds
from tests.helpers.running import RunningDatastore

ACTORS = [("alice", "class1", "impl_a"), ("bob", "class1", "impl_b"), ("carol", "class2", "impl_a")]


def trial_params(**properties: str) -> common_pb2.TrialParams:
    return common_pb2.TrialParams(
        actors=[common_pb2.ActorParams(name=n, actor_class=c, implementation=i) for n, c, i in ACTORS],
        properties=properties,
        max_steps=100,
    )


def datalog_sample(
    tick: int, state: int = common_pb2.RUNNING, *, out_of_sync: bool = False, reward: float | None = None
) -> datalog_pb2.DatalogSample:
    sample = datalog_pb2.DatalogSample(
        info=datalog_pb2.SampleInfo(tick_id=tick, timestamp=1000 + tick, state=state, out_of_sync=out_of_sync)
    )
    if not out_of_sync:
        sample.observations.CopyFrom(
            env.ObservationSet(observations=[f"obs-{tick}".encode(), b"shared"], actors_map=[0, 1, 1])
        )
        sample.actions.extend(
            common_pb2.Action(content=f"act-{tick}-{a}".encode()) for a in range(len(ACTORS))
        )
    if reward is not None:
        sample.rewards.append(
            common_pb2.Reward(
                receiver_name="bob",
                sources=[
                    common_pb2.RewardSource(
                        sender_name="alice", value=reward, confidence=1, user_data=any_pb2.Any(value=b"why")
                    )
                ],
            )
        )
    return sample


def datalog_inputs(
    params: common_pb2.TrialParams, samples: Sequence[datalog_pb2.DatalogSample]
) -> list[datalog_pb2.RunTrialDatalogInput]:
    return [datalog_pb2.RunTrialDatalogInput(trial_params=params)] + [
        datalog_pb2.RunTrialDatalogInput(sample=sample) for sample in samples
    ]


async def send_acknowledged(call: Any, inputs: Sequence[datalog_pb2.RunTrialDatalogInput]) -> None:
    """Write each input on an open RunTrialDatalog call and wait for its acknowledgement, as the
    orchestrator of a trial still running does."""
    for message in inputs:
        await call.write(message)
        await call.read()


def full_trial(ticks: int) -> list[datalog_pb2.DatalogSample]:
    return [
        datalog_sample(tick, common_pb2.ENDED if tick == ticks - 1 else common_pb2.RUNNING)
        for tick in range(ticks)
    ]


async def run_datalog(
    d: RunningDatastore,
    trial_id: str,
    samples: Sequence[datalog_pb2.DatalogSample],
    params: common_pb2.TrialParams | None = None,
    user_id: str = "the-user",
) -> int:
    """Ingest through DatalogSP; returns the number of acknowledgements."""
    call = d.datalog.RunTrialDatalog(
        iter(datalog_inputs(params or trial_params(), samples)),
        metadata=(("trial-id", trial_id), ("user-id", user_id)),
    )
    return len([ack async for ack in call])


async def read_samples(
    d: RunningDatastore, trial_ids: Sequence[str], **filters: object
) -> list[ds.StoredTrialSample]:
    call = d.stub.RetrieveSamples(ds.RetrieveSamplesRequest(trial_ids=trial_ids, **filters), timeout=30)
    return [reply.trial_sample async for reply in call]


async def add_trial(d: RunningDatastore, trial_id: str, user_id: str = "u", **properties: str) -> None:
    await d.stub.AddTrial(
        ds.AddTrialRequest(user_id=user_id, trial_params=trial_params(**properties)),
        metadata=(("trial-id", trial_id),),
    )


async def list_trials(d: RunningDatastore, **request: object) -> ds.RetrieveTrialsReply:
    reply: ds.RetrieveTrialsReply = await d.stub.RetrieveTrials(ds.RetrieveTrialsRequest(**request))
    return reply
