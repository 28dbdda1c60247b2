"""A replay buffer of episodes' steps, sampled as transitions with the conventions of
`TrainingData` (docs/training-data.md): transition t of an episode is (observation t, action t,
the reward of tick t, observation t + 1); its last transition is terminal if the episode ended,
a timeout if it did not; views are a column at a shift from the transition, zeros (None for
undecoded bytes) with a `_valid` mask outside the episode; n-step returns stop at the episode's
last transition.

Steps are kept in a `StepStore` ring, each linked to the previous and next step of its episode
(live episodes interleave), so views and n-step returns follow links instead of copying data. A
step becomes a transition, ready to sample, once its next step came and its n-step window did
(or its episode finished). Inserts and samples go through a Reverb-style `RateLimiter`: a sample
it holds back waits (up to a timeout), and so does the writer of steps it holds back.

Thread-safe: steps come from a feeding thread, batches are taken by the training loop's.
"""

from __future__ import annotations

import bisect
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from services.datastore.client.discovery import DISCOVERY_REFRESH_S, datastore_endpoints, is_discovery
from services.datastore.client.rate_limiter import RateLimiter
from services.datastore.client.replay_feed import DatastoreFeed
from services.datastore.client.replay_steps import ActorSelection, Decoder
from services.datastore.client.samplers import FifoSampler, PrioritizedSampler, Sampler, UniformSampler
from services.datastore.client.step_store import Keys, StepStore
from services.datastore.client.training import COLUMNS, Shift, shifts_of
from shared.channel import ClientTls
from shared.client import DEFAULT_TIMEOUT_S

SamplerName = Literal["uniform", "prioritized", "fifo"]
NO_KEY = -1
# How an episode's last step finished it (`_final`): not (yet) its last, ended, cut short.
RUNNING, ENDED, TRUNCATED = 0, 1, 2


@dataclass
class _LiveEpisode:
    # Its steps' keys by position (for late rewards), from position `first` on: those of steps
    # removed are forgotten (`_forget_removed_keys`).
    keys: array[int] = field(default_factory=lambda: array("q"))
    first: int = 0
    # Steps with a next step, not yet ready (or removed since: dropped as they come up).
    pending: deque[int] = field(default_factory=deque)


