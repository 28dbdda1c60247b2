"""The Trial Datastore command-line client (`python -m services.datastore.client`) against a real
datastore over gRPC, on SQLite and on PostgreSQL, and the export file format it writes and reads.

The CLI runs in-process (its `main`, in a thread: the datastore serves from the test's event
loop) and as a subprocess where standard input and output matter."""

from __future__ import annotations

import asyncio
import io
import json
import os
import pty
import re
import shlex
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import grpc
import pytest

from services.datastore.client.api import DatastoreClient
from services.datastore.client.cli import main
from services.datastore.client.transfer import IMPORT_BATCH, import_trials
from services.datastore.client.trial_file import TrialFileError, TrialFileReader
from shared.api import common_pb2
from shared.api import trial_datastore_pb2 as ds
from shared.cli import to_json
from shared.client import ClientError
from shared.version import PACKAGE_VERSION
from tests.helpers.datastore import (
    add_trial,
    datalog_inputs,
    datalog_sample,
    full_trial,
    list_trials,
    read_samples,
    run_datalog,
    send_acknowledged,
    trial_params,
)
from tests.helpers.eventually import eventually
from tests.helpers.fake_services import free_port
from tests.helpers.running import RunningDatastore
from tests.helpers.services import PROJECT_ROOT, clean_environment

MAGIC = b"COGMENTTRIALS001"
CAPTION = re.compile(r"^(\d+) trials retrieved(?: from <(.*)>)?, next trial handle is <(.*)>$")


# ---- running the CLI ----


@dataclass
class Run:
    code: int
    out: str
    err: str


def endpoint(d: RunningDatastore) -> str:
    return f"grpc://127.0.0.1:{d.service.port}"


async def cli(d: RunningDatastore, *args: str) -> Run:
    """`main(args)` in a thread, against `d`."""
    out, err = io.StringIO(), io.StringIO()
    code = await asyncio.to_thread(main, [*args, "--endpoint", endpoint(d)], {}, out, err)
    return Run(code, out.getvalue(), err.getvalue())


async def ok(d: RunningDatastore, *args: str) -> str:
    run = await cli(d, *args)
    assert run.code == 0, run.err
    return run.out


async def fails(d: RunningDatastore, *args: str) -> str:
    """The error message of a command that must exit with 1."""
    run = await cli(d, *args)
    assert (run.code, run.out) == (1, ""), run
    assert run.err.startswith("Error: ")
    return run.err.strip()


def client_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.datastore.client", *args]


def run_process(*args: str) -> subprocess.CompletedProcess[bytes]:
    result = subprocess.run(
        client_command(*args), cwd=PROJECT_ROOT, env=clean_environment(), capture_output=True, timeout=60
    )
    assert b"Traceback" not in result.stderr, result.stderr.decode()
    return result


def popen(*args: str, stdin: int | IO[bytes] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        client_command(*args), cwd=PROJECT_ROOT, env=clean_environment(), stdin=stdin,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_interruptible,
    )  # fmt: skip


