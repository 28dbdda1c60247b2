"""Benchmark of the Trial Datastore (datalog ingestion, replay) against a bare grpc.aio baseline.

    .venv/bin/python bench/datastore.py [--database_url URL] [--trials 8] [--ticks 2500] [--rounds 3] ...

What it does, all traffic on 127.0.0.1, everything bounded in time and count:

1. Starts the datastore as users do (`python -m services.datastore --port 0 --bind_address
   127.0.0.1 --log_format json --data_dir <tmpdir> --database_url ...`) and learns its port from
   its JSON `serving` log line. The default database is a fresh SQLite file in a temporary directory.
2. Ingestion: `--trials` concurrent DatalogSP.RunTrialDatalog streams on one channel, as the
   orchestrator logs its trials: metadata `trial-id` and `user-id`, the trial parameters, then one
   DatalogSample per tick, the last one ENDED. A tick holds `--actors` observations of
   `--observation_bytes` (one per actor), one action of `--action_bytes` per actor and one reward
   from the environment to every actor (`*`). Each stream writes as fast as gRPC flow control
   lets it while it reads its acknowledgements (one empty RunTrialDatalogOutput per message), as
   the orchestrator does; the window runs from the first write to the last acknowledgement. The
   messages are encoded before the window (the orchestrator's encoding is not the client's cost).
3. Replay: after one untimed replay (which, on the datastore's first round, also checks every
   sample and captures the replies for the baseline), RetrieveSamples over the trials just
   ingested, two ways: one call naming every trial, which is what the Python SDK's
   `Datastore.all_samples(trial_infos)` sends and so what training readers do (the replay target
   applies to it), then one call per trial, all at once (readers following trials one by one).
   The client counts the replies and their bytes without parsing them: parsing would cost the
   same on both sides, and only make the client (one CPU) the bottleneck sooner.
4. Baseline: a bare grpc.aio server (this script, `_bare`, in its own subprocess) whose DatalogSP
   only deserializes each input and answers one empty output per input, and whose RetrieveSamples
   streams the datastore's own replies as captured (the same bytes, in the same order, already
   encoded: the datastore also sends stored bytes without re-encoding them). The same client code
   loads it the same way, with the same pinning.

Each of `--rounds` rounds ingests `--trials` new trials into each server and replays them. The
datastore's first round comes first (the baseline serves what it captured), then the baseline's;
later rounds alternate which server goes first, both servers staying up (an idle one costs next to
nothing). Figures are medians over the rounds; a datastore/bare ratio is the median of the
per-round ratios (the two ran back to back, so a drifting background load weighs on both).

CPUs: with two or more, each server is pinned to the first CPU and the client (this process) to
the others (a PostgreSQL server given by `--database_url` is not pinned). CPU time (user + system,
from /proc) is reported per sample for the whole server and for its main thread alone, the event
loop: the SQLite writer and gRPC's threads could use other CPUs, the event loop cannot. A Python
grpc.aio client costs about as much per message as the bare server, so the bare phases are often
limited by the client (flagged when the client used >= 90% of its CPU): the rate ratio then
overstates the datastore, and the ratio of server CPU per sample (bare/datastore, what the rate
ratio would be if both servers used their CPU fully) is the better guide. The datastore's RSS is
sampled during each phase, and its kernel high-water mark (VmHWM) read before it stops.

`--paced` measures at the orchestrator's pace instead of flooding: `--trials` streams (8) at
`--rate` samples per second in all (800), 500 ticks of 2 actors unless given, each stream writing
one message per tick at its share of the rate, the streams' ticks spread evenly, acknowledgements
read as they come. Per round and server (the datastore, then the bare receiver, alternating): the
server CPU per sample (all its threads, and its event loop alone), and the p50, p99 and max time
from a message's write to its acknowledgement. The ratio of server CPU per sample,
datastore/bare, is the figure to watch (both servers keep up with the pace: the rates are equal).
`--replicas N` runs N datastores on one PostgreSQL `--database_url`, the streams spread over them,
and adds up their CPU.

`--profile` runs the datastore under cProfile, every Python thread (the event loop, the SQLite
writer and reader) profiled on its own CPU time, and prints where each spent it; the figures are
then much slowed by the profiler and not comparable with an unprofiled run.

The summary table is followed by one JSON line with every figure. Targets are shown, never
asserted: the exit status is 0 whenever the benchmark itself ran.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import cProfile
import io
import os
import pstats
import random
import secrets
import statistics
import struct
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve()
if str(SCRIPT.parents[1]) not in sys.path:  # run as a script: `bench` is not an installed package
    sys.path.insert(0, str(SCRIPT.parents[1]))

import grpc  # noqa: E402

from bench.common import (  # noqa: E402
    CHANNEL_OPTIONS,
    READY_TIMEOUT_S,
    BenchError,
    Child,
    MiB,
    Plan,
    RssSampler,
    cpu_seconds,
    fmt,
    pinned_plan,
    print_table,
    run_benchmark,
    serve_bare,
    start_server,
    vm_hwm,
    vm_rss,
)
from shared.api import common_pb2, datalog_pb2, environment_pb2  # noqa: E402
from shared.api import trial_datastore_pb2 as ds  # noqa: E402

DATALOG_SERVICE = datalog_pb2.DESCRIPTOR.services_by_name["DatalogSP"].full_name
DATASTORE_SERVICE = ds.DESCRIPTOR.services_by_name["TrialDatastoreSP"].full_name
RUN_TRIAL_DATALOG = f"/{DATALOG_SERVICE}/RunTrialDatalog"
RETRIEVE_SAMPLES = f"/{DATASTORE_SERVICE}/RetrieveSamples"

# Datastore/bare rate ratios, per phase.
TARGETS = {"ingest": 0.5, "replay_one_call": 0.6, "replay_per_trial": 0.6}
USER_ID = "bench-user"
ENVIRONMENT = "env"
# Bounds: every call ends by then, whatever the server does (far beyond a slow database's needs).
CALL_TIMEOUT_S = 600.0
RSS_INTERVAL_S = 0.01
# Client CPU use (percent of one CPU) from which a phase is taken as limited by the client.
CLIENT_BOUND_PCT = 90.0
# Capture file of the baseline: a sequence of (4-byte big-endian length, encoded RetrieveSampleReply).
FRAME_LENGTH = struct.Struct(">I")
REPLAY_MODES = ("replay_one_call", "replay_per_trial")


# ---- the workload (built once, encoded before any window) ----


@dataclass(frozen=True)
class Workload:
    trials: int
    ticks: int
    actors: int
    observation_bytes: int
    action_bytes: int

    @property
    def samples(self) -> int:
        return self.trials * self.ticks


def trial_params(actors: int) -> common_pb2.TrialParams:
    return common_pb2.TrialParams(
        environment=common_pb2.EnvironmentParams(name=ENVIRONMENT, implementation="bench-env"),
        actors=[
            common_pb2.ActorParams(name=f"agent_{index}", actor_class="player", implementation="bench-agent")
            for index in range(actors)
        ],
        properties={"bench": "datastore"},
    )


def datalog_stream(workload: Workload, ticks: int, rng: random.Random) -> list[bytes]:
    """One trial's RunTrialDatalog inputs, encoded: the parameters, then one sample per tick."""
    actors = workload.actors
    frames = [datalog_pb2.RunTrialDatalogInput(trial_params=trial_params(actors)).SerializeToString()]
    start_ns = time.time_ns()
    for tick in range(ticks):
        timestamp = start_ns + tick * 10_000_000
        value = rng.uniform(-1.0, 1.0)
        sample = datalog_pb2.DatalogSample(
            info=datalog_pb2.SampleInfo(
                tick_id=tick,
                timestamp=timestamp,
                state=common_pb2.ENDED if tick == ticks - 1 else common_pb2.RUNNING,
            ),
            observations=environment_pb2.ObservationSet(
                tick_id=tick,
                timestamp=timestamp,
                observations=[rng.randbytes(workload.observation_bytes) for _ in range(actors)],
                actors_map=range(actors),
            ),
            actions=[
                common_pb2.Action(
                    tick_id=tick, timestamp=timestamp, content=rng.randbytes(workload.action_bytes)
                )
                for _ in range(actors)
            ],
            rewards=[
                common_pb2.Reward(
                    tick_id=tick,
                    receiver_name="*",
                    value=value,
                    sources=[common_pb2.RewardSource(sender_name=ENVIRONMENT, value=value, confidence=1.0)],
                )
            ],
        )
        frames.append(datalog_pb2.RunTrialDatalogInput(sample=sample).SerializeToString())
    return frames


