"""The Trial Datastore as users run it: a process that registers itself in a directory twice
(as DATASTORE_SERVICE and DATALOG_SERVICE, on the same port) and deregisters on shutdown, and
reports the load its ingestion puts on it."""

from __future__ import annotations

import functools
import threading
import time
from pathlib import Path

import grpc

from shared.api import common_pb2, datalog_pb2_grpc, directory_pb2, trial_datastore_pb2_grpc
from tests.helpers.datastore import datalog_inputs, full_trial, trial_params
from tests.helpers.eventually import wait_until
from tests.helpers.services import directory_entries, start_service


def test_registers_as_datastore_and_datalog_and_deregisters_on_shutdown(tmp_path: Path) -> None:
    types = [directory_pb2.DATASTORE_SERVICE, directory_pb2.DATALOG_SERVICE]
    directory_args = ["--database_url", f"sqlite+aiosqlite:///{tmp_path / 'directory.db'}"]
    with start_service("services.directory", directory_args, log_dir=tmp_path) as directory:
        datastore_args = ["--database_url", f"sqlite+aiosqlite:///{tmp_path / 'datastore.db'}"]
        env = {"COGMENT_DIRECTORY_ENDPOINT": directory.endpoint}
        with start_service("services.datastore", datastore_args, env=env, log_dir=tmp_path) as datastore:
            for service_type in types:
                (entry,) = wait_until(
                    functools.partial(directory_entries, directory.address, service_type),
                    f"the datastore to register as {service_type}",
                    timeout_s=15,
                    interval_s=0.2,
                )
                assert (entry.endpoint.host, entry.endpoint.port) == ("127.0.0.1", datastore.port)
                assert "__version" in entry.details.properties
        assert datastore.process.returncode == 0
        assert all(directory_entries(directory.address, service_type) == [] for service_type in types)


def test_overall_load_reports_the_ingestion_it_does(tmp_path: Path) -> None:
    """What the directory balances trials by: a datastore busy ingesting reports a load well
    above the one it reports idle."""
    args = ["--database_url", f"sqlite+aiosqlite:///{tmp_path / 'datastore.db'}"]
    with start_service("services.datastore", args, log_dir=tmp_path) as datastore:
        with grpc.insecure_channel(datastore.address) as channel:
            status = common_pb2.StatusRequest(names=["overall_load"])
            stub = trial_datastore_pb2_grpc.TrialDatastoreSPStub(channel)

            def load() -> int:
                return int(stub.Status(status, timeout=5).statuses["overall_load"])

            time.sleep(2.5)  # past the sampling period that saw the start-up
            idle = load()
            loads: list[int] = []
            stop = threading.Event()

            def sample_loads() -> None:
                while not stop.wait(0.25):
                    loads.append(load())

            sampler = threading.Thread(target=sample_loads)
            sampler.start()
            try:
                deadline = time.monotonic() + 4
                trial = 0
                while time.monotonic() < deadline:
                    trial += 1
                    samples = full_trial(300)
                    acks = datalog_pb2_grpc.DatalogSPStub(channel).RunTrialDatalog(
                        iter(datalog_inputs(trial_params(), samples)),
                        metadata=(("trial-id", f"load-{trial}"), ("user-id", "u")),
                        timeout=30,
                    )
                    assert len(list(acks)) == 1 + len(samples)
            finally:
                stop.set()
                sampler.join()
        assert idle < 10, idle
        assert max(loads) >= idle + 20, (idle, loads)
