"""Prometheus metrics: per-RPC counts and latencies (the usual grpc_server_* names), and the
optional HTTP endpoint that exposes them (`--metrics_port`)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram, start_http_server

RPC_LABELS = ("grpc_type", "grpc_service", "grpc_method")

started_total = Counter("grpc_server_started_total", "RPCs started on the server.", RPC_LABELS)
handled_total = Counter(
    "grpc_server_handled_total", "RPCs completed on the server, by status code.", (*RPC_LABELS, "grpc_code")
)
handling_seconds = Histogram(
    "grpc_server_handling_seconds",
    "Time from the start of an RPC to its completion.",
    RPC_LABELS,
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)


def serve_metrics(port: int, address: str) -> int:
    """Expose every registered metric over HTTP from a daemon thread; returns the bound port."""
    server, _thread = start_http_server(port, addr=address)
    return int(server.server_address[1])
