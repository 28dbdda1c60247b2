"""The Parquet export (`client export --format parquet`): trials ingested through DatalogSP, then
exported, read back with pyarrow and compared with rows computed directly from the stored samples."""

from __future__ import annotations

import asyncio
import io
import re
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from services.datastore.client import dataset
from services.datastore.client.api import DatastoreClient
from services.datastore.client.cli import main
from shared.api import common_pb2, datalog_pb2
from shared.api import trial_datastore_pb2 as ds
from tests.helpers.datastore import (
    ACTORS,
    datalog_inputs,
    datalog_sample,
    read_samples,
    run_datalog,
    send_acknowledged,
    trial_params,
)
from tests.helpers.running import RunningDatastore


async def export(d: RunningDatastore, *args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    argv = ["export", *args, "--format", "parquet", "--endpoint", f"grpc://127.0.0.1:{d.service.port}"]
    code = await asyncio.to_thread(main, argv, {}, out, err)
    return code, out.getvalue(), err.getvalue()


def expected_steps(trial_id: str, samples: list[ds.StoredTrialSample], ended: bool) -> list[dict[str, Any]]:
    """The rows, computed plainly: every sample of a tick not seen before is a step; every other
    sample's rewards go to the tick it names."""
    late: dict[tuple[int, int], list[ds.StoredTrialActorSample]] = {}
    steps: list[ds.StoredTrialSample] = []
    seen: set[int] = set()
    for sample in samples:
        if steps and sample.tick_id <= max(seen):
            for actor in sample.actor_samples:
                late.setdefault((sample.tick_id, actor.actor), []).append((sample, actor))  # type: ignore[arg-type]
        else:
            seen.add(sample.tick_id)
            steps.append(sample)
    rows = []
    for position, sample in enumerate(steps):
        for index, (name, actor_class, implementation) in enumerate(ACTORS):
            (actor,) = [a for a in sample.actor_samples if a.actor == index]

            def payload(s: ds.StoredTrialSample, i: int) -> bytes:
                return s.payloads[i]

            rewards = [
                {
                    "sender": r.sender,
                    "value": r.reward,
                    "confidence": r.confidence,
                    "user_data": payload(sample, r.user_data) if r.HasField("user_data") else None,
                }
                for r in actor.received_rewards
            ]
            reward = actor.reward if actor.HasField("reward") else None
            late_values = [
                late_actor.reward
                for _, late_actor in late.get((sample.tick_id, index), [])  # type: ignore[misc]
                if late_actor.HasField("reward")
            ]
            if late_values:  # its own reward, plus the sum of the late ones
                late_sum = sum(late_values, 0.0)
                reward = float(np.float32(late_sum if reward is None else reward + late_sum))
            for late_sample, late_actor in late.get((sample.tick_id, index), []):  # type: ignore[misc]
                rewards += [
                    {
                        "sender": r.sender,
                        "value": r.reward,
                        "confidence": r.confidence,
                        "user_data": payload(late_sample, r.user_data) if r.HasField("user_data") else None,
                    }
                    for r in late_actor.received_rewards
                ]
            last = position == len(steps) - 1
            rows.append(
                {
                    "trial_id": trial_id,
                    "tick_id": sample.tick_id,
                    "timestamp": sample.timestamp,
                    "actor": index,
                    "actor_name": name,
                    "actor_class": actor_class,
                    "actor_implementation": implementation,
                    "observation": payload(sample, actor.observation)
                    if actor.HasField("observation")
                    else None,
                    "action": payload(sample, actor.action) if actor.HasField("action") else None,
                    "reward": reward,
                    "received_rewards": rewards,
                    "received_messages": [
                        {"sender": m.sender, "payload": payload(sample, m.payload)}
                        for m in actor.received_messages
                    ],
                    "is_first": position == 0,
                    "is_last": last,
                    "is_terminal": last and ended,
                    "state": common_pb2.TrialState.Name(sample.state),
                }
            )
    return rows


def rewarded(tick: int, state: int = common_pb2.RUNNING) -> datalog_pb2.DatalogSample:
    return datalog_sample(tick, state, reward=0.5 + tick)


# Row group bounds, and the reads they lead to. "ended" makes 18 rows (8 samples: 24 at most),
# "cut" 12. Default: each is read once. 20 rows: "ended" may not fit, it is read twice (rewards
# first); "cut" once, after the row group is written. 10 rows: both are read twice. 100 bytes:
# each starts in one pass, outgrows the row group's bytes half-way, and is read twice after.
ONCE, TWICE = ["samples"], ["rewards", "samples"]


@pytest.mark.parametrize(
    ("row_group_rows", "row_group_bytes", "reads"),
    [
        (dataset.ROW_GROUP_ROWS, dataset.ROW_GROUP_BYTES, {"ended": ONCE, "cut": ONCE}),
        (20, dataset.ROW_GROUP_BYTES, {"ended": TWICE, "cut": ONCE}),
        (10, dataset.ROW_GROUP_BYTES, {"ended": TWICE, "cut": TWICE}),
        (dataset.ROW_GROUP_ROWS, 100, {"ended": ["samples", *TWICE], "cut": ["samples", *TWICE]}),
    ],
)
async def test_trials_export_as_steps_with_late_rewards_folded_in(
    datastore: RunningDatastore,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    row_group_rows: int,
    row_group_bytes: int,
    reads: dict[str, list[str]],
) -> None:
    monkeypatch.setattr(dataset, "ROW_GROUP_ROWS", row_group_rows)
    monkeypatch.setattr(dataset, "ROW_GROUP_BYTES", row_group_bytes)
    read: dict[str, list[str]] = {}
    counted_samples = DatastoreClient.samples

    def recorded(*args: Any) -> Any:
        [trial_id] = args[1]
        read.setdefault(trial_id, []).append("rewards" if args[2:] else "samples")
        return counted_samples(*args)

    monkeypatch.setattr(DatastoreClient, "samples", recorded)
    # "ended": 6 ticks, late rewards for ticks 1 and 4 (one after the last tick); "cut": the
    # stream closes before the trial ends (interrupted).
    ended = [rewarded(tick) for tick in range(3)]
    ended += [datalog_sample(1, out_of_sync=True, reward=7.0)]
    ended += [rewarded(tick) for tick in range(3, 5)]
    ended += [rewarded(5, common_pb2.ENDED), datalog_sample(4, out_of_sync=True, reward=2.0)]
    await run_datalog(datastore, "ended", ended, trial_params(kind="demo"))
    await run_datalog(datastore, "cut", [rewarded(tick) for tick in range(4)])
    target = tmp_path / "dataset"
    code, out, err = await export(datastore, "ended", "cut", "--file", str(target), "--progress")
    assert code == 0, err
    assert out == f'2 trials exported to "{target}" (12 samples, 30 step rows)\n'
    assert read == reads
    # The progress bar counts each sample once, never going back, to the end.
    drawn = [int(done) for done in re.findall(r"(\d+)/12 samples", err)]
    assert drawn == sorted(drawn) and drawn[-1] == 12, err
    assert sorted(path.name for path in target.iterdir()) == ["steps.parquet", "trials.parquet"]

    rows = pq.read_table(target / "steps.parquet").to_pylist()
    stored = {trial_id: await read_samples(datastore, [trial_id]) for trial_id in ("ended", "cut")}
    expected = expected_steps("ended", stored["ended"], ended=True)
    expected += expected_steps("cut", stored["cut"], ended=False)
    assert rows == expected
    # The late rewards are in their ticks' rows (bob receives them from alice).
    bob = {row["tick_id"]: row for row in rows if row["trial_id"] == "ended" and row["actor_name"] == "bob"}
    assert bob[1]["reward"] == pytest.approx(1.5 + 7.0) and len(bob[1]["received_rewards"]) == 2
    assert bob[4]["reward"] == pytest.approx(4.5 + 2.0)
    assert [row["is_terminal"] for row in rows if row["is_last"]] == [True] * 3 + [False] * 3

    trials = pq.read_table(target / "trials.parquet").to_pylist()
    # "cut" is interrupted: its stream closed before it ended, though its last state is RUNNING.
    summaries = [
        (t["trial_id"], t["state"], t["ended"], t["interrupted"], t["samples"], t["ticks"]) for t in trials
    ]
    assert summaries == [
        ("ended", "ENDED", True, False, 8, 6),
        ("cut", "RUNNING", False, True, 4, 4),
    ]
    assert trials[0]["properties"] == [("kind", "demo")]
    assert [a["name"] for a in trials[0]["actors"]] == [name for name, _, _ in ACTORS]
    assert common_pb2.TrialParams.FromString(trials[0]["params"]) == trial_params(kind="demo")


async def test_a_live_trial_is_cut_where_the_export_started(
    datastore: RunningDatastore, tmp_path: Path
) -> None:
    call = datastore.datalog.RunTrialDatalog(metadata=(("trial-id", "live"),))
    inputs = datalog_inputs(trial_params(), [rewarded(tick) for tick in range(8)])
    await send_acknowledged(call, inputs[:6])  # the parameters and 5 samples
    target = tmp_path / "dataset"
    code, _, err = await export(datastore, "live", "--file", str(target))
    assert code == 0, err
    await send_acknowledged(call, inputs[6:])
    await call.done_writing()
    rows = pq.read_table(target / "steps.parquet").to_pylist()
    assert sorted({row["tick_id"] for row in rows}) == [0, 1, 2, 3, 4]
    assert [row["is_terminal"] for row in rows if row["is_last"]] == [False] * len(ACTORS)
    # Cut, not interrupted: its stream was still open.
    [trial] = pq.read_table(target / "trials.parquet").to_pylist()
    assert (trial["ended"], trial["interrupted"]) == (False, False)


async def test_a_failed_export_leaves_no_files(datastore: RunningDatastore, tmp_path: Path) -> None:
    await run_datalog(datastore, "t", [rewarded(tick) for tick in range(3)])
    code, _, err = await export(datastore, "t")
    assert code == 1 and "--format parquet writes a directory" in err
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    code, _, err = await export(datastore, "t", "--file", str(blocked / "dataset"))
    assert code == 1 and err.startswith("Error: cannot write")
    assert not await asyncio.to_thread(lambda: list(tmp_path.glob("**/*.parquet*")))


def test_rows_are_written_in_bounded_row_groups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dataset, "ROW_GROUP_ROWS", 10)
    path = tmp_path / "steps.parquet"
    writer = dataset.StepsWriter(path)
    info = ds.StoredTrialInfo(trial_id="t", last_state=common_pb2.ENDED, params=trial_params())
    trial = dataset.TrialSteps("t", info, dataset.LateRewards())
    stepper = dataset.TrialStepper(trial, writer, rewards_read_first=True)
    for tick in range(20):
        sample = ds.StoredTrialSample(trial_id="t", tick_id=tick, payloads=[b"x" * 100])
        sample.actor_samples.add(actor=0, observation=0)
        stepper.add(sample)
        if writer.full:
            writer.flush()
    stepper.finish()
    writer.close()
    metadata = pq.ParquetFile(path).metadata
    assert metadata.num_rows == 60 and metadata.num_row_groups >= 5
    assert all(metadata.row_group(i).num_rows <= 12 for i in range(metadata.num_row_groups))


