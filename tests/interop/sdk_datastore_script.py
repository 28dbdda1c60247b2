"""Exercise a Cogment Trial Datastore through the OFFICIAL Cogment Python SDK (2.10.1).

Run with the SDK venv interpreter (see ``sdk_env.py``), never imported by pytest:

    .venv-sdk/bin/python tests/interop/sdk_datastore_script.py grpc://127.0.0.1:PORT SCENARIO 'JSON ARGS'

Scenarios: ``list``, ``wait``, ``wait_timeout``, ``samples``, ``filters``, ``live``, ``delete`` (see
``SCENARIOS``); the test feeds the data and passes what to ask for (trial ids, properties, filters) as the
JSON argument.

Output (stdout, one JSON object per line): while it runs, ``{"event": ...}`` lines the test acts on (e.g. it
creates a trial once the SDK is waiting for it), then exactly ONE report ``{"sdk_version", "scenario",
"errors", ...}`` as the last line.  Everything else goes to stderr.  All traffic goes to 127.0.0.1, every
wait is bounded and the whole run is bounded by ``OVERALL_TIMEOUT``.  The only files written are the trial
spec and its generated ``cog_settings`` module, in the working directory (the test's tmp dir).

What the SDK 2.10.1 does with a trial datastore (read from cogment/datastore.py, cogment/context.py and
cogment/parameters.py)
--------------------------------------------------------------------------------------------------------------
Setup
* ``await Context(user_id, cog_settings).get_datastore(Endpoint("grpc://h:p"))``: a ``grpc://`` endpoint
  gives the ``Datastore`` at once (the ``await`` works through an ``__await__`` hack); ``cogment://`` URLs
  are resolved through the directory (type DATASTORE).  One insecure channel with DEFAULT options (4 MiB
  receive limit) and a ``cogmentAPI.TrialDatastoreSP`` stub; the Context metadata goes on every call; no
  call has a deadline.

Listing
* ``get_trials(ids=[], properties={})``: ONE ``RetrieveTrials(trial_ids, properties)`` with no count, no
  handle and no timeout: every matching trial in one reply (so a big datastore can exceed the 4 MiB limit).
* ``all_trials(bundle_size=1, wait_for_trials=0, properties={}, ids=[])``: async generator calling
  ``RetrieveTrials(trial_ids, properties, trials_count=bundle_size, timeout=int(wait_for_trials*1000) ms,
  trial_handle=<previous next_trial_handle>)`` until a reply holds fewer than ``bundle_size`` trials (so an
  exact multiple costs an extra, empty call).  The timeout goes on EVERY call: the last, short page always
  lasts the full timeout.  Default bundle size 1 = one call per trial.
* Each trial is a ``DatastoreTrialInfo``: ``trial_id``, ``user_id``, ``trial_state`` (``TrialState`` built
  from ``last_state``), ``sample_count`` (``samples_count``) and ``parameters``, a ``TrialParameters`` over
  the raw params (``properties``, ``max_steps``, ``environment_*``,
  ``actors[i].name/actor_class/implementation``...).

Samples: ``all_samples(trial_infos, actor_names=[], actor_classes=[], actor_implementations=[],
fields=[])``
* Takes the ``DatastoreTrialInfo`` objects, not ids (their ``parameters`` decode the samples); no info ->
  CogmentError before any call.  ``fields`` are ``DatastoreFields`` members -> ``selected_sample_fields``.
* One ``RetrieveSamples`` stream; each reply -> ``DatastoreSample``: ``trial_id``, ``trial_state``,
  ``tick_id``, ``timestamp`` and ``actors_data``, a dict actor name -> ``DatastoreActorData``, the name
  being read from each entry's ``actor`` index in the trial params (so actors removed by a filter are
  absent; duplicate names -> CogmentError).
* ``DatastoreActorData``: ``observation_serialized`` / ``action_serialized`` = the payload bytes (None when
  the field is unset); ``observation`` / ``action`` = those bytes parsed with the cog_settings class's
  ``observation_space`` / ``action_space`` (no cog_settings -> CogmentError); ``reward`` (0.0 when unset);
  ``all_received_rewards()`` / ``all_sent_rewards()`` -> ``DatastoreReward`` (``value``, ``confidence``,
  ``sender`` and ``receiver`` = ``params.actors[index].name``, ``user_data`` = the payload parsed as a
  ``google.protobuf.Any``); ``all_received_messages()`` / ``all_sent_messages()`` -> ``DatastoreMessage``
  (``sender``, ``receiver``, ``payload`` parsed as an ``Any``).
* The end of the stream ends the generator; UNAVAILABLE is logged and ends it silently; any other gRPC error
  is raised (``grpc.aio.AioRpcError``); a cancellation is swallowed (the generator just ends), so a caller
  bounding the read with ``asyncio.wait_for`` cannot tell a timeout from the end: this script bounds reads
  itself.

Deleting: ``delete_trials(ids)``: one ``DeleteTrials``; no id -> CogmentError before any call; gRPC errors
escape.

How the SDK reads what a (reference-compatible) datastore stores -- quirks the tests pin down
* An index of -1 (the environment, or a name that is not an actor) is used as a Python index: the SDK names
  the LAST actor of the trial as sender/receiver.
* Received rewards' ``receiver`` and sent rewards' ``sender`` are not set by the datastore (ignored by
  the 2.x API: docs/compatibility.md#datastore-conversion), and the SDK reads them anyway: 0 -> actor
  0's name.  This script reports them; tests do not rely on them.
* Reward user data is stored as the ``Any``'s VALUE bytes (type_url dropped, as the reference does), but the
  SDK parses it as a whole ``Any``: for a packed ``StringValue("x")`` it gives ``type_url == "x"`` and an
  empty value.  ``SerializeToString()`` of that ``Any`` gives the stored bytes back (reported as
  ``serialized``).  Message payloads are stored the same way, but the SDK never gets that far:
  ``DatastoreMessage.payload`` calls ``HasField("payload")`` on a field without presence (``uint32 payload =
  3``), which raises ValueError (an SDK bug: message payloads cannot be read through the public API).
"""

