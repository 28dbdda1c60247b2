"""`python -m services`, what `make run` starts: its help, flags passed through to the services,
and what happens when one of them dies."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.__main__ import SERVICES
from services.console import service as console_service
from services.datastore import service as datastore_service
from services.directory import service as directory_service
from services.model_registry import service as registry_service
from shared.api import common_pb2, directory_pb2_grpc
from tests.helpers.fake_services import free_port
from tests.helpers.services import clean_environment

pytestmark = pytest.mark.timeout(90)


class Supervisor:
    def __init__(self, process: subprocess.Popen[str], log_path: Path) -> None:
        self.process = process
        self.log_path = log_path

    def lines(self) -> list[dict[str, Any]]:
        """The JSON log lines of the supervisor and of its services so far."""
        found = []
        for raw in self.log_path.read_text().splitlines():
            try:
                found.append(json.loads(raw))
            except ValueError:
                continue
        return found

    def wait_for(self, event: str, count: int, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        while len(found := [line for line in self.lines() if line.get("event") == event]) < count:
            assert self.process.poll() is None, self.log_path.read_text()
            assert time.monotonic() < deadline, f"waiting for {count} {event!r}:\n{self.log_path.read_text()}"
            time.sleep(0.05)
        return found

    def children(self) -> dict[str, int]:
        """The pid of each service, from the supervisor's `started` lines."""
        return {str(line["service"]): int(line["pid"]) for line in self.wait_for("started", len(SERVICES))}


@contextmanager
def supervisor(tmp_path: Path, *args: str) -> Iterator[Supervisor]:
    """`python -m services <args>` in `tmp_path` (its data directory there), JSON logs, every
    service on 127.0.0.1 and a free port unless `args` say otherwise."""
    env = clean_environment(
        {
            f"{prefix}_{setting}": value
            for prefix in SERVICES.values()
            for setting, value in (("PORT", "0"), ("BIND_ADDRESS", "127.0.0.1"))
        }
    )
    log_path = tmp_path / "services.log"
    with log_path.open("w") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "services", "--log_format", "json", *args],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log_file,
            text=True,
            start_new_session=True,  # its group holds it and its services, and nothing else
        )
    running = Supervisor(process, log_path)
    try:
        yield running
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.append(pid)
    return alive