def trial_ids(tag: str, server: str, round_: int, trials: int) -> list[str]:
    """Ids of one round's trials; all of the same length, so every round's replies weigh the same."""
    return [f"bench-{tag}-{server[:4]}-r{round_:03d}-t{trial:04d}" for trial in range(trials)]


# ---- the client (this process) ----


@dataclass
class Window:
    """Wall time and CPU time over one measured phase: of the server, of its event loop (which a
    Python server cannot spread over CPUs, unlike its SQLite and gRPC threads), of the client."""

    server_pid: int
    seconds: float = 0.0
    cpu_s: dict[str, float | None] = field(default_factory=dict)

    def _cpu(self) -> dict[str, float | None]:
        return {
            "server": cpu_seconds(self.server_pid),
            "loop": cpu_seconds(self.server_pid, self.server_pid),
            "client": cpu_seconds(os.getpid()),
        }

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        before = self._cpu()
        started = time.perf_counter()
        yield
        self.seconds = time.perf_counter() - started
        after = self._cpu()
        for key, value in after.items():
            earlier = before[key]
            self.cpu_s[key] = None if value is None or earlier is None else value - earlier

    def figures(self, samples: int) -> dict[str, Any]:
        seconds = max(self.seconds, 1e-9)

        def pct(cpu: float | None) -> float | None:
            return None if cpu is None else round(100 * cpu / seconds, 1)

        def per_sample(cpu: float | None) -> float | None:
            return None if cpu is None or not samples else round(cpu * 1e6 / samples, 1)

        return {
            "samples": samples,
            "seconds": round(self.seconds, 3),
            "samples_per_s": round(samples / seconds, 1),
            "server_cpu_pct": pct(self.cpu_s["server"]),
            "client_cpu_pct": pct(self.cpu_s["client"]),
            "server_cpu_us_per_sample": per_sample(self.cpu_s["server"]),
            "loop_cpu_us_per_sample": per_sample(self.cpu_s["loop"]),
        }


def rpc_failure(what: str, error: grpc.aio.AioRpcError) -> BenchError:
    return BenchError(f"{what}: {error.code().name}: {error.details()}")


async def ingest(channel: grpc.aio.Channel, ids: Sequence[str], streams: Sequence[list[bytes]]) -> None:
    """Every trial's datalog at once, each stream reading its acknowledgements as they come."""
    method = channel.stream_stream(RUN_TRIAL_DATALOG)  # no serializers: the frames are encoded

    async def one(trial_id: str, frames: list[bytes]) -> None:
        acks = 0
        try:
            call = method(
                iter(frames), metadata=(("trial-id", trial_id), ("user-id", USER_ID)), timeout=CALL_TIMEOUT_S
            )
            async for _ in call:
                acks += 1
        except grpc.aio.AioRpcError as error:
            raise rpc_failure(f"RunTrialDatalog of {trial_id} after {acks} acknowledgements", error) from None
        if acks != len(frames):
            raise BenchError(
                f"RunTrialDatalog of {trial_id}: {acks} acknowledgements for {len(frames)} messages"
            )

    await asyncio.gather(*(one(trial_id, frames) for trial_id, frames in zip(ids, streams, strict=True)))


