"""Prometheus metrics: per-RPC counts and latencies (the usual grpc_server_* names), and the
optional HTTP endpoint that exposes them (`--metrics_port`).

The per-RPC figures are plain numbers, updated on every call and turned into metric families only
when scraped: prometheus_client's Counter and Histogram take a lock and check their state on each
update, which cost 20-25 us of server CPU per call, about a tenth of a small inquiry's
(bench/directory.py).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from prometheus_client import REGISTRY, start_http_server
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

RPC_LABELS = ("grpc_type", "grpc_service", "grpc_method")
HANDLING_SECONDS_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
)  # fmt: skip
# Their `le` labels, as prometheus_client writes them ("0.0005", "1.0", "+Inf").
_BUCKET_LABELS: list[str] = [
    floatToGoString(bound)  # type: ignore[no-untyped-call]
    for bound in (*HANDLING_SECONDS_BUCKETS, float("inf"))
]


class RpcStats:
    """The calls of one method: started, handled by status code, and their handling times.

    Updated by the event loop that serves the method (a process's servers run on its one loop,
    so there is one writer), read by the scraping thread: plain `+=` without a lock.
    """

    __slots__ = ("bucket_counts", "handled", "labels", "seconds_sum", "started")

    def __init__(self, labels: tuple[str, str, str]) -> None:
        self.labels = labels
        self.started = 0
        self.handled: dict[str, int] = {}
        # One count per bucket of HANDLING_SECONDS_BUCKETS, then +Inf; not cumulative.
        self.bucket_counts = [0] * (len(HANDLING_SECONDS_BUCKETS) + 1)
        self.seconds_sum = 0.0

    def finished(self, code_name: str, seconds: float) -> None:
        self.handled[code_name] = self.handled.get(code_name, 0) + 1
        # The first bucket whose bound is >= seconds (Prometheus buckets are "less or equal").
        self.bucket_counts[bisect.bisect_left(HANDLING_SECONDS_BUCKETS, seconds)] += 1
        self.seconds_sum += seconds


class _RpcCollector(Collector):  # type: ignore[misc]
    def __init__(self) -> None:
        self._stats: dict[tuple[str, str, str], RpcStats] = {}

    def stats(self, rpc_type: str, service: str, method: str) -> RpcStats:
        """The figures of one method: servers of one process serving it share them."""
        labels = (rpc_type, service, method)
        stats = self._stats.get(labels)
        if stats is None:
            stats = self._stats[labels] = RpcStats(labels)
        return stats

    def collect(self) -> Iterator[Metric]:
        started = CounterMetricFamily("grpc_server_started", "RPCs started on the server.", labels=RPC_LABELS)
        handled = CounterMetricFamily(
            "grpc_server_handled",
            "RPCs completed on the server, by status code.",
            labels=(*RPC_LABELS, "grpc_code"),
        )
        seconds = HistogramMetricFamily(
            "grpc_server_handling_seconds",
            "Time from the start of an RPC to its completion.",
            labels=RPC_LABELS,
        )
        for stats in list(self._stats.values()):
            labels = list(stats.labels)
            started.add_metric(labels, stats.started)
            for code_name, count in dict(stats.handled).items():
                handled.add_metric([*labels, code_name], count)
            total, cumulative = 0, []
            for bound, count in zip(_BUCKET_LABELS, list(stats.bucket_counts), strict=True):
                total += count
                cumulative.append((bound, total))
            seconds.add_metric(labels, cumulative, stats.seconds_sum)
        yield started
        yield handled
        yield seconds


rpc_metrics = _RpcCollector()
REGISTRY.register(rpc_metrics)


def serve_metrics(port: int, address: str) -> int:
    """Expose every registered metric over HTTP from a daemon thread; returns the bound port."""
    server, _thread = start_http_server(port, addr=address)
    return int(server.server_address[1])
