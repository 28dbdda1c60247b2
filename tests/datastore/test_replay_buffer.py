"""The replay buffer: the same transitions, views and n-step returns as `TrainingData` for the same
episodes, fed step by step and interleaved; readiness, late rewards, capacity, the rate limiter."""

from __future__ import annotations

import contextlib
import threading
import time
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.datastore.client.replay_buffer import ReplayBuffer
from services.datastore.client.replay_steps import DecodedColumn, LiveTrial
from services.datastore.client.training import Episode, TrainingData
from shared.api import common_pb2, trial_datastore_pb2

VIEWS = {"frames": ("observation", "-2:0"), "next_action": ("action", 1), "rewards3": ("reward", [0, 1, 2])}


def observation(episode: int, position: int) -> np.ndarray:
    return np.array([episode, position], dtype=np.float32)


@st.composite
def episodes(draw: st.DrawFn) -> tuple[list[int], list[bool], list[int], int]:
    lengths = draw(st.lists(st.integers(1, 9), min_size=1, max_size=6))
    ended = draw(st.lists(st.booleans(), min_size=len(lengths), max_size=len(lengths)))
    # The order steps come in: episode numbers, each episode's steps in order.
    order = draw(st.permutations([e for e, n in enumerate(lengths) for _ in range(n)]))
    return lengths, ended, list(order), draw(st.integers(1, 4))


def reward(episode: int, position: int) -> float:
    return float(episode * 10 + position)


def action(episode: int, position: int) -> bytes:
    return bytes([episode, position])


@settings(max_examples=150, deadline=None)
@given(episodes())
def test_the_same_transitions_as_training_data(case: tuple[list[int], list[bool], list[int], int]) -> None:
    lengths, ended, order, n_step = case
    buffer = ReplayBuffer(1000, sampler="fifo", n_step=n_step, gamma=0.5, views=VIEWS)
    fed = [0] * len(lengths)
    for episode in order:
        position = fed[episode]
        buffer.extend(
            episode,
            [observation(episode, position)],
            [action(episode, position)],
            [reward(episode, position)],
        )
        fed[episode] += 1
        if fed[episode] == lengths[episode]:
            buffer.finish(episode, ended[episode])

    steps = [(e, p) for e, n in enumerate(lengths) for p in range(n)]
    data = TrainingData(
        [Episode(f"t{e}", 0, "a", "c", "i", sum(lengths[:e]), n, ended[e]) for e, n in enumerate(lengths)],
        [observation(e, p).tobytes() for e, p in steps],
        [action(e, p) for e, p in steps],
        np.array([reward(e, p) for e, p in steps], np.float32),
        decode_observation=lambda raw: np.frombuffer(raw, np.float32),
    )
    assert len(buffer) == len(data)
    if not len(data):
        return
    got = buffer.sample(len(data))
    expected = data.batch(np.arange(len(data)), VIEWS, (n_step, 0.5))
    expected.update(data.d4rl())
    # Both in some order: match them by their observation (episode, position).
    got_order = np.lexsort(got["observations"].T[::-1])
    want_order = np.lexsort(expected["observations"].T[::-1])
    for name in ("observations", "next_observations", "rewards", "terminals", "timeouts", "n_step_returns"):
        if name == "n_step_returns" and n_step == 1:
            continue
        assert np.array_equal(got[name][got_order], expected[name][want_order]), name
    assert list(got["actions"][got_order]) == list(expected["actions"][want_order])
    for view in VIEWS:
        assert np.array_equal(got[f"{view}_valid"][got_order], expected[f"{view}_valid"][want_order]), view
        mine, theirs = got[view][got_order], expected[view][want_order]
        if view == "frames":
            theirs = np.array([[np.zeros(2) if f is None else f for f in row] for row in theirs.tolist()])
        assert [repr(x) for x in np.asarray(mine).tolist()] == [
            repr(x) for x in np.asarray(theirs).tolist()
        ], view


def test_a_step_is_sampleable_once_its_n_step_window_came() -> None:
    buffer = ReplayBuffer(100, n_step=3)
    buffer.extend("e", [observation(0, 0), observation(0, 1), observation(0, 2)], [b"a"] * 3, [1, 2, 3])
    assert len(buffer) == 0  # step 0 waits for step 3
    buffer.extend("e", [observation(0, 3)], [b"a"], [4])
    assert len(buffer) == 1
    buffer.finish("e", ended=True)  # the rest come in, cut at the episode's end
    assert len(buffer) == 3


