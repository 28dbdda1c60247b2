"""Fixtures shared by the test suite: databases (SQLite file, throwaway PostgreSQL cluster), real
S3 (SeaweedFS), and in-process services reached over real gRPC connections."""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.helpers.fake_services import free_port
from tests.helpers.running import (
    DatastoreFactory,
    DirectoryFactory,
    RegistryFactory,
    RunningDatastore,
    RunningDirectory,
    make_datastore_factory,
    make_directory_factory,
    make_registry_factory,
)
from tests.interop.sdk_env import SdkEnvError, ensure_sdk_python

pytest_plugins = ["tests.fixtures.postgres", "tests.fixtures.seaweedfs"]


def pytest_addoption(parser: pytest.Parser) -> None:
    # tests/shared/test_seeded_fault_schedule.py: its fixed seeds and short run by default; a seed
    # it printed replays that run's faults, and a longer run soaks the services.
    group = parser.getgroup("fault schedule", "the seeded fault-schedule test (issue 29)")
    group.addoption(
        "--fault-schedule-seed", type=int, default=None, help="run the fault schedule of this seed only"
    )
    group.addoption(
        "--fault-schedule-seconds",
        type=float,
        default=None,
        help="seconds of faults per seed (default: a short run that fits `make test`)",
    )


@pytest.fixture(scope="session")
def sdk_python() -> Path:
    """Interpreter of the venv holding the official Cogment SDK 2.10.1 (built on first use)."""
    try:
        return ensure_sdk_python()
    except SdkEnvError as error:
        pytest.fail(f"cannot set up the Cogment SDK environment: {error}")


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each test using this runs twice: on an SQLite file and on a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'test.db'}"
    return str(request.getfixturevalue("postgres_url"))


@pytest.fixture
def closed_port() -> int:
    """A port nothing listens on (free when probed)."""
    return free_port()


@pytest.fixture
def directory_factory(database_url: str) -> DirectoryFactory:
    """Directories on `database_url`: tests using it run on SQLite and on PostgreSQL."""
    return make_directory_factory(database_url)


@pytest.fixture
async def directory(directory_factory: DirectoryFactory) -> AsyncIterator[RunningDirectory]:
    """A directory with default settings but a fast health-check interval."""
    async with directory_factory("--health_check_interval", "0.2") as running:
        yield running


@pytest.fixture
def datastore_factory(database_url: str) -> DatastoreFactory:
    """Datastores on `database_url`: tests using it run on SQLite and on PostgreSQL."""
    return make_datastore_factory(database_url)


@pytest.fixture
async def datastore(datastore_factory: DatastoreFactory) -> AsyncIterator[RunningDatastore]:
    async with datastore_factory() as running:
        yield running


@pytest.fixture(params=["sqlite-local", "postgresql-s3"])
def registry_factory(request: pytest.FixtureRequest, tmp_path: Path) -> RegistryFactory:
    """Registries on one database and blob store (several may run at once: replicas)."""
    if request.param == "sqlite-local":
        storage = ["--database_url", f"sqlite+aiosqlite:///{tmp_path / 'registry.db'}",
                   "--archive_dir", str(tmp_path / "blobs")]  # fmt: skip
    else:
        s3 = request.getfixturevalue("seaweed_s3")
        storage = [
            "--database_url", request.getfixturevalue("postgres_url"),
            "--s3_endpoint", s3.endpoint, "--s3_access_key", s3.access_key, "--s3_secret_key", s3.secret_key,
            "--s3_secure=false", "--s3_bucket", f"test-{secrets.token_hex(6)}",
        ]  # fmt: skip
    return make_registry_factory(*storage)


@pytest.fixture
def small_volume(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs of this test's own (mounting needs root), unmounted afterwards: a disk that
    fills up."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount_point = tmp_path / "volume"
    mount_point.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount_point)], check=True)
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "--lazy", str(mount_point)], check=False)