from __future__ import annotations

import os

# grpc honours http(s)_proxy; make sure loopback traffic never goes through one.
for _var in ("no_proxy", "NO_PROXY", "no_grpc_proxy"):
    _current = os.environ.get(_var, "")
    os.environ[_var] = ",".join(x for x in (_current, "127.0.0.1", "localhost") if x)
for _var in ("COGMENT_DIRECTORY_ENDPOINT", "COGMENT_DIRECTORY_AUTHENTICATION_TOKEN"):
    os.environ.pop(_var, None)

import asyncio  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import pathlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from typing import Any  # noqa: E402

OVERALL_TIMEOUT = 100.0  # seconds, whole script
CALL_TIMEOUT = 15.0  # seconds, any single call
READ_TIMEOUT = 30.0  # seconds, reading every sample of finished trials
GENERATE_TIMEOUT = 60.0  # seconds, `python -m cogment.generate`
SCENARIOS = ("list", "wait", "wait_timeout", "samples", "filters", "live", "delete")

# The trial spec the samples are decoded with.  The message layouts equal google.protobuf.StringValue and
# Int64Value, which is what the test (protobuf 7, no generated code of its own) encodes payloads with.
SPEC_PACKAGE = "interop"
SPEC_PROTO_FILE = "interop_spec.proto"
SPEC_PROTO = """syntax = "proto3";
package interop;

message TextObservation { string value = 1; }
message TextAction { string value = 1; }
message NumberObservation { int64 value = 1; }
message NumberAction { int64 value = 1; }
"""
SPEC_KINDS = ("Text", "Number")


def _log(msg: str) -> None:
    print(f"[sdk_datastore_script] {msg}", file=sys.stderr, flush=True)


def _emit(event: str, **fields: Any) -> None:
    """An event line: the test waits for some of them before feeding the datastore."""
    print(json.dumps({"event": event, **fields}), flush=True)


def _error(exc: BaseException) -> dict[str, Any]:
    import grpc

    result: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc)[:300]}
    if isinstance(exc, grpc.aio.AioRpcError):
        result["code"] = exc.code().name
        result["details"] = exc.details()
    return result