async def replay(channel: grpc.aio.Channel, calls: Sequence[Sequence[str]]) -> tuple[int, int]:
    """RetrieveSamples calls at once, each naming its trials: (replies, bytes) received in all."""
    method = channel.unary_stream(
        RETRIEVE_SAMPLES, request_serializer=ds.RetrieveSamplesRequest.SerializeToString
    )

    async def one(ids: Sequence[str]) -> tuple[int, int]:
        replies = size = 0
        try:
            async for frame in method(ds.RetrieveSamplesRequest(trial_ids=ids), timeout=CALL_TIMEOUT_S):
                replies += 1
                size += len(frame)
        except grpc.aio.AioRpcError as error:
            raise rpc_failure(
                f"RetrieveSamples of {len(ids)} trial(s) after {replies} replies", error
            ) from None
        return replies, size

    totals = await asyncio.gather(*(one(ids) for ids in calls))
    return sum(replies for replies, _ in totals), sum(size for _, size in totals)


async def capture(
    channel: grpc.aio.Channel, ids: Sequence[str], workload: Workload
) -> tuple[list[bytes], list[str]]:
    """The replies of one call naming every trial, in the order received, and what is wrong with them."""
    method = channel.unary_stream(
        RETRIEVE_SAMPLES, request_serializer=ds.RetrieveSamplesRequest.SerializeToString
    )
    frames: list[bytes] = []
    try:
        async for frame in method(ds.RetrieveSamplesRequest(trial_ids=ids), timeout=CALL_TIMEOUT_S):
            frames.append(frame)
    except grpc.aio.AioRpcError as error:
        raise rpc_failure(f"capture: RetrieveSamples after {len(frames)} replies", error) from None
    return frames, check_replies(frames, ids, workload)


def check_replies(frames: Sequence[bytes], ids: Sequence[str], workload: Workload) -> list[str]:
    """Each trial's samples, in tick order, with one entry per actor and its payloads, the last ENDED."""
    problems: list[str] = []
    next_tick = dict.fromkeys(ids, 0)
    for frame in frames:
        sample = ds.RetrieveSampleReply.FromString(frame).trial_sample
        expected = next_tick.get(sample.trial_id)
        if expected is None:
            problems.append(f"a sample of an unrequested trial {sample.trial_id!r}")
            continue
        next_tick[sample.trial_id] = expected + 1
        last = expected == workload.ticks - 1
        if (
            sample.tick_id != expected
            or sample.user_id != USER_ID
            or len(sample.actor_samples) != workload.actors
            or len(sample.payloads) != 2 * workload.actors
            or (sample.state == common_pb2.ENDED) != last
        ):
            problems.append(f"{sample.trial_id} sample {expected}: unexpected {sample}"[:300])
    problems.extend(
        f"{trial_id}: {count} samples, not {workload.ticks}"
        for trial_id, count in next_tick.items()
        if count != workload.ticks
    )
    return problems[:10]


class Session:
    """One server's warm-up and rounds, on one channel, and the figures of its measured phases."""

    def __init__(
        self,
        name: str,
        server: Child,
        workload: Workload,
        tag: str,
        replays: tuple[list[str], int] | None,
        sampler: RssSampler | None = None,
    ) -> None:
        self.name = name
        self.sampler = sampler  # the RSS sampler of the server, if its RSS is reported
        self.server = server
        self.workload = workload
        self.tag = tag
        self.phases: dict[str, list[dict[str, Any]]] = {"ingest": [], **{mode: [] for mode in REPLAY_MODES}}
        self.problems: list[str] = []
        self.rss_peak_mib: dict[str, float] = {}
        self.channel = grpc.aio.insecure_channel(server.address, options=CHANNEL_OPTIONS)
        # What the replays return: on the datastore (`replays` None) each round's trials, checked
        # against the capture of its first round; on the baseline the captured trials.
        self.stores = replays is None
        self.replay_ids, self.expected_bytes = replays or ([], 0)

    async def warm_up(self, stream: list[bytes]) -> None:
        await asyncio.wait_for(self.channel.channel_ready(), READY_TIMEOUT_S)
        warmup_id = f"bench-{self.tag}-{self.name[:4]}-warmup"
        await ingest(self.channel, [warmup_id], [stream])
        if self.stores:  # the bare server stores nothing
            await replay(self.channel, [[warmup_id]])

    async def round(self, round_: int, streams: Sequence[list[bytes]]) -> list[bytes] | None:
        """Ingest new trials, then replay (untimed once, then measured both ways). The datastore's
        first round returns the replies of its untimed replay, for the baseline."""
        print(f"  {self.name}: round {round_ + 1}...", file=sys.stderr)
        captured: list[bytes] | None = None
        ids = trial_ids(self.tag, self.name, round_, self.workload.trials)
        window = Window(self.server.process.pid)
        self._rss_phase(None)
        with window.measure():
            await ingest(self.channel, ids, streams)
        self.phases["ingest"].append(window.figures(self.workload.samples))
        self._rss_phase("ingest")
        if self.stores and not self.replay_ids:
            captured, problems = await capture(self.channel, ids, self.workload)
            self.problems.extend(problems)
            self.expected_bytes = sum(len(frame) for frame in captured)
        else:  # untimed, as the capture was
            await replay(self.channel, [ids if self.stores else self.replay_ids])
        if self.stores:
            self.replay_ids = ids  # all trial ids have the same length: the same bytes are expected
        for mode in REPLAY_MODES:
            calls = [self.replay_ids] if mode == "replay_one_call" else [[t] for t in self.replay_ids]
            window = Window(self.server.process.pid)
            with window.measure():
                replies, size = await replay(self.channel, calls)
            self.phases[mode].append(window.figures(replies))
            if replies != self.workload.samples or size != self.expected_bytes:
                self.problems.append(
                    f"{self.name} {mode} round {round_ + 1}: {replies} replies of {size} bytes, expected "
                    f"{self.workload.samples} of {self.expected_bytes}"
                )
        self._rss_phase("replay")
        return captured

    def _rss_phase(self, ended: str | None) -> None:
        """Record the peak RSS of the phase that `ended` (None: one begins)."""
        if self.sampler is None:
            return
        if ended is not None:
            peak = max(self.rss_peak_mib.get(ended, 0.0), self.sampler.peak / MiB)
            self.rss_peak_mib[ended] = round(peak, 1)
        self.sampler.reset()

    def figures(self) -> dict[str, Any]:
        return {name: median_phase(runs) for name, runs in self.phases.items()}


