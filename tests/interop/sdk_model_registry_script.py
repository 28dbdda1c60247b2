"""Exercise a Cogment Model Registry through the OFFICIAL Cogment Python SDK (2.10.1).

Run with the SDK venv interpreter (see ``sdk_env.py``), never imported by pytest:

    .venv-sdk/bin/python tests/interop/sdk_model_registry_script.py grpc://127.0.0.1:PORT [main|large]

Prints exactly ONE JSON object on stdout (everything else goes to stderr).  All traffic goes to
127.0.0.1; every wait is bounded; the whole run is bounded by ``OVERALL_TIMEOUT``.  Nothing is
written to disk.  Model ids carry a random prefix, so several runs can share one registry.

What the SDK 2.10.1 does with a model registry (read from cogment/model_registry_v2.py and
cogment/context.py)
---------------------------------------------------------------------------------------------
Setup
* ``await Context(...).get_model_registry_v2(Endpoint("grpc://h:p"))``: resolves ``cogment://``
  URLs through the directory (type MODEL_REGISTRY) when the Context has one, then opens one
  insecure ``grpc.aio`` channel with DEFAULT options (4 MiB receive limit) and a
  ``cogmentAPI.ModelRegistrySP`` stub.  The Context metadata goes on every call.
  (``get_model_registry`` is the deprecated v1 class, not exercised here.)

Publishing: ``publish_model(name, bytes, props)`` (archived=False) / ``store_model`` (archived=True)
* ``model=None`` with props -> CogmentError; ``len(model) == 0`` -> CogmentError("Model is empty")
  BEFORE any call: a 0-byte version cannot be published through the public API (this script
  uploads one with the SDK's generated stub, as docs/compatibility.md#model-registry describes it, and
  reads it back through the public API).  ``model=None`` only creates the model.
* ``RetrieveModels(model_ids=[name])``: ANY error or an empty reply means "absent" -> then
  ``CreateOrUpdateModel({model_id})`` (no user data).  Then ``CreateVersion``: a header
  ``{model_id, archived, data_size, user_data=props}`` (no hash, no timestamp, no number), then
  body chunks of 2 MiB.  Returns ``ModelIterationInfo`` built from the reply's version_info:
  ``model_name, iteration, timestamp, hash, size, stored (= archived), properties (= user_data)``.
* ``update_model_info(name, props)``: ``CreateOrUpdateModel`` with user data (errors ->
  CogmentError).  ``get_model_info(name)``: ``RetrieveModels(model_ids=[name])``, any error or an
  empty reply -> ``None``.

Listing
* ``list_models()``: ``RetrieveModels(models_count=10, model_handle=<previous next_model_handle>)``
  until a reply has fewer than 10 models (so an exact multiple of 10 costs an extra, empty call).
* ``list_iterations(name)``: same with ``RetrieveVersionInfos(model_id, versions_count=10,
  version_handle)``.  Any error -> CogmentError (so an unknown model raises).

Lookups
* ``get_iteration_info(name, n)``: ``RetrieveVersionInfos(model_id, version_numbers=[n])``.  An
  error -> ``get_model_info``: unknown model -> CogmentError, known model -> ``None``.  An empty
  reply -> ``None`` as well (so the public API cannot tell NOT_FOUND from an empty list; this
  script checks the raw status codes with the SDK's generated stub).
* ``retrieve_model(name, n=-1)``: ``RetrieveVersionData``, concatenating ``data_chunk``s; an error
  -> unknown model: CogmentError, known model: ``None``.

Tracking
* ``iteration_updates(name)``: async generator over ``VersionUpdate({model_id})``; an
  UNAVAILABLE error ends it silently, any other gRPC error is raised; the end of the stream
  ends it.
* ``track_latest_model(name, deserialize_func=None, initial_wait=0)``: ``get_model_info`` first
  (unknown model -> CogmentError after ``initial_wait`` one-second retries), then a
  ``LatestModel`` whose background task reads ``iteration_updates`` and downloads each announced
  version (``retrieve_model``).  ``await latest.get()`` waits for the first one;
  ``await latest.wait_for_newer(n)`` waits for an iteration > n; ``get_no_wait()``.
* ``remove_model(name)``: ``DeleteModel``; a gRPC error escapes as ``grpc.aio.AioRpcError``.

How this script observes the wire
* Public API for everything the brief asks.  For observation only, the unary calls of the
  registry's stub (``RetrieveModels`` / ``RetrieveVersionInfos``) are wrapped to record the
  paging requests the SDK makes.  The SDK's generated stub (``cogment.api``) is used read-only
  to check gRPC status codes of unknown models/versions and download chunk sizes, and to upload
  the 0-byte version the public API refuses.
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
import base64  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import uuid  # noqa: E402
from typing import Any  # noqa: E402

OVERALL_TIMEOUT = {"main": 90.0, "large": 90.0}  # seconds, whole script
CALL_TIMEOUT = 15.0  # seconds, any single call
LARGE_TIMEOUT = 60.0  # seconds, a 50 MB upload or download
UPDATE_TIMEOUT = 10.0  # seconds, a tracked / streamed update to arrive
NO_UPDATE_WAIT = 1.5  # seconds, to check that nothing arrives

LARGE_SIZE = 50 * 1024 * 1024 + 12_345  # 50 MiB and a partial last chunk
PAGE_MODELS = 12
PAGE_VERSIONS = (12, 20)  # more than 10, and an exact multiple of 10
SCENARIOS = ("main", "large")


def _log(msg: str) -> None:
    print(f"[sdk_model_registry_script] {msg}", file=sys.stderr, flush=True)


def b64sha(data: bytes) -> str:
    return base64.b64encode(hashlib.sha256(data).digest()).decode()


def payload(tag: str, size: int) -> bytes:
    seed = hashlib.sha256(tag.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


async def _bounded(awaitable, timeout: float = CALL_TIMEOUT):
    return await asyncio.wait_for(awaitable, timeout=timeout)


def _info(info) -> dict[str, Any] | None:
    if info is None:
        return None
    return {
        "model_name": info.model_name,
        "iteration": int(info.iteration),
        "timestamp": int(info.timestamp),
        "hash": info.hash,
        "size": int(info.size),
        "stored": bool(info.stored),
        "properties": dict(info.properties),
    }


def _error(exc: BaseException) -> dict[str, Any]:
    import grpc

    result: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc)[:300]}
    if isinstance(exc, grpc.aio.AioRpcError):
        result["code"] = exc.code().name
        result["details"] = exc.details()
    return result


async def _outcome(awaitable, timeout: float = CALL_TIMEOUT) -> dict[str, Any]:
    """{"value": ...} or {"error": {...}} -- never raises (except cancellation)."""
    try:
        return {"value": await _bounded(awaitable, timeout), "error": None}
    except asyncio.TimeoutError:
        return {"value": None, "error": {"type": "Timeout", "message": f"no answer in {timeout}s"}}
    except Exception as exc:
        return {"value": None, "error": _error(exc)}


class RecordingStub:
    """Delegates to the SDK's stub; records the unary paging requests (observation only)."""

    def __init__(self, stub) -> None:
        self._stub = stub
        self.calls: list[dict[str, Any]] = []

    def __getattr__(self, name: str):
        return getattr(self._stub, name)

    async def RetrieveModels(self, request, **kwargs):
        entry: dict[str, Any] = {
            "method": "RetrieveModels",
            "ids": list(request.model_ids),
            "count": int(request.models_count),
            "handle": request.model_handle,
        }
        self.calls.append(entry)
        try:
            reply = await self._stub.RetrieveModels(request, **kwargs)
        except Exception as exc:
            entry["error"] = _error(exc).get("code", type(exc).__name__)
            raise
        entry["replied"] = len(reply.model_infos)
        entry["next"] = reply.next_model_handle
        return reply

    async def RetrieveVersionInfos(self, request, **kwargs):
        entry: dict[str, Any] = {
            "method": "RetrieveVersionInfos",
            "model": request.model_id,
            "numbers": list(request.version_numbers),
            "count": int(request.versions_count),
            "handle": request.version_handle,
        }
        self.calls.append(entry)
        try:
            reply = await self._stub.RetrieveVersionInfos(request, **kwargs)
        except Exception as exc:
            entry["error"] = _error(exc).get("code", type(exc).__name__)
            raise
        entry["replied"] = len(reply.version_infos)
        entry["next"] = reply.next_version_handle
        return reply