def _interruptible() -> None:
    """Ctrl-C's default in the client: a shell running the tests in the background (CI) ignores
    SIGINT, and its children would inherit that, and Python would never see the signal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# ---- trial data ----


async def read_first(d: RunningDatastore, trial_id: str, count: int) -> list[ds.StoredTrialSample]:
    """The first `count` samples of a trial, which may never end (imported ongoing trials)."""
    call = d.stub.RetrieveSamples(ds.RetrieveSamplesRequest(trial_ids=[trial_id]), timeout=30)
    samples: list[ds.StoredTrialSample] = []
    async for reply in call:
        samples.append(reply.trial_sample)
        if len(samples) == count:
            break
    call.cancel()
    return samples


async def infos(d: RunningDatastore) -> dict[str, ds.StoredTrialInfo]:
    return {info.trial_id: info for info in (await list_trials(d)).trial_infos}


async def three_trials(d: RunningDatastore) -> None:
    """t0: 20 samples, ended; t1: 10 samples, still running; empty: no samples."""
    await run_datalog(d, "t0", full_trial(20), trial_params(kind="a"))
    await run_datalog(d, "t1", [datalog_sample(tick, reward=tick / 2) for tick in range(10)])
    await add_trial(d, "empty")


def renamed(sample: ds.StoredTrialSample, trial_id: str) -> bytes:
    copy = ds.StoredTrialSample()
    copy.CopyFrom(sample)
    copy.trial_id = trial_id
    return copy.SerializeToString()


async def assert_imported(d: RunningDatastore, prefix: str, user_id: str) -> None:
    """t0 and t1 of `three_trials` were imported with `prefix`: same samples, new ids and owner."""
    stored = await infos(d)
    assert f"{prefix}empty" not in stored  # no samples: not exported
    for trial_id, state, count in [("t0", common_pb2.ENDED, 20), ("t1", common_pb2.RUNNING, 10)]:
        original, imported = stored[trial_id], stored[prefix + trial_id]
        assert (imported.user_id, imported.last_state, imported.samples_count) == (user_id, state, count)
        assert imported.params == original.params
        # Byte for byte the original samples, but for the trial id; their user id is kept.
        samples = await read_first(d, prefix + trial_id, count)
        assert [s.SerializeToString() for s in samples] == [
            renamed(s, prefix + trial_id) for s in await read_samples(d, [trial_id])
        ]
        assert {s.user_id for s in samples} == {"the-user"}


# ---- the file format, by hand (independent of trial_file.py) ----


def frame(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


def hand_built_file(samples: Sequence[ds.StoredTrialSample], trial_ids: Sequence[str]) -> bytes:
    header = ds.TrialSamplesFileHeader(
        version_info=common_pb2.VersionInfo(
            versions=[common_pb2.VersionInfo.Version(name="cogment", version="2.9")]
        ),
        export_timestamp=123,
        trial_params={trial_id: trial_params(origin=trial_id) for trial_id in trial_ids},
    )
    return MAGIC + frame(header.SerializeToString()) + b"".join(frame(s.SerializeToString()) for s in samples)


def parse_by_hand(data: bytes) -> tuple[ds.TrialSamplesFileHeader, list[ds.StoredTrialSample]]:
    assert data[:16] == MAGIC
    messages, position = [], 16
    while position < len(data):
        (length,) = struct.unpack_from("<I", data, position)
        messages.append(data[position + 4 : position + 4 + length])
        position += 4 + length
    assert position == len(data)
    header = ds.TrialSamplesFileHeader.FromString(messages[0])
    return header, [ds.StoredTrialSample.FromString(m) for m in messages[1:]]


def stored_sample(trial_id: str, tick: int, state: int = common_pb2.RUNNING) -> ds.StoredTrialSample:
    return ds.StoredTrialSample(
        user_id="someone", trial_id=trial_id, tick_id=tick, timestamp=tick * 10, state=state,  # type: ignore[arg-type]
        actor_samples=[ds.StoredTrialActorSample(actor=0, observation=0, reward=1.5)],
        payloads=[f"{trial_id}-{tick}".encode()],
    )  # fmt: skip


def read_all(reader: TrialFileReader) -> tuple[ds.TrialSamplesFileHeader, list[ds.StoredTrialSample]]:
    header = reader.read_header()
    samples = []
    while (sample := reader.read_sample()) is not None:
        samples.append(sample)
    return header, samples


class OneByteAtATime(io.RawIOBase):
    """A stream whose reads return at most one byte, as a slow pipe may."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._position = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        if self._position >= len(self._data) or not len(buffer):
            return 0
        buffer[0] = self._data[self._position]
        self._position += 1
        return 1


# ---- list_trials ----


async def test_list_with_no_trials(datastore: RunningDatastore) -> None:
    lines = (await ok(datastore, "list_trials")).splitlines()
    assert lines == [
        "TRIAL ID  USER ID  STATE  SAMPLES  ACTORS  PROPERTIES",
        "0 trials retrieved, next trial handle is <0>",
    ]
    reply = json.loads(await ok(datastore, "list", "--console_output", "json"))
    assert reply == {"trial_infos": [], "next_trial_handle": "0"}


async def test_list_pages_with_from(datastore: RunningDatastore) -> None:
    for number in range(10):
        await add_trial(datastore, f"trial{number}", user_id=f"user{number}", index=str(number))
    await run_datalog(datastore, "trial3", full_trial(4))  # updates trial3: its place stays

    def rows(output: str) -> tuple[list[list[str]], re.Match[str]]:
        lines = output.splitlines()
        assert lines[0].split() == ["TRIAL", "ID", "USER", "ID", "STATE", "SAMPLES", "ACTORS", "PROPERTIES"]
        caption = CAPTION.match(lines[-1])
        assert caption is not None, lines[-1]
        return [line.split() for line in lines[1:-1]], caption

    first, caption = rows(await ok(datastore, "list", "--count", "5"))
    assert [row[0] for row in first] == [f"trial{n}" for n in range(5)]
    assert first[0] == ["trial0", "user0", "UNKNOWN", "0", "3", "index=0"]
    assert first[3] == ["trial3", "the-user", "ENDED", "4", "3"]  # the datalog's params have no properties
    assert caption.group(1, 2) == ("5", None)

    handle = caption.group(3)
    second, caption = rows(await ok(datastore, "list", "--count", "5", "--from", handle))
    assert [row[0] for row in second] == [f"trial{n}" for n in range(5, 10)]
    assert caption.group(1, 2) == ("5", handle)
    last, caption = rows(await ok(datastore, "list", "--count=5", f"--from={caption.group(3)}"))
    assert last == [] and caption.group(1) == "0"

    # The default count is 10.
    everything, _ = rows(await ok(datastore, "list_trials", "--count", "100"))
    assert len(everything) == 10
    assert len(rows(await ok(datastore, "list_trials"))[0]) == 10
    await add_trial(datastore, "trial10")
    assert len(rows(await ok(datastore, "list_trials"))[0]) == 10