class ReplayBuffer:
    def __init__(
        self,
        capacity: int,
        *,
        capacity_bytes: int | None = None,
        sampler: SamplerName = "uniform",
        alpha: float = 0.6,
        beta: float = 0.4,
        min_size: int = 1,
        samples_per_insert: float | None = None,
        error_buffer: float | None = None,
        n_step: int = 1,
        gamma: float = 0.99,
        views: Mapping[str, tuple[str, Shift]] | None = None,
        seed: int | None = None,
    ) -> None:
        """`capacity` steps at most (each but an episode's last is a transition), and
        `capacity_bytes` of their data, the oldest removed first."""
        if n_step < 1:
            raise ValueError(f"n_step must be at least 1, not {n_step}")
        if min_size >= capacity:
            # An episode's last step is no transition: `capacity` steps hold fewer transitions.
            raise ValueError(
                f"min_size ({min_size}) must be less than the capacity ({capacity}) to be reached"
            )
        self._views = {name: (column, *shifts_of(shift)) for name, (column, shift) in (views or {}).items()}
        for name, (column, _, _) in self._views.items():
            if column not in COLUMNS:
                raise ValueError(f"view {name!r}: unknown column {column!r}, one of {', '.join(COLUMNS)}")
        self._steps = StepStore(capacity, capacity_bytes)
        self._prev = np.full(capacity, NO_KEY, dtype=np.int64)
        self._next = np.full(capacity, NO_KEY, dtype=np.int64)
        self._final = np.zeros(capacity, dtype=np.int8)
        self._ready = np.zeros(capacity, dtype=bool)
        self._ready_count = 0
        self._sampler: Sampler
        if sampler == "uniform":
            self._sampler = UniformSampler()
        elif sampler == "prioritized":
            self._sampler = PrioritizedSampler(capacity, alpha, beta)
        elif sampler == "fifo":
            self._sampler = FifoSampler()
        else:
            raise ValueError(f"sampler must be 'uniform', 'prioritized' or 'fifo', not {sampler!r}")
        self._limiter = RateLimiter(min_size, samples_per_insert, error_buffer)
        self._n_step = n_step
        # A step is ready once the steps its n-step return and its views look ahead to came.
        ahead = [max(offsets) for _, offsets, _ in self._views.values()]
        self._window = max([n_step, *ahead])
        self._gamma = gamma
        self._rng = np.random.default_rng(seed)
        self._live: dict[Hashable, _LiveEpisode] = {}
        self._live_keys = 0  # held by the live episodes, removed steps' included
        self._changed = threading.Condition()
        self._closed = False
        self._failure: BaseException | None = None
        self._waited_s = {"min_size": 0.0, "samples_per_insert": 0.0, "inserts": 0.0}
        self._feed: DatastoreFeed | None = None
        self._listeners: list[Callable[[], None]] = []

    @classmethod
    def from_datastore(
        cls,
        endpoint: str,
        *,
        capacity: int,
        actor_classes: Sequence[str] = (),
        actor_names: Sequence[str] = (),
        actor_implementations: Sequence[str] = (),
        trial_properties: Mapping[str, str] | None = None,
        backfill: bool = False,
        decode_observation: Decoder | None = None,
        decode_action: Decoder | None = None,
        directory: str | None = None,
        directory_token: str = "",
        tls: ClientTls | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        **options: Any,
    ) -> ReplayBuffer:
        """A buffer fed by the datastore at `endpoint` (`grpc://host:port`, `grpcs://` over TLS),
        or by every replica a discovery URL (`cogment://discover/datastore[?name=value...]`)
        finds through `directory` (with `directory_token`), looked up again every 10 s: the
        selected actors' steps of trials as they start (with `trial_properties`: those having
        them), as their samples are committed; with `backfill`, first the latest stored trials
        that fill the capacity (a learner that restarts gets its buffer back). A datastore away
        is retried, for `timeout_s` before the next call raises. `options`: those of
        `ReplayBuffer`. `close()` stops the feed."""
        endpoints = datastore_endpoints(
            endpoint, directory, token=directory_token, tls=tls, timeout_s=timeout_s
        )
        buffer = cls(capacity, **options)
        buffer._feed = DatastoreFeed(
            buffer,
            endpoints,
            refresh_s=DISCOVERY_REFRESH_S if is_discovery(endpoint) else None,
            actors=ActorSelection(actor_classes, actor_names, actor_implementations),
            trial_properties=trial_properties,
            backfill=backfill,
            decode_observation=decode_observation,
            decode_action=decode_action,
            timeout_s=timeout_s,
            tls=tls,
        )
        buffer._feed.start()
        return buffer

    @property
    def capacity(self) -> int:
        """Steps held at most."""
        return self._steps.capacity

    # ---- the training loop's side ----

    def __len__(self) -> int:
        """Transitions ready to sample."""
        with self._changed:
            return self._ready_count

    def sample(self, batch_size: int, timeout_s: float | None = None) -> dict[str, npt.NDArray[Any]]:
        """A batch: `observations`, `actions`, `rewards`, `next_observations`, `terminals`,
        `timeouts`, the views (and `<view>_valid`), `n_step_returns` when n_step > 1, `keys` (for
        `update_priorities`) and `weights` (importance weights: 1 but for prioritized replay).
        Waits while the rate limiter holds it back, `TimeoutError` after `timeout_s`."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {batch_size}")
        largest = self._limiter.largest_batch()
        if largest is not None and batch_size > largest:
            raise ValueError(
                f"batch_size {batch_size} is more than the error_buffer lets through ({largest}): "
                "it would wait for inserts that wait for it"
            )
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._changed:
            while True:
                self._raise_if_over()
                held = self._limiter.why_held(batch_size)
                if held is None:
                    break
                started = time.monotonic()
                left = None if deadline is None else deadline - started
                if left is not None and left <= 0:
                    why = f"the rate limiter held the sample back ({held}) for {timeout_s} s"
                    unmatched = None if self._feed is None else self._feed.unmatched
                    raise TimeoutError(why if unmatched is None else f"{why}: {unmatched}")
                self._changed.wait(left)
                self._waited_s[held] += time.monotonic() - started
            slots, weights = self._sampler.sample(
                self._steps, self._ready, self._ready_count, batch_size, self._rng
            )
            batch = self._batch(slots)
            batch["weights"] = weights.astype(np.float32)
            self._limiter.sampled(len(slots))
            if self._sampler.consumes:
                self._leave(batch["keys"])
            self._notify()
            return batch

    def update_priorities(self, keys: npt.ArrayLike, priorities: npt.ArrayLike) -> None:
        """New priorities for sampled transitions (prioritized replay); those removed since are
        skipped."""
        if not isinstance(self._sampler, PrioritizedSampler):
            raise TypeError("update_priorities is for sampler='prioritized'")
        with self._changed:
            self._sampler.update(self._steps, self._ready, keys, priorities)

    def stats(self) -> dict[str, Any]:
        """What the buffer holds and did, and how long samples and inserts waited, by cause."""
        with self._changed:
            return {
                "transitions": self._ready_count,
                "steps": len(self._steps),
                "bytes": self._steps.held_bytes,
                "live_episodes": len(self._live),
                "inserts": self._limiter.inserts,
                "samples": self._limiter.samples,
                "removals": self._limiter.removals,
                "waited_s": dict(self._waited_s),
            }

    def nbytes(self) -> int:
        """Bytes of the arrays it holds: its steps' columns and keys, their links and flags (and
        not the Python objects of undecoded bytes or text)."""
        per_slot = (self._prev, self._next, self._final, self._ready)
        return self._steps.nbytes() + sum(array.nbytes for array in per_slot)

    def close(self) -> None:
        """Stop the feed, if any; calls after this raise."""
        with self._changed:
            self._closed = True
            self._notify()
        if self._feed is not None:
            self._feed.stop()

    def __enter__(self) -> ReplayBuffer:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # ---- the feed's side ----

    def extend(
        self,
        episode: Hashable,
        observations: Sequence[Any],
        actions: Sequence[Any],
        rewards: Sequence[float],
        *,
        ended: bool = False,
        wait: bool = True,
    ) -> None:
        """Add an episode's next steps, in order; `ended`: the last of them ended the episode (its
        transition is terminal from now on, in the same step as it becomes sampleable; `finish`
        follows). Waits while the rate limiter holds inserts back (sampling makes room), unless
        `wait` is false (a caller that waited for room with `wait_for_room`)."""
        with self._changed:
            if wait:
                self.wait_for_room()
            self._raise_if_over()
            live = self._live.setdefault(episode, _LiveEpisode())
            keys, removed = self._steps.add(
                {
                    "observation": list(observations),
                    "action": list(actions),
                    "reward": np.asarray(rewards, dtype=np.float32),
                }
            )
            self._leave(removed[removed < keys[0]])  # the others are this batch's, never stored
            previous = np.concatenate(([live.keys[-1] if live.keys else NO_KEY], keys[:-1]))
            live.keys.frombytes(keys.astype(np.int64).tobytes())
            self._live_keys += len(keys)
            if self._live_keys > 2 * self._steps.capacity:
                self._forget_removed_keys()
            # Of more steps than fit, the first were removed at once: only the stored ones link.
            stored = self._steps.present(keys)
            keys, previous = keys[stored], previous[stored]
            slots = keys % self._steps.capacity
            self._prev[slots] = previous
            self._next[slots] = NO_KEY
            self._final[slots] = RUNNING
            self._ready[slots] = False
            linked = previous != NO_KEY
            linked[linked] = self._steps.present(previous[linked])
            self._next[previous[linked] % self._steps.capacity] = keys[linked]
            live.pending.extend(int(key) for key in previous[linked])
            if ended and len(keys):
                self._final[slots[-1]] = ENDED
            # A step with a next step is ready once the window - 1 steps after its next one came
            # (those the capacity removed meanwhile leave the queue here).
            ripe = np.array(
                [live.pending.popleft() for _ in range(len(live.pending) - (self._window - 1))],
                dtype=np.int64,
            )
            self._make_ready(ripe[self._steps.present(ripe)])

    def add_late_reward(self, episode: Hashable, position: int, reward: float) -> None:
        """Add a reward to the step at `position` of a live episode (a reward that came after
        later ticks); a step no longer in the buffer keeps nothing."""
        with self._changed:
            live = self._live.get(episode)
            if live is None or not 0 <= position < live.first + len(live.keys):
                raise KeyError(f"episode {episode!r} has no step {position}")
            if position < live.first:
                return  # removed, and forgotten
            key = live.keys[position - live.first]
            if self._steps.present([key])[0]:
                self._steps.column("reward")[key % self._steps.capacity] += reward

    def finish(self, episode: Hashable, ended: bool) -> None:
        """The episode has no more steps: it ended (its last transition is terminal), or not (a
        timeout). Its steps still waiting for their n-step window become ready."""
        with self._changed:
            live = self._live.pop(episode, None)
            if live is None:
                return
            self._live_keys -= len(live.keys)
            if not live.keys:
                return
            last = live.keys[-1]
            if self._steps.present([last])[0]:
                self._final[last % self._steps.capacity] = ENDED if ended else TRUNCATED
            pending = np.array(live.pending, dtype=np.int64)
            self._make_ready(pending[self._steps.present(pending)])

    def first_position(self, episode: Hashable) -> int:
        """The position of a live episode's oldest step the buffer may still hold: a late reward
        for an earlier one keeps nothing."""
        with self._changed:
            live = self._live.get(episode)
            return 0 if live is None else live.first

    def fail(self, error: BaseException) -> None:
        """The feed failed: the next call raises `error`."""
        with self._changed:
            self._failure = error
            self._notify()

    def insert_room(self) -> int | None:
        """How many transitions the rate limiter lets in now (None: any number)."""
        with self._changed:
            return self._limiter.insert_room()

    def largest_insert_room(self) -> int | None:
        """The most transitions the rate limiter ever lets in at once (None: any number)."""
        with self._changed:
            return self._limiter.largest_insert_room()

    def inserts_waited(self, seconds: float) -> None:
        """A writer waited this long for room (`stats()`' `waited_s["inserts"]`)."""
        with self._changed:
            self._waited_s["inserts"] += seconds

    def on_change(self, callback: Callable[[], None]) -> None:
        """Call `callback` (from any thread, at once) when samples may have made room, or the
        buffer closed or failed: a writer on an event loop waits for it there, not in a thread."""
        with self._changed:
            self._listeners.append(callback)

    def wait_for_room(self) -> None:
        """Until the rate limiter lets inserts through (or the buffer closed or failed)."""
        with self._changed:
            started = time.monotonic()
            while not self._limiter.can_insert() and not self._closed and self._failure is None:
                self._changed.wait()
            self._waited_s["inserts"] += time.monotonic() - started

    # ---- inside ----

    def _notify(self) -> None:
        self._changed.notify_all()
        for callback in self._listeners:
            callback()

    def _raise_if_over(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise RuntimeError("the replay buffer is closed")

    def _forget_removed_keys(self) -> None:
        """Drop the live episodes' keys of removed steps (the oldest of each: steps leave in key
        order), so that what they hold stays within twice the capacity, however long they run."""
        oldest = self._steps.oldest_key
        self._live_keys = 0
        for live in self._live.values():
            removed = bisect.bisect_left(live.keys, oldest)
            if removed:
                del live.keys[:removed]
                live.first += removed
            self._live_keys += len(live.keys)

    def _make_ready(self, keys: Keys) -> None:
        if not keys.size:
            return
        self._ready[keys % self._steps.capacity] = True
        self._ready_count += len(keys)
        self._sampler.became_ready(keys)
        self._limiter.inserted(len(keys))
        self._changed.notify_all()

    def _leave(self, keys: Keys) -> None:
        """Ready transitions stop being so (removed, or consumed by a FIFO)."""
        slots = keys % self._steps.capacity
        leaving = keys[self._ready[slots]]
        if not leaving.size:
            return
        self._ready[leaving % self._steps.capacity] = False
        self._ready_count -= len(leaving)
        self._sampler.left(leaving)
        self._limiter.removed(len(leaving))

    def _shifted(self, keys: Keys, shift: int) -> Keys:
        """The keys `shift` steps from `keys` in their episodes (NO_KEY where there is none)."""
        links = self._next if shift > 0 else self._prev
        shifted = keys.copy()
        for _ in range(abs(shift)):
            known = shifted != NO_KEY
            shifted[known] = links[shifted[known] % self._steps.capacity]
            shifted[~self._steps.present(shifted)] = NO_KEY  # NO_KEY is never present
        return shifted

    def _column_at(self, column: str, keys: Keys) -> tuple[npt.NDArray[Any], npt.NDArray[np.bool_]]:
        valid = keys != NO_KEY
        values = self._steps.column(column)[np.where(valid, keys, 0) % self._steps.capacity]
        if values.dtype == object:
            values[~valid] = None
        else:
            values[~valid] = 0
        return values, valid

    def _batch(self, slots: npt.NDArray[np.int64]) -> dict[str, npt.NDArray[Any]]:
        # A ready transition's step and next step are stored: plain indexing, no masks.
        keys = self._steps.keys_at(slots)
        next_slots = self._next[slots] % self._steps.capacity
        observations = self._steps.column("observation")
        finals = self._final[next_slots]
        batch: dict[str, npt.NDArray[Any]] = {
            "observations": observations[slots],
            "actions": self._steps.column("action")[slots],
            "rewards": self._steps.column("reward")[slots],
            "next_observations": observations[next_slots],
            "terminals": finals == ENDED,
            "timeouts": finals == TRUNCATED,
            "keys": keys,
        }
        for name, (column, offsets, single) in self._views.items():
            picked = [self._column_at(column, self._shifted(keys, offset)) for offset in offsets]
            values = np.stack([value for value, _ in picked], axis=1)
            valid = np.stack([mask for _, mask in picked], axis=1)
            batch[name], batch[f"{name}_valid"] = (values[:, 0], valid[:, 0]) if single else (values, valid)
        if self._n_step > 1:
            batch["n_step_returns"] = self._n_step_returns(keys)
        return batch

    def _n_step_returns(self, keys: Keys) -> npt.NDArray[np.float32]:
        """sum over k < n of gamma^k reward(t + k), over transitions of the episode only."""
        total = np.zeros(len(keys), dtype=np.float64)
        current = keys.copy()
        for k in range(self._n_step):
            transition = current != NO_KEY
            transition[transition] = self._next[current[transition] % self._steps.capacity] != NO_KEY
            rewards = self._steps.column("reward")[np.where(transition, current, 0) % self._steps.capacity]
            total += np.where(transition, rewards, 0.0) * self._gamma**k
            following = self._next[np.where(transition, current, 0) % self._steps.capacity]
            current = np.where(transition, following, NO_KEY)
        return total.astype(np.float32)
