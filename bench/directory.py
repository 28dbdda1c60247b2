"""Benchmark of the Directory service against a bare grpc.aio baseline.

    .venv/bin/python bench/directory.py [--database_url URL] [--services 10000] [--duration 10] ...

What it does, all traffic on 127.0.0.1, everything bounded in time and count:

1. Starts the directory as users do (`python -m services.directory --port 0 --bind_address
   127.0.0.1 --log_format json --database_url ...`, log level info) and learns its port from its
   JSON `serving` log line. The default database is a fresh SQLite file in a temporary directory.
2. Registration phase: registers `--services` entries through Register streams from
   `--register_clients` concurrent clients, each sending one request and waiting for its reply
   (as the SDKs do), and reports registrations/s and the per-registration latency.
3. Inquiry phase: `--inquire_clients` concurrent clients (each on its own HTTP/2 connection)
   send Inquire by type and properties, each matching 1 to 3 entries (the results are checked),
   in a closed loop (or paced at `--inquire_rate`, open loop): `--warmup` seconds not measured,
   then `--duration` seconds measured. Latency is per call, from the call to its last reply.
   In a closed loop at saturation, latency is about clients / throughput (Little's law); use
   `--inquire_rate` to read latencies below saturation.
4. Baseline: a bare grpc.aio server (this script, in its own subprocess, same interpreter)
   implementing only `/cogmentAPI.DirectorySP/Inquire` with one prebuilt InquireReply per call,
   loaded by the same client code with the same concurrency.

Optionally (`--deregister`), everything registered is deregistered at the end, e.g. to leave a
shared PostgreSQL database as it was.

The load generator runs in `--client_procs` worker subprocesses. With two or more CPUs the server
is pinned to one CPU and the clients (and this orchestrator) to the others, so the two sides do
not steal each other's CPU; the CPU use of both sides over the measured window is reported, which
tells whether the server (the thing measured) or the client was the bottleneck.

Dataset: entries come in groups of 1 to --max_group_size (default 1) that share a type and a
property map, like the registrations of the SDKs (`__actor_class`, `__implementation`,
`__registration_source`, `__version`, plus user properties). An inquiry names a group's type
and its identifying properties, so it matches exactly that group. Most entries are non-permanent with protocol
COGMENT and host `client`: they are stored like any registration but are never health-checked,
so no health check of a non-existent endpoint interferes (and removes entries) during the run. A
share (`--permanent_share`) is registered permanent with protocol GRPC, which exercises the other
write path (the upsert on the permanent identity); permanent entries are never checked either.

The summary table is followed by one JSON line with every figure. Targets are shown, never
asserted: the exit status is 0 whenever the benchmark itself ran.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import json
import math
import os
import random
import secrets
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve()
if str(SCRIPT.parents[1]) not in sys.path:  # run as a script: `bench` is not an installed package
    sys.path.insert(0, str(SCRIPT.parents[1]))

import grpc  # noqa: E402

from bench.common import (  # noqa: E402
    CHANNEL_OPTIONS,
    READY_TIMEOUT_S,
    START_TIMEOUT_S,
    Child,
    MiB,
    Plan,
    emit,
    fmt,
    pin,
    pinned_plan,
    print_table,
    run_benchmark,
    serve_bare,
    start_server,
    stdin_lines,
    vm_hwm,
    vm_rss,
)
from shared.api import common_pb2, directory_pb2  # noqa: E402

REGISTER = "/cogmentAPI.DirectorySP/Register"
DEREGISTER = "/cogmentAPI.DirectorySP/Deregister"
INQUIRE = "/cogmentAPI.DirectorySP/Inquire"
STATUS = "/cogmentAPI.DirectorySP/Status"
TOKEN_METADATA_KEY = "authentication-token"

RPC_TIMEOUT_S = 10.0
GO_DELAY_S = 0.2
# A worker gives up on a phase after this long past its planned end (bounded in time).
WORKER_GRACE_S = 30.0
# A client stops early after this many errors in a row (e.g. the server died).
MAX_CONSECUTIVE_ERRORS = 100

TARGET_REGISTRATIONS_PER_S = 1500.0
TARGET_RATIO = 0.8
TARGET_P99_MS = 10.0
# Replicas: how many registrations through the first are timed until another answers them.
PROPAGATION_SAMPLES = 100
TARGET_PROPAGATION_MS = 50.0

D = directory_pb2
# (service type, weight): mostly actors and environments, a few of every other kind.
SERVICE_TYPE_WEIGHTS = [
    (D.ACTOR_SERVICE, 60),
    (D.ENVIRONMENT_SERVICE, 20),
    (D.PRE_HOOK_SERVICE, 5),
    (D.DATALOG_SERVICE, 5),
    (D.TRIAL_LIFE_CYCLE_SERVICE, 3),
    (D.CLIENT_ACTOR_CONNECTION_SERVICE, 3),
    (D.DATASTORE_SERVICE, 2),
    (D.MODEL_REGISTRY_SERVICE, 2),
]
TEAMS = ["red", "blue", "green", "gold"]
REGIONS = ["eu-west", "us-east", "ap-south"]
ACTOR_CLASSES = 40


# ---- the dataset (rebuilt identically, from the same arguments, in every process) ----


@dataclass(frozen=True)
class Group:
    """Entries sharing a type and a property map; an inquiry for the group matches them all."""

    service_type: int
    permanent: bool
    first: int  # index of the group's first entry
    size: int
    properties: dict[str, str]
    query: dict[str, str]


def build_groups(services: int, seed: int, permanent_share: float, max_group_size: int = 1) -> list[Group]:
    rng = random.Random(seed)
    types = [service_type for service_type, _ in SERVICE_TYPE_WEIGHTS]
    weights = [weight for _, weight in SERVICE_TYPE_WEIGHTS]
    groups: list[Group] = []
    first = 0
    while first < services:
        g = len(groups)
        size = min(rng.randint(1, max_group_size), services - first)
        service_type = rng.choices(types, weights)[0]
        properties = {
            "__registration_source": "PythonSDK-Implicit",
            "__version": "2.10.1",
            "team": rng.choice(TEAMS),
            "region": rng.choice(REGIONS),
        }
        if service_type == D.ACTOR_SERVICE:
            # The (class, implementation) pair is unique to the group.
            identity = {"__actor_class": f"class_{g % ACTOR_CLASSES}", "__implementation": f"agent_v{g}"}
        elif service_type == D.ENVIRONMENT_SERVICE:
            identity = {"__implementation": f"env_{g}"}
        else:
            identity = {"name": f"service_{g}"}
        properties.update(identity)
        query = dict(identity)
        if g % 4 == 0:  # some inquiries also name a user property
            query["team"] = properties["team"]
        groups.append(Group(service_type, rng.random() < permanent_share, first, size, properties, query))
        first += size
    return groups


def registration_request(group: Group, member: int) -> directory_pb2.RegisterRequest:
    properties = dict(group.properties)
    if group.permanent:
        # A permanent entry is identified by (token, type, property map): members must differ.
        properties["instance"] = str(member)
        endpoint = D.ServiceEndpoint(
            protocol=D.ServiceEndpoint.GRPC, host=f"svc-{group.first}.bench.invalid", port=9000 + member
        )
    else:
        endpoint = D.ServiceEndpoint(protocol=D.ServiceEndpoint.COGMENT, host="client", port=0)
    return D.RegisterRequest(
        endpoint=endpoint,
        details=D.ServiceDetails(type=group.service_type, properties=properties),  # type: ignore[arg-type]
        permanent=group.permanent,
    )


def inquire_request(group: Group) -> directory_pb2.InquireRequest:
    return D.InquireRequest(
        details=D.ServiceDetails(type=group.service_type, properties=group.query)  # type: ignore[arg-type]
    )


def all_registrations(groups: Sequence[Group]) -> list[directory_pb2.RegisterRequest]:
    return [registration_request(group, member) for group in groups for member in range(group.size)]


# ---- small helpers ----


def percentile(sorted_values: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile of an already sorted sequence."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(p / 100.0 * len(sorted_values)))
    return float(sorted_values[rank - 1])


def latency_summary(latencies_us: Sequence[int]) -> dict[str, float | None]:
    values = sorted(latencies_us)

    def ms(value: float | None) -> float | None:
        return None if value is None else round(value / 1000.0, 3)

    return {
        "p50": ms(percentile(values, 50)),
        "p90": ms(percentile(values, 90)),
        "p99": ms(percentile(values, 99)),
        "max": ms(float(values[-1]) if values else None),
        "mean": ms(sum(values) / len(values) if values else None),
    }


def metadata(token: str) -> tuple[tuple[str, str], ...]:
    return ((TOKEN_METADATA_KEY, token),)


# ---- the load generator (worker subprocesses) ----


@dataclass
class ClientStats:
    latencies_us: list[int] = field(default_factory=list)
    replies: int = 0
    warmup_calls: int = 0
    wrong_results: int = 0
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    first_error: str | None = None
    first_start: float | None = None  # wall clock
    last_end: float | None = None
    outcomes: list[list[Any]] = field(default_factory=list)

    def error(self, what: str, detail: str) -> None:
        self.errors[what] += 1
        if self.first_error is None:
            self.first_error = f"{what}: {detail}"[:500]


class Clock:
    """Wall-clock instants (shared by the processes) mapped to this process's perf_counter."""

    def __init__(self) -> None:
        self.offset = time.time() - time.perf_counter()

    def local(self, wall: float) -> float:
        return wall - self.offset