async def _bounded(awaitable, timeout: float = CALL_TIMEOUT):
    return await asyncio.wait_for(awaitable, timeout=timeout)


async def _outcome(awaitable, timeout: float = CALL_TIMEOUT) -> dict[str, Any]:
    """{"value": ..., "error": None} or {"value": None, "error": {...}} -- never raises (but cancellation)."""
    try:
        return {"value": await _bounded(awaitable, timeout), "error": None}
    except asyncio.TimeoutError:
        return {"value": None, "error": {"type": "Timeout", "message": f"no answer in {timeout}s"}}
    except Exception as exc:
        return {"value": None, "error": _error(exc)}


def _safe(read) -> Any:
    """What a property of the SDK gives, or {"error": ...} when reading it raises."""
    try:
        return read()
    except Exception as exc:
        return {"error": _error(exc)}


def _hex(data: bytes | None) -> str | None:
    return None if data is None else data.hex()


# ---- what the SDK exposes, as JSON ----


def info_dict(info) -> dict[str, Any]:
    params = info.parameters
    return {
        "trial_id": info.trial_id,
        "user_id": info.user_id,
        "state": info.trial_state.name,
        "sample_count": info.sample_count,
        "has_specs": info.has_specs(),
        "properties": dict(params.properties),
        "max_steps": params.max_steps,
        "max_inactivity": params.max_inactivity,
        "nb_buffered_ticks": params.nb_buffered_ticks,
        "environment": {
            "name": params.environment_name,
            "implementation": params.environment_implementation,
            "endpoint": params.environment_endpoint,
        },
        "actors": [
            {"name": a.name, "actor_class": a.actor_class, "implementation": a.implementation}
            for a in params.actors
        ],
    }


def _message(message) -> dict[str, Any] | None:
    """A decoded observation/action of the spec (every spec message has one `value` field)."""
    if message is None:
        return None
    return {"type": message.DESCRIPTOR.full_name, "value": message.value}


def _any(value) -> dict[str, Any] | None:
    if value is None:
        return None
    return {
        "type_url": value.type_url,
        "value": value.value.hex(),
        "serialized": value.SerializeToString().hex(),
    }


def _reward(reward) -> dict[str, Any]:
    return {
        "value": reward.value,
        "confidence": reward.confidence,
        "sender": _safe(lambda: reward.sender),
        "receiver": _safe(lambda: reward.receiver),
        "user_data": _safe(lambda: _any(reward.user_data)),
    }


def _chat(message) -> dict[str, Any]:
    return {
        "sender": _safe(lambda: message.sender),
        "receiver": _safe(lambda: message.receiver),
        "payload": _safe(lambda: _any(message.payload)),
    }


def actor_dict(data) -> dict[str, Any]:
    return {
        "observation_serialized": _hex(data.observation_serialized),
        "action_serialized": _hex(data.action_serialized),
        "observation": _safe(lambda: _message(data.observation)),
        "action": _safe(lambda: _message(data.action)),
        "reward": data.reward,
        "received_rewards": [_reward(r) for r in data.all_received_rewards()],
        "sent_rewards": [_reward(r) for r in data.all_sent_rewards()],
        "received_messages": [_chat(m) for m in data.all_received_messages()],
        "sent_messages": [_chat(m) for m in data.all_sent_messages()],
    }


def sample_dict(sample) -> dict[str, Any]:
    return {
        "trial_id": sample.trial_id,
        "tick_id": sample.tick_id,
        "state": sample.trial_state.name,
        "timestamp": sample.timestamp,
        "actors": {name: actor_dict(data) for name, data in sample.actors_data.items()},
    }


# ---- reading ----