class Raw:
    """The SDK's generated stub, for status codes and what the public API cannot do."""

    def __init__(self, address: str) -> None:
        import grpc
        from cogment.api import model_registry_pb2, model_registry_pb2_grpc

        self.pb = model_registry_pb2
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = model_registry_pb2_grpc.ModelRegistrySPStub(self.channel)

    async def code(self, method: str, request) -> dict[str, Any]:
        import grpc

        try:
            call = getattr(self.stub, method)(request, timeout=CALL_TIMEOUT)
            if method == "RetrieveVersionData":
                chunks = [len(chunk.data_chunk) async for chunk in call]
                return {"code": "OK", "chunks": chunks}
            reply = await call
            return {"code": "OK", "reply": str(reply)[:300]}
        except grpc.aio.AioRpcError as exc:
            return {"code": exc.code().name, "details": exc.details()}

    async def upload_empty(self, model_id: str, props: dict[str, str]) -> dict[str, Any]:
        """A 0-byte version as the SDK would send it: a header alone."""
        info = self.pb.ModelVersionInfo(model_id=model_id, archived=True, data_size=0, user_data=props)
        header = self.pb.CreateVersionRequestChunk(
            header=self.pb.CreateVersionRequestChunk.Header(version_info=info)
        )

        async def chunks():
            yield header

        reply = await self.stub.CreateVersion(chunks(), timeout=CALL_TIMEOUT)
        return {"iteration": reply.version_info.version_number, "hash": reply.version_info.data_hash}

    async def close(self) -> None:
        await self.channel.close()