async def sleep_until(clock: Clock, wall: float) -> None:
    delay = clock.local(wall) - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


async def inquire_client(
    channel: Any,
    requests: Sequence[directory_pb2.InquireRequest],
    expected: Sequence[int] | None,
    config: dict[str, Any],
    client: int,
    clock: Clock,
    stats: ClientStats,
) -> None:
    method = channel.unary_stream(
        INQUIRE,
        request_serializer=D.InquireRequest.SerializeToString,
        response_deserializer=D.InquireReply.FromString,
    )
    md = metadata(config["token"])
    rng = random.Random(f"{config['seed']}:{config['label']}:{client}")
    measure_from, measure_to = clock.local(config["measure_from"]), clock.local(config["measure_to"])
    await sleep_until(clock, config["go"])
    perf_counter = time.perf_counter
    eof = grpc.aio.EOF
    # Paced (open loop): one call every `interval` seconds, latency counted from the planned
    # start, so a server that falls behind is charged for the wait. Otherwise closed loop.
    interval = config["interval"]
    planned = perf_counter() + rng.random() * interval
    calls = 0
    consecutive_errors = 0
    while calls < config["max_calls_per_client"]:
        if interval:
            delay = planned - perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            started, planned = planned, planned + interval
        else:
            started = perf_counter()
        if started >= measure_to:
            break
        calls += 1
        k = rng.randrange(len(requests))
        replies = 0
        try:
            call = method(requests[k], metadata=md, timeout=RPC_TIMEOUT_S)
            while await call.read() is not eof:
                replies += 1
        except grpc.aio.AioRpcError as error:
            consecutive_errors += 1
            stats.error(error.code().name, str(error.details()))
            if consecutive_errors >= MAX_CONSECUTIVE_ERRORS:
                return
            continue
        ended = perf_counter()
        consecutive_errors = 0
        if started >= measure_from and ended <= measure_to:
            stats.latencies_us.append(int((ended - started) * 1e6))
            stats.replies += replies
            if expected is not None and replies != expected[k]:
                stats.wrong_results += 1
        elif started < measure_from:
            stats.warmup_calls += 1


