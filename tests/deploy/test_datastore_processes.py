"""The Trial Datastore as users run it: a process that registers itself in a directory twice
(as DATASTORE_SERVICE and DATALOG_SERVICE, on the same port) and deregisters on shutdown."""

from __future__ import annotations

import time
from pathlib import Path

from shared.api import directory_pb2
from tests.helpers.services import directory_entries, start_service


def test_registers_as_datastore_and_datalog_and_deregisters_on_shutdown(tmp_path: Path) -> None:
    types = [directory_pb2.DATASTORE_SERVICE, directory_pb2.DATALOG_SERVICE]
    directory_args = ["--database_url", f"sqlite+aiosqlite:///{tmp_path / 'directory.db'}"]
    with start_service("services.directory", directory_args, log_dir=tmp_path) as directory:
        datastore_args = ["--database_url", f"sqlite+aiosqlite:///{tmp_path / 'datastore.db'}"]
        env = {"COGMENT_DIRECTORY_ENDPOINT": directory.endpoint}
        with start_service("services.datastore", datastore_args, env=env, log_dir=tmp_path) as datastore:
            deadline = time.monotonic() + 15
            for service_type in types:
                while not (found := directory_entries(directory.address, service_type)):
                    assert time.monotonic() < deadline, f"the datastore did not register as {service_type}"
                    time.sleep(0.2)
                (entry,) = found
                assert (entry.endpoint.host, entry.endpoint.port) == ("127.0.0.1", datastore.port)
                assert "__version" in entry.details.properties
        assert datastore.process.returncode == 0
        assert all(directory_entries(directory.address, service_type) == [] for service_type in types)