async def test_list_filters_on_properties(datastore: RunningDatastore) -> None:
    for number in range(20):
        properties = {"key": "value", **({"key2": "value2"} if number % 2 else {})}
        await add_trial(datastore, f"trial{number}", **properties)
    await add_trial(datastore, "other", key="other")

    async def listed(*args: str) -> list[str]:
        return [
            line.split()[0]
            for line in (await ok(datastore, "list", "--count", "100", *args)).splitlines()[1:-1]
        ]

    assert len(await listed("--properties", "key=value")) == 20
    both = await listed("--properties", "key=value, key2=value2")
    assert both == [f"trial{n}" for n in range(1, 20, 2)]
    assert await listed("--properties", "key=other") == ["other"]
    assert await listed("--properties", "key=nothing") == []
    text = await ok(datastore, "list", "--properties", "key2=value2", "--count", "1")
    assert "key=value,key2=value2" in text.splitlines()[1]


async def test_list_json_is_the_reply(datastore: RunningDatastore) -> None:
    """The reply, each trial saying whether it was interrupted (t1's stream closed before it ended)."""
    await three_trials(datastore)
    reply = json.loads(await ok(datastore, "list", "--console_output", "json", "--count", "3"))
    expected = to_json(await list_trials(datastore, trials_count=3))
    for info, interrupted in zip(expected["trial_infos"], [False, True, False], strict=True):
        info["interrupted"] = interrupted
    assert reply == expected
    assert [info["trial_id"] for info in reply["trial_infos"]] == ["t0", "t1", "empty"]
    assert reply["trial_infos"][0]["last_state"] == "ENDED" and reply["trial_infos"][0]["samples_count"] == 20
    assert reply["trial_infos"][1]["last_state"] == "RUNNING"  # the wire's state, as the reference's


async def test_list_shows_interrupted_trials(datastore: RunningDatastore) -> None:
    await three_trials(datastore)
    live = datastore.datalog.RunTrialDatalog(metadata=(("trial-id", "live"), ("user-id", "u")))
    await send_acknowledged(live, datalog_inputs(trial_params(), [datalog_sample(0)]))
    rows = {line.split()[0]: line.split() for line in (await ok(datastore, "list")).splitlines()[1:-1]}
    assert {trial_id: row[2] for trial_id, row in rows.items()} == {
        "t0": "ENDED",
        "t1": "INTERRUPTED",
        "empty": "UNKNOWN",
        "live": "RUNNING",  # its stream is open
    }
    await live.done_writing()
    assert await live.read() == grpc.aio.EOF
    rows = {line.split()[0]: line.split() for line in (await ok(datastore, "list")).splitlines()[1:-1]}
    assert rows["live"][2] == "INTERRUPTED"


async def test_list_against_a_datastore_without_trial_statuses_shows_the_wire_state() -> None:
    """The reference datastore has no TrialStatusSP: the listing falls back to the wire's state,
    without a word."""
    info = ds.StoredTrialInfo(trial_id="t", user_id="u", last_state=common_pb2.RUNNING, samples_count=2)

    async def retrieve_trials(request: ds.RetrieveTrialsRequest, context: object) -> ds.RetrieveTrialsReply:
        return ds.RetrieveTrialsReply(trial_infos=[info], next_trial_handle="1")

    server = grpc.aio.server()
    handler = grpc.unary_unary_rpc_method_handler(
        retrieve_trials,
        request_deserializer=ds.RetrieveTrialsRequest.FromString,
        response_serializer=ds.RetrieveTrialsReply.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("cogmentAPI.TrialDatastoreSP", {"RetrieveTrials": handler})]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        for output in ("text", "json"):
            out, err = io.StringIO(), io.StringIO()
            argv = ["list", "--endpoint", f"grpc://127.0.0.1:{port}", "--console_output", output]
            code = await asyncio.to_thread(main, argv, {}, out, err)
            assert (code, err.getvalue()) == (0, "")
            if output == "text":
                assert out.getvalue().splitlines()[1].split()[:3] == ["t", "u", "RUNNING"]
            else:
                [listed] = json.loads(out.getvalue())["trial_infos"]
                assert (listed["last_state"], listed["interrupted"]) == ("RUNNING", False)
    finally:
        await server.stop(None)