async def register_client(
    channel: Any,
    indexed_requests: Sequence[tuple[int, Any]],
    config: dict[str, Any],
    clock: Clock,
    stats: ClientStats,
) -> None:
    """Registrations (or deregistrations) in lock step on Register (Deregister) streams."""
    deregister = config["role"] == "deregister"
    if deregister:
        method = channel.stream_stream(
            DEREGISTER,
            request_serializer=D.DeregisterRequest.SerializeToString,
            response_deserializer=D.DeregisterReply.FromString,
        )
    else:
        method = channel.stream_stream(
            REGISTER,
            request_serializer=D.RegisterRequest.SerializeToString,
            response_deserializer=D.RegisterReply.FromString,
        )
    ok = D.DeregisterReply.OK if deregister else D.RegisterReply.OK
    md = metadata(config["token"])
    per_stream = config["per_stream"] or len(indexed_requests) or 1
    await sleep_until(clock, config["go"])
    stats.first_start = time.time()
    perf_counter = time.perf_counter
    for chunk_start in range(0, len(indexed_requests), per_stream):
        chunk = indexed_requests[chunk_start : chunk_start + per_stream]
        done = 0
        try:
            call = method(metadata=md, timeout=config["stream_timeout"])
            for index, request in chunk:
                started = perf_counter()
                await call.write(request)
                reply = await call.read()
                ended = perf_counter()
                done += 1
                if reply is grpc.aio.EOF:
                    stats.error("EOF", "the stream ended before its reply")
                    stats.errors["NOT_SENT"] += len(chunk) - done
                    break
                stats.latencies_us.append(int((ended - started) * 1e6))
                if reply.status != ok:
                    stats.error("FAILED", reply.error_msg)
                elif not deregister:
                    stats.outcomes.append([index, reply.service_id, reply.secret])
            await call.done_writing()
            if await call.read() is not grpc.aio.EOF:
                stats.error("EXTRA_REPLY", "a reply nobody asked for")
        except grpc.aio.AioRpcError as error:
            stats.error(error.code().name, str(error.details()))
            stats.errors["NOT_SENT"] += len(chunk) - done
    stats.last_end = time.time()


