"""Run a service as a subprocess, as users do (`python -m services.<name>`), and learn its port
from its `serving` log line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType

import grpc

from shared.api import directory_pb2, directory_pb2_grpc

PROJECT_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 30.0


class RunningService:
    def __init__(self, process: subprocess.Popen[str], log_path: Path) -> None:
        self.process = process
        self.log_path = log_path
        self.port: int = 0
        self.lines: list[dict[str, object]] = []
        self._serving = threading.Event()
        self._reader = threading.Thread(target=self._read_logs, daemon=True)
        self._reader.start()

    def _read_logs(self) -> None:
        assert self.process.stderr is not None
        with self.log_path.open("a") as log_file:
            for raw in self.process.stderr:
                log_file.write(raw)
                log_file.flush()
                try:
                    line = json.loads(raw)
                except ValueError:
                    continue
                self.lines.append(line)
                if line.get("event") == "serving" and not self._serving.is_set():
                    self.port = int(line["port"])  # type: ignore[call-overload]
                    self._serving.set()

    def wait_serving(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._serving.wait(0.05):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"service did not start; log:\n{self.log_path.read_text()[-4000:]}")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def endpoint(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    def events(self, name: str) -> list[dict[str, object]]:
        return [line for line in self.lines if line.get("event") == name]

    def terminate(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        code = self.process.wait(timeout_s)
        self._reader.join(5)
        return code

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                self.terminate(signal.SIGTERM, 15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)

    def __enter__(self) -> RunningService:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def rss_bytes(pid: int) -> int:
    """The resident memory of a process (what a memory test asserts on)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def clean_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without its COGMENT_* variables, plus `extra`."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("COGMENT_")}
    environment.update(extra or {})
    return environment


def directory_entries(
    directory_address: str, service_type: directory_pb2.ServiceType.ValueType
) -> list[directory_pb2.FullServiceData]:
    """The entries of `service_type` that the directory at `directory_address` answers with."""
    with grpc.insecure_channel(directory_address) as channel:
        stub = directory_pb2_grpc.DirectorySPStub(channel)
        inquiry = directory_pb2.InquireRequest(details=directory_pb2.ServiceDetails(type=service_type))
        return [reply.data for reply in stub.Inquire(inquiry, timeout=5)]


def start_service(
    module: str, args: list[str], env: dict[str, str] | None = None, log_dir: Path | None = None
) -> RunningService:
    """Start `python -m <module> --port 0 --bind_address 127.0.0.1 --log_format json <args>`."""
    environment = clean_environment(env)
    log_dir = log_dir or Path(os.environ.get("TMPDIR", "/tmp"))
    name = f"{module.replace('.', '_')}-{os.getpid()}-{time.monotonic_ns()}"
    log_path = log_dir / f"{name}.log"
    if "--data_dir" not in args:  # its files (a key, a registration) never in the project's tree
        args = ["--data_dir", str(log_dir / f"{name}-data"), *args]
    command = [
        sys.executable, "-m", module,
        "--port", "0", "--bind_address", "127.0.0.1", "--log_format", "json", "--log_level", "debug",
        *args,
    ]  # fmt: skip
    process = subprocess.Popen(
        command,
        cwd=PROJECT_ROOT,
        env=environment,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    service = RunningService(process, log_path)
    service.wait_serving()
    return service