async def test_list_usage_errors(datastore: RunningDatastore, capsys: pytest.CaptureFixture[str]) -> None:
    for count in ["0", "-1", "x", str(2**32)]:
        with pytest.raises(SystemExit) as exited:
            main(["list", "--count", count])
        assert exited.value.code == 2
        assert "expected a strictly positive number" in capsys.readouterr().err
    message = await fails(datastore, "list", "--from", "not-a-handle")
    assert "INVALID_ARGUMENT" in message and "not-a-handle" in message


async def test_unreachable_datastore() -> None:
    out, err = io.StringIO(), io.StringIO()
    code = await asyncio.to_thread(main, ["list", "--endpoint", "grpc://127.0.0.1:1"], {}, out, err)
    assert code == 1 and "cannot reach the trial datastore at grpc://127.0.0.1:1" in err.getvalue()


# ---- delete_trials ----


async def test_delete_counts_the_trials_it_deleted(datastore: RunningDatastore) -> None:
    await three_trials(datastore)
    deleted = await ok(datastore, "delete_trials", "t0", "empty", "unknown", "t0")
    assert deleted == "2 trials deleted; not stored: [unknown]\n"
    assert list(await infos(datastore)) == ["t1"]
    reply = json.loads(await ok(datastore, "delete", "t1", "nosuch", "--console_output", "json"))
    assert reply == {
        "message": "1 trial deleted; not stored: [nosuch]",
        "trial_ids": ["t1", "nosuch"],  # the ids given, as before
        "deleted": ["t1"],
        "not_stored": ["nosuch"],
    }
    assert await ok(datastore, "delete", "t1") == "0 trials deleted; not stored: [t1]\n"
    assert await infos(datastore) == {}


# ---- export / import ----


async def test_export_needs_trials_with_samples(datastore: RunningDatastore, tmp_path: Path) -> None:
    await add_trial(datastore, "trial0")
    await add_trial(datastore, "trial2")
    target = tmp_path / "export.trials"
    message = await fails(datastore, "export", "trial0", "trial2", "--file", str(target))
    assert message == "Error: no samples to export for selected trials"
    message = await fails(datastore, "export", "trial0", "nope", "gone", "--file", str(target))
    assert message == "Error: trials [nope, gone] not found"
    assert not target.exists()
    await run_datalog(datastore, "trial0", full_trial(2))
    message = await fails(datastore, "export", "trial0", "--file", str(tmp_path))
    assert message.startswith(f"Error: cannot write [{tmp_path}]")


async def test_export_import_round_trip_through_a_file(datastore: RunningDatastore, tmp_path: Path) -> None:
    await three_trials(datastore)
    target = tmp_path / "export.trials"
    target.write_bytes(b"x" * 100_000)  # a longer file is replaced, not overwritten
    before = time.time_ns()
    output = await ok(datastore, "export", "t0", "empty", "t1", "t0", "--file", str(target))
    data = target.read_bytes()
    assert output == f'2 trials exported to "{target}" (30 samples, {len(data)} bytes written)\n'

    header, samples = parse_by_hand(data)
    assert [(v.name, v.version) for v in header.version_info.versions] == [("cogment", PACKAGE_VERSION)]
    assert before <= header.export_timestamp <= time.time_ns()
    stored = await infos(datastore)
    assert dict(header.trial_params) == {"t0": stored["t0"].params, "t1": stored["t1"].params}
    originals = {trial_id: await read_samples(datastore, [trial_id]) for trial_id in ("t0", "t1")}
    for trial_id, trial_samples in originals.items():
        assert [s for s in samples if s.trial_id == trial_id] == trial_samples

    output = await ok(
        datastore, "import", "--file", str(target), "--prefix", "copy-", "--user_id", "import-test"
    )
    assert output == f'2 trials imported (30 samples) from "{target}"\n'
    await assert_imported(datastore, "copy-", "import-test")

    # Default user id, json output.
    reply = json.loads(
        await ok(datastore, "import", "--file", str(target), "--prefix", "again-", "--console_output", "json")
    )
    assert reply["samples_count"] == 30 and reply["filepath"] == str(target)
    assert sorted((t["trial_id"], t["samples_count"]) for t in reply["trials"]) == [
        ("again-t0", 20),
        ("again-t1", 10),
    ]
    await assert_imported(datastore, "again-", "cogment CLI")

    reply = json.loads(await ok(datastore, "export", "t1", "--file", str(target), "--console_output", "json"))
    assert reply["trial_ids"] == ["t1"] and reply["samples_count"] == 10
    assert reply["bytes"] == target.stat().st_size and reply["filepath"] == str(target)


