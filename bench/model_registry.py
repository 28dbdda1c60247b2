"""Benchmark of the Model Registry's version transfers (gRPC, S3 on SeaweedFS) against S3 used directly.

    .venv/bin/python bench/model_registry.py [--size_mib 1024] [--rounds 2] [--pin] ...

Everything runs on 127.0.0.1, in one run:

1. Starts a private SeaweedFS S3 server (`tests.fixtures.seaweedfs.SeaweedS3`, as the tests do),
   then the registry as users start it (`python -m services.model_registry --port 0 --bind_address
   127.0.0.1 --log_format json`) on a fresh SQLite database in a temporary directory, with
   `--s3_endpoint` and the keys of that server (`--s3_secure=false`, bucket `--s3_bucket`). Its
   port comes from its JSON `serving` log line.
2. Moves a `--size_mib` MiB version up and down both ways, in every one of `--rounds` rounds:
   - registry upload: one CreateVersion stream from this process, as the SDK sends it: a header
     (data_size and SHA-256 set) then bodies of `--chunk_kib` (2 MiB) chunks; timed until the reply
     (the version is committed in the registry's database and its data stored in S3);
   - direct upload: minio's `put_object` of the same bytes to the same server, known length,
     `--part_mib` parts (the registry's own part size), minio's default 3 parallel part uploads,
     from a file-like source;
   - registry download: RetrieveVersionData (the registry's `--sent_version_chunk_size` chunks);
   - direct download: minio's `get_object`, read in chunks of the same size.
   Both downloads check the size and the SHA-256 on the fly (the same work on both sides).
   The data is a random 16 MiB block repeated, never held whole in memory.
3. An untimed warm-up (a full-size object through minio: SeaweedFS allocates its volumes on the
   first writes; a small version through the registry) comes first. In even rounds the registry
   goes first in each direction, in odd rounds minio. Medians over the rounds are reported, with
   the ratios registry/direct (targets: upload >= 0.7, download >= 0.8), also as the median of the
   per-round ratios (the two sides ran back to back).

4. The RL fan-out (`--fanout`, default 1, 8 and 32 actors; a `--fanout_size_mib` (50 MiB)
   version), with actors as RL runs have them: processes of their own (this script's `_actor`
   mode), each with its own connections, checking what it receives on the fly. "Direct": N of them
   read the same object from S3 with minio at once. Then N of them follow a model with
   `VersionUpdate`; a learner (this process) publishes a version (untimed) and each actor, told of
   it, downloads it: "cold" is the time from the publication's reply until every actor has checked
   the whole version (the registry reads it from S3 once, sending it as it arrives). "Warm" is the
   same N downloads again, from the registry's memory. Times are read on each actor's clock
   (perf_counter, the host's monotonic clock). Ratios are direct time / registry time (targets:
   one actor cold >= 0.8, eight cold >= 0.7). Earlier versions ran the actors as coroutines of
   one process, which measured that process's single core rather than the registry once several
   actors shared it.

The registry's RSS is sampled from /proc/<pid>/status (VmRSS) by a thread every `--rss_interval_ms`
during each phase: "RSS growth" is the phase's peak minus the value at its start (target < 100 MiB
at 1 GiB; the direct phases are a control: the registry is idle then). CPU time per MiB moved
(user + system, all threads, from /proc) is shown for the registry, SeaweedFS and this process
(the client side), which tells where a transfer spends its CPU.

CPUs: by default nothing is pinned (the registry, SeaweedFS and this process share every CPU, as
they would on a small host). With `--pin` (two CPUs or more) the registry is pinned to the first
CPU and this process to the others; SeaweedFS is never pinned.

Targets are shown, never asserted: the exit status is 0 whenever the benchmark itself ran. The
last line of standard output is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

SCRIPT = Path(__file__).resolve()
if str(SCRIPT.parents[1]) not in sys.path:  # run as a script: `tests` and `bench` are not installed packages
    sys.path.insert(0, str(SCRIPT.parents[1]))

import grpc  # noqa: E402
from minio import Minio  # noqa: E402

from bench.common import (  # noqa: E402
    BLOCK_SIZE,
    START_TIMEOUT_S,
    BenchError,
    Child,
    MiB,
    RssSampler,
    chunks_of,
    cpu_seconds,
    direct_download,
    direct_upload,
    emit,
    pinned_plan,
    run_benchmark,
    sha256_b64,
    start_server,
    stdin_lines,
    vm_hwm,
    vm_rss,
)
from services.model_registry.blobstore import DEFAULT_PART_SIZE  # noqa: E402
from shared.api import model_registry_pb2 as mr  # noqa: E402
from shared.api import model_registry_pb2_grpc  # noqa: E402
from tests.fixtures.seaweedfs import SeaweedS3  # noqa: E402

TARGET_UPLOAD_RATIO = 0.7
TARGET_DOWNLOAD_RATIO = 0.8
TARGET_RSS_GROWTH_MIB = 100.0
# One actor on a cold version, eight actors following VersionUpdate: registry / direct throughput.
TARGET_FANOUT_RATIOS = {1: 0.8, 8: 0.7}
RPC_TIMEOUT_S = 30.0
WARMUP_VERSION_MIB = 32
MAX_RECEIVE_MESSAGE_BYTES = 64 * MiB
BUCKET_DIRECT = "bench-direct"
PHASES = ("registry_upload", "direct_upload", "registry_download", "direct_download")


# ---- data ----


class Checker:
    """Size and SHA-256 of received data, checked on the fly."""

    def __init__(self) -> None:
        self.size = 0
        self._hasher = hashlib.sha256()

    def update(self, chunk: bytes) -> None:
        self.size += len(chunk)
        self._hasher.update(chunk)

    def check(self, what: str, size: int, sha256: str) -> None:
        got = base64.b64encode(self._hasher.digest()).decode("ascii")
        if self.size != size or got != sha256:
            raise BenchError(f"{what}: received {self.size} bytes hashing {got}, expected {size} / {sha256}")


# ---- measurements ----


@dataclass
class Processes:
    registry: int
    weed: int | None
    sampler: RssSampler
    results: dict[str, list[dict[str, float]]] = field(default_factory=lambda: {p: [] for p in PHASES})

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        into: dict[str, float] = {}
        start_rss = self.sampler.reset()
        cpu_before = self._cpu()
        began = time.perf_counter()
        yield
        into["seconds"] = time.perf_counter() - began
        peak = self.sampler.peak_now()
        for key, (before, after) in zip(
            ("registry", "weed", "client"), zip(cpu_before, self._cpu(), strict=True), strict=True
        ):
            into[f"{key}_cpu_seconds"] = (
                (after - before) if before is not None and after is not None else -1.0
            )
        into["rss_start_mib"] = start_rss / MiB
        into["rss_growth_mib"] = (peak - start_rss) / MiB
        into["rss_over_baseline_mib"] = (peak - self.sampler.baseline) / MiB
        into["rss_samples"] = self.sampler.samples
        self.results[name].append(into)

    def _cpu(self) -> tuple[float | None, float | None, float | None]:
        weed = cpu_seconds(self.weed) if self.weed is not None else None
        return cpu_seconds(self.registry), weed, time.process_time()


# ---- the transfers ----


async def registry_upload(
    stub: model_registry_pb2_grpc.ModelRegistrySPStub,
    model_id: str,
    block: bytes,
    size: int,
    sha256: str,
    chunk_size: int,
) -> mr.ModelVersionInfo:
    header = mr.CreateVersionRequestChunk(
        header=mr.CreateVersionRequestChunk.Header(
            version_info=mr.ModelVersionInfo(
                model_id=model_id, archived=True, data_size=size, data_hash=sha256
            )
        )
    )
    call = stub.CreateVersion()
    await call.write(header)
    for chunk in chunks_of(block, size, chunk_size):
        await call.write(
            mr.CreateVersionRequestChunk(body=mr.CreateVersionRequestChunk.Body(data_chunk=chunk))
        )
    await call.done_writing()
    reply = cast(mr.CreateVersionReply, await call)
    info = reply.version_info
    if info.data_size != size or info.data_hash != sha256:
        raise BenchError(f"the registry stored {info.data_size} bytes hashing {info.data_hash}")
    return info


async def registry_download(
    stub: model_registry_pb2_grpc.ModelRegistrySPStub, model_id: str, version: int
) -> Checker:
    checker = Checker()
    replies = cast(
        AsyncIterator[mr.RetrieveVersionDataReplyChunk],
        stub.RetrieveVersionData(mr.RetrieveVersionDataRequest(model_id=model_id, version_number=version)),
    )
    async for reply in replies:
        checker.update(reply.data_chunk)
    return checker


async def create_model(stub: model_registry_pb2_grpc.ModelRegistrySPStub, model_id: str) -> None:
    await stub.CreateOrUpdateModel(
        mr.CreateOrUpdateModelRequest(model_info=mr.ModelInfo(model_id=model_id)), timeout=RPC_TIMEOUT_S
    )


async def delete_model(stub: model_registry_pb2_grpc.ModelRegistrySPStub, model_id: str) -> None:
    await stub.DeleteModel(mr.DeleteModelRequest(model_id=model_id), timeout=RPC_TIMEOUT_S)


# ---- the run ----


def registry_command(args: argparse.Namespace, workdir: Path, s3: SeaweedS3) -> list[str]:
    """The registry as users start it, on a fresh SQLite database, storing in the S3 server `s3`."""
    command = [
        sys.executable, "-m", "services.model_registry",
        "--port", "0", "--bind_address", "127.0.0.1", "--log_format", "json",
        "--database_url", f"sqlite+aiosqlite:///{workdir / 'registry.db'}",
        "--s3_endpoint", s3.endpoint,
        "--s3_access_key", s3.access_key,
        "--s3_secret_key", s3.secret_key,
        "--s3_secure=false",
        "--s3_bucket", args.s3_bucket,
        "--sent_version_chunk_size", str(args.read_chunk_kib * 1024),
    ]  # fmt: skip
    if args.server_log_level:
        command += ["--log_level", args.server_log_level]
    return command


async def transfer_rounds(args: argparse.Namespace, s3: SeaweedS3, registry: Child, procs: Processes) -> None:
    size = args.size_mib * MiB
    part_size = args.part_mib * MiB
    chunk_size = args.chunk_kib * 1024
    read_chunk = args.read_chunk_kib * 1024
    block = os.urandom(BLOCK_SIZE)
    sha256 = sha256_b64(block, size)
    client = Minio(s3.endpoint, s3.access_key, s3.secret_key, secure=False)
    if not await asyncio.to_thread(client.bucket_exists, BUCKET_DIRECT):
        await asyncio.to_thread(client.make_bucket, BUCKET_DIRECT)
    channel = grpc.aio.insecure_channel(
        registry.address, options=[("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES)]
    )
    try:
        stub = model_registry_pb2_grpc.ModelRegistrySPStub(channel)
        await asyncio.wait_for(channel.channel_ready(), START_TIMEOUT_S)

        print("warm-up (untimed)...", file=sys.stderr)
        await asyncio.to_thread(direct_upload, client, BUCKET_DIRECT, "warmup", block, size, part_size)
        await asyncio.to_thread(
            direct_download, client, BUCKET_DIRECT, "warmup", read_chunk, Checker().update
        )
        await asyncio.to_thread(client.remove_object, BUCKET_DIRECT, "warmup")
        warm_size = min(size, WARMUP_VERSION_MIB * MiB)
        await create_model(stub, "bench-warmup")
        info = await registry_upload(
            stub, "bench-warmup", block, warm_size, sha256_b64(block, warm_size), chunk_size
        )
        await registry_download(stub, "bench-warmup", info.version_number)
        await delete_model(stub, "bench-warmup")

        async def phase(name: str, round_: int) -> None:
            model_id, object_name = f"bench-{round_}", f"direct-{round_}"
            if name == "registry_upload":
                with procs.phase(name):
                    await registry_upload(stub, model_id, block, size, sha256, chunk_size)
            elif name == "direct_upload":
                with procs.phase(name):
                    await asyncio.to_thread(
                        direct_upload, client, BUCKET_DIRECT, object_name, block, size, part_size
                    )
            elif name == "registry_download":
                with procs.phase(name):
                    checker = await registry_download(stub, model_id, 1)
                checker.check(name, size, sha256)
            else:
                checker = Checker()
                with procs.phase(name):
                    await asyncio.to_thread(
                        direct_download, client, BUCKET_DIRECT, object_name, read_chunk, checker.update
                    )
                checker.check(name, size, sha256)
            last = procs.results[name][-1]
            print(
                f"  {name}: {args.size_mib / last['seconds']:.0f} MiB/s, "
                f"registry RSS growth {last['rss_growth_mib']:.1f} MiB",
                file=sys.stderr,
            )

        for round_ in range(args.rounds):
            print(f"round {round_ + 1}/{args.rounds}...", file=sys.stderr)
            await create_model(stub, f"bench-{round_}")
            # Alternating who goes first: neither side always meets a server just written to.
            first, second = ("registry", "direct") if round_ % 2 == 0 else ("direct", "registry")
            for direction in ("upload", "download"):
                await phase(f"{first}_{direction}", round_)
                await phase(f"{second}_{direction}", round_)
            await delete_model(stub, f"bench-{round_}")
            await asyncio.to_thread(client.remove_object, BUCKET_DIRECT, f"direct-{round_}")
    finally:
        await channel.close()


class Actors:
    """`count` actor processes (`_actor` mode of this script), as the actors of an RL run are
    processes of their own: the same ones fetch from S3 directly and through the registry."""

    def __init__(self, count: int, config: dict[str, Any], workdir: Path) -> None:
        self.children = [
            Child(
                f"actor-{index}",
                [sys.executable, str(SCRIPT), "_actor", json.dumps(config)],
                messages_on="stdout",
                cpus=None,
                log_path=workdir / f"actor-{index}.log",
            )
            for index in range(count)
        ]
        for child in self.children:
            child.expect("ready", START_TIMEOUT_S)

    def run(self, actors: int, command: dict[str, Any], began: float | None = None) -> float:
        """Have the first `actors` do `command`; seconds from `began` (default: now) until the
        last of them had all of it (by their own clocks: perf_counter is the host's)."""
        chosen = self.children[:actors]
        began = time.perf_counter() if began is None else began
        for child in chosen:
            child.send(command)
        finished = [child.expect("done", RPC_TIMEOUT_S) for child in chosen]
        for child, message in zip(chosen, finished, strict=True):
            if message.get("error"):
                raise BenchError(f"{child.name}: {message['error']}", child)
        return float(max(message["done"] for message in finished)) - began

    def follow(self, actors: int, model_id: str) -> None:
        for child in self.children[:actors]:
            child.send({"do": "follow", "model_id": model_id})
        for child in self.children[:actors]:
            child.expect("following", RPC_TIMEOUT_S)

    def stop(self) -> None:
        for child in self.children:
            child.stop(exit_wait_s=2.0)


def fanout_rounds(
    args: argparse.Namespace, s3: SeaweedS3, registry: Child, sampler: RssSampler, workdir: Path
) -> list[dict[str, Any]]:
    """The RL fan-out, for each N of `--fanout`: direct, cold and warm (see the module's docstring)."""
    size = args.fanout_size_mib * MiB
    block = os.urandom(BLOCK_SIZE)
    sha256 = sha256_b64(block, size)
    config = {
        "registry": registry.address,
        "s3": [s3.endpoint, s3.access_key, s3.secret_key],
        "chunk": args.read_chunk_kib * 1024,
        "size": size,
        "sha256": sha256,
    }
    client = Minio(s3.endpoint, s3.access_key, s3.secret_key, secure=False)
    if not client.bucket_exists(BUCKET_DIRECT):
        client.make_bucket(BUCKET_DIRECT)
    actors = Actors(max(args.fanout), config, workdir)
    # The learner, in this process: its channel lives on this loop, run between the actors' steps.
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    channel = grpc.aio.insecure_channel(registry.address)
    learner = model_registry_pb2_grpc.ModelRegistrySPStub(channel)
    results = []
    try:
        for count in args.fanout:
            name = model_id = f"fanout-{count}"
            direct_upload(client, BUCKET_DIRECT, name, block, size, args.part_mib * MiB)
            direct_s = actors.run(count, {"do": "direct", "bucket": BUCKET_DIRECT, "name": name})
            client.remove_object(BUCKET_DIRECT, name)

            loop.run_until_complete(create_model(learner, model_id))
            actors.follow(count, model_id)
            time.sleep(0.5)  # every actor's VersionUpdate stream is open on the registry
            start_rss = sampler.reset()
            loop.run_until_complete(
                registry_upload(learner, model_id, block, size, sha256, args.chunk_kib * 1024)
            )
            cold_s = actors.run(count, {"do": "fetch_announced"}, began=time.perf_counter())
            warm_s = actors.run(count, {"do": "download", "model_id": model_id, "version": 1})
            growth = (sampler.peak_now() - start_rss) / MiB
            loop.run_until_complete(delete_model(learner, model_id))
            result = {
                "actors": count,
                "direct_s": round(direct_s, 3),
                "cold_s": round(cold_s, 3),
                "warm_s": round(warm_s, 3),
                "cold_ratio": round(direct_s / cold_s, 3),
                "warm_ratio": round(direct_s / warm_s, 3),
                "registry_rss_growth_mib": round(growth, 1),
            }
            print(f"  fan-out {result}", file=sys.stderr)
            results.append(result)
    finally:
        loop.run_until_complete(channel.close())
        asyncio.set_event_loop(None)
        loop.close()
        actors.stop()
    return results


async def actor_main(config: dict[str, Any]) -> int:
    """`_actor CONFIG`: one actor of the fan-out. Told on stdin what to fetch (`direct` from S3,
    `follow` a model then `fetch_announced` the version VersionUpdate announces, or `download` a
    version), it reads it whole, checking its size and SHA-256, and answers on stdout with the
    time it had all of it."""
    loop = asyncio.get_running_loop()
    lines = stdin_lines(loop)
    endpoint, access_key, secret_key = config["s3"]
    client = Minio(endpoint, access_key, secret_key, secure=False)
    options = [("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES)]
    channel = grpc.aio.insecure_channel(config["registry"], options=options)
    stub = model_registry_pb2_grpc.ModelRegistrySPStub(channel)
    update: Any = None
    emit({"ready": True})
    while line := await lines.get():
        command = json.loads(line)
        if command["do"] == "follow":
            update = stub.VersionUpdate(mr.VersionUpdateRequest(model_id=command["model_id"]))
            emit({"following": True})
            continue
        checker = Checker()
        try:
            if command["do"] == "direct":
                await asyncio.to_thread(
                    direct_download,
                    client,
                    command["bucket"],
                    command["name"],
                    config["chunk"],
                    checker.update,
                )
            elif command["do"] == "fetch_announced":
                info = (await update.read()).version_info
                checker = await registry_download(stub, info.model_id, info.version_number)
                update.cancel()
            else:
                checker = await registry_download(stub, command["model_id"], command["version"])
            done = time.perf_counter()
            checker.check(command["do"], config["size"], config["sha256"])
            emit({"done": done})
        except Exception as error:
            emit({"done": time.perf_counter(), "error": f"{type(error).__name__}: {error}"})
    await channel.close()
    return 0


def summarize(args: argparse.Namespace, procs: Processes, report: dict[str, Any]) -> None:
    phases = procs.results
    report["phases"] = {}
    for name, runs in phases.items():
        seconds = statistics.median(r["seconds"] for r in runs)

        def per_mib(key: str, runs: list[dict[str, float]] = runs) -> float | None:
            values = [r[key] for r in runs if r[key] >= 0]
            return round(statistics.median(values) * 1000 / args.size_mib, 3) if values else None

        report["phases"][name] = {
            "mib_per_s": round(args.size_mib / seconds, 1),
            "mib_per_s_each": [round(args.size_mib / r["seconds"], 1) for r in runs],
            "seconds_each": [round(r["seconds"], 3) for r in runs],
            "registry_rss_growth_mib": round(max(r["rss_growth_mib"] for r in runs), 1),
            "registry_rss_over_baseline_mib": round(max(r["rss_over_baseline_mib"] for r in runs), 1),
            "registry_rss_samples": min(int(r["rss_samples"]) for r in runs),
            "registry_cpu_ms_per_mib": per_mib("registry_cpu_seconds"),
            "weed_cpu_ms_per_mib": per_mib("weed_cpu_seconds"),
            "client_cpu_ms_per_mib": per_mib("client_cpu_seconds"),
        }
    p = report["phases"]
    report["upload_ratio"] = round(p["registry_upload"]["mib_per_s"] / p["direct_upload"]["mib_per_s"], 3)
    report["download_ratio"] = round(
        p["registry_download"]["mib_per_s"] / p["direct_download"]["mib_per_s"], 3
    )
    for direction in ("upload", "download"):
        registry_runs, direct_runs = phases[f"registry_{direction}"], phases[f"direct_{direction}"]
        report[f"{direction}_ratio_paired"] = round(
            statistics.median(
                d["seconds"] / r["seconds"] for r, d in zip(registry_runs, direct_runs, strict=True)
            ),
            3,
        )
    growth = max(
        p["registry_upload"]["registry_rss_growth_mib"], p["registry_download"]["registry_rss_growth_mib"]
    )
    report["registry_rss_growth_mib"] = growth
    report["targets"] = {
        "upload ratio": "met" if report["upload_ratio"] >= TARGET_UPLOAD_RATIO else "missed",
        "download ratio": "met" if report["download_ratio"] >= TARGET_DOWNLOAD_RATIO else "missed",
        "registry RSS growth": "met" if growth < TARGET_RSS_GROWTH_MIB else "missed",
    }


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    plan = pinned_plan(args, workdir, "", args.pin)  # no token: the registry has none
    registry_cpus, client_cpus = plan.server_cpus, plan.client_cpus
    report: dict[str, Any] = {
        "bench": "model_registry",
        "size_mib": args.size_mib,
        "rounds": args.rounds,
        "chunk_kib": args.chunk_kib,
        "read_chunk_kib": args.read_chunk_kib,
        "part_mib": args.part_mib,
        "fanout_size_mib": args.fanout_size_mib,
        "cpus": (
            f"registry on CPU {sorted(registry_cpus)}, this process on {sorted(client_cpus)}, "
            "SeaweedFS unpinned"
            if registry_cpus and client_cpus
            else f"not pinned, {len(os.sched_getaffinity(0))} CPUs"
        ),
        "python": sys.version.split()[0],
        "grpc": grpc.__version__,
    }
    print("starting SeaweedFS...", file=sys.stderr)
    with SeaweedS3() as s3:
        weed = getattr(s3, "_proc", None)
        weed_pid = weed.pid if weed is not None else None
        registry = start_server(plan, "model_registry", registry_command(args, workdir, s3))
        print(f"registry serving on {registry.address}, S3 on {s3.endpoint}", file=sys.stderr)
        sampler = RssSampler(registry.process.pid, args.rss_interval_ms / 1000)
        procs = Processes(registry.process.pid, weed_pid, sampler)
        report["registry_rss_start_mib"] = round(sampler.baseline / MiB, 1)
        try:
            asyncio.run(transfer_rounds(args, s3, registry, procs))
            if args.fanout:
                print("fan-out...", file=sys.stderr)
                report["fanout"] = fanout_rounds(args, s3, registry, sampler, workdir)
            hwm = vm_hwm(registry.process.pid)
            report["registry_vm_hwm_mib"] = round(hwm / MiB, 1) if hwm is not None else None
            report["registry_rss_end_mib"] = round((vm_rss(registry.process.pid) or 0) / MiB, 1)
        finally:
            sampler.stop()
            report["registry_problems"] = [m.get("event") for m in registry.problems[:5]]
            report["registry_exit_status"] = registry.stop()
    report["client_max_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    summarize(args, procs, report)
    return report


def print_summary(report: dict[str, Any], out: Any = sys.stdout) -> None:
    print("", file=out)
    print(
        f"Model registry benchmark: {report['size_mib']} MiB version, {report['rounds']} round(s), "
        f"{report['chunk_kib']} KiB chunks up / {report['read_chunk_kib']} KiB down, "
        f"{report['part_mib']} MiB S3 parts; SeaweedFS on the same host; {report['cpus']}",
        file=out,
    )
    print("", file=out)
    header = (
        f"{'phase':18} {'MiB/s (median)':>14} {'each round':>18} {'registry RSS growth MiB':>24} "
        f"{'CPU ms/MiB: registry':>21} {'weed':>6} {'client':>7}"
    )
    print(header, file=out)
    print("-" * len(header), file=out)

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    for name, phase in report["phases"].items():
        each = ", ".join(f"{v:.0f}" for v in phase["mib_per_s_each"])
        print(
            f"{name:18} {phase['mib_per_s']:>14.1f} {each:>18} {phase['registry_rss_growth_mib']:>24.1f} "
            f"{ms(phase['registry_cpu_ms_per_mib']):>21} {ms(phase['weed_cpu_ms_per_mib']):>6} "
            f"{ms(phase['client_cpu_ms_per_mib']):>7}",
            file=out,
        )
    print("", file=out)
    targets = report["targets"]
    print(
        f"upload ratio registry/direct   {report['upload_ratio']:>6.2f}   target >= {TARGET_UPLOAD_RATIO}: "
        f"{targets['upload ratio']}   (median of per-round ratios {report['upload_ratio_paired']:.2f})",
        file=out,
    )
    print(
        f"download ratio registry/direct {report['download_ratio']:>6.2f}   target >= "
        f"{TARGET_DOWNLOAD_RATIO}: {targets['download ratio']}   "
        f"(median of per-round ratios {report['download_ratio_paired']:.2f})",
        file=out,
    )
    print(
        f"registry peak RSS growth (MiB) {report['registry_rss_growth_mib']:>6.1f}   target < "
        f"{TARGET_RSS_GROWTH_MIB:g} (at 1 GiB): {targets['registry RSS growth']}",
        file=out,
    )
    for fanout in report.get("fanout", []):
        actors = fanout["actors"]
        target = TARGET_FANOUT_RATIOS.get(actors)
        verdict = (
            f"target >= {target}: {'met' if fanout['cold_ratio'] >= target else 'missed'}" if target else ""
        )
        print(
            f"fan-out, {actors:>2} actor(s) x {report['fanout_size_mib']} MiB: "
            f"direct {fanout['direct_s']:.2f} s, "
            f"registry cold {fanout['cold_s']:.2f} s (ratio {fanout['cold_ratio']:.2f}), warm "
            f"{fanout['warm_s']:.2f} s (ratio {fanout['warm_ratio']:.2f}); registry RSS growth "
            f"{fanout['registry_rss_growth_mib']:.0f} MiB   {verdict}",
            file=out,
        )
    print(
        f"registry RSS: {report['registry_rss_start_mib']} MiB before any transfer, "
        f"{report.get('registry_rss_end_mib')} MiB at the end, kernel high-water mark "
        f"{report.get('registry_vm_hwm_mib')} MiB; this process's max RSS {report['client_max_rss_mib']} MiB",
        file=out,
    )
    if report["registry_problems"]:
        print(f"registry warnings/errors logged: {report['registry_problems']}", file=out)
    if report["registry_exit_status"] not in (0, None):
        print(f"the registry exited with status {report['registry_exit_status']}", file=out)
    print("", file=out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/model_registry.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--size_mib", type=int, default=1024, help="version size in MiB (default 1024)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the four phases (default 2)")
    parser.add_argument(
        "--chunk_kib", type=int, default=2048, help="CreateVersion body chunk size (default 2048)"
    )
    parser.add_argument(
        "--read_chunk_kib",
        type=int,
        default=2048,
        help="download chunk size: the registry's --sent_version_chunk_size and minio's reads (default 2048)",
    )
    parser.add_argument(
        "--part_mib",
        type=int,
        default=DEFAULT_PART_SIZE // MiB,
        help="part size of the direct multipart upload (default: the registry's, %(default)s)",
    )
    parser.add_argument(
        "--fanout",
        type=lambda text: [int(n) for n in text.split(",") if n],
        default=[1, 8, 32],
        help="actors of each fan-out run, comma-separated; empty: none (default 1,8,32)",
    )
    parser.add_argument("--fanout_size_mib", type=int, default=50, help="fan-out version size (default 50)")
    parser.add_argument("--s3_bucket", default="bench-model-registry", help="the registry's bucket")
    parser.add_argument("--rss_interval_ms", type=float, default=2.0, help="RSS sampling period (default 2)")
    parser.add_argument(
        "--pin", action="store_true", help="registry on the first CPU, this process on the others"
    )
    parser.add_argument("--server_log_level", help="--log_level of the registry (default: its own, info)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (log, database)")
    args = parser.parse_args(argv)
    if (
        min(
            args.size_mib,
            args.rounds,
            args.chunk_kib,
            args.read_chunk_kib,
            args.part_mib,
            args.fanout_size_mib,
        )
        <= 0
    ):
        parser.error("sizes and counts must be positive")
    if any(actors <= 0 for actors in args.fanout):
        parser.error("--fanout: numbers of actors are positive")
    if args.part_mib < 5:
        parser.error("S3 parts are at least 5 MiB")
    if args.chunk_kib * 1024 > 4 * MiB - 1024 or args.read_chunk_kib * 1024 > 4 * MiB - 1024:
        parser.error("chunks must stay under gRPC's 4 MiB message limit")
    if args.rss_interval_ms <= 0:
        parser.error("--rss_interval_ms must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_actor"]:
        return asyncio.run(actor_main(json.loads(argv[1])))
    return run_benchmark(parse_args(argv), "model-registry", run, print_summary)


if __name__ == "__main__":
    sys.exit(main())
