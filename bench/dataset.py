"""Benchmark of trials as training data: the Parquet export against the binary export of the same
trials, and batch sampling against plain numpy indexing of the same arrays.

    .venv/bin/python bench/dataset.py [--database_url URL] [--trials 8] [--ticks 2500] [--actors 2] ...

What it does, all traffic on 127.0.0.1:

1. Starts the datastore as users do (as bench/datastore.py does: a fresh SQLite file unless
   `--database_url`), and ingests `--trials` trials of `--ticks` ticks through DatalogSP, with
   bench/datastore.py's workload: every tick, each of `--actors` actors gets an observation of
   `--observation_bytes` random bytes, sends an action of `--action_bytes` and receives a reward.
2. Export, `--rounds` times, the two formats in alternating order: `client export IDS --file F`
   (the reference's trial file) and `client export IDS --format parquet --file DIR`, both through
   the client's `main` in this process, timed from the call to its return. Figures (medians over
   the rounds): samples/s, step rows/s (a step is one actor at one tick), bytes written, and the
   CPU per sample of the datastore and of the client; the ratio parquet/binary of the rates is
   the median of the per-round ratios (the two ran back to back).
3. Sampling: the Parquet dataset read with `TrainingData.from_parquet`, observations and actions
   decoded as float32 arrays (before the clock starts: decoding is once per row, not per batch).
   `--batches` batches of `--batch_size` transitions drawn uniformly, each with a 4-frame
   observation stack (view "-3:0", masked at episode starts), the action and a 3-step discounted
   return; against the limit, the same arrays indexed by plain numpy: random transitions, their
   frames, actions and rewards taken by fancy indexing, without episode boundaries or masks.
   Transitions per second for both, best of `--rounds` (the least disturbed run), and their ratio.

CPUs: with two or more, the datastore is pinned to the first CPU and this process (the client and
the sampling) to the others. Nothing is asserted: the exit status is 0 whenever the benchmark ran.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
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
    cpu_seconds,
    fmt,
    pinned_plan,
    print_table,
    run_benchmark,
    start_server,
)
from bench.datastore import Workload, datalog_stream, ingest, trial_ids  # noqa: E402
from services.datastore.client.cli import main as client_main  # noqa: E402
from services.datastore.client.training import Shift, TrainingData  # noqa: E402

FORMATS = ("cogment", "parquet")
FRAMES = "-3:0"  # the 4-frame observation stack
FRAME_OFFSETS = np.arange(-3, 1)
N_STEP, GAMMA = 3, 0.99


def float32s(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.float32)


# ---- export ----


def export(address: str, ids: Sequence[str], target: Path, form: str, server_pid: int) -> dict[str, Any]:
    """One export through the command line's `main`; its time, output size and CPU."""
    argv = ["export", *ids, "--format", form, "--file", str(target), "--endpoint", f"grpc://{address}"]
    server_before, client_before = cpu_seconds(server_pid) or 0.0, cpu_seconds(os.getpid()) or 0.0
    started = time.perf_counter()
    out, err = io.StringIO(), io.StringIO()
    code = client_main(argv, {}, out, err)
    seconds = time.perf_counter() - started
    server_cpu = (cpu_seconds(server_pid) or 0.0) - server_before
    client_cpu = (cpu_seconds(os.getpid()) or 0.0) - client_before
    if code != 0:
        raise BenchError(f"export --format {form} failed ({code}): {err.getvalue().strip()}")
    files = [target] if target.is_file() else list(target.iterdir())
    return {"seconds": seconds, "bytes": sum(f.stat().st_size for f in files), "server_cpu_s": server_cpu,
            "client_cpu_s": client_cpu}  # fmt: skip


def export_figures(runs: list[dict[str, Any]], samples: int, steps: int) -> dict[str, Any]:
    seconds = statistics.median(run["seconds"] for run in runs)

    def per_sample(key: str) -> float:
        return round(float(statistics.median(run[key] for run in runs)) * 1e6 / samples, 1)

    return {
        "seconds": round(seconds, 3),
        "samples_per_s": round(samples / seconds, 1),
        "steps_per_s": round(steps / seconds, 1),
        "mib_written": round(runs[0]["bytes"] / (1 << 20), 1),
        "server_cpu_us_per_sample": per_sample("server_cpu_s"),
        "client_cpu_us_per_sample": per_sample("client_cpu_s"),
    }


# ---- sampling ----


def sample_with_reader(data: TrainingData, batch_size: int, batches: int) -> float:
    """Transitions per second of `TrainingData.sample` with frames, action and 3-step return."""
    views: dict[str, tuple[str, Shift]] = {"frames": ("observation", FRAMES), "action": ("action", 0)}
    started = time.perf_counter()
    for seed in range(batches):
        data.sample(batch_size, seed, views, n_step=(N_STEP, GAMMA))
    return batch_size * batches / (time.perf_counter() - started)


def sample_with_numpy(data: TrainingData, batch_size: int, batches: int) -> float:
    """The limit: the same arrays, plain fancy indexing, no episode boundaries, no masks."""
    observations, actions, rewards = data.column("observation"), data.column("action"), data.column("reward")
    steps = np.concatenate(
        [np.arange(e.first_step, e.first_step + e.steps - 1) for e in data.episodes if e.steps > 1]
    )
    last = len(observations) - 1
    discounts = GAMMA ** np.arange(N_STEP)
    started = time.perf_counter()
    for seed in range(batches):
        step = steps[np.random.default_rng(seed).integers(0, len(steps), batch_size)]
        observations[np.clip(step[:, None] + FRAME_OFFSETS, 0, last)]
        actions[step]
        rewards[np.clip(step[:, None] + np.arange(N_STEP), 0, last)] @ discounts
    return float(batch_size * batches / (time.perf_counter() - started))