class RecordingStub:
    """Delegates to the SDK's stub; records the RetrieveTrials requests the SDK makes (observation only)."""

    def __init__(self, stub) -> None:
        self._stub = stub
        self.calls: list[dict[str, Any]] = []

    def __getattr__(self, name: str):
        return getattr(self._stub, name)

    async def RetrieveTrials(self, request, **kwargs):
        entry: dict[str, Any] = {
            "ids": list(request.trial_ids),
            "properties": dict(request.properties),
            "count": int(request.trials_count),
            "timeout_ms": int(request.timeout),
            "handle": request.trial_handle,
        }
        self.calls.append(entry)
        started = time.monotonic()
        try:
            reply = await self._stub.RetrieveTrials(request, **kwargs)
        except Exception as exc:
            entry["error"] = _error(exc)
            raise
        entry["replied"] = [info.trial_id for info in reply.trial_infos]
        entry["next"] = reply.next_trial_handle
        entry["elapsed_s"] = round(time.monotonic() - started, 3)
        return reply


async def collect_trials(trials, timeout: float = CALL_TIMEOUT) -> list[dict[str, Any]]:
    async def run() -> list[dict[str, Any]]:
        return [info_dict(info) async for info in trials]

    return await _bounded(run(), timeout)


async def read_samples(samples, timeout: float = READ_TIMEOUT, on_sample=None) -> dict[str, Any]:
    """Every sample of an ``all_samples`` generator, and whether the stream ENDED by itself within
    ``timeout`` (the SDK swallows cancellation, so a timeout is told apart here, not by ``wait_for``)."""
    got: list[dict[str, Any]] = []

    async def run() -> None:
        async for sample in samples:
            got.append(sample_dict(sample))
            if on_sample is not None:
                on_sample(got[-1])

    task = asyncio.ensure_future(run())
    done, _ = await asyncio.wait({task}, timeout=timeout)
    if not done:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return {"samples": got, "ended": False, "error": {"type": "Timeout", "message": f"{timeout}s"}}
    error = task.exception()
    return {"samples": got, "ended": error is None, "error": None if error is None else _error(error)}


def generate_cog_settings(workdir: pathlib.Path, classes: dict[str, str]):
    """Write a minimal trial spec (``classes``: actor class -> "Text" | "Number") and generate its
    ``cog_settings`` module with the SDK's own generator, as users do; returns the imported module."""
    lines = ["import:", "  proto:", f"    - {SPEC_PROTO_FILE}", "actor_classes:"]
    for name, kind in classes.items():
        if kind not in SPEC_KINDS:
            raise ValueError(f"unknown spec kind {kind!r} for class {name!r}")
        lines += [
            f"  - name: {name}",
            "    action:",
            f"      space: {SPEC_PACKAGE}.{kind}Action",
            "    observation:",
            f"      space: {SPEC_PACKAGE}.{kind}Observation",
        ]
    (workdir / SPEC_PROTO_FILE).write_text(SPEC_PROTO)
    (workdir / "cogment.yaml").write_text("\n".join(lines) + "\n")
    subprocess.run(
        [sys.executable, "-m", "cogment.generate", "--spec", "cogment.yaml", "--output", "cog_settings.py"],
        cwd=workdir,
        check=True,
        timeout=GENERATE_TIMEOUT,
        stdout=sys.stderr,
    )
    sys.path.insert(0, str(workdir))
    return importlib.import_module("cog_settings")


async def datastore_for(endpoint: str, cog_settings=None):
    import cogment

    context = cogment.Context(user_id="interop", cog_settings=cog_settings)
    return await context.get_datastore(endpoint=cogment.Endpoint(endpoint))


# ---- scenarios ----


async def scenario_list(endpoint: str, args: dict[str, Any], report: dict[str, Any]) -> None:
    datastore = await datastore_for(endpoint)
    rec = RecordingStub(datastore._datastore_stub)
    datastore._datastore_stub = rec  # observation only: every call still goes to the SDK's stub

    async def get(**kwargs: Any) -> list[dict[str, Any]]:
        return [info_dict(info) for info in await _bounded(datastore.get_trials(**kwargs))]

    report["get_all"] = await get()
    report["get_ids"] = await get(ids=args["ids"])
    report["get_properties"] = await get(properties=args["properties"])
    report["get_ids_and_properties"] = await get(ids=args["ids"], properties=args["properties"])
    report["get_calls"] = list(rec.calls)
    pages: dict[str, Any] = {}
    for name, kwargs in args["pages"].items():
        rec.calls.clear()
        trials = await collect_trials(datastore.all_trials(**kwargs))
        pages[name] = {"ids": [t["trial_id"] for t in trials], "calls": list(rec.calls)}
    report["pages"] = pages


