"""Training batches from an exported dataset (`client export --format parquet`) or straight from
a datastore: D4RL-style arrays, trajectory views with shifts, n-step returns, and replay-buffer
sampling, as numpy arrays.

One rule for every view (the README's "Trials as training data"): an episode is one
actor of one trial, its steps are the trial's ticks in order. An episode of N steps gives N - 1
transitions t = 0 .. N - 2: observation t, action t, the reward received at tick t, and the
observation of step t + 1; its last transition is terminal if the trial had ended, a timeout if
it was interrupted or cut. A view of a column with shift s gives, for transition t, the value of
step t + s of the same episode: zero (None for undecoded bytes) where that step is outside the
episode, with a validity mask saying so.

    data = TrainingData.from_parquet("DIR", actor_classes=["player"],
                                     decode_observation=lambda b: np.frombuffer(b, np.float32))
    arrays = data.d4rl()
    batch = data.sample(256, seed=0, views={"frames": ("observation", "-3:0")})
    live = TrainingData.from_datastore("grpc://127.0.0.1:9003", ["trial-1"], actor_classes=["player"])
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from services.datastore.client.dataset import STEPS_FILE
from services.datastore.client.transfer import download_dataset
from shared.channel import ClientTls
from shared.client import DEFAULT_TIMEOUT_S

Decoder = Callable[[bytes], Any]
# A shift: one step (int), several (a list), or an inclusive range "a:b" (RLlib's "-3:0").
Shift = int | Sequence[int] | str
COLUMNS = ("observation", "action", "reward")


def shifts_of(shift: Shift) -> tuple[list[int], bool]:
    """The steps a shift names, and whether it names a single one (its view has no shift axis)."""
    if isinstance(shift, bool):
        raise TypeError("a shift is an int, a list of ints or a range 'a:b'")
    if isinstance(shift, int):
        return [shift], True
    if isinstance(shift, str):
        first, separator, last = shift.partition(":")
        try:
            if not separator:
                return [int(shift)], True
            low, high = int(first), int(last)
        except ValueError:
            raise ValueError(f"invalid shift {shift!r}: an int, or a range 'a:b' such as '-3:0'") from None
        if high < low:
            raise ValueError(f"empty shift range {shift!r}")
        return list(range(low, high + 1)), False
    return [int(value) for value in shift], False


def _decoded(raw: list[bytes | None], decode: Decoder) -> np.ndarray:
    """Each value decoded once and stacked; a step without a value gets zeros of that shape."""
    decoded = [None if value is None else np.asarray(decode(value)) for value in raw]
    present = next((value for value in decoded if value is not None), None)
    if present is None:
        return np.zeros((len(raw),))
    blank = np.zeros_like(present)
    for row, value in enumerate(decoded):
        if value is not None and value.shape != present.shape:
            raise ValueError(
                f"the decoder gave shape {value.shape} for row {row} and {present.shape} for an "
                "earlier one: every value of a column must decode to one shape"
            )
    return np.stack([blank if value is None else value for value in decoded])


@dataclass(frozen=True)
class Episode:
    trial_id: str
    actor: int
    actor_name: str
    actor_class: str
    actor_implementation: str
    first_step: int  # index of its first step in the selection's step arrays
    steps: int
    ended: bool  # its trial had ended (its last transition is terminal, not a timeout)


class TrainingData:
    """The selected episodes of a dataset, their steps decoded once, on first use."""

    def __init__(
        self,
        episodes: list[Episode],
        observations: list[bytes | None],
        actions: list[bytes | None],
        rewards: np.ndarray,
        decode_observation: Decoder | None = None,
        decode_action: Decoder | None = None,
    ) -> None:
        self.episodes = episodes
        self._raw = {"observation": observations, "action": actions}
        self._decoders = {"observation": decode_observation, "action": decode_action}
        self._decoded: dict[str, np.ndarray] = {"reward": rewards}
        # Transitions: the global step index of each, the first and last steps of its episode,
        # and whether it is the last of an episode that ended, or of one that did not.
        steps, lows, highs, terminals, timeouts = [], [], [], [], []
        for episode in episodes:
            count = episode.steps - 1
            if count < 1:
                continue
            steps.append(np.arange(episode.first_step, episode.first_step + count))
            lows.append(np.full(count, episode.first_step))
            highs.append(np.full(count, episode.first_step + episode.steps - 1))
            last = np.zeros(count, dtype=bool)
            last[-1] = True
            terminals.append(last & episode.ended)
            timeouts.append(last & (not episode.ended))
        empty = np.zeros(0, dtype=np.int64)
        self._step = np.concatenate(steps) if steps else empty
        self._low = np.concatenate(lows) if lows else empty
        self._high = np.concatenate(highs) if highs else empty
        self.terminals = np.concatenate(terminals) if terminals else empty.astype(bool)
        self.timeouts = np.concatenate(timeouts) if timeouts else empty.astype(bool)

    @classmethod
    def from_parquet(
        cls,
        directory: str | Path,
        *,
        actor_classes: Sequence[str] = (),
        actor_names: Sequence[str] = (),
        actor_implementations: Sequence[str] = (),
        decode_observation: Decoder | None = None,
        decode_action: Decoder | None = None,
    ) -> TrainingData:
        """The episodes of the actors selected (by class, name or implementation; every actor
        when none is given) in a dataset exported with `--format parquet`."""
        table = pq.read_table(
            Path(directory) / STEPS_FILE,
            columns=[
                "trial_id",
                "actor",
                "actor_name",
                "actor_class",
                "actor_implementation",
                "observation",
                "action",
                "reward",
                "is_last",
                "is_terminal",
            ],
        )
        for column, wanted in (
            ("actor_class", actor_classes),
            ("actor_name", actor_names),
            ("actor_implementation", actor_implementations),
        ):
            if isinstance(wanted, str):
                raise TypeError(f"{column}s: a list of names, not the string {wanted!r}")
            if wanted:
                present = set(pc.unique(table[column]).to_pylist())
                if not present & set(wanted):  # a typo, most likely: say what there is
                    raise ValueError(
                        f"no {column} {', '.join(map(repr, sorted(wanted)))} in the selection "
                        f"(it has {', '.join(map(repr, sorted(present)))})"
                    )
                table = table.filter(pc.is_in(table[column], value_set=pc.cast(list(wanted), "string")))
        # Rows come trial by trial, ticks in order, actors interleaved: group by (trial, actor),
        # keeping the tick order (a stable sort by episode number).
        trial_ids = table["trial_id"].to_pylist()
        actors = table["actor"].to_numpy(zero_copy_only=False)
        episode_of: dict[tuple[str, int], int] = {}
        numbers = np.array(
            [
                episode_of.setdefault((t, int(a)), len(episode_of))
                for t, a in zip(trial_ids, actors, strict=True)
            ],
            dtype=np.int64,
        )
        order = np.argsort(numbers, kind="stable")
        table = table.take(order)
        numbers = numbers[order]
        # Where each episode starts, then the end of the last one (none for no rows).
        bounds = np.flatnonzero(np.diff(numbers, prepend=-1, append=-1))
        starts, ends = bounds[:-1], bounds[1:]
        heads = table.take(starts).select(
            ["trial_id", "actor", "actor_name", "actor_class", "actor_implementation"]
        )
        finals = table.take(ends - 1).select(["is_last", "is_terminal"])
        episodes = [
            Episode(
                trial_id=head["trial_id"],
                actor=head["actor"],
                actor_name=head["actor_name"],
                actor_class=head["actor_class"],
                actor_implementation=head["actor_implementation"],
                first_step=int(start),
                steps=int(end - start),
                ended=bool(final["is_terminal"]) and bool(final["is_last"]),
            )
            for head, final, start, end in zip(
                heads.to_pylist(), finals.to_pylist(), starts, ends, strict=True
            )
        ]
        rewards = table["reward"].fill_null(0.0).to_numpy(zero_copy_only=False).astype(np.float32)
        return cls(
            episodes,
            table["observation"].to_pylist(),
            table["action"].to_pylist(),
            rewards,
            decode_observation,
            decode_action,
        )

    @classmethod
    def from_datastore(
        cls,
        endpoint: str,
        trial_ids: Sequence[str],
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        tls: ClientTls | None = None,
        actor_classes: Sequence[str] = (),
        actor_names: Sequence[str] = (),
        actor_implementations: Sequence[str] = (),
        decode_observation: Decoder | None = None,
        decode_action: Decoder | None = None,
    ) -> TrainingData:
        """`from_parquet` of these trials read from a datastore (`grpc://host:port`, or
        `grpcs://` over TLS; `tls`: a CA bundle and a client certificate, `shared.channel.ClientTls`)
        through RetrieveSamples: stored trials, and live ones as far as they are when the call
        starts. Blocks until they are read (a notebook's event loop included); failures raise
        `shared.client.ClientError`."""
        with tempfile.TemporaryDirectory(prefix="cogment-dataset-") as directory:
            download = download_dataset(endpoint, trial_ids, Path(directory), timeout_s, tls)
            # Its own event loop in its own thread: the caller's thread may be running one.
            with ThreadPoolExecutor(1) as thread:
                thread.submit(asyncio.run, download).result()
            return cls.from_parquet(
                directory,
                actor_classes=actor_classes,
                actor_names=actor_names,
                actor_implementations=actor_implementations,
                decode_observation=decode_observation,
                decode_action=decode_action,
            )

    def __len__(self) -> int:
        """The number of transitions."""
        return len(self._step)

    def column(self, name: str) -> np.ndarray:
        """Every step's value of a column, decoded (once) by its decoder: an array of the
        decoded values stacked, or of the bytes (None where a step has none) without a decoder."""
        if name not in COLUMNS:
            raise ValueError(f"unknown column {name!r}: one of {', '.join(COLUMNS)}")
        decoded = self._decoded.get(name)
        if decoded is None:
            raw = self._raw[name]
            decode = self._decoders[name]
            if decode is None:
                decoded = np.empty(len(raw), dtype=object)
                decoded[:] = raw
            else:
                decoded = _decoded(raw, decode)
            self._decoded[name] = decoded
        return decoded

    def view(
        self, name: str, shift: Shift, transitions: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(values, valid) of a column at `shift` steps from each transition (all of them, or
        those indexed): with a shift axis after the transition axis unless `shift` is one int."""
        values = self.column(name)
        offsets, single = shifts_of(shift)
        index = np.arange(len(self)) if transitions is None else np.asarray(transitions, dtype=np.int64)
        steps = self._step[index][:, None] + np.asarray(offsets, dtype=np.int64)[None, :]
        valid = (steps >= self._low[index][:, None]) & (steps <= self._high[index][:, None])
        picked = values[np.clip(steps, 0, max(len(values) - 1, 0))]
        if picked.dtype == object:
            picked[~valid] = None
        else:
            picked[~valid] = 0
        if single:
            return picked[:, 0], valid[:, 0]
        return picked, valid

    def n_step_returns(self, n: int, gamma: float, transitions: np.ndarray | None = None) -> np.ndarray:
        """sum over k < n of gamma^k reward(t + k), stopping at the episode's last transition."""
        if n < 1:
            raise ValueError("n must be at least 1")
        rewards, valid = self.view("reward", list(range(n)), transitions)
        index = np.arange(len(self)) if transitions is None else np.asarray(transitions, dtype=np.int64)
        # Rewards of transitions only: the step after the episode's last transition is no transition.
        steps = self._step[index][:, None] + np.arange(n)[None, :]
        valid &= steps < self._high[index][:, None]
        discounts = gamma ** np.arange(n, dtype=np.float64)
        return np.asarray((np.where(valid, rewards, 0.0) * discounts).sum(axis=1), dtype=np.float32)

    def d4rl(self) -> dict[str, np.ndarray]:
        """`observations`, `actions`, `rewards`, `next_observations`, `terminals`, `timeouts`."""
        observations, _ = self.view("observation", 0)
        actions, _ = self.view("action", 0)
        rewards, _ = self.view("reward", 0)
        next_observations, _ = self.view("observation", 1)
        return {
            "observations": observations,
            "actions": actions,
            "rewards": rewards,
            "next_observations": next_observations,
            "terminals": self.terminals.copy(),
            "timeouts": self.timeouts.copy(),
        }

    def batch(
        self,
        transitions: np.ndarray,
        views: Mapping[str, tuple[str, Shift]],
        n_step: tuple[int, float] | None = None,
    ) -> dict[str, np.ndarray]:
        """The views of these transitions (`name_valid`: their masks), their terminal and timeout
        flags, and (`n_step` = (n, gamma)) their n-step returns."""
        batch: dict[str, np.ndarray] = {"transition": transitions}
        for name, (column, shift) in views.items():
            batch[name], batch[f"{name}_valid"] = self.view(column, shift, transitions)
        batch["terminals"] = self.terminals[transitions]
        batch["timeouts"] = self.timeouts[transitions]
        if n_step is not None:
            batch["n_step_returns"] = self.n_step_returns(n_step[0], n_step[1], transitions)
        return batch

    def sample(
        self,
        batch_size: int,
        seed: int | np.random.Generator,
        views: Mapping[str, tuple[str, Shift]],
        n_step: tuple[int, float] | None = None,
    ) -> dict[str, np.ndarray]:
        """A batch of transitions drawn uniformly, with replacement."""
        if not len(self):
            raise ValueError("no transitions: every selected episode has fewer than 2 steps")
        rng = np.random.default_rng(seed)
        return self.batch(rng.integers(0, len(self), batch_size), views, n_step)

    def batches(
        self,
        batch_size: int,
        seed: int,
        views: Mapping[str, tuple[str, Shift]],
        n_step: tuple[int, float] | None = None,
    ) -> Iterator[dict[str, np.ndarray]]:
        """Every transition once, shuffled, in batches (the last one may be smaller)."""
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        order = np.random.default_rng(seed).permutation(len(self))
        for start in range(0, len(order), batch_size):
            yield self.batch(order[start : start + batch_size], views, n_step)
