"""Exercise a Cogment Directory through the OFFICIAL Cogment Python SDK (2.10.1).

Run with the SDK venv interpreter (see ``sdk_env.py``), never imported by pytest:

    .venv-sdk/bin/python tests/interop/sdk_directory_script.py grpc://127.0.0.1:PORT [all]

Prints exactly ONE JSON object on stdout (everything else goes to stderr).  All
traffic goes to 127.0.0.1; every wait is bounded; the whole run is bounded by
``OVERALL_TIMEOUT``.  Nothing is written to disk.

What the SDK 2.10.1 does with a directory (read from cogment/context.py,
cogment/directory.py, cogment/endpoints.py, cogment/grpc_metadata.py)
---------------------------------------------------------------------------
Setup
* ``cogment.Context(user_id, cog_settings, directory_endpoint=Endpoint("grpc://h:p"),
  directory_auth_token=None, metadata=GrpcMetadata())``; without ``directory_endpoint``
  it reads ``COGMENT_DIRECTORY_ENDPOINT`` and ``COGMENT_DIRECTORY_AUTHENTICATION_TOKEN``.
  One insecure ``grpc.aio`` channel (default options) to the directory, stub
  ``cogmentAPI.DirectorySP``.  ``cog_settings`` may be ``None`` for registering
  and serving (it is only used once a trial runs), so none is generated here.
* Token: ``Directory.__init__`` does ``self._metadata = self._metadata.add(...)``
  but ``GrpcMetadata.add`` returns None -> any directory call then raises
  AttributeError (SDK bug).  Workaround used here: put ``authentication-token``
  into ``Context(metadata=...)``; the Context metadata is sent on every
  Register/Deregister/Inquire call (and on every other client call).

Registration (``Context.serve_all_registered(served_endpoint,
directory_registration_host=None)``)
* Starts its gRPC server on ``[::]:port`` FIRST (ServiceActorSP / EnvironmentSP /
  TrialHooksSP / DatalogSP, all implementing Status (``overall_load`` 0..254 from the
  load average, ``nb_sessions``) and Version), then registers, sequentially:
  one ACTOR_SERVICE(3) entry per actor class of each ``register_actor`` (props:
  user props + ``__implementation`` + ``__actor_class`` + ``__registration_source=
  PythonSDK-Implicit`` + ``__version=2.10.1``), one ENVIRONMENT_SERVICE(4) per
  ``register_environment`` (user props + ``__implementation`` + the two above),
  PRE_HOOK_SERVICE(5) / DATALOG_SERVICE(6) (user props + the two above).
* Each registration is its OWN ``/cogmentAPI.DirectorySP/Register`` bidi stream with
  exactly one RegisterRequest{endpoint{protocol GRPC (GRPC_SSL if served with TLS),
  host, port = actual bound port}, details{type, properties}}; ``permanent`` is never
  set (false).  The SDK reads the first reply: status != OK -> CogmentError
  (registration aborted, what was registered is deregistered); it keeps
  (service_id, secret) privately -- no public accessor.
* Host: ``directory_registration_host`` if given, else the address of the UDP route
  to 192.19.254.254; a loopback/failed address means NO registration at all (warning
  only).  Hence this script passes ``directory_registration_host="127.0.0.1"``.
* Deregistration: in a ``finally`` after ``wait_for_termination`` (so when the serving
  task is cancelled or the server stops): one ``/cogmentAPI.DirectorySP/Deregister``
  bidi stream per registration with one DeregisterRequest{service_id, secret}; the
  reply status is NOT checked (``CogmentError`` built but not raised), errors are only
  logged at debug level.
* ``Directory.register_host(type, host, port, ssl=False, properties=None)`` and
  ``Directory.deregister_service(id, secret)`` are reachable through the public (but
  undocumented) ``Context.get_context_directory()`` / ``Context.get_directory()``.

Discovery (``Directory.get_inquired_endpoint(Endpoint, type=None, properties=None)``)
* ``grpc://`` URLs are returned untouched (no directory call).  ``cogment://discover/<path>``:
  path -> type: actor 3, environment 4, datalog 6, prehook 5, lifecycle 1, actservice 2,
  datastore 7, modelregistry 8, directory 9; empty path uses the caller's default type
  (get_controller: lifecycle, get_datastore: datastore, get_model_registry[_v2]:
  modelregistry, join_trial: actservice).  ``other`` is NOT supported by the SDK.
* Query pairs (``parse_qsl``, blank values kept, strict) become ``details.properties``
  VERBATIM -- including ``__authentication-token`` (not moved to metadata, unlike the
  orchestrator).  One unary->stream ``/cogmentAPI.DirectorySP/Inquire`` with
  ``details{type, properties}``.
* ``cogment://discover/service?__id=N``: other query pairs ignored; Inquire with
  ``service_id = int(N)`` (``__id=0`` is sent as service_id 0); missing ``__id`` ->
  CogmentError before any call.
* The SDK reads the WHOLE reply stream and uses only ``data.endpoint`` (protocol, host,
  port): GRPC -> ``grpc://host:port``; GRPC_SSL -> same URL flagged ssl; COGMENT only
  with host ``client`` -> ``cogment://client``; anything else (UNKNOWN protocol, other
  COGMENT host) -> CogmentError for the whole inquiry.  ``service_id``, ``details`` and
  ``permanent`` of the reply are ignored.  It picks the FIRST reply whose ssl flag
  matches the requested endpoint's (so reply order = "most recent first" matters).
* No match (empty stream, status OK): logs an error and returns the ORIGINAL
  ``cogment://`` endpoint unchanged (callers then fail on the non-grpc scheme).  A gRPC
  error status escapes as ``grpc.aio.AioRpcError``.
* The SDK never calls Version/Status of the directory, never registers permanent
  entries and never registers DATASTORE/MODEL_REGISTRY/LIFECYCLE/... on its own.

How this script reaches the directory
* Public API only for registering, resolving and deregistering: ``Context``,
  ``serve_all_registered``, ``get_context_directory().get_inquired_endpoint``,
  ``register_host``/``deregister_service`` (to place DATASTORE / MODEL_REGISTRY
  entries), ``get_datastore`` / ``get_model_registry_v2`` + one call each to prove the
  resolved endpoint is really used.
* RAW stub shipped by the SDK (``cogment.api.directory_pb2_grpc.DirectorySPStub``),
  used READ-ONLY for verification because no public API exposes it: listing what the
  SDK registered (service ids, properties, permanent flag) via Inquire, and the gRPC
  status of a no-match Inquire.
* Fake DATASTORE / MODEL_REGISTRY targets: small grpc.aio servers built from the
  SDK's generated servicers (Status/Version so the directory's health checks pass,
  RetrieveTrials/RetrieveModels answering empty and recording which server was hit).
"""