async def scenario_wait(endpoint: str, args: dict[str, Any], report: dict[str, Any]) -> None:
    datastore = await datastore_for(endpoint)
    rec = RecordingStub(datastore._datastore_stub)
    datastore._datastore_stub = rec
    late = args["late_properties"]

    # A trial created after the call started: the first page comes as soon as it exists.
    trials = datastore.all_trials(bundle_size=1, wait_for_trials=args["wait_s"], properties=late)
    started_wall = time.time()
    started = time.monotonic()
    _emit("waiting", started_wall=started_wall)
    first = await _outcome(trials.__anext__(), args["wait_s"] + CALL_TIMEOUT)
    elapsed = time.monotonic() - started
    await trials.aclose()
    report["late"] = {
        "info": None if first["value"] is None else info_dict(first["value"]),
        "error": first["error"],
        "started_wall": started_wall,
        "elapsed_s": elapsed,
        "calls": list(rec.calls),
    }


async def scenario_wait_timeout(endpoint: str, args: dict[str, Any], report: dict[str, Any]) -> None:
    datastore = await datastore_for(endpoint)
    rec = RecordingStub(datastore._datastore_stub)
    datastore._datastore_stub = rec

    # Nothing matches: the call returns nothing, with OK, once the timeout ran out.
    started = time.monotonic()
    never = await collect_trials(
        datastore.all_trials(bundle_size=1, wait_for_trials=args["short_wait_s"], properties=args["never"])
    )
    report["never"] = {"ids": [t["trial_id"] for t in never], "elapsed_s": time.monotonic() - started}
    report["never"]["calls"] = list(rec.calls)

    # A page that stays short waits for the whole timeout, even though what matches is already there.
    rec.calls.clear()
    started = time.monotonic()
    short = await collect_trials(
        datastore.all_trials(bundle_size=10, wait_for_trials=args["short_wait_s"], properties=args["late"])
    )
    report["short_page"] = {
        "ids": [t["trial_id"] for t in short],
        "elapsed_s": time.monotonic() - started,
        "calls": list(rec.calls),
    }


async def scenario_samples(endpoint: str, args: dict[str, Any], report: dict[str, Any]) -> None:
    ids = args["trial_ids"]
    plain = await datastore_for(endpoint)
    infos = await _bounded(plain.get_trials(ids=ids))
    report["infos"] = [info_dict(info) for info in infos]
    report["plain"] = await read_samples(plain.all_samples(infos))
    report["no_infos"] = await read_samples(plain.all_samples([]))

    if "spec_classes" not in args:
        return
    cog_settings = generate_cog_settings(pathlib.Path.cwd(), args["spec_classes"])
    decoding = await datastore_for(endpoint, cog_settings)
    infos = await _bounded(decoding.get_trials(ids=ids))
    report["decoded_has_specs"] = [info.has_specs() for info in infos]
    report["decoded"] = await read_samples(decoding.all_samples(infos))


async def scenario_filters(endpoint: str, args: dict[str, Any], report: dict[str, Any]) -> None:
    import cogment

    datastore = await datastore_for(endpoint)
    infos = await _bounded(datastore.get_trials(ids=args["trial_ids"]))
    results: dict[str, Any] = {}
    for name, case in args["cases"].items():
        fields = [cogment.DatastoreFields[field] for field in case.get("fields", [])]
        samples = datastore.all_samples(
            infos,
            actor_names=case.get("actor_names", []),
            actor_classes=case.get("actor_classes", []),
            actor_implementations=case.get("actor_implementations", []),
            fields=fields,
        )
        results[name] = await read_samples(samples)
    report["cases"] = results