async def test_export_import_round_trip_through_pipes(datastore: RunningDatastore) -> None:
    await three_trials(datastore)
    address = endpoint(datastore)

    exported = await asyncio.to_thread(run_process, "export", "t0", "t1", "--endpoint", address)
    assert exported.returncode == 0 and exported.stderr == b""
    _, samples = parse_by_hand(exported.stdout)
    assert len(samples) == 30

    def pipeline() -> tuple[int, bytes, bytes, int, bytes]:
        export = popen("export", "t0", "t1", "empty", "--endpoint", address)
        assert export.stdout is not None and export.stderr is not None
        importer = popen("import", "--prefix", "piped-", "--user_id", "import-test", "--endpoint", address,
                         stdin=export.stdout)  # fmt: skip
        export.stdout.close()  # the importer holds the pipe now
        out, err = importer.communicate(timeout=60)
        export_err = export.stderr.read()
        export.stderr.close()
        return importer.returncode, out, err, export.wait(30), export_err

    code, out, err, export_code, export_err = await asyncio.to_thread(pipeline)
    assert (export_code, export_err) == (0, b"")
    assert (code, err) == (0, b"")
    assert out == b'2 trials imported (30 samples) from "stdin"\n'
    await assert_imported(datastore, "piped-", "import-test")


async def test_import_reads_a_trickling_pipe(datastore: RunningDatastore) -> None:
    data = hand_built_file([stored_sample("a", tick) for tick in range(3)], ["a"])

    def trickle() -> subprocess.CompletedProcess[bytes]:
        process = popen("import", "--endpoint", endpoint(datastore), stdin=subprocess.PIPE)
        assert process.stdin is not None
        for byte in data:
            process.stdin.write(bytes([byte]))
            process.stdin.flush()
            time.sleep(0.0005)
        out, err = process.communicate(timeout=60)
        return subprocess.CompletedProcess(process.args, process.returncode, out, err)

    result = await asyncio.to_thread(trickle)
    assert (result.returncode, result.stderr) == (0, b""), result.stderr
    assert result.stdout == b'1 trials imported (3 samples) from "stdin"\n'
    assert (await infos(datastore))["a"].samples_count == 3


async def test_import_refuses_existing_trials(datastore: RunningDatastore, tmp_path: Path) -> None:
    await three_trials(datastore)
    target = tmp_path / "export.trials"
    await ok(datastore, "export", "t0", "t1", "--file", str(target))
    await ok(datastore, "import", "--file", str(target), "--prefix", "p-")
    message = await fails(datastore, "import", "--file", str(target), "--prefix", "p-")
    match = re.fullmatch(
        r"Error: trials \[(.*)\] already exist in the target datastore, import aborted; "
        r"import them under other ids with --prefix PREFIX",
        message,
    )
    assert match is not None and sorted(match.group(1).split(", ")) == ["p-t0", "p-t1"]
    # Without a prefix the ids are the originals, which exist.
    message = await fails(datastore, "import", "--file", str(target))
    assert "[t0, t1] already exist" in message or "[t1, t0] already exist" in message
    stored = await infos(datastore)
    assert len(stored) == 5 and stored["p-t0"].samples_count == 20


async def test_export_cuts_ongoing_trials_at_their_count(datastore: RunningDatastore, tmp_path: Path) -> None:
    call = datastore.datalog.RunTrialDatalog(metadata=(("trial-id", "live"),))
    inputs = datalog_inputs(trial_params(), [datalog_sample(tick) for tick in range(8)])
    await send_acknowledged(call, inputs[:6])  # the parameters and 5 samples
    target = tmp_path / "live.trials"
    # The trial goes on: the export stops at the 5 samples it had.
    await ok(datastore, "export", "live", "--file", str(target))
    await send_acknowledged(call, inputs[6:])
    await call.done_writing()
    _, samples = parse_by_hand(target.read_bytes())
    assert [s.tick_id for s in samples] == [0, 1, 2, 3, 4]
    assert (await infos(datastore))["live"].samples_count == 8


async def test_many_trials_and_interleaved_samples(datastore: RunningDatastore, tmp_path: Path) -> None:
    # More trials than one lookup (20) and than the AddSample calls an import keeps open (32),
    # with each trial's samples spread over the file.
    trial_ids = [f"trial{n:02d}" for n in range(45)]
    samples = [stored_sample(trial_id, tick) for tick in range(3) for trial_id in trial_ids]
    samples[-1].state = common_pb2.ENDED
    source = tmp_path / "hand.trials"
    source.write_bytes(hand_built_file(samples, trial_ids))
    assert (
        await ok(datastore, "import", "--file", str(source))
        == f'45 trials imported (135 samples) from "{source}"\n'
    )

    stored = await infos(datastore)
    assert [stored[t].samples_count for t in trial_ids] == [3] * 45
    assert (
        stored["trial44"].last_state == common_pb2.ENDED
        and stored["trial00"].last_state == common_pb2.RUNNING
    )
    assert stored["trial07"].params.properties == {"origin": "trial07"}
    assert stored["trial07"].user_id == "cogment CLI"
    assert [s.SerializeToString() for s in await read_first(datastore, "trial07", 3)] == [
        s.SerializeToString() for s in samples if s.trial_id == "trial07"
    ]

    target = tmp_path / "export.trials"
    await ok(datastore, "export", *trial_ids, "--file", str(target))
    header, exported = parse_by_hand(target.read_bytes())
    assert sorted(header.trial_params) == trial_ids
    assert sorted((s.trial_id, s.tick_id) for s in exported) == sorted(
        (s.trial_id, s.tick_id) for s in samples
    )