from __future__ import annotations

import os

# grpc honours http(s)_proxy; make sure loopback traffic never goes through one.
for _var in ("no_proxy", "NO_PROXY", "no_grpc_proxy"):
    _current = os.environ.get(_var, "")
    os.environ[_var] = ",".join(x for x in (_current, "127.0.0.1", "localhost") if x)

import asyncio  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from typing import Any  # noqa: E402

OVERALL_TIMEOUT = 120.0  # seconds, whole script
CALL_TIMEOUT = 15.0  # seconds, any single directory / service call
REGISTRATION_TIMEOUT = 40.0  # seconds, SDK self-registration to become visible
DEREGISTRATION_TIMEOUT = 20.0  # seconds, SDK deregistration to become visible
DEAD_ENTRY_TIMEOUT = 15.0  # seconds, a registered but unreachable entry to be hidden

ACTOR_IMPL = "interop_actor_impl"
ACTOR_CLASSES = ["interop_class_a", "interop_class_b"]
ENV_IMPL = "interop_env_impl"
USER_PROPS = {"team": "blue"}
TOKEN = "interop-token"
UNKNOWN_ID = 9_876_543_210_123  # almost certainly never allocated

SCENARIOS = ("all",)


def _log(msg: str) -> None:
    print(f"[sdk_directory_script] {msg}", file=sys.stderr, flush=True)


async def _bounded(awaitable, timeout: float = CALL_TIMEOUT):
    return await asyncio.wait_for(awaitable, timeout=timeout)


