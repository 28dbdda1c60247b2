"""Benchmark of the model registry's S3 blob store against the minio client used directly.

    .venv/bin/python bench/blobstore.py [--size_mib 256] [--rounds 5] [--chunk_kib 2048] ...

Starts a private SeaweedFS S3 server on 127.0.0.1 (as the tests do: `tests.fixtures.seaweedfs`),
then, in the same process and the same run, moves `--size_mib` MiB up and down both ways:

- store upload: `S3BlobStore.open_upload`, `write` of `--chunk_kib` chunks (fresh bytes objects,
  as a gRPC stream delivers them), `commit` (which also returns the size and SHA-256, checked);
- direct upload: minio's `put_object` (known length, the same part size, its default 3 parallel
  part uploads) reading the same bytes from a file-like source;
- store download: `S3BlobStore.read` in `--read_chunk_kib` chunks (`--sent_version_chunk_size`);
- direct download: minio's `get_object`, read fully in chunks of the same size.

An untimed warm-up (through minio only) lets SeaweedFS allocate its volumes. The four phases then
run in every one of `--rounds` rounds, the store first in even rounds and minio first in odd ones;
the median of each phase is reported with the ratios store/direct (targets: upload >= 0.7,
download >= 0.8), also as the median of the per-round ratios (the two sides ran back to back).
RSS is sampled every 2 ms: "RSS growth" is a phase's peak over the RSS at its start (max over
rounds; target for the store: < 100 MiB at 1 GiB), "RSS over start" its peak over the RSS before
any transfer (an upper bound: it includes what the allocator kept from earlier phases). "Client
CPU" is this process's CPU time (all threads) per MiB moved. The source data is a random block
repeated, never the whole blob. Targets are shown, never asserted: the exit status is 0 whenever
the benchmark itself ran. The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve()
if str(SCRIPT.parents[1]) not in sys.path:  # run as a script: `tests` and `bench` are not installed packages
    sys.path.insert(0, str(SCRIPT.parents[1]))

from minio import Minio  # noqa: E402

from bench.common import (  # noqa: E402
    BLOCK_SIZE,
    MiB,
    RssSampler,
    chunks_of,
    direct_download,
    direct_upload,
    sha256_b64,
)
from services.model_registry.blobstore.s3 import (  # noqa: E402
    DEFAULT_PART_SIZE,
    DEFAULT_UPLOAD_CONCURRENCY,
    S3BlobStore,
)
from tests.fixtures.seaweedfs import SeaweedS3  # noqa: E402

TARGET_UPLOAD_RATIO = 0.7
TARGET_DOWNLOAD_RATIO = 0.8
TARGET_RSS_GROWTH_MIB = 100.0
RSS_INTERVAL_S = 0.002


class ByteCount:
    """Bytes received: the downloads are checked on their size alone, both ways (hashing them
    would add the same CPU time to both sides' client CPU figures and blur their difference)."""

    def __init__(self) -> None:
        self.size = 0

    def update(self, chunk: bytes) -> None:
        self.size += len(chunk)


async def store_upload(store: S3BlobStore, key: str, block: bytes, size: int, chunk_size: int) -> str:
    upload = await store.open_upload(key)
    async with upload:
        for chunk in chunks_of(block, size, chunk_size):
            await upload.write(chunk)
        written, sha256 = await upload.commit()
    if written != size:
        raise RuntimeError(f"store reported {written} bytes, not {size}")
    return sha256


async def store_download(store: S3BlobStore, key: str, chunk_size: int, received: ByteCount) -> None:
    async for chunk in store.read(key, chunk_size):
        received.update(chunk)


async def run(args: argparse.Namespace, server: SeaweedS3) -> dict[str, Any]:
    size = args.size_mib * MiB
    part_size = args.part_mib * MiB
    read_chunk = args.read_chunk_kib * 1024
    block = os.urandom(BLOCK_SIZE)
    sha256 = sha256_b64(block, size)
    bucket = "bench-blobstore"
    store = S3BlobStore(
        server.endpoint,
        server.access_key,
        server.secret_key,
        bucket,
        secure=False,
        part_size=part_size,
        upload_concurrency=args.upload_concurrency,
    )
    await store.start()
    client = Minio(server.endpoint, server.access_key, server.secret_key, secure=False)
    sampler = RssSampler(os.getpid(), RSS_INTERVAL_S)
    phases: dict[str, list[dict[str, float]]] = {
        "store_upload": [],
        "direct_upload": [],
        "store_download": [],
        "direct_download": [],
    }

    @contextmanager
    def measure(name: str) -> Iterator[None]:
        """Wall time, CPU time (this process, all threads) and RSS of one run of a phase."""
        into: dict[str, float] = {}
        phases[name].append(into)
        start = sampler.reset()
        began, cpu = time.perf_counter(), time.process_time()
        yield
        into["seconds"] = time.perf_counter() - began
        into["cpu_seconds"] = time.process_time() - cpu
        peak = sampler.peak_now()
        into["rss_growth_mib"] = (peak - start) / MiB
        into["rss_over_baseline_mib"] = (peak - sampler.baseline) / MiB

    try:
        # Untimed: SeaweedFS allocates its volumes on the first writes.
        print("warm-up...", file=sys.stderr)
        await asyncio.to_thread(direct_upload, client, bucket, "warmup", block, size, part_size)
        await asyncio.to_thread(direct_download, client, bucket, "warmup", read_chunk, ByteCount().update)
        await asyncio.to_thread(client.remove_object, bucket, "warmup")

        async def phase(name: str, round_: int) -> None:
            key, direct_name = f"versions/bench/{round_}", f"direct/{round_}"
            received = ByteCount()
            with measure(name):
                if name == "store_upload":
                    got = await store_upload(store, key, block, size, args.chunk_kib * 1024)
                elif name == "direct_upload":
                    await asyncio.to_thread(
                        direct_upload, client, bucket, direct_name, block, size, part_size
                    )
                elif name == "store_download":
                    await store_download(store, key, read_chunk, received)
                else:
                    await asyncio.to_thread(
                        direct_download, client, bucket, direct_name, read_chunk, received.update
                    )
            if name == "store_upload" and got != sha256:
                raise RuntimeError(f"store reported SHA-256 {got}, expected {sha256}")
            if name.endswith("download") and received.size != size:
                raise RuntimeError(f"{name} got {received.size} bytes, not {size}")

        for round_ in range(args.rounds):
            print(f"round {round_ + 1}/{args.rounds}...", file=sys.stderr)
            # Alternating who goes first: neither side always meets a server just written to.
            first, second = ("store", "direct") if round_ % 2 == 0 else ("direct", "store")
            for direction in ("upload", "download"):
                await phase(f"{first}_{direction}", round_)
                await phase(f"{second}_{direction}", round_)
            await store.delete(f"versions/bench/{round_}")
            await asyncio.to_thread(client.remove_object, bucket, f"direct/{round_}")
    finally:
        sampler.stop()
        await store.close()

    report: dict[str, Any] = {
        "size_mib": args.size_mib,
        "rounds": args.rounds,
        "part_mib": args.part_mib,
        "upload_concurrency": args.upload_concurrency,
        "chunk_kib": args.chunk_kib,
        "read_chunk_kib": args.read_chunk_kib,
        "cpus": os.cpu_count(),
        "phases": {},
    }
    for name, runs in phases.items():
        seconds = statistics.median(r["seconds"] for r in runs)
        report["phases"][name] = {
            "mib_per_s": args.size_mib / seconds,
            "mib_per_s_each": [round(args.size_mib / r["seconds"], 1) for r in runs],
            "rss_growth_mib": max(r["rss_growth_mib"] for r in runs),
            "rss_over_baseline_mib": max(r["rss_over_baseline_mib"] for r in runs),
            # CPU of this process (all threads) per MiB moved: the client side's cost.
            "cpu_ms_per_mib": statistics.median(r["cpu_seconds"] for r in runs) * 1000 / args.size_mib,
        }
    p = report["phases"]
    report["upload_ratio"] = p["store_upload"]["mib_per_s"] / p["direct_upload"]["mib_per_s"]
    report["download_ratio"] = p["store_download"]["mib_per_s"] / p["direct_download"]["mib_per_s"]
    # Store/direct within each round (the two ran back to back): less sensitive to the server's drift.
    for direction in ("upload", "download"):
        store_runs, direct_runs = phases[f"store_{direction}"], phases[f"direct_{direction}"]
        report[f"{direction}_ratio_paired"] = statistics.median(
            d["seconds"] / s["seconds"] for s, d in zip(store_runs, direct_runs, strict=True)
        )
    report["max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    store_rss = max(p["store_upload"]["rss_growth_mib"], p["store_download"]["rss_growth_mib"])
    report["targets"] = {
        "upload ratio": "met" if report["upload_ratio"] >= TARGET_UPLOAD_RATIO else "missed",
        "download ratio": "met" if report["download_ratio"] >= TARGET_DOWNLOAD_RATIO else "missed",
        "store RSS growth": "met" if store_rss < TARGET_RSS_GROWTH_MIB else "missed",
    }
    return report


def print_summary(report: dict[str, Any], out: Any = sys.stdout) -> None:
    fmt: Callable[[float], str] = lambda value: f"{value:.2f}"  # noqa: E731
    print("", file=out)
    print(
        f"S3 blob store benchmark: {report['size_mib']} MiB, {report['rounds']} round(s), "
        f"{report['part_mib']} MiB parts, upload concurrency {report['upload_concurrency']}, "
        f"chunks {report['chunk_kib']} KiB up / {report['read_chunk_kib']} KiB down, "
        f"{report['cpus']} CPUs (SeaweedFS on the same host)",
        file=out,
    )
    print("", file=out)
    print(
        f"{'phase':16} {'MiB/s (median)':>15} {'each round':>36} {'RSS growth MiB':>15} "
        f"{'RSS over start MiB':>19} {'client CPU ms/MiB':>18}",
        file=out,
    )
    for name, phase in report["phases"].items():
        each = ", ".join(f"{v:.0f}" for v in phase["mib_per_s_each"])
        print(
            f"{name:16} {phase['mib_per_s']:>15.1f} {each:>36} {phase['rss_growth_mib']:>15.1f} "
            f"{phase['rss_over_baseline_mib']:>19.1f} {phase['cpu_ms_per_mib']:>18.2f}",
            file=out,
        )
    print("", file=out)
    targets = report["targets"]
    print(
        f"upload ratio store/direct   {fmt(report['upload_ratio']):>6}   target >= {TARGET_UPLOAD_RATIO}: "
        f"{targets['upload ratio']}   (median of per-round ratios {fmt(report['upload_ratio_paired'])})",
        file=out,
    )
    print(
        f"download ratio store/direct {fmt(report['download_ratio']):>6}   target >= "
        f"{TARGET_DOWNLOAD_RATIO}: {targets['download ratio']}   "
        f"(median of per-round ratios {fmt(report['download_ratio_paired'])})",
        file=out,
    )
    phases = report["phases"]
    store_rss = max(phases["store_upload"]["rss_growth_mib"], phases["store_download"]["rss_growth_mib"])
    print(
        f"store peak RSS growth (MiB) {store_rss:>6.1f}"
        f"   target < {TARGET_RSS_GROWTH_MIB:g} (at 1 GiB): {targets['store RSS growth']}",
        file=out,
    )
    print(f"process max RSS {report['max_rss_mib']:.0f} MiB", file=out)
    print("", file=out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size_mib", type=int, default=256, help="blob size (default 256)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the four phases (default 5)")
    parser.add_argument("--chunk_kib", type=int, default=2048, help="upload chunk size (default 2048)")
    parser.add_argument(
        "--read_chunk_kib", type=int, default=2048, help="download chunk size, both ways (default 2048)"
    )
    parser.add_argument(
        "--part_mib", type=int, default=DEFAULT_PART_SIZE // MiB, help="multipart part size, both ways"
    )
    parser.add_argument("--upload_concurrency", type=int, default=DEFAULT_UPLOAD_CONCURRENCY)
    args = parser.parse_args(argv)
    if args.size_mib <= 0 or args.rounds <= 0 or args.chunk_kib <= 0 or args.read_chunk_kib <= 0:
        parser.error("sizes and rounds must be positive")
    if args.part_mib < 5:
        parser.error("--part_mib must be at least 5")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print("starting SeaweedFS...", file=sys.stderr)
    with SeaweedS3() as server:
        try:
            report = asyncio.run(run(args, server))
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
    print_summary(report)
    print(json.dumps(report, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