def test_a_late_reward_counts_in_its_step() -> None:
    buffer = ReplayBuffer(100, sampler="fifo")
    buffer.extend("e", [observation(0, 0), observation(0, 1)], [b"a", b"b"], [1.0, 2.0])
    buffer.add_late_reward("e", 0, 0.5)
    assert buffer.sample(1)["rewards"].tolist() == [1.5]
    with pytest.raises(KeyError):
        buffer.add_late_reward("e", 7, 1.0)


def test_the_oldest_steps_leave_and_views_into_them_are_invalid() -> None:
    buffer = ReplayBuffer(4, sampler="fifo", views={"previous": ("observation", -1)})
    buffer.extend("e", [observation(0, p) for p in range(6)], [b"a"] * 6, [0.0] * 6)  # steps 2 to 5 kept
    assert buffer.stats()["steps"] == 4 and len(buffer) == 3
    batch = buffer.sample(3)
    assert batch["observations"][:, 1].tolist() == [2, 3, 4]
    assert batch["previous_valid"].tolist() == [False, True, True]


def test_a_sample_waits_for_min_size_then_times_out() -> None:
    buffer = ReplayBuffer(100, min_size=2)
    buffer.extend("e", [observation(0, 0), observation(0, 1)], [b"a"] * 2, [0.0] * 2)
    with pytest.raises(TimeoutError, match="min_size"):
        buffer.sample(1, timeout_s=0.1)
    assert buffer.stats()["waited_s"]["min_size"] >= 0.1
    buffer.extend("e", [observation(0, 2)], [b"a"], [0.0])
    assert len(buffer.sample(1, timeout_s=0.1)["keys"]) == 1


def test_samples_per_insert_holds_the_feed_back_until_sampled() -> None:
    buffer = ReplayBuffer(100, samples_per_insert=1.0, error_buffer=2.0, min_size=1)
    fed = []

    def feed() -> None:
        for position in range(10):
            buffer.extend("e", [observation(0, position)], [b"a"], [0.0])
            fed.append(position)

    feeder = threading.Thread(target=feed)
    feeder.start()
    time.sleep(0.3)
    held_at = len(fed)
    assert held_at < 10  # inserts wait for samples
    for _ in range(12):
        buffer.sample(1, timeout_s=5)
        if len(fed) == 10:
            break
    feeder.join(5)
    assert len(fed) == 10 and buffer.stats()["waited_s"]["inserts"] > 0.2


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="capacity"):
        ReplayBuffer(0)
    with pytest.raises(ValueError, match=r"min_size \(4\) must be less than the capacity \(4\)"):
        ReplayBuffer(4, min_size=4)
    with pytest.raises(ValueError, match="unknown column 'obs'"):
        ReplayBuffer(4, views={"x": ("obs", 0)})
    with pytest.raises(ValueError, match="sampler"):
        ReplayBuffer(4, sampler="lifo")  # type: ignore[arg-type]
    buffer = ReplayBuffer(100, samples_per_insert=1.0, error_buffer=4.0)
    with pytest.raises(ValueError, match="batch_size 8 is more than the error_buffer lets through"):
        buffer.sample(8)
    with pytest.raises(TypeError, match="prioritized"):
        buffer.update_priorities([0], [1.0])
    buffer.close()
    with pytest.raises(RuntimeError, match="closed"):
        buffer.sample(1)


def test_prioritized_batches_follow_updated_priorities() -> None:
    buffer = ReplayBuffer(100, sampler="prioritized", alpha=1.0, beta=1.0, seed=7)
    buffer.extend("e", [observation(0, p) for p in range(5)], [b"a"] * 5, [0.0] * 5)  # 4 transitions
    keys = buffer.sample(4)["keys"]
    buffer.update_priorities(np.unique(keys), np.where(np.unique(keys) == 0, 97.0, 1.0))
    batch = buffer.sample(1000)
    assert np.mean(batch["keys"] == 0) > 0.9
    # The rarest draws weigh most: weights are (N * P)^-beta over the batch's largest.
    assert batch["weights"][batch["keys"] == 0].max() < batch["weights"][batch["keys"] != 0].min()
    assert batch["weights"].max() == 1.0


