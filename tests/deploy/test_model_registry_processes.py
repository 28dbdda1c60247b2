"""The Model Registry as users run it: a process that registers itself in a directory, and the
command-line client against it."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from pathlib import Path

from shared.api import directory_pb2
from tests.helpers.services import PROJECT_ROOT, directory_entries, start_service


def test_registers_in_the_directory_and_deregisters_on_shutdown(tmp_path: Path) -> None:
    directory_args = ["--database_url", f"sqlite+aiosqlite:///{tmp_path / 'directory.db'}"]
    with start_service("services.directory", directory_args, log_dir=tmp_path) as directory:
        registry_args = [
            "--database_url", f"sqlite+aiosqlite:///{tmp_path / 'registry.db'}",
            "--archive_dir", str(tmp_path / "blobs"),
        ]  # fmt: skip
        env = {"COGMENT_DIRECTORY_ENDPOINT": directory.endpoint}
        with start_service("services.model_registry", registry_args, env=env, log_dir=tmp_path) as registry:
            deadline = time.monotonic() + 15
            while not (found := directory_entries(directory.address, directory_pb2.MODEL_REGISTRY_SERVICE)):
                assert time.monotonic() < deadline, "the registry did not register itself"
                time.sleep(0.2)
            (entry,) = found
            assert (entry.endpoint.host, entry.endpoint.port) == ("127.0.0.1", registry.port)
            assert entry.endpoint.protocol == directory_pb2.ServiceEndpoint.GRPC
            assert "__version" in entry.details.properties
        assert registry.process.returncode == 0
        assert directory_entries(directory.address, directory_pb2.MODEL_REGISTRY_SERVICE) == []


def _client(endpoint: str, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "services.model_registry.client", "--endpoint", endpoint, *args]
    return subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=60)


def test_command_line_client_round_trip(tmp_path: Path) -> None:
    args = [
        "--database_url",
        f"sqlite+aiosqlite:///{tmp_path / 'r.db'}",
        "--archive_dir",
        str(tmp_path / "b"),
    ]
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
