"""What the benchmarks share: their subprocesses (servers, workers, baselines) and how they are run,
stopped, pinned and measured (CPU time, RSS, from /proc: Linux), the bare baselines' serve loop, the
summary tables, and the repeated-block data of the S3 transfers.

Nothing here imports minio or the SeaweedFS fixture: the benchmarks that do not move S3 data (and
their subprocesses, which import their script again) start without them.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import contextlib
import hashlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, BinaryIO, TextIO, cast

import grpc

if TYPE_CHECKING:  # only annotations: a benchmark that moves no S3 data does not load minio
    from minio import Minio

PROJECT_ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20

# Each client gets its own connection (by default grpc shares one subchannel per target).
CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1)]
START_TIMEOUT_S = 60.0
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0


# ---- CPUs and memory of processes, from /proc ----


def cpu_seconds(pid: int, tid: int | None = None) -> float | None:
    """User + system CPU time of a process (all its threads), or of its thread `tid` alone (a
    Python server's main thread, id `pid`, is its event loop, which cannot use more than one CPU)."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        stat = Path(path).read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pin(pid: int, cpus: set[int] | None) -> None:
    """Pin every thread of a process (sched_setaffinity applies to one thread)."""
    if not cpus:
        return
    try:
        tids = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(tid, cpus)


def _status_bytes(pid: int, key: bytes) -> int | None:
    """A memory figure of /proc/<pid>/status (given in kB there), in bytes."""
    try:
        with open(f"/proc/{pid}/status", "rb") as status:
            for line in status:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def vm_rss(pid: int) -> int | None:
    """VmRSS of a process in bytes."""
    return _status_bytes(pid, b"VmRSS:")


def vm_hwm(pid: int) -> int | None:
    """VmHWM (the kernel's high-water mark of the RSS) of a process in bytes."""
    return _status_bytes(pid, b"VmHWM:")


class RssSampler:
    """Peak RSS of a process during a phase, sampled by a thread (the kernel's high-water mark
    cannot be reset per phase without privileges on every system)."""

    def __init__(self, pid: int, interval_s: float) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.baseline = vm_rss(pid) or 0
        self.peak = self.baseline
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            rss = vm_rss(self.pid)
            if rss is not None:
                self.peak = max(self.peak, rss)
                self.samples += 1

    def reset(self) -> int:
        """Begin a phase: returns the RSS at its start, from which the peak is measured again."""
        start = vm_rss(self.pid) or 0
        self.peak = start
        self.samples = 0
        return start

    def peak_now(self) -> int:
        """The phase's peak, including the RSS now (a phase shorter than the interval has no sample)."""
        return max(self.peak, vm_rss(self.pid) or 0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


# ---- subprocesses: JSON lines both ways ----


def emit(message: dict[str, Any], stream: TextIO = sys.stdout) -> None:
    stream.write(json.dumps(message, separators=(",", ":")) + "\n")
    stream.flush()


def stdin_lines(loop: asyncio.AbstractEventLoop) -> asyncio.Queue[str]:
    """Lines of stdin ("" at EOF) read by a daemon thread, so that a blocked read never keeps
    the process alive (the orchestrator closing the pipe, or dying, means stop)."""
    lines: asyncio.Queue[str] = asyncio.Queue()

    def read() -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed first: nobody is listening
            for line in sys.stdin:
                loop.call_soon_threadsafe(lines.put_nowait, line)
            loop.call_soon_threadsafe(lines.put_nowait, "")

    threading.Thread(target=read, name="stdin", daemon=True).start()
    return lines


async def serve_bare(handlers: Sequence[grpc.GenericRpcHandler]) -> int:
    """Serve a bare grpc.aio baseline on a free port of 127.0.0.1, announced by the JSON `serving`
    line the services log (what `start_server` waits for), until stdin closes or a signal comes."""
    loop = asyncio.get_running_loop()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(tuple(handlers))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    lines = stdin_lines(loop)
    emit({"event": "serving", "level": "info", "service": "bare", "port": port}, sys.stderr)
    eof = loop.create_task(lines.get())
    stopped = loop.create_task(stop.wait())
    await asyncio.wait([eof, stopped], return_when=asyncio.FIRST_COMPLETED)
    eof.cancel()
    stopped.cancel()
    await server.stop(1.0)
    return 0


class Child:
    """A subprocess of the benchmark whose JSON lines (stdout or stderr) are collected."""

    registry: list[Child] = []

    def __init__(
        self,
        name: str,
        command: list[str],
        *,
        messages_on: str,
        cpus: set[int] | None,
        log_path: Path,
    ) -> None:
        self.name = name
        environment = {k: v for k, v in os.environ.items() if not k.startswith("COGMENT_")}
        self.process = subprocess.Popen(
            command,
            cwd=PROJECT_ROOT,
            env=environment,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE if messages_on == "stdout" else subprocess.DEVNULL,
            stderr=subprocess.PIPE if messages_on == "stderr" else None,
            text=True,
        )
        Child.registry.append(self)
        self.cpus = cpus
        pin(self.process.pid, cpus)
        self.messages: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self.problems: list[dict[str, Any]] = []
        self.log_path = log_path
        self.address = ""  # host:port, for servers
        stream = self.process.stdout if messages_on == "stdout" else self.process.stderr
        assert stream is not None
        self._reader = threading.Thread(target=self._read, args=(stream,), name=name, daemon=True)
        self._reader.start()

    def _read(self, stream: TextIO) -> None:
        with self.log_path.open("a", encoding="utf-8") as log:
            for raw in stream:
                log.write(raw)
                self.tail.append(raw.rstrip("\n")[:2000])
                try:
                    message = json.loads(raw)
                except ValueError:
                    continue
                if not isinstance(message, dict):
                    continue
                if message.get("level") in ("warning", "error", "critical"):
                    self.problems.append(message)
                self.messages.put(message)
        self.messages.put(None)

    def expect(self, key: str, timeout_s: float) -> dict[str, Any]:
        """The next message with `key` set; fails on timeout or when the child exits first."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BenchError(f"{self.name}: no {key!r} within {timeout_s:.0f} s", self)
            try:
                message = self.messages.get(timeout=remaining)
            except queue.Empty:
                continue
            if message is None:
                self.process.wait(5)
                raise BenchError(f"{self.name} exited (status {self.process.returncode})", self)
            if message.get(key) is not None or message.get("event") == key:
                return message

    def send(self, message: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(message, separators=(",", ":")) + "\n")
        self.process.stdin.flush()

    def cpu_seconds(self) -> float | None:
        return cpu_seconds(self.process.pid)

    def stop(self, sig: int = signal.SIGTERM, exit_wait_s: float = 0.0) -> int | None:
        """Close stdin, give it `exit_wait_s` to exit by itself, then signal, wait, and kill
        when it does not stop in time."""
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
        if exit_wait_s:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(exit_wait_s)
        if self.process.poll() is None:
            with contextlib.suppress(OSError):
                self.process.send_signal(sig)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self._reader.join(5)
        if self in Child.registry:
            Child.registry.remove(self)
        return self.process.returncode

    @classmethod
    def stop_all(cls) -> None:
        for child in reversed(list(cls.registry)):
            with contextlib.suppress(Exception):
                child.stop()


class BenchError(Exception):
    def __init__(self, message: str, child: Child | None = None) -> None:
        if child is not None:
            message += f"\n--- last lines of {child.name} ({child.log_path}) ---\n" + "\n".join(child.tail)
        super().__init__(message)


@dataclass
class Plan:
    args: argparse.Namespace
    workdir: Path
    token: str
    server_cpus: set[int] | None
    client_cpus: set[int] | None


def pinned_plan(args: argparse.Namespace, workdir: Path, token: str, pin_cpus: bool) -> Plan:
    """A run's plan with the server on the first CPU and the clients on the others, this process
    (a client, or the orchestrator) moved there now, so that the two sides do not steal each
    other's CPU; nothing pinned when not `pin_cpus` or with a single CPU."""
    available = sorted(os.sched_getaffinity(0)) if pin_cpus and hasattr(os, "sched_getaffinity") else []
    if len(available) < 2:
        return Plan(args, workdir, token, None, None)
    client_cpus = set(available[1:])
    os.sched_setaffinity(0, client_cpus)
    return Plan(args, workdir, token, {available[0]}, client_cpus)


def start_server(plan: Plan, name: str, command: list[str]) -> Child:
    """Start a server that logs JSON lines on stderr, pinned to the server CPUs, and wait for its
    `serving` line, which gives its port (every server here listens on port 0)."""
    server = Child(
        name, command, messages_on="stderr", cpus=plan.server_cpus, log_path=plan.workdir / f"{name}.log"
    )
    message = server.expect("serving", START_TIMEOUT_S)
    server.address = f"127.0.0.1:{int(message['port'])}"
    pin(server.process.pid, plan.server_cpus)  # again: threads started since then
    return server


def run_benchmark(
    args: argparse.Namespace,
    name: str,
    run: Callable[[argparse.Namespace, Path], dict[str, Any]],
    print_summary: Callable[[dict[str, Any]], None],
) -> int:
    """Run one benchmark in a work directory of its own: stop its processes whatever happens,
    keep its logs when it fails (or with --keep), print the summary and the JSON report."""

    def terminate(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGHUP, terminate)
    workdir = Path(tempfile.mkdtemp(prefix=f"cogment-bench-{name}-"))
    try:
        report = run(args, workdir)
    except BenchError as error:
        print(f"benchmark failed: {error}", file=sys.stderr)
        print(f"(logs kept in {workdir})", file=sys.stderr)
        args.keep = True
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        Child.stop_all()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print_summary(report)
    if args.keep:
        print(f"logs and database kept in {workdir}", file=sys.stderr)
    print(json.dumps(report, separators=(",", ":")))
    return 0


# ---- the summaries ----


def fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if unit == "%" or abs(value) >= 100:
            return f"{value:,.1f}{unit}"
        return f"{value:.3g}{unit}" if abs(value) < 1 else f"{value:.2f}{unit}"
    return f"{value:,}{unit}" if isinstance(value, int) else f"{value}{unit}"


def print_table(rows: Sequence[Sequence[str]], left_columns: int, out: TextIO) -> None:
    """Rows of cells in aligned columns, the first `left_columns` (labels) left-justified, the
    others (figures) right-justified, the first row (the header) underlined."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for number, row in enumerate(rows):
        print(
            "  ".join(
                cell.ljust(w) if i < left_columns else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            ),
            file=out,
        )
        if number == 0:
            print("  ".join("-" * w for w in widths), file=out)


# ---- S3 transfer data: a random block repeated, never the whole blob in memory ----

BLOCK_SIZE = 16 * MiB  # the random block the data repeats


class RepeatingReader:
    """A file-like source of `size` bytes: `block` over and over."""

    def __init__(self, block: bytes, size: int) -> None:
        self._block = block
        self._size = size
        self._offset = 0

    def read(self, n: int = -1) -> bytes:
        n = self._size - self._offset if n < 0 else min(n, self._size - self._offset)
        pieces = []
        while n > 0:
            start = self._offset % len(self._block)
            piece = self._block[start : start + n]
            pieces.append(piece)
            self._offset += len(piece)
            n -= len(piece)
        if not pieces:
            return b""  # at the end
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def chunks_of(block: bytes, size: int, chunk_size: int) -> Iterator[bytes]:
    reader = RepeatingReader(block, size)
    while chunk := reader.read(chunk_size):
        yield chunk


def sha256_b64(block: bytes, size: int) -> str:
    """The SHA-256 of the data in the registry's and the blob store's form: base64 of the digest."""
    hasher = hashlib.sha256()
    for chunk in chunks_of(block, size, BLOCK_SIZE):
        hasher.update(chunk)
    return base64.b64encode(hasher.digest()).decode("ascii")


def direct_upload(client: Minio, bucket: str, name: str, block: bytes, size: int, part_size: int) -> None:
    """The baseline upload: minio's `put_object`, known length, its default parallel part uploads."""
    source = cast(BinaryIO, RepeatingReader(block, size))  # minio only calls read()
    client.put_object(bucket, name, source, size, part_size=part_size)


def direct_download(
    client: Minio, bucket: str, name: str, chunk_size: int, received: Callable[[bytes], None]
) -> None:
    """The baseline download: minio's `get_object`, read in `chunk_size` chunks, each given to
    `received` (which counts or checks them, as the benchmark's other side does)."""
    response = client.get_object(bucket, name)
    try:
        while chunk := response.read(chunk_size):
            received(chunk)
    finally:
        response.close()
        response.release_conn()
