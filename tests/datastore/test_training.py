"""The training reader (services.datastore.client.training) against a direct computation, on hand-built
datasets: random trials, lengths, actors, ended or not, rewards or none, shifts and n; and read
straight from a datastore, stored and live trials."""

from __future__ import annotations

import asyncio
import random
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.datastore.client.dataset import STEPS_FILE, STEPS_SCHEMA
from services.datastore.client.training import TrainingData, shifts_of
from shared.api import common_pb2
from shared.client import ClientError
from tests.helpers.datastore import (
    datalog_inputs,
    datalog_sample,
    run_datalog,
    send_acknowledged,
    trial_params,
)
from tests.helpers.fake_services import free_port
from tests.helpers.running import RunningDatastore

CLASSES = ["player", "critic"]
# A trial: its actors' classes, its number of ticks, whether it ended, and per (tick, actor) a
# reward or None.
trials = st.lists(
    st.tuples(
        st.lists(st.sampled_from(CLASSES), min_size=1, max_size=3),
        st.integers(1, 7),
        st.booleans(),
        st.randoms(use_true_random=False),
    ),
    min_size=1,
    max_size=4,
)
shifts = st.one_of(
    st.integers(-3, 3),
    st.lists(st.integers(-4, 4), min_size=1, max_size=4),
    st.tuples(st.integers(-4, 1), st.integers(0, 3))
    .filter(lambda r: r[0] <= r[1])
    .map(lambda r: f"{r[0]}:{r[1]}"),
)


def observation(trial: int, tick: int, actor: int) -> bytes:
    return struct.pack("<2i", trial, tick * 10 + actor)


def build(directory: Path, spec: list[tuple[list[str], int, bool, Any]]) -> dict[tuple[int, int], Any]:
    """Write the dataset; returns each episode (trial, actor) as the test sees it."""
    rows = []
    episodes: dict[tuple[int, int], Any] = {}
    for trial, (classes, ticks, ended, rng) in enumerate(spec):
        for actor in range(len(classes)):
            episodes[(trial, actor)] = {"class": classes[actor], "ended": ended, "steps": []}
        for tick in range(ticks):
            for actor, actor_class in enumerate(classes):
                reward = None if rng.random() < 0.3 else round(rng.uniform(-2, 2), 3)
                step = {
                    "observation": observation(trial, tick, actor),
                    "action": b"a%d" % tick,
                    "reward": reward,
                }
                episodes[(trial, actor)]["steps"].append(step)
                rows.append(
                    {
                        "trial_id": f"trial{trial}",
                        "tick_id": tick,
                        "timestamp": tick,
                        "actor": actor,
                        "actor_name": f"actor{actor}",
                        "actor_class": actor_class,
                        "actor_implementation": "impl",
                        "observation": step["observation"],
                        "action": step["action"],
                        "reward": reward,
                        "received_rewards": [],
                        "received_messages": [],
                        "is_first": tick == 0,
                        "is_last": tick == ticks - 1,
                        "is_terminal": tick == ticks - 1 and ended,
                        "state": "ENDED" if ended and tick == ticks - 1 else "RUNNING",
                    }
                )
    directory.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=STEPS_SCHEMA), directory / STEPS_FILE)
    return episodes


def decode(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.int32)


def direct_transitions(episodes: dict[tuple[int, int], Any], wanted: set[str]) -> list[tuple[Any, int]]:
    """(episode, t) for every transition, episodes in order of trial then actor."""
    return [
        (episode, t)
        for _, episode in sorted(episodes.items())
        if episode["class"] in wanted
        for t in range(len(episode["steps"]) - 1)
    ]


def value(episode: Any, step: int, column: str) -> Any:
    if not 0 <= step < len(episode["steps"]):
        return None
    raw = episode["steps"][step][column]
    if column == "reward":
        return 0.0 if raw is None else raw
    return raw


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(trials, shifts, st.sampled_from([["player"], ["critic"], []]), st.integers(1, 4), st.floats(0.5, 1.0))
def test_views_returns_and_d4rl_arrays_follow_one_rule(
    tmp_path_factory: pytest.TempPathFactory,
    spec: list[tuple[list[str], int, bool, Any]],
    shift: Any,
    classes: list[str],
    n: int,
    gamma: float,
) -> None:
    directory = tmp_path_factory.mktemp("dataset")
    episodes = build(directory, spec)
    if classes and not any(episode["class"] in classes for episode in episodes.values()):
        with pytest.raises(ValueError, match="no actor_class"):
            TrainingData.from_parquet(directory, actor_classes=classes)
        return
    data = TrainingData.from_parquet(directory, actor_classes=classes, decode_observation=decode)
    expected = direct_transitions(episodes, set(classes or CLASSES))
    assert len(data) == len(expected)

    arrays = data.d4rl()
    for i, (episode, t) in enumerate(expected):
        last = t == len(episode["steps"]) - 2
        assert list(arrays["observations"][i]) == list(decode(value(episode, t, "observation")))
        assert list(arrays["next_observations"][i]) == list(decode(value(episode, t + 1, "observation")))
        assert arrays["actions"][i] == value(episode, t, "action")
        assert arrays["rewards"][i] == pytest.approx(value(episode, t, "reward"))
        assert arrays["terminals"][i] == (last and episode["ended"])
        assert arrays["timeouts"][i] == (last and not episode["ended"])

    offsets, single = shifts_of(shift)
    observations, valid = data.view("observation", shift)
    actions, _ = data.view("action", shift)
    returns = data.n_step_returns(n, gamma)
    for i, (episode, t) in enumerate(expected):
        for j, offset in enumerate(offsets):
            at = (i,) if single else (i, j)
            wanted = value(episode, t + offset, "observation")
            assert valid[at] == (wanted is not None)
            assert list(observations[at]) == ([0, 0] if wanted is None else list(decode(wanted)))
            assert actions[at] == value(episode, t + offset, "action")
        transitions = len(episode["steps"]) - 1
        direct = sum(gamma**k * value(episode, t + k, "reward") for k in range(n) if t + k < transitions)
        assert returns[i] == pytest.approx(direct, rel=1e-5, abs=1e-5)


