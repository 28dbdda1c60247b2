"""Benchmark of the web console: time to the first answer of `/trials` over 10,000 trials and of
a 100,000-tick trial's page, and the console's memory while serving them.

    .venv/bin/python bench/console.py [--trials 10000] [--ticks 100000]

A Trial Datastore (SQLite, in a temporary directory) and the console run as users run them
(`python -m services.datastore`, `python -m services.console`), on 127.0.0.1. The trials are
added with AddTrial (no samples), the long trial through DatalogSP as the orchestrator logs it
(three actors, a reward each per tick). Each page is fetched twice: the first fetch is what a
person opening it waits for (the datastore's pages not yet in its cache); the console's resident
memory is read from /proc after each. It measures and prints; it asserts nothing about time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import vm_hwm, vm_rss
from shared.api import (
    common_pb2,
    datalog_pb2,
    datalog_pb2_grpc,
    trial_datastore_pb2_grpc,
)
from shared.api import trial_datastore_pb2 as ds

ACTORS = ("alice", "bob", "carol")
START_TIMEOUT_S = 60.0


@contextmanager
def process(
    command: list[str], log_path: Path
) -> Iterator[tuple[subprocess.Popen[bytes], dict[str, object]]]:
    """Run a service; yields it and its JSON `serving` line."""
    with log_path.open("wb") as log:
        child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
            serving = [line for line in lines if line.get("event") == "serving"]
            if serving:
                yield child, serving[0]
                break
            if child.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{command[2]} did not start:\n{log_path.read_text()[-2000:]}")
            time.sleep(0.1)
    finally:
        child.terminate()
        child.wait(timeout=30)


def params() -> common_pb2.TrialParams:
    return common_pb2.TrialParams(
        actors=[common_pb2.ActorParams(name=name, actor_class="player") for name in ACTORS], max_steps=0
    )


async def fill(address: str, trials: int, ticks: int) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = trial_datastore_pb2_grpc.TrialDatastoreSPStub(channel)
        for start in range(0, trials, 200):
            await asyncio.gather(
                *(
                    stub.AddTrial(
                        ds.AddTrialRequest(user_id="bench", trial_params=params()),
                        metadata=(("trial-id", f"t-{n}"),),
                    )
                    for n in range(start, min(trials, start + 200))
                )
            )
        datalog = datalog_pb2_grpc.DatalogSPStub(channel)

        def inputs() -> Iterator[datalog_pb2.RunTrialDatalogInput]:
            yield datalog_pb2.RunTrialDatalogInput(trial_params=params())
            for tick in range(ticks):
                state = common_pb2.ENDED if tick == ticks - 1 else common_pb2.RUNNING
                sample = datalog_pb2.DatalogSample(
                    info=datalog_pb2.SampleInfo(tick_id=tick, timestamp=tick, state=state)
                )
                for name in ACTORS:
                    source = common_pb2.RewardSource(sender_name="env", value=(tick % 7) - 3, confidence=1)
                    sample.rewards.append(
                        common_pb2.Reward(receiver_name=name, tick_id=tick, sources=[source])
                    )
                yield datalog_pb2.RunTrialDatalogInput(sample=sample)

        call = datalog.RunTrialDatalog(inputs(), metadata=(("trial-id", "long"), ("user-id", "bench")))
        acknowledged = 0
        async for _ in call:
            acknowledged += 1
        assert acknowledged == ticks + 1, acknowledged


def fetch(url: str) -> tuple[float, int, int]:
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(url, timeout=600) as response:
            body, status = response.read(), response.status
    except urllib.error.HTTPError as error:  # measured and shown, as any answer
        body, status = error.read(), error.code
    return time.perf_counter() - started, status, len(body)


def curves(url: str) -> tuple[float, float, int]:
    """Seconds to the first snapshot of a trial's curves and to the last, and how many came."""
    started = time.perf_counter()
    first, count = 0.0, 0
    with urllib.request.urlopen(url, timeout=600) as response:
        for line in response:
            if line.startswith(b"data: {") and line.strip() != b"data: {}":
                count += 1
                first = first or time.perf_counter() - started
            if line.startswith(b"event: end"):
                break
    return first, time.perf_counter() - started, count


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=10_000)
    parser.add_argument("--ticks", type=int, default=100_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-console-") as scratch:
        work = Path(scratch)
        datastore_command = [
            sys.executable, "-m", "services.datastore", "--port", "0", "--bind_address", "127.0.0.1",
            "--log_format", "json", "--data_dir", str(work),
        ]  # fmt: skip
        with process(datastore_command, work / "datastore.log") as (_, serving):
            address = f"127.0.0.1:{serving['port']}"
            started = time.perf_counter()
            asyncio.run(fill(address, args.trials, args.ticks))
            filled_s = time.perf_counter() - started
            print(f"filled: {args.trials} trials and one of {args.ticks} ticks in {filled_s:.1f} s")
            console_command = [
                sys.executable, "-m", "services.console", "--port", "0", "--log_format", "json",
                "--trial_datastore_endpoint", f"grpc://{address}", "--directory_endpoint", "grpc://127.0.0.1:1",
                "--model_registry_endpoint", "grpc://127.0.0.1:1",
            ]  # fmt: skip
            with process(console_command, work / "console.log") as (console, serving):
                origin = str(serving["url"]).rstrip("/")
                print(f"console idle: RSS {(vm_rss(console.pid) or 0) / 2**20:.0f} MiB")
                rows = []
                for page in (
                    "/trials",
                    "/trials",
                    "/trials/long",
                    "/trials/long",
                    f"/api/trials/long/ticks/{args.ticks - 1}",
                ):
                    seconds, status, size = fetch(origin + page)
                    rows.append(
                        (page, status, seconds, size, vm_rss(console.pid) or 0, vm_hwm(console.pid) or 0)
                    )
                first, last, snapshots = curves(origin + "/api/trials/long/curves")
                rss, hwm = (vm_rss(console.pid) or 0) / 2**20, (vm_hwm(console.pid) or 0) / 2**20
                print(
                    f"the long trial's curves: first snapshot after {first:.2f} s, complete after "
                    f"{last:.1f} s ({snapshots} snapshots); console RSS {rss:.0f} MiB, peak {hwm:.0f} MiB"
                )
                print(f"{'page':<32}{'status':>7}{'seconds':>9}{'bytes':>10}{'RSS MiB':>9}{'peak MiB':>9}")
                for page, status, seconds, size, rss, hwm in rows:
                    mib = f"{rss / 2**20:>9.0f}{hwm / 2**20:>9.0f}"
                    print(f"{page:<32}{status:>7}{seconds:>9.2f}{size:>10}{mib}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