async def worker_main() -> int:
    loop = asyncio.get_running_loop()
    lines = stdin_lines(loop)
    config: dict[str, Any] = json.loads(await lines.get())
    role = config["role"]
    clients = config["clients"]  # this worker's client numbers
    # Client n talks to replica n mod N (registrations: to the first replica only).
    addresses = config["addresses"] if role == "inquire" else config["addresses"][:1]
    channels = [
        grpc.aio.insecure_channel(addresses[client % len(addresses)], options=CHANNEL_OPTIONS)
        for client in clients
    ]
    try:
        await asyncio.wait_for(asyncio.gather(*(ch.channel_ready() for ch in channels)), READY_TIMEOUT_S)
        groups = build_groups(
            config["services"], config["seed"], config["permanent_share"], config["max_group_size"]
        )
        work: list[Callable[[Clock, ClientStats], Awaitable[None]]] = []
        if role == "inquire":
            requests = [inquire_request(group) for group in groups]
            expected = [group.size for group in groups] if config["check_results"] else None
            for channel, client in zip(channels, clients, strict=True):
                work.append(functools.partial(inquire_client, channel, requests, expected, config, client))
        else:
            n_clients = config["total_clients"]
            indexed: list[tuple[int, Any]]
            if role == "register":
                registrations = all_registrations(groups)
                indexed = list(enumerate(registrations))
            else:
                indexed = [
                    (index, D.DeregisterRequest(service_id=service_id, secret=secret))
                    for index, service_id, secret in config["outcomes"]
                ]
            for channel, client in zip(channels, clients, strict=True):
                mine = indexed[client::n_clients]
                work.append(functools.partial(register_client, channel, mine, config))
        emit({"ready": True})
        go_line = await lines.get()
        if not go_line:
            return 1
        config.update(json.loads(go_line))
        clock = Clock()
        stats = [ClientStats() for _ in work]
        deadline = config["end"] + WORKER_GRACE_S - time.time()
        await asyncio.wait_for(
            asyncio.gather(*(job(clock, s) for job, s in zip(work, stats, strict=True))), deadline
        )
    finally:
        await asyncio.gather(*(channel.close() for channel in channels), return_exceptions=True)
    errors: collections.Counter[str] = collections.Counter()
    for s in stats:
        errors.update(s.errors)
    starts = [s.first_start for s in stats if s.first_start is not None]
    ends = [s.last_end for s in stats if s.last_end is not None]
    emit(
        {
            "result": {
                "latencies_us": [v for s in stats for v in s.latencies_us],
                "replies": sum(s.replies for s in stats),
                "warmup_calls": sum(s.warmup_calls for s in stats),
                "wrong_results": sum(s.wrong_results for s in stats),
                "errors": dict(errors),
                "first_error": next((s.first_error for s in stats if s.first_error), None),
                "first_start": min(starts) if starts else None,
                "last_end": max(ends) if ends else None,
                "outcomes": [o for s in stats for o in s.outcomes],
            }
        }
    )
    return 0


# ---- the baseline: a bare grpc.aio server answering Inquire with one prebuilt reply ----


def bare_reply() -> directory_pb2.InquireReply:
    """What the directory sends for an actor entry, built once."""
    group = next(g for g in build_groups(100, 1, 0.0) if g.service_type == D.ACTOR_SERVICE)
    request = registration_request(group, 0)
    return D.InquireReply(
        data=D.FullServiceData(
            endpoint=request.endpoint,
            service_id=secrets.randbelow(2**63 - 1) + 1,
            details=request.details,
            permanent=False,
        )
    )


async def bare_main() -> int:
    reply = bare_reply()

    async def inquire(
        request: directory_pb2.InquireRequest, context: Any
    ) -> AsyncIterator[directory_pb2.InquireReply]:
        yield reply

    handler = grpc.method_handlers_generic_handler(
        "cogmentAPI.DirectorySP",
        {
            "Inquire": grpc.unary_stream_rpc_method_handler(
                inquire,
                request_deserializer=D.InquireRequest.FromString,
                response_serializer=D.InquireReply.SerializeToString,
            )
        },
    )
    return await serve_bare([handler])


# ---- the orchestrator ----


def propagation(replicas: list[Child], token: str) -> dict[str, float | None]:
    """Register PROPAGATION_SAMPLES entries through the first replica, one at a time, each timed
    from its Register reply until the next replica's first inquiry that answers it (inquiries
    back to back: the figure includes up to one inquiry's round trip)."""
    with (
        grpc.insecure_channel(replicas[0].address) as first,
        grpc.insecure_channel(replicas[1].address) as second,
    ):
        register = first.stream_stream(
            REGISTER,
            request_serializer=D.RegisterRequest.SerializeToString,
            response_deserializer=D.RegisterReply.FromString,
        )
        inquire = second.unary_stream(
            INQUIRE,
            request_serializer=D.InquireRequest.SerializeToString,
            response_deserializer=D.InquireReply.FromString,
        )
        delays_us = []
        for number in range(PROPAGATION_SAMPLES):
            details = D.ServiceDetails(type=D.OTHER_SERVICE, properties={"propagation": f"{token}-{number}"})
            endpoint = D.ServiceEndpoint(protocol=D.ServiceEndpoint.COGMENT, host="client", port=0)
            request = D.RegisterRequest(endpoint=endpoint, details=details)
            (reply,) = register(iter([request]), metadata=metadata(token), timeout=RPC_TIMEOUT_S)
            registered = time.perf_counter()
            if reply.status != D.RegisterReply.OK:
                raise RuntimeError(f"propagation: registration failed: {reply.error_msg}")
            while not list(
                inquire(D.InquireRequest(details=details), metadata=metadata(token), timeout=RPC_TIMEOUT_S)
            ):
                if time.perf_counter() - registered > RPC_TIMEOUT_S:
                    raise RuntimeError("propagation: the other replica never answered the registration")
            delays_us.append(int((time.perf_counter() - registered) * 1e6))
    return latency_summary(delays_us)