async def _collect_updates(agen, queue: asyncio.Queue) -> None:
    try:
        async for info in agen:
            await queue.put(("info", _info(info)))
        await queue.put(("end", None))
    except Exception as exc:
        await queue.put(("error", _error(exc)))


async def _next_update(queue: asyncio.Queue, timeout: float = UPDATE_TIMEOUT) -> dict[str, Any]:
    try:
        kind, value = await asyncio.wait_for(queue.get(), timeout)
    except asyncio.TimeoutError:
        return {"kind": "timeout"}
    return {"kind": kind, "value": value}


async def scenario_main(registry, raw: Raw, rec: RecordingStub, prefix: str, report: dict[str, Any]) -> None:
    from cogment.errors import CogmentError  # noqa: F401  (documents the expected error type)

    start_ns = time.time_ns()
    report["start_ns"] = start_ns

    # ---- publishing ----
    basic = f"{prefix}-basic"
    data1, data2, data3 = payload("v1", 1000), payload("v2", 3 * 1024 * 1024 + 7), payload("v3", 1)
    published: dict[str, Any] = {"model": basic}
    published["v1"] = _info(await _bounded(registry.publish_model(basic, data1, {"epoch": "1"})))
    published["v2"] = _info(await _bounded(registry.store_model(basic, data2, {"epoch": "2", "é": "ü"})))
    published["v3"] = _info(await _bounded(registry.publish_model(basic, data3)))
    published["expected"] = {
        "v1": {"hash": b64sha(data1), "size": len(data1)},
        "v2": {"hash": b64sha(data2), "size": len(data2)},
        "v3": {"hash": b64sha(data3), "size": len(data3)},
    }
    published["model_info"] = None
    info = await _bounded(registry.get_model_info(basic))
    if info is not None:
        published["model_info"] = {"name": info.name, "properties": dict(info.properties)}
    await _bounded(registry.update_model_info(basic, {"owner": "interop", "kind": "policy"}))
    info = await _bounded(registry.get_model_info(basic))
    published["model_info_updated"] = None if info is None else dict(info.properties)
    # publishing into a model that already has user data must keep it (SDK only creates when absent)
    published["v4"] = _info(await _bounded(registry.publish_model(basic, payload("v4", 10))))
    info = await _bounded(registry.get_model_info(basic))
    published["model_info_after_v4"] = None if info is None else dict(info.properties)
    report["published"] = published

    # ---- retrieval by number, -1, -n ----
    datas = {1: data1, 2: data2, 3: data3, 4: payload("v4", 10)}
    lookups: dict[str, Any] = {}
    for n in (1, 2, 3, 4, -1, -2, -4):
        got = await _outcome(registry.get_iteration_info(basic, n))
        lookups[f"info_{n}"] = {"info": _info(got["value"]), "error": got["error"]}
        data = await _outcome(registry.retrieve_model(basic, n))
        expected_number = n if n > 0 else 4 + n + 1
        value = data["value"]
        lookups[f"data_{n}"] = {
            "error": data["error"],
            "size": None if value is None else len(value),
            "hash": None if value is None else b64sha(value),
            "matches": value == datas[expected_number],
        }
    default = await _bounded(registry.retrieve_model(basic))
    lookups["data_default_is_latest"] = default == datas[4]
    for n in (0, 5, 99, -5, -99):
        got = await _outcome(registry.get_iteration_info(basic, n))
        lookups[f"missing_info_{n}"] = {"info": _info(got["value"]), "error": got["error"]}
        data = await _outcome(registry.retrieve_model(basic, n))
        lookups[f"missing_data_{n}"] = {
            "is_none": data["value"] is None,
            "error": data["error"],
        }
    report["lookups"] = lookups

    # ---- 0-byte model ----
    empty = f"{prefix}-empty"
    zero: dict[str, Any] = {}
    got = await _outcome(registry.publish_model(empty, b""))
    zero["public_publish"] = {"error": got["error"], "value": _info(got["value"])}
    await _bounded(registry.update_model_info(empty, {"size": "0"}))
    zero["raw_upload"] = await _outcome(raw.upload_empty(empty, {"why": "zero"}))
    zero["info"] = _info(await _bounded(registry.get_iteration_info(empty, -1)))
    got = await _outcome(registry.retrieve_model(empty, 1))
    zero["data"] = {"error": got["error"], "value_repr": repr(got["value"])}
    zero["raw_chunks"] = await raw.code(
        "RetrieveVersionData", raw.pb.RetrieveVersionDataRequest(model_id=empty, version_number=1)
    )
    zero["expected_hash"] = b64sha(b"")
    report["zero"] = zero

    # ---- listing models (paging by 10) ----
    page_names = [f"{prefix}-page-{i:02d}" for i in range(PAGE_MODELS)]
    for i, name in enumerate(page_names):
        await _bounded(registry.update_model_info(name, {"i": str(i)}))
    rec.calls.clear()
    models = await _bounded(registry.list_models(), 30)
    listed = [m for m in models if m.name.startswith(prefix)]
    report["list_models"] = {
        "total": len(models),
        "names": [m.name for m in listed],
        "duplicates": len(models) - len({m.name for m in models}),
        "properties": {m.name: dict(m.properties) for m in listed},
        "calls": list(rec.calls),
    }

    # ---- listing versions (paging by 10) ----
    versions: dict[str, Any] = {}
    for count in PAGE_VERSIONS:
        name = f"{prefix}-many-{count}"
        created = []
        for i in range(count):
            data = payload(f"{name}-{i}", 100 + i)
            send = registry.store_model if i % 3 == 0 else registry.publish_model
            created.append(_info(await _bounded(send(name, data, {"i": str(i)}))))
        rec.calls.clear()
        iterations = await _bounded(registry.list_iterations(name), 30)
        versions[str(count)] = {
            "created": [c["iteration"] for c in created],
            "listed": [_info(it) for it in iterations],
            "expected_hashes": [b64sha(payload(f"{name}-{i}", 100 + i)) for i in range(count)],
            "calls": list(rec.calls),
        }
    no_versions = f"{prefix}-no-versions"
    await _bounded(registry.update_model_info(no_versions, {}))
    got = await _outcome(registry.list_iterations(no_versions))
    versions["no_versions"] = {
        "error": got["error"],
        "listed": None if got["value"] is None else [_info(i) for i in got["value"]],
    }
    got = await _outcome(registry.get_iteration_info(no_versions, -1))
    versions["no_versions_latest"] = {"info": _info(got["value"]), "error": got["error"]}
    report["versions"] = versions

    # ---- tracking ----
    report["tracking"] = await _tracking(registry, prefix)

    # ---- unknown model / version ----
    unknown = f"{prefix}-does-not-exist"
    errors: dict[str, Any] = {}
    errors["get_iteration_info"] = await _outcome(registry.get_iteration_info(unknown, 1))
    errors["get_iteration_info_latest"] = await _outcome(registry.get_iteration_info(unknown, -1))
    errors["retrieve_model"] = await _outcome(registry.retrieve_model(unknown, -1))
    errors["list_iterations"] = await _outcome(registry.list_iterations(unknown))
    errors["track_latest_model"] = await _outcome(registry.track_latest_model(unknown))
    errors["remove_model"] = await _outcome(registry.remove_model(unknown))
    errors["get_model_info"] = await _outcome(registry.get_model_info(unknown))

    async def first_update() -> Any:
        async for info in registry.iteration_updates(unknown):
            return _info(info)
        return "ended"

    errors["iteration_updates"] = await _outcome(first_update())
    for value in errors.values():
        if value["value"] is not None and not isinstance(value["value"], (str, dict, list)):
            value["value"] = repr(value["value"])
    raw_codes = {
        "RetrieveModels": await raw.code("RetrieveModels", raw.pb.RetrieveModelsRequest(model_ids=[unknown])),
        "RetrieveVersionInfos_model": await raw.code(
            "RetrieveVersionInfos", raw.pb.RetrieveVersionInfosRequest(model_id=unknown)
        ),
        "RetrieveVersionInfos_version": await raw.code(
            "RetrieveVersionInfos", raw.pb.RetrieveVersionInfosRequest(model_id=basic, version_numbers=[99])
        ),
        "RetrieveVersionInfos_latest_unknown_model": await raw.code(
            "RetrieveVersionInfos", raw.pb.RetrieveVersionInfosRequest(model_id=unknown, version_numbers=[-1])
        ),
        "RetrieveVersionData_model": await raw.code(
            "RetrieveVersionData", raw.pb.RetrieveVersionDataRequest(model_id=unknown, version_number=-1)
        ),
        "RetrieveVersionData_version": await raw.code(
            "RetrieveVersionData", raw.pb.RetrieveVersionDataRequest(model_id=basic, version_number=99)
        ),
        "DeleteModel": await raw.code("DeleteModel", raw.pb.DeleteModelRequest(model_id=unknown)),
    }
    errors["raw"] = raw_codes
    report["unknown"] = errors

    # ---- deletion ----
    report["deletion"] = await _deletion(registry, prefix, basic, page_names)