def test_sampling_is_seeded_and_batches_cover_every_transition(tmp_path: Path) -> None:

    build(
        tmp_path,
        [(["player", "critic"], 6, True, random.Random(1)), (["player"], 4, False, random.Random(2))],
    )
    data = TrainingData.from_parquet(tmp_path, decode_observation=decode)
    views = {"frames": ("observation", "-3:0"), "next": ("observation", 1)}
    first = data.sample(32, seed=7, views=views, n_step=(3, 0.9))
    again = data.sample(32, seed=7, views=views, n_step=(3, 0.9))
    assert all(np.array_equal(first[key], again[key]) for key in first)
    assert first["frames"].shape == (32, 4, 2) and first["frames_valid"].shape == (32, 4)
    assert first["n_step_returns"].shape == (32,)
    seen = np.concatenate([batch["transition"] for batch in data.batches(4, seed=3, views=views)])
    assert sorted(seen) == list(range(len(data))) == list(range(5 + 5 + 3))
    with pytest.raises(ValueError):
        data.view("value", 0)


async def test_reads_stored_and_live_trials_from_a_datastore(datastore: RunningDatastore) -> None:
    endpoint = f"grpc://127.0.0.1:{datastore.service.port}"
    # "ended": 4 ticks, bob rewarded 0.5 + tick, a late reward of 7 for tick 1; "live": 3 ticks
    # so far, its stream still open.
    ended = [datalog_sample(tick, reward=0.5 + tick) for tick in range(3)]
    ended += [datalog_sample(1, out_of_sync=True, reward=7.0), datalog_sample(3, common_pb2.ENDED)]
    await run_datalog(datastore, "ended", ended)
    live = datastore.datalog.RunTrialDatalog(metadata=(("trial-id", "live"),))
    inputs = datalog_inputs(trial_params(), [datalog_sample(tick) for tick in range(5)])
    await send_acknowledged(live, inputs[:4])

    # From async code (this test) the blocking reader goes to a thread.
    data = await asyncio.to_thread(
        TrainingData.from_datastore,
        endpoint,
        ["ended", "live"],
        actor_names=["alice", "bob"],
        decode_observation=bytes.decode,
    )
    await send_acknowledged(live, inputs[4:])
    await live.done_writing()

    assert [(e.trial_id, e.actor_name, e.steps, e.ended) for e in data.episodes] == [
        ("ended", "alice", 4, True),
        ("ended", "bob", 4, True),
        ("live", "alice", 3, False),
        ("live", "bob", 3, False),
    ]
    arrays = data.d4rl()
    # alice sees "obs-<tick>", bob the shared observation (tests.helpers.datastore.datalog_sample).
    assert (
        list(arrays["observations"])
        == ["obs-0", "obs-1", "obs-2"] + ["shared"] * 3 + ["obs-0", "obs-1"] + ["shared"] * 2
    )
    assert list(arrays["next_observations"][:3]) == ["obs-1", "obs-2", "obs-3"]
    assert list(arrays["actions"][:3]) == [b"act-0-0", b"act-1-0", b"act-2-0"]
    assert list(arrays["rewards"]) == pytest.approx([0, 0, 0, 0.5, 1.5 + 7.0, 2.5, 0, 0, 0, 0])
    assert list(arrays["terminals"]) == [False, False, True] * 2 + [False] * 4
    assert list(arrays["timeouts"]) == [False] * 6 + [False, True] * 2

    with pytest.raises(ClientError, match=r"trials \[nope\] not found"):
        await asyncio.to_thread(TrainingData.from_datastore, endpoint, ["ended", "nope"])
    with pytest.raises(ClientError, match="cannot reach the trial datastore"):
        await asyncio.to_thread(TrainingData.from_datastore, f"grpc://127.0.0.1:{free_port()}", ["ended"])


def test_mistakes_are_named(tmp_path: Path) -> None:
    build(tmp_path, [(["player", "critic"], 4, True, random.Random(3))])
    with pytest.raises(
        ValueError, match=r"no actor_class 'plyer' in the selection \(it has 'critic', 'player'\)"
    ):
        TrainingData.from_parquet(tmp_path, actor_classes=["plyer"])
    with pytest.raises(TypeError, match="a list of names, not the string 'player'"):
        TrainingData.from_parquet(tmp_path, actor_classes="player")
    shapes = iter([np.zeros(2), np.zeros(3)] * 8)
    data = TrainingData.from_parquet(tmp_path, decode_observation=lambda raw: next(shapes))
    with pytest.raises(ValueError, match=r"shape \(3,\) for row 1 and \(2,\) for an earlier one"):
        data.column("observation")
    with pytest.raises(ValueError, match=r"invalid shift '-3\.\.0'"):
        data.view("action", "-3..0")
    with pytest.raises(ValueError, match="batch_size must be at least 1"):
        next(data.batches(0, seed=0, views={}))
    values, valid = data.view("action", [0, 1], transitions=[])
    assert values.shape == valid.shape == (0, 2)
