"""Benchmark of the live replay buffer (`ReplayBuffer.from_datastore`).

    .venv/bin/python bench/replay.py [--trials 8] [--ticks 2500] [--actors 2] ...

What it measures, all traffic on 127.0.0.1, the datastore (a fresh SQLite file) pinned to the
first CPU and this process (the buffer, its feed, the client) to the others:

1. Live feed: a buffer follows the datastore while `--trials` trials of `--ticks` ticks are
   ingested at full speed (bench/datastore.py's workload): transitions per second into the buffer,
   from the first datalog message to the last transition, against the ingestion's own rate.
   Also against the datastore's replay rate (below): the issue's target is 0.8 of it, which a
   live feed cannot pass when ingestion is slower than replay, as it is here.
   The live path's own speed, not bounded by ingestion: trials stored but for their last sample,
   their datalog streams held open (running), read by a new buffer's backfill as it reads
   running trials (ranges that wait for the next samples): transitions per second against the
   replay rate.
2. Backfill: a new buffer loads the same, now stored, trials (`backfill=True`): transitions per
   second, against the datastore's replay of the same samples (one RetrieveSamples per trial, all
   at once), in transitions per second of the same samples (the issue's target: 0.8 at least);
   and against reading them by ranges (RetrieveSampleRange), as the backfill itself does.
3. Lag: one trial at `--paced_rate` ticks per second, acknowledged one by one; for each
   transition, the time from the acknowledgement of the sample that completes it to the moment
   the buffer holds it (polled every 0.5 ms): median and 99th percentile.
4. Sampling: a buffer of `--transitions` steps (episodes of 1,000 steps, float32 observations of
   `--observation_floats`), batches of `--batch_size`: uniform and prioritized, against plain
   numpy indexing of the same arrays (observations, actions, rewards, next observations, no
   episode boundaries); best of `--rounds`.
5. Memory: this process's RSS growth while that buffer filled, against the arrays it holds.

Nothing is asserted: the exit status is 0 whenever the benchmark ran.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import threading
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve()
if str(SCRIPT.parents[1]) not in sys.path:  # run as a script: `bench` is not an installed package
    sys.path.insert(0, str(SCRIPT.parents[1]))

import grpc  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import (  # noqa: E402
    CHANNEL_OPTIONS,
    READY_TIMEOUT_S,
    BenchError,
    fmt,
    pinned_plan,
    run_benchmark,
    start_server,
    vm_rss,
)
from bench.datastore import RUN_TRIAL_DATALOG, Workload, datalog_stream, ingest, trial_ids  # noqa: E402
from services.datastore.client.api import DatastoreClient  # noqa: E402
from services.datastore.client.replay_buffer import ReplayBuffer  # noqa: E402
from services.datastore.client.replay_feed import RANGE_SAMPLES  # noqa: E402
from shared.api import trial_datastore_pb2, trial_datastore_pb2_grpc  # noqa: E402

WAIT_S = 300.0
EPISODE_STEPS = 1000


def float32s(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.float32)


def wait_for(buffer: ReplayBuffer, transitions: int) -> float:
    """When (perf_counter) the buffer came to hold `transitions`."""
    deadline = time.monotonic() + WAIT_S
    while len(buffer) < transitions:
        if time.monotonic() > deadline:
            raise BenchError(f"the buffer holds {len(buffer)} of {transitions} transitions: {buffer.stats()}")
        time.sleep(0.0005)
    return time.perf_counter()


def feed(address: str, **options: Any) -> ReplayBuffer:
    return ReplayBuffer.from_datastore(
        f"grpc://{address}", decode_observation=float32s, decode_action=float32s, **options
    )


async def replay_seconds(address: str, ids: Sequence[str]) -> float:
    """The datastore's own replay of the trials: one RetrieveSamples per trial, all at once."""
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = trial_datastore_pb2_grpc.TrialDatastoreSPStub(channel)

        async def one(trial_id: str) -> None:
            async for _ in stub.RetrieveSamples(
                trial_datastore_pb2.RetrieveSamplesRequest(trial_ids=[trial_id])
            ):
                pass

        started = time.perf_counter()
        await asyncio.gather(*map(one, ids))
        return time.perf_counter() - started


async def range_seconds(address: str, ids: Sequence[str]) -> float:
    """The same samples read by ranges (`RetrieveSampleRange`, as a backfill reads closed trials):
    one reader per trial, all at once."""
    async with DatastoreClient(f"grpc://{address}") as client:

        async def one(trial_id: str) -> None:
            first, count = 0, 1
            while first < count and (reply := await client.sample_range(trial_id, first, RANGE_SAMPLES)):
                first, count = reply.first + len(reply.samples), reply.samples_count

        started = time.perf_counter()
        await asyncio.gather(*map(one, ids))
        return time.perf_counter() - started