async def _tracking(registry, prefix: str) -> dict[str, Any]:
    result: dict[str, Any] = {}
    name = f"{prefix}-tracked"
    await _bounded(registry.publish_model(name, payload("t1", 64)))
    await _bounded(registry.publish_model(name, payload("t2", 64)))

    # iteration_updates: the latest at once, then each new one (archived or not)
    queue: asyncio.Queue = asyncio.Queue()
    task = asyncio.create_task(_collect_updates(registry.iteration_updates(name), queue))
    try:
        result["updates_first"] = await _next_update(queue)
        result["updates_nothing_more"] = await _next_update(queue, NO_UPDATE_WAIT)
        await _bounded(registry.publish_model(name, payload("t3", 64), {"n": "3"}))
        result["updates_after_publish"] = await _next_update(queue)
        await _bounded(registry.store_model(name, payload("t4", 64), {"n": "4"}))
        result["updates_after_store"] = await _next_update(queue)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    # track_latest_model: the latest (bytes) at once, then newer ones
    latest = await _bounded(registry.track_latest_model(name))
    model, info = await _bounded(latest.get(), UPDATE_TIMEOUT)
    result["track_initial"] = {"info": _info(info), "matches": model == payload("t4", 64)}
    published = _info(await _bounded(registry.publish_model(name, payload("t5", 64))))
    await _bounded(latest.wait_for_newer(info.iteration), UPDATE_TIMEOUT)
    model, info = latest.get_no_wait()
    result["track_newer"] = {
        "published": published["iteration"],
        "info": _info(info),
        "matches": model == payload("t5", 64),
    }

    # with a deserializer, on a model that has no version yet: available once one is published
    later = f"{prefix}-tracked-later"
    await _bounded(registry.update_model_info(later, {}))
    tracked = await _bounded(registry.track_latest_model(later, lambda data: {"len": len(data)}))
    waiting = asyncio.create_task(tracked.get())
    await asyncio.sleep(NO_UPDATE_WAIT)
    result["later_available_before_publish"] = waiting.done()
    await _bounded(registry.store_model(later, payload("l1", 33)))
    try:
        model, info = await _bounded(asyncio.shield(waiting), UPDATE_TIMEOUT)
        result["later"] = {"model": model, "info": _info(info)}
    except Exception as exc:
        waiting.cancel()
        result["later"] = {"error": _error(exc)}
    # SDK 2.10.1 bug: LatestModel.is_deserialized() reads `deserialized_func`, the attribute is
    # `deserialize_func` -> AttributeError whatever the registry does.
    try:
        result["is_deserialized"] = {"value": tracked.is_deserialized(), "error": None}
    except Exception as exc:
        result["is_deserialized"] = {"value": None, "error": _error(exc)}
    return result