async def test_progress_bars(datastore: RunningDatastore, tmp_path: Path) -> None:
    await three_trials(datastore)
    target = tmp_path / "export.trials"
    run = await cli(datastore, "export", "t0", "t1", "--file", str(target), "--progress")
    assert run.code == 0
    assert run.err.startswith("\rExporting 2 trials [") and run.err.endswith("\n")
    assert "100.0% 30/30 samples" in run.err.rsplit("\r", 1)[-1]
    run = await cli(datastore, "import", "--file", str(target), "--prefix", "p-", "--progress")
    assert run.code == 0
    size = target.stat().st_size / (1024 * 1024)
    assert run.err.startswith("\rImporting [") and f"100.0% {size:.1f}/{size:.1f} MiB" in run.err
    # Not a terminal: none unless asked.
    run = await cli(datastore, "export", "t0", "--file", str(target))
    assert run.code == 0 and run.err == ""


async def test_import_of_a_hand_built_file(datastore: RunningDatastore, tmp_path: Path) -> None:
    samples = [stored_sample("a", 0), stored_sample("b", 0), stored_sample("a", 1, common_pb2.ENDED)]
    source = tmp_path / "hand.trials"
    source.write_bytes(hand_built_file(samples, ["a", "b", "no-samples"]))
    output = await ok(datastore, "import", "--file", str(source), "--prefix", "x/", "--user_id", "me")
    assert output == f'2 trials imported (3 samples) from "{source}"\n'
    stored = await infos(datastore)
    assert sorted(stored) == ["x/a", "x/b"]
    assert (stored["x/a"].user_id, stored["x/a"].last_state, stored["x/a"].samples_count) == (
        "me",
        common_pb2.ENDED,
        2,
    )
    assert [s.SerializeToString() for s in await read_samples(datastore, ["x/a"])] == [
        renamed(samples[0], "x/a"),
        renamed(samples[2], "x/a"),
    ]


async def test_import_of_bad_files(datastore: RunningDatastore, tmp_path: Path) -> None:
    samples = [stored_sample("a", 0), stored_sample("a", 1)]
    data = hand_built_file(samples, ["a"])
    source = tmp_path / "bad.trials"

    source.write_bytes(b"COGMENTTRIALS002" + data[16:])
    assert "not a Cogment trial samples file" in await fails(datastore, "import", "--file", str(source))
    source.write_bytes(data[:-3])
    message = await fails(datastore, "import", "--file", str(source))
    assert message.startswith("Error: truncated file: sample #2 ")
    assert message.endswith("; nothing was imported: the trial it had created was deleted")
    assert await infos(datastore) == {}  # no half-imported trial left behind
    # A sample naming a trial the header does not have.
    source.write_bytes(hand_built_file([stored_sample("b", 0)], ["a"]))
    message = await fails(datastore, "import", "--file", str(source), "--prefix", "p-")
    assert message == (
        "Error: read a sample of trial [b], whose parameters are missing from the file; nothing was imported"
    )
    assert "cannot read" in await fails(datastore, "import", "--file", str(tmp_path / "missing"))