def _entry_to_json(data) -> dict[str, Any]:
    from cogment.api import directory_pb2

    return {
        "service_id": int(data.service_id),
        "protocol": directory_pb2.ServiceEndpoint.Protocol.Name(data.endpoint.protocol),
        "host": data.endpoint.host,
        "port": int(data.endpoint.port),
        "type": directory_pb2.ServiceType.Name(data.details.type),
        "properties": dict(data.details.properties),
        "permanent": bool(data.permanent),
    }


def _closed_port() -> int:
    """A loopback port nobody listens on (bound then released)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


class FakeAuxServer:
    """TrialDatastoreSP + ModelRegistrySP on 127.0.0.1, recording client calls."""

    def __init__(self, label: str):
        self.label = label
        self.calls: list[str] = []
        self.port = 0
        self._server = None

    async def start(self) -> None:
        import grpc.aio
        from cogment.api import (
            common_pb2,
            model_registry_pb2,
            model_registry_pb2_grpc,
            trial_datastore_pb2,
            trial_datastore_pb2_grpc,
        )

        outer = self

        def status_reply(request):
            reply = common_pb2.StatusReply()
            if request.names:
                reply.statuses["overall_load"] = "0"
            return reply

        class Datastore(trial_datastore_pb2_grpc.TrialDatastoreSPServicer):
            async def RetrieveTrials(self, request, context):
                outer.calls.append("TrialDatastoreSP/RetrieveTrials")
                return trial_datastore_pb2.RetrieveTrialsReply()

            async def Version(self, request, context):
                outer.calls.append("TrialDatastoreSP/Version")
                return common_pb2.VersionInfo()

            async def Status(self, request, context):
                outer.calls.append("TrialDatastoreSP/Status")
                return status_reply(request)

        class Registry(model_registry_pb2_grpc.ModelRegistrySPServicer):
            async def RetrieveModels(self, request, context):
                outer.calls.append("ModelRegistrySP/RetrieveModels")
                return model_registry_pb2.RetrieveModelsReply()

            async def Version(self, request, context):
                outer.calls.append("ModelRegistrySP/Version")
                return common_pb2.VersionInfo()

            async def Status(self, request, context):
                outer.calls.append("ModelRegistrySP/Status")
                return status_reply(request)

        self._server = grpc.aio.server()
        trial_datastore_pb2_grpc.add_TrialDatastoreSPServicer_to_server(Datastore(), self._server)
        model_registry_pb2_grpc.add_ModelRegistrySPServicer_to_server(Registry(), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()

    def client_calls(self) -> list[str]:
        return [c for c in self.calls if not c.endswith(("/Status", "/Version"))]

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(None)


class Runner:
    def __init__(self, directory_url: str, out: dict[str, Any]):
        self.directory_url = directory_url
        self.out = out
        self.errors: list[str] = out["errors"]

    # -- helpers -----------------------------------------------------------------
    def error(self, what: str, exc: BaseException | None = None) -> None:
        msg = what if exc is None else f"{what}: {type(exc).__name__}: {exc}"
        _log("ERROR " + msg)
        self.errors.append(msg)

    async def resolve(self, directory, url: str) -> dict[str, Any]:
        """Public-API discovery; records resolved URL or the exception."""
        import cogment

        try:
            endpoint = await _bounded(directory.get_inquired_endpoint(cogment.Endpoint(url)))
            return {"url": url, "resolved": endpoint.url, "error": None}
        except Exception as exc:  # recorded, asserted on by pytest
            return {"url": url, "resolved": None, "error": f"{type(exc).__name__}: {exc}"}

    async def raw_inquire(
        self,
        token: str | None = None,
        *,
        service_id: int | None = None,
        service_type: int | None = None,
        properties: dict[str, str] | None = None,
    ):
        """Read-only verification through the SDK-shipped raw stub (see module doc)."""
        from cogment.api import directory_pb2

        request = directory_pb2.InquireRequest()
        if service_id is not None:
            request.service_id = service_id
        else:
            request.details.type = service_type or 0
            request.details.properties.update(properties or {})
        metadata = [("authentication-token", token)] if token else []
        entries = []
        call = self.raw_stub.Inquire(request, metadata=metadata, timeout=CALL_TIMEOUT)
        async for reply in call:
            entries.append(_entry_to_json(reply.data))
        code = await call.code()
        return {"code": code.name, "entries": entries}

    # -- main flow ---------------------------------------------------------------
    async def run(self) -> None:
        import cogment
        import grpc.aio
        from cogment.api import directory_pb2_grpc
        from cogment.directory import ServiceType

        out = self.out
        out["sdk_version"] = cogment.__version__
        out["directory_endpoint"] = self.directory_url
        host_port = self.directory_url.split("://", 1)[1]
        self.raw_channel = grpc.aio.insecure_channel(host_port)
        self.raw_stub = directory_pb2_grpc.DirectorySPStub(self.raw_channel)

        ctx = cogment.Context(
            user_id="interop", cog_settings=None, directory_endpoint=cogment.Endpoint(self.directory_url)
        )
        directory = ctx.get_context_directory()

        # ---- 1. SDK self-registration through serve_all_registered ----------------
        async def actor_impl(session):  # never run: no trial is started
            pass

        async def env_impl(session):
            pass

        async def prehook_impl(session):
            pass

        async def datalog_impl(session):
            pass

        ctx.register_actor(actor_impl, ACTOR_IMPL, list(ACTOR_CLASSES), properties=dict(USER_PROPS))
        ctx.register_environment(env_impl, ENV_IMPL, properties=dict(USER_PROPS))
        ctx.register_pre_trial_hook(prehook_impl, properties=dict(USER_PROPS))
        ctx.register_datalog(datalog_impl, properties=dict(USER_PROPS))

        serve_task = asyncio.create_task(
            ctx.serve_all_registered(cogment.ServedEndpoint(port=0), directory_registration_host="127.0.0.1")
        )

        try:
            await self._registration_part(ctx, directory, serve_task)
            aux1, aux2 = FakeAuxServer("aux1"), FakeAuxServer("aux2")
            await aux1.start()
            await aux2.start()
            try:
                await self._aux_part(ctx, directory, aux1, aux2, ServiceType)
                await self._token_part(aux1, ServiceType)
                # Health checks the directory made on the fake services (Status / Version).
                out.setdefault("aux", {})["health_calls"] = {
                    s.label: [c for c in s.calls if c.endswith(("/Status", "/Version"))] for s in (aux1, aux2)
                }
            finally:
                await aux1.stop()
                await aux2.stop()
            await self._sdk_deregistration_part(ctx, directory, serve_task)
        finally:
            if not serve_task.done():
                serve_task.cancel()
                await asyncio.wait([serve_task], timeout=DEREGISTRATION_TIMEOUT)
            # Cleanup only (no public stop API): stop the SDK's own gRPC server.
            # grpcio 1.48 raises CancelledError from stop() once wait_for_termination was
            # cancelled, so stop it in its own task and ignore that outcome.
            server = getattr(ctx, "_grpc_server", None)
            if server is not None:
                stop_task = asyncio.ensure_future(server.stop(None))
                await asyncio.wait([stop_task], timeout=5)
                if stop_task.done() and not stop_task.cancelled():
                    stop_task.exception()  # retrieved, deliberately ignored
            await self.raw_channel.close()

    async def _registration_part(self, ctx, directory, serve_task) -> None:
        out = self.out
        last_url = "cogment://discover/datalog?team=blue"  # the SDK registers it last
        deadline = time.monotonic() + REGISTRATION_TIMEOUT
        visible = None
        while time.monotonic() < deadline:
            if serve_task.done():
                exc = serve_task.exception() if not serve_task.cancelled() else None
                self.error("serve_all_registered ended early", exc)
                break
            visible = await self.resolve(directory, last_url)
            if visible["resolved"] and visible["resolved"].startswith("grpc://"):
                break
            await asyncio.sleep(0.2)
        out["served_port"] = ctx.served_port
        out["registration_wait"] = visible
        if not (visible and visible["resolved"] and visible["resolved"].startswith("grpc://")):
            self.error(f"SDK registrations not visible after {REGISTRATION_TIMEOUT}s: {visible}")

        # What the SDK registered (read back with the raw stub: ids are not public).
        registered = {}
        for name, stype in (("actor", 3), ("environment", 4), ("prehook", 5), ("datalog", 6)):
            try:
                registered[name] = await self.raw_inquire(service_type=stype, properties=dict(USER_PROPS))
            except Exception as exc:
                self.error(f"raw inquire {name}", exc)
                registered[name] = {"code": None, "entries": []}
        out["sdk_registered"] = registered

        a, b = ACTOR_CLASSES
        discover = {
            "actor_a": f"cogment://discover/actor?__actor_class={a}&__implementation={ACTOR_IMPL}",
            "actor_b": f"cogment://discover/actor?__actor_class={b}&__implementation={ACTOR_IMPL}",
            "actor_a_class_only": f"cogment://discover/actor?__actor_class={a}",
            "actor_impl_only": f"cogment://discover/actor?__implementation={ACTOR_IMPL}",
            "actor_user_prop": f"cogment://discover/actor?__actor_class={b}&team=blue",
            "actor_sdk_props": "cogment://discover/actor?__registration_source=PythonSDK-Implicit"
            f"&__version={out['sdk_version']}&__actor_class={a}",
            "environment": f"cogment://discover/environment?__implementation={ENV_IMPL}",
            "prehook": "cogment://discover/prehook?team=blue",
            "datalog": "cogment://discover/datalog?team=blue",
            # no-match cases: must come back unchanged, without error
            "nomatch_actor_class": "cogment://discover/actor?__actor_class=no_such_class",
            "nomatch_wrong_value": f"cogment://discover/actor?__actor_class={a}&team=red",
            "nomatch_wrong_type": f"cogment://discover/environment?__actor_class={a}",
            "nomatch_empty_value": f"cogment://discover/actor?__actor_class={a}&team=",
            "nomatch_modelregistry": "cogment://discover/modelregistry?name=interop_no_such_registry",
            "nomatch_unknown_id": f"cogment://discover/service?__id={UNKNOWN_ID}",
            "nomatch_id_zero": "cogment://discover/service?__id=0",
        }
        out["discovery"] = {k: await self.resolve(directory, v) for k, v in discover.items()}

        by_id = {}
        for info in registered.values():
            for entry in info["entries"]:
                sid = entry["service_id"]
                by_id[str(sid)] = await self.resolve(directory, f"cogment://discover/service?__id={sid}")
        out["id_discovery"] = by_id

        try:
            out["raw_nomatch"] = await self.raw_inquire(
                service_type=3, properties={"__actor_class": "no_such_class"}
            )
            out["raw_nomatch_id"] = await self.raw_inquire(service_id=UNKNOWN_ID)
        except Exception as exc:
            self.error("raw no-match inquire", exc)

    async def _aux_part(self, ctx, directory, aux1, aux2, ServiceType) -> None:
        import cogment

        out = self.out
        aux = {"aux1_port": aux1.port, "aux2_port": aux2.port}
        out["aux"] = aux
        try:
            ds1 = await _bounded(
                directory.register_host(
                    ServiceType.DATASTORE,
                    "127.0.0.1",
                    aux1.port,
                    properties={"name": "interop_ds", "rank": "first"},
                )
            )
            ds2 = await _bounded(
                directory.register_host(
                    ServiceType.DATASTORE,
                    "127.0.0.1",
                    aux2.port,
                    properties={"name": "interop_ds", "rank": "second"},
                )
            )
            mr1 = await _bounded(
                directory.register_host(
                    ServiceType.MODEL_REG, "127.0.0.1", aux1.port, properties={"name": "interop_mr"}
                )
            )
        except Exception as exc:
            self.error("Directory.register_host (datastore/model registry)", exc)
            return
        aux["ids"] = {"ds1": ds1[0], "ds2": ds2[0], "mr1": mr1[0]}
        aux["secret_lengths"] = {"ds1": len(ds1[1]), "ds2": len(ds2[1]), "mr1": len(mr1[1])}

        urls = {
            "ds_latest": "cogment://discover/datastore?name=interop_ds",
            "ds_first": "cogment://discover/datastore?name=interop_ds&rank=first",
            "ds_second": "cogment://discover/datastore?name=interop_ds&rank=second",
            "mr": "cogment://discover/modelregistry?name=interop_mr",
            "ds_any": "cogment://discover/datastore",
            "ds1_by_id": f"cogment://discover/service?__id={ds1[0]}",
            "ds2_by_id": f"cogment://discover/service?__id={ds2[0]}",
            "mr1_by_id": f"cogment://discover/service?__id={mr1[0]}",
            "ds_wrong_type": "cogment://discover/modelregistry?name=interop_ds",
        }
        aux["discovery"] = {k: await self.resolve(directory, v) for k, v in urls.items()}

        # An entry whose endpoint does not answer (a closed loopback port): a health-checking
        # directory must not hand it out.
        dead_port = _closed_port()
        try:
            dead = await _bounded(
                directory.register_host(
                    ServiceType.DATASTORE, "127.0.0.1", dead_port, properties={"name": "interop_dead"}
                )
            )
            registered_at = time.monotonic()
            dead_url = "cogment://discover/datastore?name=interop_dead"
            aux["dead"] = {
                "port": dead_port,
                "service_id": dead[0],
                "by_props": await self.resolve(directory, dead_url),
                "by_id": await self.resolve(directory, f"cogment://discover/service?__id={dead[0]}"),
                "hidden_after_s": None,
            }
            # How long the dead entry stays discoverable (bounded).
            while time.monotonic() - registered_at < DEAD_ENTRY_TIMEOUT:
                if (await self.resolve(directory, dead_url))["resolved"] == dead_url:
                    aux["dead"]["hidden_after_s"] = round(time.monotonic() - registered_at, 3)
                    break
                await asyncio.sleep(0.05)
            await _bounded(directory.deregister_service(*dead))
        except Exception as exc:
            self.error("dead endpoint registration", exc)

        # The SDK's public client accessors, then one real call each: which server got it?
        public = {}
        for key, url, getter, call in (
            ("datastore_latest", urls["ds_latest"], ctx.get_datastore, "get_trials"),
            ("datastore_first", urls["ds_first"], ctx.get_datastore, "get_trials"),
            ("model_registry", urls["mr"], ctx.get_model_registry_v2, "list_models"),
        ):
            before = {s.label: len(s.client_calls()) for s in (aux1, aux2)}
            try:
                client = await _bounded(getter(cogment.Endpoint(url)))
                await _bounded(getattr(client, call)())
                hit = [s.label for s in (aux1, aux2) if len(s.client_calls()) > before[s.label]]
                public[key] = {"hit": hit, "error": None}
            except Exception as exc:
                public[key] = {"hit": [], "error": f"{type(exc).__name__}: {exc}"}
        aux["public_clients"] = public
        aux["client_calls"] = {"aux1": aux1.client_calls(), "aux2": aux2.client_calls()}

        # Deregistration through the SDK's Directory object (it ignores the reply status,
        # so the effect is checked by resolving again).
        try:
            await _bounded(directory.deregister_service(ds1[0], ds1[1] + "x"))  # wrong secret
            aux["after_bad_secret_deregister"] = await self.resolve(directory, urls["ds1_by_id"])
            await _bounded(directory.deregister_service(ds1[0], ds1[1]))
            await _bounded(directory.deregister_service(ds2[0], ds2[1]))
            await _bounded(directory.deregister_service(mr1[0], mr1[1]))
            await _bounded(directory.deregister_service(mr1[0], mr1[1]))  # already gone
        except Exception as exc:
            self.error("Directory.deregister_service", exc)
        aux["after_deregister"] = {
            k: await self.resolve(directory, urls[k])
            for k in ("ds_latest", "ds_first", "mr", "ds1_by_id", "ds2_by_id", "mr1_by_id")
        }

    async def _token_part(self, aux1, ServiceType) -> None:
        import cogment

        out = self.out
        tok: dict[str, Any] = {}
        out["token"] = tok
        metadata = cogment.GrpcMetadata()
        metadata.add("authentication-token", TOKEN)
        ctx_tok = cogment.Context(
            user_id="interop-token",
            cog_settings=None,
            directory_endpoint=cogment.Endpoint(self.directory_url),
            metadata=metadata,
        )
        ctx_plain = cogment.Context(
            user_id="interop-plain",
            cog_settings=None,
            directory_endpoint=cogment.Endpoint(self.directory_url),
        )
        dir_tok = ctx_tok.get_context_directory()
        dir_plain = ctx_plain.get_context_directory()
        try:
            sid, secret = await _bounded(
                dir_tok.register_host(
                    ServiceType.DATASTORE, "127.0.0.1", aux1.port, properties={"name": "interop_tok_ds"}
                )
            )
        except Exception as exc:
            self.error("register with token", exc)
            return
        tok["service_id"] = sid
        url = "cogment://discover/datastore?name=interop_tok_ds"
        id_url = f"cogment://discover/service?__id={sid}"
        tok["with_token"] = await self.resolve(dir_tok, url)
        tok["with_token_by_id"] = await self.resolve(dir_tok, id_url)
        tok["without_token"] = await self.resolve(dir_plain, url)
        tok["without_token_by_id"] = await self.resolve(dir_plain, id_url)
        # The SDK sends `__authentication-token` from the query as a plain inquiry property
        # (the orchestrator moves it to metadata); the directory takes it as the token.
        tok["token_in_query"] = await self.resolve(
            dir_plain, f"cogment://discover/datastore?name=interop_tok_ds&__authentication-token={TOKEN}"
        )
        try:
            tok["raw_wrong_token"] = await self.raw_inquire("other-token", service_id=sid)
        except Exception as exc:
            self.error("raw inquire wrong token", exc)
        try:
            await _bounded(dir_plain.deregister_service(sid, secret))  # no token: must be refused
            tok["after_deregister_without_token"] = await self.resolve(dir_tok, id_url)
            await _bounded(dir_tok.deregister_service(sid, secret))
            tok["after_deregister_with_token"] = await self.resolve(dir_tok, id_url)
        except Exception as exc:
            self.error("deregister with/without token", exc)

    async def _sdk_deregistration_part(self, ctx, directory, serve_task) -> None:
        out = self.out
        dereg: dict[str, Any] = {}
        out["sdk_deregistration"] = dereg
        if serve_task.done():
            self.error("serving task already finished before deregistration test")
            return
        ids = [e["service_id"] for info in out.get("sdk_registered", {}).values() for e in info["entries"]]
        serve_task.cancel()  # as on Ctrl-C: the SDK deregisters in its `finally`
        done, _ = await asyncio.wait([serve_task], timeout=DEREGISTRATION_TIMEOUT)
        dereg["serve_task_finished"] = bool(done)
        deadline = time.monotonic() + DEREGISTRATION_TIMEOUT
        remaining: list[int] = ids
        while time.monotonic() < deadline:
            remaining = []
            for sid in ids:
                info = await self.raw_inquire(service_id=sid)
                if info["entries"]:
                    remaining.append(sid)
            if not remaining:
                break
            await asyncio.sleep(0.2)
        dereg["ids"] = ids
        dereg["remaining_ids"] = remaining
        dereg["discovery_after"] = {
            "actor_a": await self.resolve(
                directory,
                f"cogment://discover/actor?__actor_class={ACTOR_CLASSES[0]}&__implementation={ACTOR_IMPL}",
            ),
            "environment": await self.resolve(
                directory, f"cogment://discover/environment?__implementation={ENV_IMPL}"
            ),
        }


async def _main_async(directory_url: str, scenario: str, out: dict[str, Any]) -> None:
    runner = Runner(directory_url, out)
    await runner.run()


def main(argv: list[str]) -> int:
    logging.basicConfig(
        stream=sys.stderr, level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    out: dict[str, Any] = {"errors": [], "scenario": None}
    if len(argv) < 2 or not argv[1].startswith("grpc://"):
        out["errors"].append("usage: sdk_directory_script.py grpc://127.0.0.1:PORT [scenario]")
        print(json.dumps(out), flush=True)
        return 2
    directory_url = argv[1]
    scenario = argv[2] if len(argv) > 2 else "all"
    out["scenario"] = scenario
    if scenario not in SCENARIOS:
        out["errors"].append(f"unknown scenario {scenario!r}; known: {SCENARIOS}")
        print(json.dumps(out), flush=True)
        return 2
    try:
        asyncio.run(asyncio.wait_for(_main_async(directory_url, scenario, out), timeout=OVERALL_TIMEOUT))
    except asyncio.TimeoutError:
        out["errors"].append(f"script timed out after {OVERALL_TIMEOUT}s")
    except BaseException as exc:  # report everything as JSON
        out["errors"].append(f"fatal: {type(exc).__name__}: {exc}")
        traceback.print_exc(file=sys.stderr)
    print(json.dumps(out, sort_keys=True), flush=True)
    return 0 if not out["errors"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