async def scenario_live(endpoint: str, args: dict[str, Any], report: dict[str, Any]) -> None:
    datastore = await datastore_for(endpoint)
    trial_id = args["trial_id"]
    # The trial does not exist yet: wait for it, then read it while it is being ingested.
    trials = datastore.all_trials(bundle_size=1, wait_for_trials=args["wait_s"], ids=[trial_id])
    _emit("waiting-trial")
    info = await _bounded(trials.__anext__(), args["wait_s"] + CALL_TIMEOUT)
    await trials.aclose()
    report["info"] = info_dict(info)
    started = time.monotonic()

    def on_sample(sample: dict[str, Any]) -> None:
        _emit("sample", tick_id=sample["tick_id"], state=sample["state"])

    result = await read_samples(datastore.all_samples([info]), args["read_timeout_s"], on_sample)
    report["read"] = {
        "ticks": [s["tick_id"] for s in result["samples"]],
        "states": [s["state"] for s in result["samples"]],
        "trial_ids": sorted({s["trial_id"] for s in result["samples"]}),
        "ended": result["ended"],
        "error": result["error"],
        "elapsed_s": time.monotonic() - started,
    }


async def scenario_delete(endpoint: str, args: dict[str, Any], report: dict[str, Any]) -> None:
    datastore = await datastore_for(endpoint)

    async def listed() -> list[str]:
        return [info.trial_id for info in await _bounded(datastore.get_trials())]

    report["before"] = await listed()
    deleted_infos = await _bounded(datastore.get_trials(ids=args["delete"]))
    report["delete"] = await _outcome(datastore.delete_trials(args["delete"]))
    report["after"] = await listed()
    report["delete_again"] = await _outcome(datastore.delete_trials(args["delete"]))
    report["delete_nothing"] = await _outcome(datastore.delete_trials([]))
    report["read_deleted"] = await read_samples(datastore.all_samples(deleted_infos))
    kept = await _bounded(datastore.get_trials(ids=[args["keep"]]))
    read = await read_samples(datastore.all_samples(kept))
    report["read_kept"] = {"ticks": [s["tick_id"] for s in read["samples"]], "ended": read["ended"]}


SCENARIO_FUNCTIONS = {
    "list": scenario_list,
    "wait": scenario_wait,
    "wait_timeout": scenario_wait_timeout,
    "samples": scenario_samples,
    "filters": scenario_filters,
    "live": scenario_live,
    "delete": scenario_delete,
}


class SdkLog(logging.Handler):
    """What the SDK logs at WARNING and above: how it tells, e.g., a lost connection from a normal end."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.levelname}: {record.getMessage()}"[:500])


async def run(endpoint: str, scenario: str, args: dict[str, Any]) -> dict[str, Any]:
    import cogment

    report: dict[str, Any] = {"sdk_version": cogment.__version__, "scenario": scenario, "errors": []}
    sdk_log = SdkLog()
    logging.getLogger("cogment.sdk").addHandler(sdk_log)
    try:
        await SCENARIO_FUNCTIONS[scenario](endpoint, args, report)
    except Exception as exc:
        report["errors"].append({"error": _error(exc), "traceback": traceback.format_exc()[-3000:]})
    report["sdk_log"] = sdk_log.records
    return report


def main() -> int:
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    if len(sys.argv) != 4:
        print(json.dumps({"errors": ["usage: script grpc://127.0.0.1:PORT SCENARIO 'JSON ARGS'"]}))
        return 2
    endpoint, scenario, raw_args = sys.argv[1:]
    if scenario not in SCENARIOS or not endpoint.startswith("grpc://127.0.0.1:"):
        print(json.dumps({"errors": [f"bad arguments {sys.argv[1:]}"]}))
        return 2

    async def bounded_run() -> dict[str, Any]:
        return await asyncio.wait_for(run(endpoint, scenario, json.loads(raw_args)), OVERALL_TIMEOUT)

    try:
        report = asyncio.run(bounded_run())
    except Exception as exc:
        report = {"errors": [{"error": _error(exc), "traceback": traceback.format_exc()[-3000:]}]}
    print(json.dumps(report, default=repr), flush=True)
    return 0 if not report.get("errors") else 1


if __name__ == "__main__":
    sys.exit(main())