def status_value(address: str, name: str) -> str | None:
    with grpc.insecure_channel(address) as channel:
        method = channel.unary_unary(
            STATUS,
            request_serializer=common_pb2.StatusRequest.SerializeToString,
            response_deserializer=common_pb2.StatusReply.FromString,
        )
        reply = method(common_pb2.StatusRequest(names=[name]), timeout=RPC_TIMEOUT_S)
        value = reply.statuses.get(name)
        return None if value is None else str(value)


def split_clients(total: int, procs: int) -> list[list[int]]:
    procs = max(1, min(procs, total))
    return [list(range(p, total, procs)) for p in range(procs)]


def run_workers(
    plan: Plan, servers: list[Child], label: str, config: dict[str, Any], total_clients: int, span_s: float
) -> dict[str, Any]:
    """Run one phase on `--client_procs` workers: returns their merged results and the CPU use
    of the servers (all together) and the workers over the measured window."""
    args = plan.args
    base = {
        "label": label,
        "addresses": [server.address for server in servers],
        "token": plan.token,
        "services": args.services,
        "seed": args.seed,
        "permanent_share": args.permanent_share,
        "max_group_size": args.max_group_size,
        "total_clients": total_clients,
        **config,
    }
    workers: list[Child] = []
    try:
        for number, clients in enumerate(split_clients(total_clients, args.client_procs)):
            worker = Child(
                f"{label}-worker{number}",
                [sys.executable, str(SCRIPT), "_worker"],
                messages_on="stdout",
                cpus=plan.client_cpus,
                log_path=plan.workdir / f"{label}-worker{number}.out",
            )
            workers.append(worker)
            worker.send({**base, "clients": clients})
        for worker in workers:
            worker.expect("ready", READY_TIMEOUT_S + START_TIMEOUT_S)
            pin(worker.process.pid, plan.client_cpus)
        go = time.time() + GO_DELAY_S
        measure_from = go + config.get("warmup", 0.0)
        timing = {"go": go, "measure_from": measure_from, "measure_to": measure_from + span_s}
        timing["end"] = timing["measure_to"]
        for worker in workers:
            worker.send(timing)

        def cpu_sample() -> tuple[float, float | None, float | None]:
            worker_cpus = [w.cpu_seconds() for w in workers]
            total = None if None in worker_cpus else sum(c for c in worker_cpus if c is not None)
            server_cpus = [server.cpu_seconds() for server in servers]
            server_total = None if None in server_cpus else sum(c for c in server_cpus if c is not None)
            return time.time(), server_total, total

        time.sleep(max(0.0, measure_from - time.time()))
        first = cpu_sample()
        results: list[dict[str, Any]] = []
        last: tuple[float, float | None, float | None] | None = None
        if config["role"] == "inquire":
            time.sleep(max(0.0, timing["measure_to"] - time.time()))
            last = cpu_sample()
        for worker in workers:
            results.append(
                worker.expect("result", timing["end"] - time.time() + 2 * WORKER_GRACE_S)["result"]
            )
        if last is None:  # count and not time bounded: the window ends with the last reply
            last = cpu_sample()
            ends = [r["last_end"] for r in results if r["last_end"] is not None]
            last = (max(ends) if ends else last[0], last[1], last[2])
        for worker in workers:
            worker.stop(exit_wait_s=5.0)
    finally:
        for worker in workers:
            worker.stop(signal.SIGKILL)
    merged: dict[str, Any] = {
        "latencies_us": [v for r in results for v in r["latencies_us"]],
        "replies": sum(r["replies"] for r in results),
        "warmup_calls": sum(r["warmup_calls"] for r in results),
        "wrong_results": sum(r["wrong_results"] for r in results),
        "errors": dict(sum((collections.Counter(r["errors"]) for r in results), collections.Counter())),
        "first_error": next((r["first_error"] for r in results if r["first_error"]), None),
        "outcomes": [o for r in results for o in r["outcomes"]],
        "window": (first[0], last[0]),
    }
    seconds = max(last[0] - first[0], 1e-9)
    server_cpu = None if first[1] is None or last[1] is None else last[1] - first[1]
    client_cpu = None if first[2] is None or last[2] is None else last[2] - first[2]
    merged["server_cpu_pct"] = None if server_cpu is None else round(100 * server_cpu / seconds, 1)
    merged["client_cpu_pct"] = None if client_cpu is None else round(100 * client_cpu / seconds, 1)
    merged["server_cpu_s"] = server_cpu
    return merged


