"""Prometheus metrics: per-RPC counts and latencies (the usual grpc_server_* names), those every
service has (readiness, dependencies, build), plain-number counters and histograms for the
services' own hot paths, and the optional HTTP endpoint that exposes them (`--metrics_port`).
The README's "Metrics" table lists every family (tests/shared/test_metrics_table.py checks it).

The per-RPC figures are plain numbers, updated on every call and turned into metric families only
when scraped: prometheus_client's Counter and Histogram take a lock and check their state on each
update, which cost 20-25 us of server CPU per call, about a tenth of a small inquiry's
(bench/directory.py). PlainCounter and PlainHistogram do the same for any family.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

from prometheus_client import REGISTRY, Counter, Gauge, disable_created_metrics, start_http_server
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

# No `<counter>_created` series beside each prometheus_client counter: a timestamp per series that
# doubles the series and that nobody queries (the families are those of the README's table).
disable_created_metrics()  # type: ignore[no-untyped-call]

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


class PlainCounter(Collector):  # type: ignore[misc]
    """A counter family kept as plain numbers, one per label-value tuple, turned into a family
    only when scraped: `inc` is a dict update (well under a microsecond), for paths taken on
    every call. Registers itself on creation (a second family of the same name is refused).

    Label values must come from a bounded set the code chooses (an outcome, a service type),
    never from what clients send: each distinct tuple is a series kept for the process's life.
    Updates come from one thread (the event loop): `+=` without a lock, as RpcStats.

        inquiries_total = PlainCounter("cogment_x_inquiries_total", "Inquiries.", ["source"])
        inquiries_total.inc("memory")
    """

    def __init__(
        self, name: str, documentation: str, labels: Sequence[str] = (), *, registered: bool = True
    ) -> None:
        """`name` may end in `_total` (exposed with it either way); `registered=False` for tests."""
        self.name = name.removesuffix("_total")
        self.documentation = documentation
        self.labels = tuple(labels)
        self._counts: dict[tuple[str, ...], float] = {}
        if registered:
            REGISTRY.register(self)

    def inc(self, *label_values: str, amount: float = 1) -> None:
        """Add `amount` to the series of these label values (as many as `labels`, in order)."""
        self._counts[label_values] = self._counts.get(label_values, 0) + amount

    def value(self, *label_values: str) -> float:
        """The count of one series (0 before its first `inc`)."""
        return self._counts.get(label_values, 0)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labels)
        for label_values, count in dict(self._counts).items():
            family.add_metric(list(label_values), count)
        yield family


class PlainHistogram(Collector):  # type: ignore[misc]
    """A histogram family kept as plain numbers, as PlainCounter: `observe` is a bisect and three
    additions. Units in the name (`_seconds`, `_bytes`); label values from a bounded set."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labels: Sequence[str] = (),
        *,
        buckets: Sequence[float] = HANDLING_SECONDS_BUCKETS,
        registered: bool = True,
    ) -> None:
        """`buckets`: the finite upper bounds, increasing (+Inf is added)."""
        self.name = name
        self.documentation = documentation
        self.labels = tuple(labels)
        self._bounds = tuple(buckets)
        self._bucket_labels: list[str] = [
            floatToGoString(bound)  # type: ignore[no-untyped-call]
            for bound in (*self._bounds, float("inf"))
        ]
        # Per label-value tuple: one count per bucket then +Inf (not cumulative), and the sum.
        self._counts: dict[tuple[str, ...], list[int]] = {}
        self._sums: dict[tuple[str, ...], float] = {}
        if registered:
            REGISTRY.register(self)

    def observe(self, value: float, *label_values: str) -> None:
        counts = self._counts.get(label_values)
        if counts is None:
            counts = self._counts[label_values] = [0] * (len(self._bounds) + 1)
        counts[bisect.bisect_left(self._bounds, value)] += 1
        self._sums[label_values] = self._sums.get(label_values, 0.0) + value

    def count(self, *label_values: str) -> int:
        """How many values this series observed."""
        return sum(self._counts.get(label_values, ()))

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labels)
        for label_values, counts in dict(self._counts).items():
            total, cumulative = 0, []
            for bound, count in zip(self._bucket_labels, list(counts), strict=True):
                total += count
                cumulative.append((bound, total))
            family.add_metric(list(label_values), cumulative, self._sums.get(label_values, 0.0))
        yield family


rpc_metrics = _RpcCollector()
REGISTRY.register(rpc_metrics)

# Every service's: labelled by `cogment_service` (its name: directory, model_registry,
# trial_datastore), so that dashboards tell processes apart. Not `service`: the Prometheus
# Operator gives every target that label (the Kubernetes Service's name), which would rename ours
# to `exported_service`. Set on changes, not per call.
build_info = Gauge(
    "cogment_build_info",
    "Always 1: the cogment-aux version and the Cogment API version it implements.",
    ["cogment_service", "version", "cogment_api"],
)
ready = Gauge(
    "cogment_ready",
    '1 while the service is ready (its health for "" is SERVING), else 0.',
    ["cogment_service"],
)
dependency_up = Gauge(
    "cogment_dependency_up",
    "1 while a dependency answers its probes, else 0.",
    ["cogment_service", "dependency"],
)
dependency_changes_total = Counter(
    "cogment_dependency_changes_total",
    "A dependency going down (state=down) or coming back (state=up).",
    ["cogment_service", "dependency", "state"],
)


def dependency_label(name: str) -> str:
    """A dependency's `dependency` label: its name in the logs, as an identifier ("blob store" is
    blob_store)."""
    return name.replace(" ", "_")


def serve_metrics(port: int, address: str) -> int:
    """Expose every registered metric over HTTP from a daemon thread; returns the bound port."""
    server, _thread = start_http_server(port, addr=address)
    return int(server.server_address[1])