async def catch_up_seconds(
    address: str, ids: Sequence[str], streams: Sequence[list[bytes]], actors: int
) -> float:
    """The live path at full speed: trials whose samples are all stored but the last (their
    datalog streams held open, so they are running), and a new buffer that backfills them as it
    follows running trials: seconds until it holds their transitions."""
    release = asyncio.Event()

    async def held_open(frames: list[bytes]) -> AsyncIterator[bytes]:
        for frame in frames[:-1]:
            yield frame
        await release.wait()
        yield frames[-1]

    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        method = channel.stream_stream(RUN_TRIAL_DATALOG)
        calls = [
            method(held_open(frames), metadata=(("trial-id", trial_id),))
            for trial_id, frames in zip(ids, streams, strict=True)
        ]
        for call, frames in zip(calls, streams, strict=True):
            for _ in frames[:-1]:
                await call.read()  # all stored but the last
        # Each trial's last step stored has no next step yet: (ticks - 2) transitions per actor.
        expected = sum(len(frames) - 3 for frames in streams) * actors
        # A capacity of their steps: the backfill takes these trials, not the older (closed) ones.
        steps = sum(len(frames) - 2 for frames in streams) * actors
        started = time.perf_counter()
        buffer = await asyncio.to_thread(feed, address, capacity=steps, backfill=True)
        try:
            held = await asyncio.to_thread(wait_for, buffer, expected)
        finally:
            await asyncio.to_thread(buffer.close)
        release.set()
        for call in calls:
            while await call.read() != grpc.aio.EOF:  # the last acknowledgement
                pass
        return held - started


async def paced(address: str, trial_id: str, frames: list[bytes], rate: float) -> list[float]:
    """One trial's datalog at `rate` ticks per second; when (perf_counter) each sample was acknowledged."""
    acknowledged = []
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        call = channel.stream_stream(RUN_TRIAL_DATALOG)(metadata=(("trial-id", trial_id),))
        for index, frame in enumerate(frames):
            started = time.perf_counter()
            await call.write(frame)
            await call.read()
            if index:  # the first is the trial's parameters
                acknowledged.append(time.perf_counter())
            await asyncio.sleep(max(0.0, 1 / rate - (time.perf_counter() - started)))
        await call.done_writing()
    return acknowledged


def lag_ms(
    runner: asyncio.Runner, address: str, workload: Workload, rng: random.Random, rate: float
) -> dict[str, float]:
    frames = datalog_stream(workload, workload.ticks, rng)
    with feed(address, capacity=10 * workload.ticks * workload.actors) as buffer:
        held: list[tuple[int, float]] = []
        stop = threading.Event()

        def watch() -> None:
            seen = 0
            while not stop.is_set():
                count = len(buffer)
                if count != seen:
                    held.append((count, time.perf_counter()))
                    seen = count
                time.sleep(0.0005)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            acknowledged = runner.run(paced(address, "bench-replay-lag", frames, rate))
            wait_for(buffer, (workload.ticks - 1) * workload.actors)
        finally:
            stop.set()
            watcher.join()
    # Transition t of each actor is complete once sample t + 1 is acknowledged.
    lags = []
    for tick in range(workload.ticks - 1):
        complete = (tick + 1) * workload.actors
        ready = next(at for count, at in held if count >= complete)
        lags.append((ready - acknowledged[tick + 1]) * 1000)
    return {
        "p50_ms": round(float(np.percentile(lags, 50)), 2),
        "p99_ms": round(float(np.percentile(lags, 99)), 2),
    }