def inquiry_phase(plan: Plan, servers: list[Child], label: str, check_results: bool) -> dict[str, Any]:
    args = plan.args
    clients = args.inquire_clients
    raw = run_workers(
        plan,
        servers,
        label,
        {
            "role": "inquire",
            "warmup": args.warmup,
            "check_results": check_results,
            "max_calls_per_client": max(1, args.max_inquiries // clients),
            "interval": clients / args.inquire_rate if args.inquire_rate else 0.0,
        },
        clients,
        args.duration,
    )
    calls = len(raw["latencies_us"])
    seconds = raw["window"][1] - raw["window"][0]
    return {
        "clients": clients,
        "client_procs": min(args.client_procs, clients),
        "load": f"paced at {args.inquire_rate:g}/s (open loop)" if args.inquire_rate else "closed loop",
        "seconds": round(seconds, 3),
        "calls": calls,
        "warmup_calls": raw["warmup_calls"],
        "throughput_rps": round(calls / seconds, 1),
        "latency_ms": latency_summary(raw["latencies_us"]),
        "replies_per_call": round(raw["replies"] / calls, 3) if calls else None,
        "wrong_results": raw["wrong_results"] if check_results else None,
        "errors": raw["errors"],
        "first_error": raw["first_error"],
        "server_cpu_pct": raw["server_cpu_pct"],
        "client_cpu_pct": raw["client_cpu_pct"],
        "server_cpu_us_per_call": (
            round(raw["server_cpu_s"] * 1e6 / calls, 1) if calls and raw["server_cpu_s"] is not None else None
        ),
    }


def write_phase(plan: Plan, server: Child, role: str, outcomes: list[list[Any]] | None) -> dict[str, Any]:
    args = plan.args
    clients = args.register_clients
    count = args.services if outcomes is None else len(outcomes)
    config: dict[str, Any] = {
        "role": role,
        "per_stream": args.registrations_per_stream,
        # Bounded: far beyond what even a slow database needs.
        "stream_timeout": max(120.0, count / 20),
    }
    if outcomes is not None:
        config["outcomes"] = outcomes
    raw = run_workers(plan, [server], role, config, clients, config["stream_timeout"])
    seconds = raw["window"][1] - raw["window"][0]
    done = len(raw["latencies_us"])
    failed = sum(raw["errors"].values())
    result = {
        "clients": clients,
        "requested": count,
        "ok": done - raw["errors"].get("FAILED", 0),
        "failed": failed,
        "seconds": round(seconds, 3),
        "per_s": round(done / seconds, 1),
        "latency_ms": latency_summary(raw["latencies_us"]),
        "errors": raw["errors"],
        "first_error": raw["first_error"],
        "server_cpu_pct": raw["server_cpu_pct"],
        "client_cpu_pct": raw["client_cpu_pct"],
    }
    if role == "register":
        result["unique_ids"] = len({o[1] for o in raw["outcomes"]})
        result["_outcomes"] = raw["outcomes"]
    return result


def print_summary(report: dict[str, Any]) -> None:
    out = sys.stdout
    reg = report["register"]
    print("", file=out)
    replicas = report["args"]["replicas"]
    spread = f", {replicas} replicas (inquiries spread, CPU summed)" if replicas > 1 else ""
    print(f"Directory benchmark ({report['database']}, {report['cpus']}{spread})", file=out)
    print("", file=out)
    rows = [("phase", "count", "seconds", "rate/s", "p50 ms", "p99 ms", "errors", "srv CPU", "cli CPU")]
    for name, phase in (("register", reg), ("deregister", report.get("deregister"))):
        if phase:
            rows.append(
                (
                    name,
                    fmt(phase["ok"]),
                    fmt(phase["seconds"]),
                    fmt(phase["per_s"]),
                    fmt(phase["latency_ms"]["p50"]),
                    fmt(phase["latency_ms"]["p99"]),
                    fmt(phase["failed"]),
                    fmt(phase["server_cpu_pct"], "%"),
                    fmt(phase["client_cpu_pct"], "%"),
                )
            )
    for name, phase in (
        ("inquire directory", report["inquire_directory"]),
        ("inquire bare", report["inquire_bare"]),
    ):
        if phase:
            rows.append(
                (
                    name,
                    fmt(phase["calls"]),
                    fmt(phase["seconds"]),
                    fmt(phase["throughput_rps"]),
                    fmt(phase["latency_ms"]["p50"]),
                    fmt(phase["latency_ms"]["p99"]),
                    fmt(sum(phase["errors"].values()) + (phase["wrong_results"] or 0)),
                    fmt(phase["server_cpu_pct"], "%"),
                    fmt(phase["client_cpu_pct"], "%"),
                )
            )
    print_table(rows, 1, out)
    print("", file=out)
    d, b = report["inquire_directory"], report["inquire_bare"]
    bare_replies = fmt(b["replies_per_call"]) if b else "-"
    bare_cpu = fmt(b["server_cpu_us_per_call"], " us") if b else "-"
    print(
        f"inquiry: {d['clients']} clients in {d['client_procs']} process(es), {d['load']}, "
        f"{report['args']['warmup']:g} s warm-up then {report['args']['duration']:g} s measured; "
        f"replies/call: directory {fmt(d['replies_per_call'])}, bare {bare_replies}",
        file=out,
    )
    print(
        f"server CPU per call: directory {fmt(d['server_cpu_us_per_call'], ' us')}, bare {bare_cpu}",
        file=out,
    )
    print(
        f"directory RSS: {report['directory_rss_start_mib']} MiB once serving, peak (kernel high-water "
        f"mark) {report['directory_peak_rss_mib']} MiB",
        file=out,
    )
    propagation = report.get("propagation_ms")
    if propagation:
        print(
            f"propagation to another replica ({PROPAGATION_SAMPLES} registrations): "
            f"p50 {fmt(propagation['p50'])} ms, p99 {fmt(propagation['p99'])} ms, "
            f"max {fmt(propagation['max'])} ms",
            file=out,
        )
    targets = report["targets"]
    for name, value, target, better in (
        ("registrations/s", reg["per_s"], TARGET_REGISTRATIONS_PER_S, "min"),
        ("throughput directory/bare", report["ratio"], TARGET_RATIO, "min"),
        ("directory inquiry p99 ms", d["latency_ms"]["p99"], TARGET_P99_MS, "max"),
        ("propagation p99 ms", (propagation or {}).get("p99"), TARGET_PROPAGATION_MS, "max"),
    ):
        if name not in targets:
            continue
        verdict = targets.get(name)
        sign = ">=" if better == "min" else "<="
        print(f"{name:28} {fmt(value):>10}   target {sign} {target:g}: {verdict}", file=out)
    for name in ("register", "inquire_directory", "deregister", "inquire_bare"):
        phase = report.get(name)
        if phase and phase["first_error"]:
            print(f"{name}: errors {phase['errors']}, first: {phase['first_error']}", file=out)
        if phase and phase.get("wrong_results"):
            print(f"{name}: {phase['wrong_results']} inquiries had the wrong number of replies", file=out)
    if report["directory_exit_status"] != 0:
        print(f"the directory exited with status {report['directory_exit_status']}", file=out)
    if report["server_problems"]:
        print(
            f"directory warnings/errors logged: {report['server_problems']} "
            f"(first: {report['server_problem_sample']})",
            file=out,
        )
    print("", file=out)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/directory.py",
        description="Benchmark the Directory (registration, inquiry) against a bare grpc.aio baseline.",
    )
    parser.add_argument(
        "--database_url",
        help="directory database (default: sqlite+aiosqlite:///<tmpdir>/bench.db); use a fresh "
        "database for comparable figures (on a reused one, earlier runs' entries stay invisible to "
        "this run's token but still weigh on indexes and planner statistics)",
    )
    parser.add_argument(
        "--token",
        help="authentication-token of every call (default: a new random one per run)",
    )
    parser.add_argument("--services", type=int, default=10_000, help="entries to register")
    parser.add_argument("--register_clients", type=int, default=16, help="concurrent Register streams")
    parser.add_argument(
        "--registrations_per_stream",
        type=int,
        default=0,
        help="requests per Register stream before opening a new one (0: one stream per client)",
    )
    parser.add_argument("--permanent_share", type=float, default=0.1, help="share of permanent groups")
    parser.add_argument(
        "--max_group_size",
        type=int,
        default=1,
        help="entries per group are drawn from 1..N; an inquiry matches its whole group, so 1 gives "
        "one reply per call like the bare baseline, 3 a mix of 1 to 3 replies",
    )
    parser.add_argument("--inquire_clients", type=int, default=16, help="concurrent Inquire clients")
    parser.add_argument(
        "--inquire_rate",
        type=float,
        default=0.0,
        help="pace the inquiries at this total rate (req/s, open loop; latency from the planned "
        "start); 0: closed loop, every client sends its next inquiry as soon as it has the answer",
    )
    parser.add_argument("--client_procs", type=int, default=1, help="worker processes for the clients")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of inquiries not measured")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of inquiries measured")
    parser.add_argument(
        "--max_inquiries", type=int, default=2_000_000, help="bound on inquiries per phase (all clients)"
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="directories sharing the (PostgreSQL) database: registrations go to the first, "
        "inquiry clients are spread over all, and the delay until another replica answers a "
        "registration is measured",
    )
    parser.add_argument("--seed", type=int, default=20240601)
    parser.add_argument("--no_pin", action="store_true", help="do not pin server and clients to CPUs")
    parser.add_argument("--skip_bare", action="store_true", help="no baseline run")
    parser.add_argument("--deregister", action="store_true", help="deregister everything at the end")
    parser.add_argument("--server_log_level", help="--log_level of the directory (default: its own, info)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, database)")
    args = parser.parse_args(argv)
    if args.services < 1 or args.register_clients < 1 or args.inquire_clients < 1 or args.client_procs < 1:
        parser.error("counts must be positive")
    if args.replicas < 1 or (args.replicas > 1 and not (args.database_url or "").startswith("postgresql")):
        parser.error("--replicas: at least 1, and more only on a PostgreSQL --database_url")
    if args.duration <= 0 or args.warmup < 0 or args.inquire_rate < 0:
        parser.error("--duration must be positive, --warmup and --inquire_rate not negative")
    return args


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    token = f"bench-{secrets.token_hex(8)}" if args.token is None else args.token
    plan = pinned_plan(args, workdir, token, not args.no_pin)
    server_cpus, client_cpus = plan.server_cpus, plan.client_cpus
    database_url = args.database_url or f"sqlite+aiosqlite:///{workdir / 'bench.db'}"
    database = database_url.split(":", 1)[0]
    command = [
        sys.executable, "-m", "services.directory",
        "--port", "0", "--bind_address", "127.0.0.1", "--log_format", "json",
        "--database_url", database_url, "--data_dir", str(workdir),
    ]  # fmt: skip
    if args.server_log_level:
        command += ["--log_level", args.server_log_level]
    report: dict[str, Any] = {
        "bench": "directory",
        "database": database,
        "cpus": (
            f"server on CPU {sorted(server_cpus)}, clients on {sorted(client_cpus)}"
            if server_cpus and client_cpus
            else f"not pinned, {os.cpu_count()} CPUs"
        ),
        "python": sys.version.split()[0],
        "grpc": grpc.__version__,
        "args": vars(args),
    }
    replicas = [
        start_server(plan, f"directory-{n}" if n else "directory", command) for n in range(args.replicas)
    ]
    directory = replicas[0]
    address = directory.address
    report["directory_rss_start_mib"] = round((vm_rss(directory.process.pid) or 0) / MiB, 1)
    entries_before = int(status_value(address, "nb_entries") or 0)
    print(
        f"directory serving on {address} ({database}); registering {args.services:,} services...",
        file=sys.stderr,
    )
    register = write_phase(plan, directory, "register", None)
    outcomes = register.pop("_outcomes")
    register["entries_added"] = int(status_value(address, "nb_entries") or 0) - entries_before
    report["register"] = register
    print(
        f"registered at {register['per_s']:,.0f}/s; inquiring for {args.warmup + args.duration:g} s...",
        file=sys.stderr,
    )
    report["inquire_directory"] = inquiry_phase(plan, replicas, "inquire-directory", check_results=True)
    if len(replicas) > 1:
        report["propagation_ms"] = propagation(replicas, plan.token)
    if args.deregister:
        report["deregister"] = write_phase(plan, directory, "deregister", outcomes)
    report["directory_peak_rss_mib"] = round((vm_hwm(directory.process.pid) or 0) / MiB, 1)
    problems = [problem for replica in replicas for problem in replica.problems]
    report["server_problems"] = len(problems)
    report["server_problem_sample"] = [p.get("event") for p in problems[:5]]
    report["directory_exit_status"] = max(replica.stop() or 0 for replica in replicas)
    report["inquire_bare"] = None
    if not args.skip_bare:
        print("bare grpc.aio baseline...", file=sys.stderr)
        bare = start_server(plan, "bare", [sys.executable, str(SCRIPT), "_bare"])
        try:
            report["inquire_bare"] = inquiry_phase(plan, [bare], "inquire-bare", check_results=False)
        finally:
            bare.stop()
    d, b = report["inquire_directory"], report["inquire_bare"]
    # Paced, both servers answer the offered rate: only a closed loop measures capacity.
    capacity = b is not None and b["throughput_rps"] > 0 and not args.inquire_rate
    report["ratio"] = round(d["throughput_rps"] / b["throughput_rps"], 3) if capacity else None
    if report["ratio"] is not None:
        ratio_verdict = "met" if report["ratio"] >= TARGET_RATIO else "missed"
    else:
        ratio_verdict = "n/a when paced" if args.inquire_rate else "-"
    report["targets"] = {
        "registrations/s": "met" if register["per_s"] >= TARGET_REGISTRATIONS_PER_S else "missed",
        "throughput directory/bare": ratio_verdict,
        "directory inquiry p99 ms": (
            "met" if (d["latency_ms"]["p99"] or math.inf) <= TARGET_P99_MS else "missed"
        ),
    }
    if "propagation_ms" in report:
        propagation_p99 = report["propagation_ms"]["p99"] or math.inf
        report["targets"]["propagation p99 ms"] = (
            "met" if propagation_p99 <= TARGET_PROPAGATION_MS else "missed"
        )
    return report


def orchestrate(argv: Sequence[str] | None) -> int:
    return run_benchmark(parse_args(argv), "directory", run, print_summary)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_worker"]:
        return asyncio.run(worker_main())
    if argv[:1] == ["_bare"]:
        return asyncio.run(bare_main())
    return orchestrate(argv)


if __name__ == "__main__":
    sys.exit(main())