# ---- the baseline: a bare grpc.aio server (subprocess `_bare CAPTURE_FILE`) ----


def write_capture(path: Path, frames: Sequence[bytes]) -> None:
    with path.open("wb") as out:
        for frame in frames:
            out.write(FRAME_LENGTH.pack(len(frame)))
            out.write(frame)


def read_capture(path: Path) -> list[bytes]:
    data = path.read_bytes()
    frames: list[bytes] = []
    offset = 0
    while offset < len(data):
        (length,) = FRAME_LENGTH.unpack_from(data, offset)
        offset += FRAME_LENGTH.size
        frames.append(data[offset : offset + length])
        offset += length
    return frames


class BareReplay:
    """The captured replies: all of them in the order received (a call naming the same trials in
    the same order gets exactly that stream), and each trial's in its order."""

    def __init__(self, frames: list[bytes]) -> None:
        self.frames = frames
        self.by_trial: dict[str, list[bytes]] = {}
        for frame in frames:
            trial_id = ds.RetrieveSampleReply.FromString(frame).trial_sample.trial_id
            self.by_trial.setdefault(trial_id, []).append(frame)
        self.order = list(self.by_trial)

    def for_trials(self, ids: Sequence[str]) -> list[bytes] | None:
        if list(ids) == self.order:
            return self.frames
        if any(trial_id not in self.by_trial for trial_id in ids):
            return None
        return [frame for trial_id in ids for frame in self.by_trial[trial_id]]


async def bare_main(capture_path: str) -> int:
    samples = BareReplay(read_capture(Path(capture_path)))
    ack = datalog_pb2.RunTrialDatalogOutput()

    async def run_trial_datalog(requests: Any, context: Any) -> Any:
        async for _ in requests:  # deserialized by grpc (request_deserializer)
            yield ack

    async def retrieve_samples(request: ds.RetrieveSamplesRequest, context: Any) -> Any:
        frames = samples.for_trials(request.trial_ids)
        if frames is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "trial not captured")
        for frame in frames or ():
            yield frame  # already encoded: no response serializer

    return await serve_bare(
        (
            grpc.method_handlers_generic_handler(
                DATALOG_SERVICE,
                {
                    "RunTrialDatalog": grpc.stream_stream_rpc_method_handler(
                        run_trial_datalog,
                        request_deserializer=datalog_pb2.RunTrialDatalogInput.FromString,
                        response_serializer=datalog_pb2.RunTrialDatalogOutput.SerializeToString,
                    )
                },
            ),
            grpc.method_handlers_generic_handler(
                DATASTORE_SERVICE,
                {
                    "RetrieveSamples": grpc.unary_stream_rpc_method_handler(
                        retrieve_samples, request_deserializer=ds.RetrieveSamplesRequest.FromString
                    )
                },
            ),
        )
    )


# ---- profiling the datastore (subprocess `_profile PREFIX DATASTORE_ARGS...`) ----


def profiled_main(prefix: str, argv: list[str]) -> int:
    """The datastore under cProfile, each Python thread with its own profile (cProfile only sees
    the thread that enabled it), written to `PREFIX-<n>-<thread>.pstats` once it stopped. The
    profiles count each thread's CPU time, not wall time: waiting (epoll, queues) costs nothing,
    so the tables show where the CPU, the server's limit, goes."""
    from services.datastore.__main__ import main as datastore_main

    profiles: list[tuple[str, cProfile.Profile]] = []
    lock = threading.Lock()
    thread_run = threading.Thread.run

    def run(thread: threading.Thread) -> None:
        profile = cProfile.Profile(time.thread_time)
        with lock:
            profiles.append((thread.name, profile))
        profile.enable()
        try:
            thread_run(thread)
        finally:
            profile.disable()

    threading.Thread.run = run  # type: ignore[method-assign,assignment]
    main_profile = cProfile.Profile(time.thread_time)
    profiles.append(("main", main_profile))
    main_profile.enable()
    try:
        return datastore_main(argv)
    finally:
        main_profile.disable()
        with lock:
            for number, (name, profile) in enumerate(profiles):
                with contextlib.suppress(Exception):  # a thread still running: its profile is partial
                    label = "".join(c if c.isalnum() else "_" for c in name)
                    profile.dump_stats(f"{prefix}-{number}-{label}.pstats")


def profile_tables(workdir: Path, lines: int) -> list[str]:
    """The top functions of each profiled thread, by own time then by cumulative time."""
    tables: list[str] = []

    def order(path: Path) -> list[Any]:  # profile-[r<replica>-]<n>-<thread>, numbers in order
        return [int(part) if part.isdigit() else part for part in path.stem.split("-")]

    for path in sorted(workdir.glob("profile-*.pstats"), key=order):
        out = io.StringIO()
        stats = pstats.Stats(str(path), stream=out)
        total: float = getattr(stats, "total_tt", 0.0)  # not in the stubs
        if total < 0.05:  # an idle thread
            continue
        stats.strip_dirs()
        out.write(f"==== {path.name}: {total:.2f} s of CPU\n")
        stats.sort_stats("tottime").print_stats(lines)
        stats.sort_stats("cumulative").print_stats(lines)
        tables.append(out.getvalue())
    return tables


# ---- the orchestrator ----