# A trial as stored: per event, either a new tick (after a gap of 1 or 2) or a late sample naming
# a tick `back` ticks before the last one (possibly one the trial skipped, or before its first);
# each with a reward or none, per actor: float32 values whose sums round (the order of the
# additions shows), and large ones that cancel.
stored_events = st.lists(
    st.tuples(
        st.sampled_from(["tick", "late"]),
        st.integers(0, 4),
        st.lists(
            st.one_of(
                st.none(),
                st.floats(-1e3, 1e3, width=32),
                st.sampled_from([1e30, -1e30, 1.0, 0.1]),
            ),
            min_size=3,
            max_size=3,
        ),
    ),
    min_size=1,
    max_size=25,
)


def stored_trial(events: list[tuple[str, int, list[float | None]]]) -> list[ds.StoredTrialSample]:
    samples: list[ds.StoredTrialSample] = []
    tick = -1
    for kind, number, rewards in events:
        late = kind == "late" and tick >= 0
        at = tick - number if late else tick + 1 + number % 2
        if not late:
            tick = at
        sample = ds.StoredTrialSample(trial_id="t", tick_id=max(at, 0), timestamp=max(at, 0))
        for index, reward in enumerate(rewards):
            if late and reward is None:
                continue
            actor = sample.actor_samples.add(actor=index)
            if not late:
                sample.payloads.extend([b"obs-%d-%d" % (at, index), b"act-%d-%d" % (at, index)])
                actor.observation, actor.action = len(sample.payloads) - 2, len(sample.payloads) - 1
            if reward is not None:
                actor.reward = reward
                actor.received_rewards.add(sender=-1, reward=reward, confidence=1.0)
        samples.append(sample)
    return samples


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stored_events, st.booleans(), st.booleans())
@example(  # a row written before its late rewards come: its own reward plus their sum, in one pass too
    events=[("tick", 0, [1e30, None, None]), ("tick", 0, [None] * 3), ("late", 1, [-1e30, None, None]),
            ("late", 1, [1.0, None, None])],
    ended=True,
    two_passes=False,
)  # fmt: skip
def test_late_rewards_fold_the_same_in_one_pass_and_in_two(
    tmp_path_factory: pytest.TempPathFactory,
    events: list[tuple[str, int, list[float | None]]],
    ended: bool,
    two_passes: bool,
) -> None:
    samples = stored_trial(events)
    state = common_pb2.ENDED if ended else common_pb2.RUNNING
    info = ds.StoredTrialInfo(trial_id="t", last_state=state, params=trial_params())
    path = tmp_path_factory.mktemp("steps") / "steps.parquet"
    writer = dataset.StepsWriter(path)
    trial = dataset.TrialSteps("t", info, dataset.LateRewards())
    if two_passes:  # rewards first, then rows written a few at a time
        for sample in samples:
            trial.late.read(sample)
    stepper = dataset.TrialStepper(trial, writer, rewards_read_first=two_passes)
    for sample in samples:
        stepper.add(sample)
        if two_passes:
            writer.flush()
    stepper.finish()
    writer.close()
    rows = pq.read_table(path).to_pylist()
    assert rows == expected_steps("t", samples, ended)
    assert trial.samples == len(samples)