def test_a_fifo_under_min_size_takes_inserts_whatever_the_ratio() -> None:
    """Its samples remove transitions: were inserts held by the ratio under min_size, the feed
    and the sampler would wait for each other for ever."""
    buffer = ReplayBuffer(100, sampler="fifo", min_size=4, samples_per_insert=2.0, error_buffer=2.0)
    stop = threading.Event()

    def feed() -> None:
        position = 0
        with contextlib.suppress(RuntimeError):  # closed: a waiting extend says so
            while not stop.is_set():
                buffer.extend("e", [observation(0, position)], [b"a"], [0.0])
                position += 1

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    try:
        for _ in range(20):
            assert len(buffer.sample(2, timeout_s=5)["keys"]) == 2
    finally:
        stop.set()
        buffer.close()
        feeder.join(5)


def test_a_batch_larger_than_the_capacity_keeps_the_count_right() -> None:
    buffer = ReplayBuffer(4, sampler="fifo")
    buffer.extend("e", [observation(0, p) for p in range(4)], [b"a"] * 4, [0.0] * 4)
    buffer.extend("e", [observation(0, p) for p in range(4, 10)], [b"a"] * 6, [0.0] * 6)
    assert len(buffer) == 3  # steps 6 to 9 stored: 6, 7 and 8 are transitions
    assert buffer.sample(3)["observations"][:, 1].tolist() == [6, 7, 8]


def test_a_live_step_is_ready_once_its_views_can_see_ahead() -> None:
    buffer = ReplayBuffer(100, sampler="fifo", views={"r": ("reward", [0, 1, 2])})
    buffer.extend("e", [observation(0, p) for p in range(3)], [b"a"] * 3, [1.0, 2.0, 3.0])
    assert len(buffer) == 1  # step 0 sees steps 1 and 2; step 1 waits for step 3
    batch = buffer.sample(1)
    assert batch["r"].tolist() == [[1.0, 2.0, 3.0]] and batch["r_valid"].all()


def test_an_episode_that_ends_is_terminal_as_its_last_transition_becomes_sampleable() -> None:
    buffer = ReplayBuffer(100, sampler="fifo")
    buffer.extend("e", [observation(0, 0)], [b"a"], [0.0])
    buffer.extend("e", [observation(0, 1)], [b"a"], [0.0], ended=True)  # before finish comes
    assert buffer.sample(1)["terminals"].tolist() == [True]


def test_a_long_live_trial_keeps_what_the_buffer_holds_not_its_length() -> None:
    """A running trial far longer than the capacity: its steps' keys and its ticks' positions
    (kept for late rewards) are forgotten with the steps removed, so memory stays flat; a late
    reward still counts in a step held, and keeps nothing for one removed."""
    buffer = ReplayBuffer(1000, sampler="fifo")
    trial = LiveTrial("long", [0, 1], common_pb2.RUNNING)
    raw = DecodedColumn(None)

    def sample(tick: int, late_reward: float | None = None) -> trial_datastore_pb2.StoredTrialSample:
        actor = trial_datastore_pb2.StoredTrialActorSample
        if late_reward is not None:  # a reward for a past tick, to both actors
            late = [actor(actor=index, reward=late_reward) for index in (0, 1)]
            return trial_datastore_pb2.StoredTrialSample(tick_id=tick, actor_samples=late)
        actors = [actor(actor=index, observation=0, action=0, reward=1.0) for index in (0, 1)]
        return trial_datastore_pb2.StoredTrialSample(
            tick_id=tick, state=common_pb2.RUNNING, actor_samples=actors, payloads=[b"o"]
        )

    def run(ticks: range) -> None:
        for start in range(ticks.start, ticks.stop, 100):
            trial.add(buffer, [sample(tick) for tick in range(start, start + 100)], raw, raw)

    run(range(0, 10_000))  # the structures have reached their size
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        run(range(10_000, 60_000))
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # Unbounded, the 100,000 steps' keys and 50,000 positions cost about 10 MB.
    assert grown < 500_000, grown
    assert len(trial.positions) <= 2 * buffer.capacity

    # Each actor's last 500 steps are held (ticks 59,500 on): tick 59,990's transitions take the
    # reward; tick 5's steps are long gone.
    trial.add(buffer, [sample(59_990, late_reward=100.0), sample(5, late_reward=100.0)], raw, raw)
    rewards = buffer.sample(len(buffer))["rewards"].tolist()
    assert len(rewards) == 2 * 499 and sorted(rewards) == [1.0] * (2 * 498) + [101.0, 101.0]