async def test_a_truncated_import_of_several_trials_leaves_none(
    datastore: RunningDatastore, tmp_path: Path
) -> None:
    await add_trial(datastore, "unrelated")
    samples = [stored_sample(trial_id, tick) for tick in range(40) for trial_id in ("a", "b", "c")]
    data = hand_built_file(samples, ["a", "b", "c", "no-samples"])
    source = tmp_path / "cut.trials"
    source.write_bytes(data[: len(data) * 2 // 3])  # a cut in the middle of a sample
    message = await fails(datastore, "import", "--file", str(source), "--prefix", "p-")
    assert message.startswith("Error: truncated file: sample #")
    assert message.endswith("; nothing was imported: the 3 trials it had created were deleted")
    assert list(await infos(datastore)) == ["unrelated"]
    # The same file, whole, imports under the same ids: nothing is in the way.
    source.write_bytes(data)
    assert await ok(datastore, "import", "--file", str(source), "--prefix", "p-") == (
        f'3 trials imported (120 samples) from "{source}"\n'
    )


async def test_an_interrupted_import_leaves_no_trial(datastore: RunningDatastore) -> None:
    """Ctrl-C in the middle of an import: the trials it created are deleted, it says so, and it
    exits as an interrupted program does."""
    samples = [stored_sample(trial_id, tick) for tick in range(IMPORT_BATCH) for trial_id in ("a", "b")]
    data = hand_built_file(samples, ["a", "b"])
    process = popen("import", "--endpoint", endpoint(datastore), stdin=subprocess.PIPE)
    try:
        assert process.stdin is not None
        # All but the last byte: the first batches are imported (the trials are created), and the
        # import waits for the rest of the last sample.
        process.stdin.write(data[:-1])
        process.stdin.flush()

        async def both_created() -> bool:
            return set(await infos(datastore)) == {"a", "b"}

        await eventually(both_created, "the first trials to be imported", timeout_s=30)
        process.send_signal(signal.SIGINT)
        # Its input stays open until it said so: closed sooner, the truncated file could fail the
        # import first (and it waits for the thread reading its input to end before exiting).
        assert process.stderr is not None
        said = await asyncio.to_thread(process.stderr.readline)
        assert said == b"Interrupted: nothing was imported: the 2 trials it had created were deleted\n"
        out, err = await asyncio.to_thread(process.communicate, None, 60)
        assert (process.returncode, out, err) == (130, b"", b"")
    finally:
        if process.poll() is None:  # an assertion failed first: the import still waits for its input
            process.kill()
            process.wait()
    assert await infos(datastore) == {}


async def test_an_import_the_datastore_refuses_leaves_no_trial(
    datastore: RunningDatastore, tmp_path: Path
) -> None:
    samples = [stored_sample("a", 0), stored_sample("b", 0), stored_sample("a", 1), stored_sample("b", 1)]
    samples[3].user_id = "no\x00nul"  # a text column cannot hold it: the datastore refuses the sample
    source = tmp_path / "refused.trials"
    source.write_bytes(hand_built_file(samples, ["a", "b"]))
    message = await fails(datastore, "import", "--file", str(source))
    assert "INVALID_ARGUMENT" in message and "NUL" in message
    assert message.endswith("; nothing was imported: the 2 trials it had created were deleted")
    assert await infos(datastore) == {}


async def test_an_import_that_cannot_delete_its_trials_names_them_and_the_command(
    datastore: RunningDatastore, tmp_path: Path
) -> None:
    """The datastore goes away between the failure and the clean-up: the trials left are named,
    with the command that deletes them, which then does."""
    data = hand_built_file(
        [stored_sample("a b", 0), stored_sample("c", 0), stored_sample("a b", 1)], ["a b", "c"]
    )
    address = endpoint(datastore)
    async with DatastoreClient(address) as client:

        async def unavailable(request: ds.DeleteTrialsRequest, timeout: float) -> None:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone away"
            )

        client.stub.DeleteTrials = unavailable  # type: ignore[method-assign]
        with pytest.raises(ClientError) as failed:
            await import_trials(client, TrialFileReader(io.BytesIO(data[:-2])), prefix="x/")
    command = f"cogment-aux client trial_datastore delete_trials --endpoint {address} 'x/a b' x/c"
    message = str(failed.value)
    assert message.startswith("truncated file: sample #3 ")
    assert message.endswith(
        "; the import's trials [x/a b, x/c] are incomplete, and could not be deleted (cannot reach "
        f"the trial datastore at {address} (gone away)): delete them with `{command}`"
    )
    assert sorted(await infos(datastore)) == ["x/a b", "x/c"]
    words = shlex.split(command)
    assert words[:4] == ["cogment-aux", "client", "trial_datastore", "delete_trials"]
    out, err = io.StringIO(), io.StringIO()
    assert await asyncio.to_thread(main, words[3:], {}, out, err) == 0, err.getvalue()
    assert await infos(datastore) == {}


async def test_export_refuses_to_write_binary_to_a_terminal(datastore: RunningDatastore) -> None:
    await three_trials(datastore)

    def export_to_a_terminal() -> tuple[subprocess.CompletedProcess[bytes], bytes]:
        controller, terminal = pty.openpty()
        try:
            result = subprocess.run(
                client_command("export", "t0", "--endpoint", endpoint(datastore)),
                cwd=PROJECT_ROOT, env=clean_environment(), stdout=terminal, stderr=subprocess.PIPE,
                timeout=60,
            )  # fmt: skip
            os.set_blocking(controller, False)
            try:
                shown = os.read(controller, 65536)
            except BlockingIOError:
                shown = b""
            return result, shown
        finally:
            os.close(terminal)
            os.close(controller)

    result, shown = await asyncio.to_thread(export_to_a_terminal)
    assert result.returncode == 1
    assert result.stderr == (b"Error: the export is binary: give --file PATH, or redirect standard output\n")
    assert shown == b""
    # Redirected (a pipe), it writes as before.
    exported = await asyncio.to_thread(run_process, "export", "t0", "--endpoint", endpoint(datastore))
    assert exported.returncode == 0 and exported.stdout.startswith(MAGIC)


# ---- the reader, on its own ----


def test_reader_reads_a_hand_built_file() -> None:
    samples = [stored_sample("a", 0), stored_sample("b", 0), ds.StoredTrialSample()]
    data = hand_built_file(samples, ["a", "b"])
    reader = TrialFileReader(io.BytesIO(data))
    header, read = read_all(reader)
    assert sorted(header.trial_params) == ["a", "b"] and header.export_timestamp == 123
    assert read == samples and reader.bytes_read == len(data)
    assert reader.read_sample() is None


def test_reader_loops_on_short_reads() -> None:
    samples = [stored_sample("a", tick) for tick in range(5)]
    data = hand_built_file(samples, ["a"])
    assert read_all(TrialFileReader(OneByteAtATime(data)))[1] == samples  # type: ignore[arg-type]

    # A real pipe fed one byte at a time, read without buffering.
    read_fd, write_fd = os.pipe()

    def feed() -> None:
        with os.fdopen(write_fd, "wb", buffering=0) as pipe:
            for byte in data:
                pipe.write(bytes([byte]))
                time.sleep(0.0002)

    feeder = threading.Thread(target=feed)
    feeder.start()
    with os.fdopen(read_fd, "rb", buffering=0) as pipe:
        assert read_all(TrialFileReader(pipe))[1] == samples  # type: ignore[arg-type]
    feeder.join()


def cuts(data: bytes) -> Iterator[tuple[int, str]]:
    """Lengths at which `data` (a header and one sample) is cut, and the error expected."""
    header_length = struct.unpack_from("<I", data, 16)[0]
    sample_start = 20 + header_length
    yield 0, "the input is empty"
    yield 10, "it starts with b'COGMENTTRI'"
    yield 16, "truncated file: the length of the header at byte 16 has 0 of 4 bytes"
    yield 18, "truncated file: the length of the header at byte 16 has 2 of 4 bytes"
    yield 25, f"truncated file: the header at byte 16 has 5 of its {header_length} bytes"
    yield sample_start + 3, f"truncated file: the length of sample #1 at byte {sample_start} has 3 of 4 bytes"
    yield len(data) - 1, f"truncated file: sample #1 at byte {sample_start} has"


def test_reader_errors_are_clear() -> None:
    data = hand_built_file([stored_sample("a", 0)], ["a"])
    for length, expected in cuts(data):
        with pytest.raises(TrialFileError) as raised:
            read_all(TrialFileReader(io.BytesIO(data[:length])))
        assert expected in str(raised.value), (length, str(raised.value))

    with pytest.raises(TrialFileError, match="not a Cogment trial samples file"):
        TrialFileReader(io.BytesIO(b"COGMENTTRIALS000" + data[16:])).read_header()
    garbage = data + frame(b"\x0a\xff")  # a length-delimited field whose length does not parse
    with pytest.raises(
        TrialFileError, match=r"sample #2 \(2 bytes ending at byte \d+\) is not a valid StoredTrialSample"
    ):
        read_all(TrialFileReader(io.BytesIO(garbage)))
    with pytest.raises(TrialFileError, match=r"the header .* is not a valid TrialSamplesFileHeader"):
        TrialFileReader(io.BytesIO(MAGIC + frame(b"\xff"))).read_header()


def test_without_the_dataset_extra_only_parquet_exports_are_refused() -> None:
    """`make run` installs no pyarrow: the client still works, and a Parquet export says what to
    install (before calling the datastore: none listens here)."""
    blocked = "import runpy, sys; sys.modules['pyarrow'] = None; "
    endpoint = f"grpc://127.0.0.1:{free_port()}"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        main = "runpy.run_module('services.datastore.client', run_name='__main__')"
        code = f"{blocked}sys.argv = ['client', *{list(args)!r}]; {main}"
        return subprocess.run(
            [sys.executable, "-c", code], cwd=PROJECT_ROOT, env=clean_environment(), capture_output=True,
            text=True, timeout=60,
        )  # fmt: skip

    listed = run("list", "--endpoint", endpoint)
    assert listed.returncode == 1 and listed.stderr.startswith("Error: cannot reach the trial datastore"), (
        listed
    )
    exported = run("export", "t", "--format", "parquet", "--file", "dataset", "--endpoint", endpoint)
    assert exported.returncode == 1, exported
    assert exported.stderr == (
        "Error: Parquet exports (--format parquet) need pyarrow and numpy: pip install "
        "'cogment-aux[dataset]' (from a checkout: pip install -e '.[dataset]', or make install)\n"
    ), exported