def best_rate(
    measure: Callable[[TrainingData, int, int], float], data: TrainingData, args: argparse.Namespace
) -> float:
    return max(measure(data, args.batch_size, args.batches) for _ in range(args.rounds))


# ---- the run ----


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    plan = pinned_plan(args, workdir, "", not args.no_pin)
    database_url = args.database_url or f"sqlite+aiosqlite:///{workdir / 'bench.db'}"
    workload = Workload(args.trials, args.ticks, args.actors, args.observation_bytes, args.action_bytes)
    rng = random.Random(args.seed)
    streams = [datalog_stream(workload, workload.ticks, rng) for _ in range(workload.trials)]
    command = [
        sys.executable, "-m", "services.datastore", "--port", "0", "--bind_address", "127.0.0.1",
        "--log_format", "json", "--data_dir", str(workdir / "data"), "--database_url", database_url,
    ]  # fmt: skip
    datastore = start_server(plan, "datastore", command)
    ids = trial_ids(f"dataset-{args.seed}", "datastore", 0, workload.trials)

    async def load() -> None:
        async with grpc.aio.insecure_channel(datastore.address, options=CHANNEL_OPTIONS) as channel:
            await asyncio.wait_for(channel.channel_ready(), READY_TIMEOUT_S)
            await ingest(channel, ids, streams)

    print(f"ingesting {workload.samples} samples into {datastore.address}...", file=sys.stderr)
    asyncio.run(load())
    pid = datastore.process.pid
    runs: dict[str, list[dict[str, Any]]] = {form: [] for form in FORMATS}
    for round_ in range(args.rounds):
        print(f"  export round {round_ + 1}...", file=sys.stderr)
        for form in FORMATS if round_ % 2 == 0 else reversed(FORMATS):
            target = workdir / f"export-{round_}-{form}"
            runs[form].append(export(datastore.address, ids, target, form, pid))
    steps = workload.samples * workload.actors
    ratios = [b["seconds"] / p["seconds"] for b, p in zip(runs["cogment"], runs["parquet"], strict=True)]
    report: dict[str, Any] = {
        "bench": "dataset",
        "database": database_url.split(":", 1)[0],
        "cpus": f"server on CPU {sorted(plan.server_cpus)}" if plan.server_cpus else "not pinned",
        "args": vars(args),
        "samples": workload.samples,
        "steps": steps,
        "export": {form: export_figures(runs[form], workload.samples, steps) for form in FORMATS},
        "export_ratio": round(statistics.median(ratios), 3),
    }  # fmt: skip
    datastore.stop()

    print("sampling...", file=sys.stderr)
    data = TrainingData.from_parquet(
        workdir / "export-0-parquet", decode_observation=float32s, decode_action=float32s
    )
    for column in ("observation", "action"):
        data.column(column)  # decoded once, before the clock
    reader, plain = best_rate(sample_with_reader, data, args), best_rate(sample_with_numpy, data, args)
    report["sampling"] = {
        "transitions": len(data),
        "reader_per_s": round(reader, 1),
        "numpy_per_s": round(plain, 1),
        "ratio": round(reader / plain, 3),
    }
    return report


def print_summary(report: dict[str, Any]) -> None:
    out = sys.stdout
    print(
        f"\n{report['samples']:,} samples ({report['steps']:,} steps) on {report['database']}, "
        f"{report['cpus']}\n",
        file=out,
    )
    rows = [["export", "samples/s", "steps/s", "MiB", "server µs/sample", "client µs/sample"]]
    for form, figures in report["export"].items():
        rows.append(
            [form, fmt(figures["samples_per_s"]), fmt(figures["steps_per_s"]), fmt(figures["mib_written"]),
             fmt(figures["server_cpu_us_per_sample"]), fmt(figures["client_cpu_us_per_sample"])]
        )  # fmt: skip
    print_table(rows, 1, out)
    print(f"\nparquet/binary export rate: {report['export_ratio']}", file=out)
    sampling = report["sampling"]
    print(
        f"\nsampling {sampling['transitions']:,} transitions, 4 frames + action + 3-step return:\n"
        f"  reader {fmt(sampling['reader_per_s'])}/s, plain numpy {fmt(sampling['numpy_per_s'])}/s, "
        f"ratio {sampling['ratio']}\n",
        file=out,
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/dataset.py",
        description="Benchmark the Parquet export against the binary export, and batch sampling "
        "against plain numpy indexing.",
    )
    parser.add_argument("--database_url", help="datastore database (default: a fresh SQLite file)")
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--ticks", type=int, default=2500, help="samples per trial")
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--observation_bytes", type=int, default=256, help="a multiple of 4 (float32s)")
    parser.add_argument("--action_bytes", type=int, default=16, help="a multiple of 4 (float32s)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--batches", type=int, default=200, help="batches per sampling run")
    parser.add_argument("--seed", type=int, default=20261124)
    parser.add_argument("--no_pin", action="store_true", help="do not pin the server and the client to CPUs")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args(argv)
    if min(args.trials, args.ticks, args.actors, args.rounds, args.batch_size, args.batches) < 1:
        parser.error("counts must be positive")
    if (
        args.observation_bytes < 4
        or args.observation_bytes % 4
        or args.action_bytes < 4
        or args.action_bytes % 4
    ):
        parser.error("--observation_bytes and --action_bytes: positive multiples of 4 (float32 arrays)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    return run_benchmark(parse_args(argv), "dataset", run, print_summary)


if __name__ == "__main__":
    sys.exit(main())