async def _deletion(registry, prefix: str, basic: str, page_names: list[str]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    # a VersionUpdate stream open on the model ends when it is deleted
    queue: asyncio.Queue = asyncio.Queue()
    task = asyncio.create_task(_collect_updates(registry.iteration_updates(basic), queue))
    try:
        result["stream_first"] = await _next_update(queue)
        result["remove"] = await _outcome(registry.remove_model(basic))
        result["stream_after_delete"] = await _next_update(queue)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    result["get_model_info"] = repr(await _bounded(registry.get_model_info(basic)))
    result["retrieve_model"] = (await _outcome(registry.retrieve_model(basic, 1)))["error"]
    result["get_iteration_info"] = (await _outcome(registry.get_iteration_info(basic, 1)))["error"]
    result["list_iterations"] = (await _outcome(registry.list_iterations(basic)))["error"]
    result["remove_again"] = (await _outcome(registry.remove_model(basic)))["error"]
    models = await _bounded(registry.list_models(), 30)
    names = {m.name for m in models}
    result["still_listed"] = basic in names
    result["others_listed"] = all(name in names for name in page_names)
    # the id can be used again: a fresh model starts at version 1
    recreated = await _bounded(registry.publish_model(basic, payload("again", 5)))
    result["recreated"] = _info(recreated)
    return result


async def scenario_large(registry, raw: Raw, rec: RecordingStub, prefix: str, report: dict[str, Any]) -> None:
    name = f"{prefix}-large"
    data = payload("large", LARGE_SIZE)
    started = time.monotonic()
    info = _info(await _bounded(registry.store_model(name, data, {"size": "50MiB"}), LARGE_TIMEOUT))
    uploaded = time.monotonic()
    back = await _bounded(registry.retrieve_model(name, -1), LARGE_TIMEOUT)
    downloaded = time.monotonic()
    chunks = await raw.code(
        "RetrieveVersionData", raw.pb.RetrieveVersionDataRequest(model_id=name, version_number=1)
    )
    report["large"] = {
        "info": info,
        "expected_hash": b64sha(data),
        "expected_size": len(data),
        "downloaded_size": None if back is None else len(back),
        "downloaded_matches": back == data,
        "downloaded_hash": None if back is None else b64sha(back),
        "raw_chunk_count": len(chunks.get("chunks", [])),
        "raw_max_chunk": max(chunks.get("chunks", [0]) or [0]),
        "raw_code": chunks["code"],
        "upload_s": round(uploaded - started, 3),
        "download_s": round(downloaded - uploaded, 3),
    }


async def run(endpoint: str, scenario: str) -> dict[str, Any]:
    import cogment

    report: dict[str, Any] = {"sdk_version": cogment.__version__, "scenario": scenario, "errors": []}
    prefix = f"interop-{uuid.uuid4().hex[:10]}"
    report["prefix"] = prefix
    address = endpoint.split("://", 1)[1]
    context = cogment.Context(user_id="interop", cog_settings=None)
    registry = await context.get_model_registry_v2(cogment.Endpoint(endpoint))
    rec = RecordingStub(registry._model_registry_stub)
    registry._model_registry_stub = rec  # observation only: every call still goes to the SDK's stub
    raw = Raw(address)
    try:
        if scenario == "main":
            await scenario_main(registry, raw, rec, prefix, report)
        else:
            await scenario_large(registry, raw, rec, prefix, report)
    except Exception as exc:
        report["errors"].append({"error": _error(exc), "traceback": traceback.format_exc()[-3000:]})
    finally:
        await raw.close()
    return report


def main() -> int:
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    if len(sys.argv) < 2:
        print(json.dumps({"errors": ["usage: script grpc://host:port [main|large]"]}))
        return 2
    endpoint = sys.argv[1]
    scenario = sys.argv[2] if len(sys.argv) > 2 else "main"
    if scenario not in SCENARIOS or not endpoint.startswith("grpc://127.0.0.1:"):
        print(json.dumps({"errors": [f"bad arguments {sys.argv[1:]}"]}))
        return 2

    async def bounded_run() -> dict[str, Any]:
        return await asyncio.wait_for(run(endpoint, scenario), OVERALL_TIMEOUT[scenario])

    try:
        report = asyncio.run(bounded_run())
    except Exception as exc:
        report = {"errors": [{"error": _error(exc), "traceback": traceback.format_exc()[-3000:]}]}
    print(json.dumps(report, default=repr), flush=True)
    return 0 if not report.get("errors") else 1


if __name__ == "__main__":
    sys.exit(main())
