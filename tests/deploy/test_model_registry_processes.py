"""The Model Registry as users run it: a process that registers itself in a directory, and the
command-line client against it."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from shared.api import directory_pb2
from tests.helpers.eventually import wait_until
from tests.helpers.services import PROJECT_ROOT, directory_entries, start_service


def registry_args(tmp_path: Path, *extra: str) -> list[str]:
    """A registry's flags: its database and version data in `tmp_path`, then `extra`."""
    return [
        "--database_url", f"sqlite+aiosqlite:///{tmp_path / 'registry.db'}",
        "--archive_dir", str(tmp_path / "blobs"),
        *extra,
    ]  # fmt: skip


def client_command(endpoint: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "services.model_registry.client", "--endpoint", endpoint, *args]


def test_registers_in_the_directory_and_deregisters_on_shutdown(tmp_path: Path) -> None:
    directory_args = ["--database_url", f"sqlite+aiosqlite:///{tmp_path / 'directory.db'}"]
    with start_service("services.directory", directory_args, log_dir=tmp_path) as directory:
        env = {"COGMENT_DIRECTORY_ENDPOINT": directory.endpoint}
        args = registry_args(tmp_path)
        with start_service("services.model_registry", args, env=env, log_dir=tmp_path) as registry:
            (entry,) = wait_until(
                lambda: directory_entries(directory.address, directory_pb2.MODEL_REGISTRY_SERVICE),
                "the registry to register itself",
                timeout_s=15,
                interval_s=0.2,
            )
            assert (entry.endpoint.host, entry.endpoint.port) == ("127.0.0.1", registry.port)
            assert entry.endpoint.protocol == directory_pb2.ServiceEndpoint.GRPC
            assert "__version" in entry.details.properties
        assert registry.process.returncode == 0
        assert directory_entries(directory.address, directory_pb2.MODEL_REGISTRY_SERVICE) == []


def test_shutdown_stays_within_the_grace_when_the_directory_is_gone(tmp_path: Path) -> None:
    """Deregistering from a directory that no longer answers must not hold the shutdown past the
    grace Kubernetes gives (it took the 10 s deregistration deadline)."""
    grace_s = 2.0
    directory_args = ["--database_url", f"sqlite+aiosqlite:///{tmp_path / 'directory.db'}"]
    with start_service("services.directory", directory_args, log_dir=tmp_path) as directory:
        env = {"COGMENT_DIRECTORY_ENDPOINT": directory.endpoint}
        args = registry_args(tmp_path, "--shutdown_grace", str(grace_s))
        with start_service("services.model_registry", args, env=env, log_dir=tmp_path) as registry:
            wait_until(
                lambda: registry.events("registered in the directory"), "its registration", timeout_s=15
            )
            directory.terminate(signal.SIGKILL)
            asked = time.monotonic()
            # The bound is the grace plus the start and end of a Python process, far from 10 s.
            assert registry.terminate(signal.SIGTERM, timeout_s=grace_s + 3) == 0
            assert time.monotonic() - asked < grace_s + 3
            [warning] = registry.events("could not deregister from the directory")
            assert warning["code"] == "DEADLINE_EXCEEDED"


def _client(endpoint: str, *args: str) -> subprocess.CompletedProcess[str]:
    command = client_command(endpoint, *args)
    return subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=60)


def test_command_line_client_round_trip(tmp_path: Path) -> None:
    args = registry_args(tmp_path)
    source = tmp_path / "model.bin"
    source.write_bytes(hashlib.sha256(b"seed").digest() * 200_000)  # 6.4 MB
    with start_service("services.model_registry", args, log_dir=tmp_path) as registry:
        uploaded = _client(
            registry.endpoint, "upload", "pilot", str(source), "--create_model", "--no-archived"
        )
        assert uploaded.returncode == 0, uploaded.stderr
        listed = _client(registry.endpoint, "list_versions", "pilot")
        assert listed.returncode == 0 and "pilot" in listed.stdout, listed.stderr
        target = tmp_path / "downloaded.bin"
        downloaded = _client(registry.endpoint, "download", "pilot", str(target))
        assert downloaded.returncode == 0, downloaded.stderr
        assert target.read_bytes() == source.read_bytes()
        assert _client(registry.endpoint, "delete_model", "pilot").returncode == 0
        missing = _client(registry.endpoint, "download", "pilot", str(tmp_path / "nothing.bin"))
        assert missing.returncode == 1 and "not found" in missing.stderr


def test_output_closed_early_ends_quietly_with_the_status_of_sigpipe(tmp_path: Path) -> None:
    """`list_versions ... | head` printed a BrokenPipeError traceback."""
    args = registry_args(tmp_path)
    source = tmp_path / "model.bin"
    source.write_bytes(b"weights")
    with start_service("services.model_registry", args, log_dir=tmp_path) as registry:
        assert _client(registry.endpoint, "upload", "pilot", str(source), "--create_model").returncode == 0
        for command in (["list_versions", "pilot"], ["download", "pilot", "-"]):
            read_end, write_end = os.pipe()
            os.close(read_end)  # the reader is gone before anything is written: every write fails
            try:
                client = subprocess.run(
                    client_command(registry.endpoint, *command),
                    cwd=PROJECT_ROOT, stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60,
                )  # fmt: skip
            finally:
                os.close(write_end)
            assert (client.returncode, client.stderr) == (128 + signal.SIGPIPE, ""), command