def median_phase(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median over the rounds of every figure of a phase, and each round's rate."""
    figures: dict[str, Any] = {}
    for key in runs[0]:
        values = [run[key] for run in runs if run[key] is not None]
        figures[key] = round(statistics.median(values), 1) if values else None
    figures["samples_per_s_each"] = [run["samples_per_s"] for run in runs]
    return figures


def compare(datastore: Session, bare: Session) -> dict[str, dict[str, Any]]:
    """Per phase: datastore/bare rates paired round by round (the two ran back to back, so a
    drifting background load weighs on both), and the ratio of server CPU per sample."""
    ratios: dict[str, dict[str, Any]] = {}
    for phase, target in TARGETS.items():
        pairs = [
            d["samples_per_s"] / b["samples_per_s"]
            for d, b in zip(datastore.phases[phase], bare.phases[phase], strict=True)
        ]
        ratio = round(statistics.median(pairs), 3)
        d_cpu = median_phase(datastore.phases[phase])["server_cpu_us_per_sample"]
        b_cpu = median_phase(bare.phases[phase])["server_cpu_us_per_sample"]
        ratios[phase] = {
            "ratio": ratio,
            "each_round": [round(pair, 3) for pair in pairs],
            "target": target,
            "verdict": "met" if ratio >= target else "missed",
            # What the ratio would be if both servers used their CPU fully (no client limit).
            "server_cpu_ratio": round(b_cpu / d_cpu, 3) if d_cpu and b_cpu else None,
        }
    return ratios


async def measure(
    args: argparse.Namespace,
    plan: Plan,
    datastore: Child,
    sampler: RssSampler,
    workload: Workload,
    streams: Sequence[list[bytes]],
    warmup_stream: list[bytes],
) -> list[Session]:
    """The datastore's first round (whose replies the baseline then serves), the baseline's, then
    the other rounds, alternating which server goes first."""
    tag = secrets.token_hex(3)
    sessions = [Session("datastore", datastore, workload, tag, None, sampler)]
    try:
        await sessions[0].warm_up(warmup_stream)
        captured = await sessions[0].round(0, streams)
        assert captured is not None
        if not args.skip_bare:
            capture_path = plan.workdir / "capture.bin"
            write_capture(capture_path, captured)
            print("starting the bare grpc.aio baseline...", file=sys.stderr)
            command = [sys.executable, str(SCRIPT), "_bare", str(capture_path)]
            bare = await asyncio.to_thread(start_server, plan, "bare", command)
            replays = (sessions[0].replay_ids, sessions[0].expected_bytes)
            sessions.append(Session("bare", bare, workload, tag, replays))
            await sessions[1].warm_up(warmup_stream)
            await sessions[1].round(0, streams)
        for round_ in range(1, args.rounds):
            for session in sessions if round_ % 2 == 0 else reversed(sessions):
                await session.round(round_, streams)
    finally:
        await asyncio.gather(*(session.channel.close() for session in sessions))
    return sessions


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    plan = pinned_plan(args, workdir, "", not args.no_pin)  # no token: the datastore has none
    server_cpus, client_cpus = plan.server_cpus, plan.client_cpus
    database_url = args.database_url or f"sqlite+aiosqlite:///{workdir / 'bench.db'}"
    database = database_url.split(":", 1)[0]
    workload = Workload(args.trials, args.ticks, args.actors, args.observation_bytes, args.action_bytes)
    rng = random.Random(args.seed)
    streams = [datalog_stream(workload, workload.ticks, rng) for _ in range(workload.trials)]
    warmup_stream = datalog_stream(workload, args.warmup_ticks, rng)
    report: dict[str, Any] = {
        "bench": "datastore",
        "database": database,
        "cpus": (
            f"server on CPU {sorted(server_cpus)}, client on {sorted(client_cpus)}"
            if server_cpus and client_cpus
            else f"not pinned, {os.cpu_count()} CPUs"
        ),
        "python": sys.version.split()[0],
        "grpc": grpc.__version__,
        "args": vars(args),
        "datalog_message_bytes": round(statistics.mean(len(frame) for frame in streams[0][1:]), 1),
    }
    datastore_args = [
        "--port", "0", "--bind_address", "127.0.0.1", "--log_format", "json",
        "--data_dir", str(workdir / "data"), "--database_url", database_url,
    ]  # fmt: skip
    if args.server_log_level:
        datastore_args += ["--log_level", args.server_log_level]
    datastore_args += args.server_arg
    if args.profile:
        command = [sys.executable, str(SCRIPT), "_profile", str(workdir / "profile"), *datastore_args]
    else:
        command = [sys.executable, "-m", "services.datastore", *datastore_args]
    datastore = start_server(plan, "datastore", command)
    pid = datastore.process.pid
    sampler = RssSampler(pid, RSS_INTERVAL_S)
    report["datastore_rss_start_mib"] = round(sampler.baseline / MiB, 1)
    print(f"datastore serving on {datastore.address} ({database})...", file=sys.stderr)
    try:
        sessions = asyncio.run(measure(args, plan, datastore, sampler, workload, streams, warmup_stream))
    finally:
        sampler.stop()
    hwm = {session.name: vm_hwm(session.server.process.pid) for session in sessions}
    report["datastore_rss_end_mib"] = round((vm_rss(pid) or 0) / MiB, 1)
    report["vm_hwm_mib"] = {
        name: None if value is None else round(value / MiB, 1) for name, value in hwm.items()
    }
    report["datastore_rss_peak_mib"] = sessions[0].rss_peak_mib
    report["problems"] = [problem for session in sessions for problem in session.problems]
    report["server_problems"] = len(datastore.problems)
    report["server_problem_sample"] = [p.get("event") for p in datastore.problems[:5]]
    for session in reversed(sessions):
        status = session.server.stop()
        if session.stores:
            report["datastore_exit_status"] = status
    report["datastore"] = sessions[0].figures()
    report["bare"] = sessions[1].figures() if len(sessions) > 1 else None
    report["ratios"] = compare(*sessions) if len(sessions) > 1 else None
    if args.profile:
        report["profile"] = profile_tables(workdir, args.profile_lines)
    return report


PHASE_LABELS = {
    "ingest": "ingest (DatalogSP)",
    "replay_one_call": "replay, 1 call",
    "replay_per_trial": "replay, 1 call/trial",
}


def print_summary(report: dict[str, Any]) -> None:
    out = sys.stdout
    args = report["args"]
    print("", file=out)
    print(f"Trial Datastore benchmark ({report['database']}, {report['cpus']})", file=out)
    print(
        f"{args['trials']} concurrent trials x {args['ticks']:,} ticks, {args['actors']} actors, "
        f"{args['observation_bytes']}-byte observations, {args['action_bytes']}-byte actions, one reward "
        f"per tick ({report['datalog_message_bytes']:g} bytes per datalog message); {args['rounds']} "
        "round(s), median shown",
        file=out,
    )
    print("", file=out)
    rows = [
        (
            "phase",
            "server",
            "samples/s",
            "each round",
            "srv CPU",
            "srv us/sample",
            "loop us/sample",
            "cli CPU",
        )
    ]
    for phase, label in PHASE_LABELS.items():
        for server in ("datastore", "bare"):
            figures = report[server][phase] if report[server] else None
            if figures is None:
                continue
            rows.append(
                (
                    label,
                    server,
                    fmt(figures["samples_per_s"]),
                    ", ".join(f"{rate:,.0f}" for rate in figures["samples_per_s_each"]),
                    fmt(figures["server_cpu_pct"], "%"),
                    fmt(figures["server_cpu_us_per_sample"]),
                    fmt(figures["loop_cpu_us_per_sample"]),
                    fmt(figures["client_cpu_pct"], "%"),
                )
            )
    print_table(rows, 2, out)
    print("", file=out)
    ratios = report["ratios"] or {}
    for phase, figures in ratios.items():
        bare = report["bare"][phase]
        # A client at full CPU on the baseline means the bare rate is the client's limit: the
        # rate ratio then overstates the datastore, the server CPU ratio does not.
        limited = " (bare run client-bound)" if (bare["client_cpu_pct"] or 0) >= CLIENT_BOUND_PCT else ""
        print(
            f"{PHASE_LABELS[phase] + ' datastore/bare':36} {fmt(figures['ratio']):>6}   target >= "
            f"{figures['target']:g}: {figures['verdict']:6}  "
            f"rounds: {', '.join(map(str, figures['each_round']))}; "
            f"server CPU/sample bare/datastore {fmt(figures['server_cpu_ratio'])}{limited}",
            file=out,
        )
    peaks = report["datastore_rss_peak_mib"]
    hwm = report["vm_hwm_mib"]
    print(
        f"datastore RSS: {report['datastore_rss_start_mib']} MiB once serving, peak "
        f"{peaks.get('ingest')} MiB during ingestion and {peaks.get('replay')} MiB during replay, "
        f"{report['datastore_rss_end_mib']} MiB at the end; peak RSS (VmHWM) {hwm['datastore']} MiB"
        + (f" (bare server: {hwm['bare']} MiB)" if "bare" in hwm else ""),
        file=out,
    )
    for problem in report["problems"]:
        print(f"problem: {problem}", file=out)
    if report["datastore_exit_status"] != 0:
        print(f"the datastore exited with status {report['datastore_exit_status']}", file=out)
    if report["server_problems"]:
        print(
            f"datastore warnings/errors logged: {report['server_problems']} "
            f"(first: {report['server_problem_sample']})",
            file=out,
        )
    if report.get("profile"):
        print("", file=out)
        print("datastore profile (cProfile, per thread; the figures above are slowed by it):", file=out)
        for table in report.pop("profile"):  # long: printed here, left out of the JSON line
            print(table, file=out)
    print("", file=out)


# ---- paced mode: the orchestrator's pace ----

# Targets of the paced mode: datastore/bare server CPU per sample, and the p99 time from a
# sample's write to its acknowledgement.
PACED_CPU_RATIO_TARGET = 1.25
PACED_P99_TARGET_MS = 50.0


async def paced_ingest(
    channels: Sequence[grpc.aio.Channel], ids: Sequence[str], streams: Sequence[list[bytes]], rate: float
) -> list[float]:
    """Every trial's datalog at once, as the orchestrator sends it: `rate` messages per second on
    each stream (its ticks), the streams' ticks spread evenly in time, each stream on the channel
    of its index (replicas), its acknowledgements read as they come. Returns each message's time
    from its write to its acknowledgement, in seconds."""
    latencies: list[float] = []
    start = time.perf_counter() + 0.05

    async def one(index: int, trial_id: str, frames: list[bytes]) -> None:
        method = channels[index % len(channels)].stream_stream(RUN_TRIAL_DATALOG)
        call = method(metadata=(("trial-id", trial_id), ("user-id", USER_ID)), timeout=CALL_TIMEOUT_S)
        written: collections.deque[float] = collections.deque()

        async def read_acknowledgements() -> int:
            acks = 0
            while (reply := await call.read()) is not grpc.aio.EOF:
                assert reply is not None
                latencies.append(time.perf_counter() - written.popleft())
                acks += 1
            return acks

        reading = asyncio.create_task(read_acknowledgements())
        offset = start + index / (rate * len(streams))
        try:
            for tick, frame in enumerate(frames):
                delay = offset + tick / rate - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                written.append(time.perf_counter())
                await call.write(frame)
            await call.done_writing()
            acks = await reading
        except grpc.aio.AioRpcError as error:
            raise rpc_failure(f"RunTrialDatalog of {trial_id}", error) from None
        finally:
            reading.cancel()
        if acks != len(frames):
            raise BenchError(
                f"RunTrialDatalog of {trial_id}: {acks} acknowledgements for {len(frames)} messages"
            )

    await asyncio.gather(*(one(i, t, f) for i, (t, f) in enumerate(zip(ids, streams, strict=True))))
    return latencies


def percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


class PacedSession:
    """One server (or replicas sharing a database) and the figures of its paced rounds."""

    def __init__(self, name: str, servers: Sequence[Child], workload: Workload, tag: str) -> None:
        self.name = name
        self.servers = list(servers)
        self.workload = workload
        self.tag = tag
        self.rounds: list[dict[str, Any]] = []
        self.channels = [grpc.aio.insecure_channel(s.address, options=CHANNEL_OPTIONS) for s in servers]

    def _cpu(self) -> tuple[float | None, float | None]:
        """CPU seconds of every server process, and of their event loops (main threads)."""
        pids = [server.process.pid for server in self.servers]
        total = [cpu_seconds(pid) for pid in pids]
        loops = [cpu_seconds(pid, pid) for pid in pids]
        return (
            None if None in total else sum(t for t in total if t is not None),
            None if None in loops else sum(t for t in loops if t is not None),
        )

    async def warm_up(self, stream: list[bytes], rate: float) -> None:
        for channel in self.channels:
            await asyncio.wait_for(channel.channel_ready(), READY_TIMEOUT_S)
        ids = [f"bench-{self.tag}-{self.name[:4]}-warmup-{n}" for n in range(len(self.channels))]
        await paced_ingest(self.channels, ids, [stream] * len(ids), rate)

    async def round(self, round_: int, streams: Sequence[list[bytes]], rate: float) -> None:
        print(f"  {self.name}: paced round {round_ + 1}...", file=sys.stderr)
        ids = trial_ids(self.tag, self.name, round_, self.workload.trials)
        cpu_before, loop_before = self._cpu()
        started = time.perf_counter()
        latencies = await paced_ingest(self.channels, ids, streams, rate)
        seconds = time.perf_counter() - started
        cpu_after, loop_after = self._cpu()
        samples = len(latencies)

        def per_sample(after: float | None, before: float | None) -> float | None:
            return None if after is None or before is None else round((after - before) * 1e6 / samples, 1)

        self.rounds.append(
            {
                "samples": samples,
                "samples_per_s": round(samples / seconds, 1),
                "server_cpu_us_per_sample": per_sample(cpu_after, cpu_before),
                "loop_cpu_us_per_sample": per_sample(loop_after, loop_before),
                "ack_p50_ms": round(percentile(latencies, 0.5) * 1000, 2),
                "ack_p99_ms": round(percentile(latencies, 0.99) * 1000, 2),
                "ack_max_ms": round(max(latencies) * 1000, 2),
            }
        )

    def figures(self) -> dict[str, Any]:
        return median_phase(self.rounds)


async def measure_paced(
    args: argparse.Namespace,
    plan: Plan,
    datastores: list[Child],
    workload: Workload,
    streams: list[list[bytes]],
    warmup: list[bytes],
) -> list[PacedSession]:
    tag = secrets.token_hex(3)
    rate = args.rate / args.trials  # ticks per second of each stream
    sessions = [PacedSession("datastore", datastores, workload, tag)]
    try:
        if not args.skip_bare:
            capture_path = plan.workdir / "capture.bin"
            write_capture(capture_path, [])  # nothing to replay: the bare server only receives
            command = [sys.executable, str(SCRIPT), "_bare", str(capture_path)]
            # As many bare receivers as replicas, each given the same share of the streams: a
            # process's cost per message grows as its load falls (fewer events per loop turn).
            bares = [
                await asyncio.to_thread(start_server, plan, f"bare-{replica}", command)
                for replica in range(len(datastores))
            ]
            sessions.append(PacedSession("bare", bares, workload, tag))
        for session in sessions:
            await session.warm_up(warmup, rate)
        for round_ in range(args.rounds):
            for session in sessions if round_ % 2 == 0 else reversed(sessions):
                await session.round(round_, streams, rate)
    finally:
        await asyncio.gather(*(c.close() for session in sessions for c in session.channels))
    return sessions


def run_paced(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    plan = pinned_plan(args, workdir, "", not args.no_pin)
    database_url = args.database_url or f"sqlite+aiosqlite:///{workdir / 'bench.db'}"
    if args.replicas > 1 and not database_url.startswith("postgresql"):
        raise BenchError("--replicas above 1 needs a PostgreSQL --database_url (replicas share it)")
    workload = Workload(args.trials, args.ticks, args.actors, args.observation_bytes, args.action_bytes)
    rng = random.Random(args.seed)
    streams = [datalog_stream(workload, workload.ticks, rng) for _ in range(workload.trials)]
    warmup = datalog_stream(workload, args.warmup_ticks, rng)
    datastores = []
    for replica in range(args.replicas):
        datastore_args = [
            "--port", "0", "--bind_address", "127.0.0.1", "--log_format", "json",
            "--data_dir", str(workdir / f"data-{replica}"), "--database_url", database_url,
            *(["--log_level", args.server_log_level] if args.server_log_level else []), *args.server_arg,
        ]  # fmt: skip
        if args.profile:
            prefix = str(workdir / f"profile-r{replica}")
            command = [sys.executable, str(SCRIPT), "_profile", prefix, *datastore_args]
        else:
            command = [sys.executable, "-m", "services.datastore", *datastore_args]
        datastores.append(start_server(plan, f"datastore-{replica}", command))
    print(f"{args.replicas} datastore(s) serving ({database_url.split(':', 1)[0]})...", file=sys.stderr)
    sessions = asyncio.run(measure_paced(args, plan, datastores, workload, streams, warmup))
    report: dict[str, Any] = {
        "bench": "datastore-paced",
        "database": database_url.split(":", 1)[0],
        "cpus": f"servers on CPU {sorted(plan.server_cpus)}" if plan.server_cpus else "not pinned",
        "args": vars(args),
        "datalog_message_bytes": round(statistics.mean(len(frame) for frame in streams[0][1:]), 1),
        "sessions": {session.name: session.figures() for session in sessions},
        "server_problems": sum(len(server.problems) for server in datastores),
    }
    if len(sessions) > 1:
        d_cpu = report["sessions"]["datastore"]["server_cpu_us_per_sample"]
        b_cpu = report["sessions"]["bare"]["server_cpu_us_per_sample"]
        report["cpu_ratio"] = round(d_cpu / b_cpu, 3) if d_cpu and b_cpu else None
    for session in reversed(sessions):
        for server in session.servers:
            server.stop()
    if args.profile:
        report["profile"] = profile_tables(workdir, args.profile_lines)
    return report


def print_paced_summary(report: dict[str, Any]) -> None:
    args = report["args"]
    print("", file=sys.stdout)
    print(
        f"Trial Datastore at the orchestrator's pace ({report['database']}, {args['replicas']} replica(s), "
        f"{report['cpus']}): {args['trials']} streams at {args['rate']:g} samples/s in all, "
        f"{args['ticks']} ticks each, {args['actors']} actors, {report['datalog_message_bytes']:g} bytes "
        f"per message; {args['rounds']} round(s), median shown",
        file=sys.stdout,
    )
    rows = [
        ("server", "samples/s", "srv us/sample", "loop us/sample", "ack p50 ms", "ack p99 ms", "ack max ms")
    ]
    for name, figures in report["sessions"].items():
        rows.append(
            (
                name,
                fmt(figures["samples_per_s"]),
                fmt(figures["server_cpu_us_per_sample"]),
                fmt(figures["loop_cpu_us_per_sample"]),
                fmt(figures["ack_p50_ms"]),
                fmt(figures["ack_p99_ms"]),
                fmt(figures["ack_max_ms"]),
            )
        )
    print_table(rows, 1, sys.stdout)
    datastore = report["sessions"]["datastore"]
    if report.get("cpu_ratio") is not None:
        verdict = "met" if report["cpu_ratio"] <= PACED_CPU_RATIO_TARGET else "missed"
        print(
            f"server CPU per sample datastore/bare {report['cpu_ratio']}: target <= "
            f"{PACED_CPU_RATIO_TARGET}: {verdict}",
            file=sys.stdout,
        )
    verdict = "met" if datastore["ack_p99_ms"] < PACED_P99_TARGET_MS else "missed"
    print(f"datastore ack p99 {datastore['ack_p99_ms']} ms: target < {PACED_P99_TARGET_MS:g}: {verdict}")
    if report["server_problems"]:
        print(f"datastore warnings/errors logged: {report['server_problems']}", file=sys.stdout)
    for table in report.pop("profile", []):  # long: printed here, left out of the JSON line
        print(table, file=sys.stdout)
    print("", file=sys.stdout)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/datastore.py",
        description="Benchmark the Trial Datastore (datalog ingestion, replay) against a bare grpc.aio "
        "baseline.",
    )
    parser.add_argument(
        "--database_url",
        help="datastore database (default: sqlite+aiosqlite:///<tmpdir>/bench.db); e.g. "
        "postgresql+psycopg://user:password@127.0.0.1/db (trials are added to what is there)",
    )
    parser.add_argument("--trials", type=int, default=8, help="concurrent trials per round")
    parser.add_argument("--ticks", type=int, default=2500, help="samples per trial")
    parser.add_argument("--actors", type=int, default=4, help="actors per trial")
    parser.add_argument("--observation_bytes", type=int, default=256, help="size of each actor's observation")
    parser.add_argument("--action_bytes", type=int, default=16, help="size of each actor's action")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of ingestion and replay per server")
    parser.add_argument("--warmup_ticks", type=int, default=500, help="ticks of the untimed warm-up trial")
    parser.add_argument("--seed", type=int, default=20240601)
    parser.add_argument("--no_pin", action="store_true", help="do not pin the server and the client to CPUs")
    parser.add_argument("--skip_bare", action="store_true", help="no baseline run")
    parser.add_argument("--server_log_level", help="--log_level of the datastore (default: its own, info)")
    parser.add_argument(
        "--server_arg",
        action="append",
        default=[],
        help="an extra flag for the datastore, e.g. --server_arg=--batch_max_samples=2000 (repeatable)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="run the datastore under cProfile (every thread) and print where the time goes; keeps "
        "the temporary directory with the .pstats files",
    )
    parser.add_argument("--profile_lines", type=int, default=25, help="functions shown per profile table")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, database)")
    paced = parser.add_argument_group(
        "paced mode", "the orchestrator's pace: one message per tick on each stream, at a total rate"
    )
    paced.add_argument(
        "--paced",
        action="store_true",
        help="paced ingestion instead of the flood (defaults then: 8 trials x 500 ticks, 2 actors)",
    )
    paced.add_argument("--rate", type=float, default=800.0, help="samples per second, all streams together")
    paced.add_argument(
        "--replicas", type=int, default=1, help="datastores sharing the (PostgreSQL) database, streams spread"
    )
    args = parser.parse_args(argv)
    if args.paced:  # the shape of the orchestrator's trials, unless given
        given = set(argv or [])
        for flag, value in (("ticks", 500), ("actors", 2)):
            if not any(arg.split("=", 1)[0] == f"--{flag}" for arg in given):
                setattr(args, flag, value)
    if args.rate <= 0 or args.replicas < 1:
        parser.error("--rate and --replicas must be positive")
    if min(args.trials, args.ticks, args.actors, args.rounds, args.warmup_ticks, args.profile_lines) < 1:
        parser.error("counts must be positive")
    if args.observation_bytes < 0 or args.action_bytes < 0:
        parser.error("sizes cannot be negative")
    args.keep = args.keep or args.profile
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_bare"]:
        return asyncio.run(bare_main(argv[1]))
    if argv[:1] == ["_profile"]:
        return profiled_main(argv[1], argv[2:])
    args = parse_args(argv)
    if args.paced:
        return run_benchmark(args, "datastore-paced", run_paced, print_paced_summary)
    return run_benchmark(args, "datastore", run, print_summary)


if __name__ == "__main__":
    sys.exit(main())