def filled(args: argparse.Namespace, sampler: str) -> tuple[ReplayBuffer, int]:
    """A buffer of `--transitions` steps, and how much this process's RSS grew while it filled
    (the episodes are made one at a time, and dropped once added)."""
    before = vm_rss(os.getpid()) or 0
    buffer = ReplayBuffer(args.transitions, sampler=sampler)  # type: ignore[arg-type]
    rng = np.random.default_rng(0)
    for episode in range(args.transitions // EPISODE_STEPS):
        observations = rng.random((EPISODE_STEPS, args.observation_floats), dtype=np.float32)
        actions = rng.random((EPISODE_STEPS, 4), dtype=np.float32)
        rewards = rng.random(EPISODE_STEPS, dtype=np.float32)
        buffer.extend(episode, list(observations), list(actions), rewards.tolist())
        buffer.finish(episode, ended=True)
    return buffer, (vm_rss(os.getpid()) or 0) - before


def sampling_rate(buffer: ReplayBuffer, args: argparse.Namespace) -> float:
    best = 0.0
    for _ in range(args.rounds):
        started = time.perf_counter()
        for _ in range(args.batches):
            buffer.sample(args.batch_size)
        best = max(best, args.batch_size * args.batches / (time.perf_counter() - started))
    return best


def numpy_rate(args: argparse.Namespace) -> float:
    """The limit: arrays of the same steps, plain fancy indexing, no episode boundaries."""
    rng = np.random.default_rng(0)
    steps = args.transitions
    observations = rng.random((steps, args.observation_floats), dtype=np.float32)
    actions = rng.random((steps, 4), dtype=np.float32)
    rewards = rng.random(steps, dtype=np.float32)
    best = 0.0
    for _ in range(args.rounds):
        started = time.perf_counter()
        for _ in range(args.batches):
            index = rng.integers(0, steps - 1, args.batch_size)
            observations[index], actions[index], rewards[index], observations[index + 1]
        best = max(best, args.batch_size * args.batches / (time.perf_counter() - started))
    return best


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    # One event loop for every phase, closed at the end: gRPC's poller calls into each loop that
    # served a channel, and one closed before then prints "Event loop is closed" tracebacks.
    with asyncio.Runner() as runner:
        return measured(runner, args, workdir)


def measured(runner: asyncio.Runner, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    plan = pinned_plan(args, workdir, "", not args.no_pin)
    workload = Workload(args.trials, args.ticks, args.actors, args.observation_bytes, args.action_bytes)
    rng = random.Random(args.seed)
    streams = [datalog_stream(workload, workload.ticks, rng) for _ in range(workload.trials)]
    command = [
        sys.executable, "-m", "services.datastore", "--port", "0", "--bind_address", "127.0.0.1",
        "--log_format", "json", "--data_dir", str(workdir / "data"),
        "--database_url", f"sqlite+aiosqlite:///{workdir / 'bench.db'}",
    ]  # fmt: skip
    datastore = start_server(plan, "datastore", command)
    if plan.client_cpus:
        os.sched_setaffinity(0, plan.client_cpus)
    ids = trial_ids(f"replay-{args.seed}", "datastore", 0, workload.trials)
    transitions = workload.trials * workload.actors * (workload.ticks - 1)
    report: dict[str, Any] = {"bench": "replay", "args": vars(args), "transitions": transitions}

    async def load() -> float:
        async with grpc.aio.insecure_channel(datastore.address, options=CHANNEL_OPTIONS) as channel:
            await asyncio.wait_for(channel.channel_ready(), READY_TIMEOUT_S)
            started = time.perf_counter()
            await ingest(channel, ids, streams)
            return time.perf_counter() - started

    print(f"live feed of {workload.samples:,} samples...", file=sys.stderr)
    with feed(datastore.address, capacity=2 * transitions) as buffer:
        started = time.perf_counter()
        ingest_s = runner.run(load())
        live_s = wait_for(buffer, transitions) - started
    print("backfill and replay...", file=sys.stderr)
    replay_s = min(runner.run(replay_seconds(datastore.address, ids)) for _ in range(args.rounds))
    ranges_s = min(runner.run(range_seconds(datastore.address, ids)) for _ in range(args.rounds))
    backfill_s = []
    for _ in range(args.rounds):
        started = time.perf_counter()
        with feed(datastore.address, capacity=2 * transitions, backfill=True) as buffer:
            backfill_s.append(wait_for(buffer, transitions) - started)
    print("the live path catching up...", file=sys.stderr)
    held_ids = trial_ids(f"replay-{args.seed}-held", "datastore", 0, workload.trials)
    catch_up_s = runner.run(catch_up_seconds(datastore.address, held_ids, streams, workload.actors))
    caught_up = workload.trials * workload.actors * (workload.ticks - 2)
    report["live_catch_up"] = {
        "transitions_per_s": round(caught_up / catch_up_s, 1),
        "ratio": round(replay_s / transitions * caught_up / catch_up_s, 3),
    }
    report["live"] = {
        "transitions_per_s": round(transitions / live_s, 1),
        "ingested_transitions_per_s": round(transitions / ingest_s, 1),
        "ratio_to_ingestion": round(ingest_s / live_s, 3),
        "ratio_to_replay": round(replay_s / live_s, 3),
    }
    report["backfill"] = {
        "transitions_per_s": round(transitions / min(backfill_s), 1),
        "replay_transitions_per_s": round(transitions / replay_s, 1),
        "range_transitions_per_s": round(transitions / ranges_s, 1),
        "ratio": round(replay_s / min(backfill_s), 3),
        "ratio_to_ranges": round(ranges_s / min(backfill_s), 3),
    }
    print("lag...", file=sys.stderr)
    paced_workload = Workload(1, args.paced_ticks, args.actors, args.observation_bytes, args.action_bytes)
    report["lag"] = lag_ms(runner, datastore.address, paced_workload, rng, args.paced_rate)
    datastore.stop()

    print(f"sampling from {args.transitions:,} steps...", file=sys.stderr)
    uniform, rss_growth = filled(args, "uniform")
    report["memory"] = {
        "rss_growth_mib": round(rss_growth / 2**20, 1),
        "arrays_mib": round(uniform.nbytes() / 2**20, 1),
        "ratio": round(rss_growth / uniform.nbytes(), 3),
    }
    uniform_rate = sampling_rate(uniform, args)
    del uniform
    plain = numpy_rate(args)
    prioritized, _ = filled(args, "prioritized")
    prioritized_rate = sampling_rate(prioritized, args)
    report["sampling"] = {
        "numpy_per_s": round(plain, 1),
        "uniform_per_s": round(uniform_rate, 1),
        "prioritized_per_s": round(prioritized_rate, 1),
        "numpy_over_uniform": round(plain / uniform_rate, 2),
        "uniform_over_prioritized": round(uniform_rate / prioritized_rate, 2),
    }
    return report


def print_summary(report: dict[str, Any]) -> None:
    live, backfill, lag = report["live"], report["backfill"], report["lag"]
    sampling, memory = report["sampling"], report["memory"]
    args = report["args"]
    print(
        f"\n{report['transitions']:,} transitions ({args['trials']} trials x {args['ticks']:,} ticks x "
        f"{args['actors']} actors)\n"
        f"live feed      {fmt(live['transitions_per_s'])} transitions/s while ingestion ran at "
        f"{fmt(live['ingested_transitions_per_s'])}/s: ratio {live['ratio_to_ingestion']} to ingestion, "
        f"{live['ratio_to_replay']} to the datastore's replay (target >= 0.8)\n"
        f"live catch-up  {fmt(report['live_catch_up']['transitions_per_s'])} transitions/s through the "
        f"live path: ratio {report['live_catch_up']['ratio']} to the datastore's replay (target >= 0.8)\n"
        f"backfill       {fmt(backfill['transitions_per_s'])} transitions/s, the datastore's replay "
        f"{fmt(backfill['replay_transitions_per_s'])}/s: ratio {backfill['ratio']} (target >= 0.8); "
        f"its ranges {fmt(backfill['range_transitions_per_s'])}/s: ratio {backfill['ratio_to_ranges']}\n"
        f"lag            p50 {lag['p50_ms']} ms, p99 {lag['p99_ms']} ms at {args['paced_rate']:g} ticks/s "
        f"(target p99 <= 50 ms)\n"
        f"sampling {args['batch_size']} of {args['transitions']:,}: numpy {fmt(sampling['numpy_per_s'])}/s, "
        f"uniform {fmt(sampling['uniform_per_s'])}/s ({sampling['numpy_over_uniform']}x slower, "
        f"target <= 2x), prioritized {fmt(sampling['prioritized_per_s'])}/s "
        f"({sampling['uniform_over_prioritized']}x slower than uniform, target <= 5x)\n"
        f"memory         RSS grew {memory['rss_growth_mib']} MiB for {memory['arrays_mib']} MiB of arrays: "
        f"ratio {memory['ratio']} (target <= 1.1)\n"
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/replay.py", description="Benchmark the live replay buffer.")
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--ticks", type=int, default=2500, help="samples per trial")
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--observation_bytes", type=int, default=256, help="a multiple of 4 (float32s)")
    parser.add_argument("--action_bytes", type=int, default=16, help="a multiple of 4 (float32s)")
    parser.add_argument("--paced_ticks", type=int, default=500, help="ticks of the lag's trial")
    parser.add_argument("--paced_rate", type=float, default=100.0, help="ticks per second of the lag's trial")
    parser.add_argument("--transitions", type=int, default=1_000_000, help="steps of the sampling buffer")
    parser.add_argument("--observation_floats", type=int, default=16)
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=20261128)
    parser.add_argument("--no_pin", action="store_true", help="do not pin the server and the client to CPUs")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args(argv)
    if min(args.trials, args.ticks, args.actors, args.rounds, args.batch_size, args.batches) < 1:
        parser.error("counts must be positive")
    if args.transitions < EPISODE_STEPS or args.ticks < 2 or args.paced_ticks < 2:
        parser.error(f"--transitions: {EPISODE_STEPS} at least; --ticks and --paced_ticks: 2 at least")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    return run_benchmark(parse_args(argv), "replay", run, print_summary)


if __name__ == "__main__":
    sys.exit(main())