def run_to_exit(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m services <args>` in `tmp_path`, expected to exit by itself."""
    return subprocess.run(
        [sys.executable, "-m", "services", *args],
        cwd=tmp_path,
        env=clean_environment(),
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_help_describes_it_and_starts_nothing(tmp_path: Path) -> None:
    result = run_to_exit(tmp_path, "--help")
    assert result.returncode == 0
    assert result.stdout.startswith("usage: python -m services")
    for text in (
        "--directory FLAGS",
        "--model_registry FLAGS",
        "--datastore FLAGS",
        "COGMENT_TRIAL_DATASTORE_*",
    ):
        assert text in result.stdout
    assert not (tmp_path / ".cogment-aux").exists()


def test_an_unknown_flag_is_a_usage_error(tmp_path: Path) -> None:
    result = run_to_exit(tmp_path, "--port", "1234")
    assert result.returncode == 2
    assert "unrecognized arguments: --port 1234" in result.stderr
    assert not (tmp_path / ".cogment-aux").exists()


def test_unreadable_service_flags_are_a_usage_error_of_the_command_used(tmp_path: Path) -> None:
    for command, prog in (
        (["-m", "services"], "python -m services"),
        (["-m", "services.cli", "services", "all"], "cogment-aux services all"),
    ):
        result = subprocess.run(
            [sys.executable, *command, "--directory=--port '9105"],
            cwd=tmp_path,
            env=clean_environment(),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert result.returncode == 2
        assert result.stderr == f"{prog}: error: --directory: No closing quotation\n"
        assert not (tmp_path / ".cogment-aux").exists()


def test_flags_reach_their_service_and_sigterm_stops_all_with_status_0(tmp_path: Path) -> None:
    port = free_port()
    with supervisor(tmp_path, f"--directory=--port {port} --registration_lag 0") as running:
        pids = running.children()
        servings = {str(line["service"]): line for line in running.wait_for("serving", len(SERVICES))}
        assert servings["directory"]["port"] == port
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = directory_pb2_grpc.DirectorySPStub(channel)
            assert stub.Version(common_pb2.VersionRequest(), timeout=5).versions
        running.process.send_signal(signal.SIGTERM)
        assert running.process.wait(30) == 0
        assert _alive(list(pids.values())) == []
        assert {line["service"] for line in running.lines() if line.get("event") == "stopped"} == set(
            SERVICES
        )


@pytest.mark.parametrize("victim", SERVICES)
def test_a_service_that_dies_is_named_and_the_exit_status_says_so(tmp_path: Path, victim: str) -> None:
    with supervisor(tmp_path) as running:
        pids = running.children()
        running.wait_for("serving", len(SERVICES))
        os.kill(pids[victim], signal.SIGKILL)
        assert running.process.wait(30) == 128 + signal.SIGKILL
        [ended] = running.wait_for("a service ended: stopping the others", 1)
        assert (ended["service"], ended["signal"], ended["level"]) == (victim, "SIGKILL", "error")
        assert _alive(list(pids.values())) == []
        others = {line["service"] for line in running.lines() if line.get("event") == "stopped"}
        assert others == set(SERVICES) - {victim}


def test_a_service_that_cannot_start_stops_the_others_with_its_status(tmp_path: Path) -> None:
    with supervisor(tmp_path, "--datastore=--database_url mysql://nowhere/x") as running:
        pids = running.children()
        assert running.process.wait(30) == 1
        [ended] = running.wait_for("a service failed to start: stopping the others", 1)
        assert (ended["service"], ended["exit_status"]) == ("datastore", 1)
        [why] = [line for line in running.lines() if line.get("event") == "cannot start"]
        assert why["service"] == "datastore" and "unsupported database URL" in why["error"]
        assert _alive(list(pids.values())) == []


def test_a_second_supervisor_on_taken_ports_says_its_services_failed_to_start(tmp_path: Path) -> None:
    """Each service of the second one fails to start, or is stopped while starting: none is said
    to have failed to stop, and each one said to have failed to start said why itself."""
    ports = {name: free_port() for name in SERVICES}
    flags = [f"--{name}=--port {port}" for name, port in ports.items()]
    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    first_dir.mkdir()
    second_dir.mkdir()
    with supervisor(first_dir, *flags) as first:
        first.wait_for("serving", len(SERVICES))
        with supervisor(second_dir, *flags) as second:
            assert second.process.wait(30) == 1
            lines = second.lines()
        events = [line["event"] for line in lines]
        assert "a service failed to stop cleanly" not in events
        [ended] = [
            line for line in lines if line["event"] == "a service failed to start: stopping the others"
        ]
        failed = {ended["service"]} | {
            line["service"] for line in lines if line["event"] == "a service failed to start"
        }
        reasons = {line["service"]: line["error"] for line in lines if line["event"] == "cannot start"}
        assert failed <= reasons.keys()
        assert all("Address already in use" in reasons[name] for name in failed), reasons
        # The first one serves on, untouched.
        assert first.process.poll() is None
        assert not [line for line in first.lines() if line["level"] == "error"]


def test_every_line_of_a_service_names_it(tmp_path: Path) -> None:
    """Up to `serving` (and after): start-up lines too, so that lines on one stderr can be told apart."""
    with supervisor(tmp_path, "--log_level", "debug") as running:
        running.wait_for("serving", len(SERVICES))
        running.process.send_signal(signal.SIGTERM)
        assert running.process.wait(30) == 0
        lines = running.lines()
    raw = [text for text in running.log_path.read_text().splitlines() if text.strip()]
    assert len(raw) == len(lines)  # every line is JSON, library lines included
    assert all(line.get("service") in SERVICES for line in lines), [
        line for line in lines if line.get("service") not in SERVICES
    ]
    for name in SERVICES:
        assert {"serving", "stopped"} <= {line["event"] for line in lines if line["service"] == name}


def test_the_environment_prefixes_are_the_services_own() -> None:
    assert SERVICES == {
        "directory": directory_service.ENV_PREFIX,
        "model_registry": registry_service.ENV_PREFIX,
        "datastore": datastore_service.ENV_PREFIX,
        "console": console_service.ENV_PREFIX,
    }
