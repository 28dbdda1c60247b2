"""The suite of the three services the demo's tests run it against: in this process, each on its
own SQLite file, reached over real gRPC."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.demo.helpers import Suite
from tests.helpers.running import make_datastore_factory, make_directory_factory, make_registry_factory


@pytest.fixture
async def suite(tmp_path: Path) -> AsyncIterator[Suite]:
    datastore = make_datastore_factory(f"sqlite+aiosqlite:///{tmp_path / 'datastore.db'}")
    registry = make_registry_factory(
        "--database_url",
        f"sqlite+aiosqlite:///{tmp_path / 'registry.db'}",
        "--archive_dir",
        str(tmp_path / "blobs"),
    )
    directory = make_directory_factory(f"sqlite+aiosqlite:///{tmp_path / 'directory.db'}")
    async with datastore() as d, registry() as r, directory() as e:
        yield Suite(d, r, e)
