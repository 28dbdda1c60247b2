"""The Trial Datastore's own Prometheus metrics (`cogment_trial_datastore_*`, README "Metrics").

Ingestion handles thousands of samples a second, so nothing here is updated per sample: counters
and histograms are plain numbers (shared.metrics) updated once per committed batch, per stream or
per trial; gauges are read from the service's own figures when scraped.

Label values come from a bounded set the code chooses, never from what clients send, but for the
actor classes of the RL figures: the first MAX_ACTOR_CLASS_LABELS distinct classes a process sees
get a series of their own, every later one is counted under OTHER_ACTOR_CLASS.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import Gauge

from shared.metrics import PlainCounter, PlainHistogram

PREFIX = "cogment_trial_datastore_"
# The `api` label: the ingestion service a sample came through.
DATALOG_API = "datalog"
LOG_EXPORTER_API = "log_exporter"
ADD_SAMPLE_API = "add_sample"

# Actor classes given a series of their own, per process; the rest share OTHER_ACTOR_CLASS. Classes
# longer than MAX_ACTOR_CLASS_LABEL_BYTES share it too (a trial's parameters may hold 1 MiB).
MAX_ACTOR_CLASS_LABELS = 32
MAX_ACTOR_CLASS_LABEL_BYTES = 128
OTHER_ACTOR_CLASS = "_other"

_BATCH_SAMPLES_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
_RETURN_BUCKETS = (
    -1000, -300, -100, -30, -10, -3, -1, 0, 1, 3, 10, 30, 100, 300, 1000,
)  # fmt: skip
_TRIAL_SECONDS_BUCKETS = (0.1, 1, 5, 10, 30, 60, 300, 600, 1800, 3600, 3 * 3600, 12 * 3600, 24 * 3600)
_TRIAL_TICKS_BUCKETS = (1, 10, 50, 100, 500, 1000, 5000, 10_000, 50_000, 100_000, 1_000_000)

ingested_samples_total = PlainCounter(
    PREFIX + "ingested_samples_total", "Samples ingested (committed), by ingestion service.", ["api"]
)
ingested_bytes_total = PlainCounter(
    PREFIX + "ingested_bytes_total",
    "Bytes of stored samples ingested (committed), by ingestion service.",
    ["api"],
)
trials_started_total = PlainCounter(
    PREFIX + "trials_started_total", "Datalog streams opened (a trial reopened counts again)."
)
trials_ended_total = PlainCounter(
    PREFIX + "trials_ended_total", "Datalog streams closed after their trial's ENDED sample was stored."
)
trials_interrupted_total = PlainCounter(
    PREFIX + "trials_interrupted_total", "Datalog streams closed before their trial ended."
)
lease_closures_total = PlainCounter(
    PREFIX + "lease_closures_total",
    "Trials closed as interrupted because their ingestion lease expired (their process died).",
)
commit_batch_samples = PlainHistogram(
    PREFIX + "commit_batch_samples",
    "Samples per ingestion transaction.",
    buckets=_BATCH_SAMPLES_BUCKETS,
)
commit_duration_seconds = PlainHistogram(
    PREFIX + "commit_duration_seconds", "Time an ingestion transaction takes, outages ridden out included."
)
ack_wait_seconds = PlainHistogram(
    PREFIX + "ack_wait_seconds",
    "Time from a sample's arrival to its commit (then acknowledgement): one value per stream and "
    "transaction, that of the stream's oldest sample in it.",
)
outage_held_batches_total = PlainCounter(
    PREFIX + "outage_held_batches_total",
    "Ingestion transactions held until the database came back from an outage.",
)
replayed_samples_total = PlainCounter(
    PREFIX + "replayed_samples_total", "Samples sent to readers (RetrieveSamples, RetrieveSampleRange)."
)
trial_return = PlainHistogram(
    PREFIX + "trial_return",
    "Return of each actor of a trial ended through a datalog stream (the sum of its rewards), "
    f"by actor class (at most {MAX_ACTOR_CLASS_LABELS} classes, the rest as {OTHER_ACTOR_CLASS}); "
    "buckets only: returns may be negative, the +Inf bucket counts them.",
    ["actor_class"],
    buckets=_RETURN_BUCKETS,
)
trial_duration_seconds = PlainHistogram(
    PREFIX + "trial_duration_seconds",
    "Time from the first to the ENDED sample's timestamp of trials ended through a datalog stream.",
    buckets=_TRIAL_SECONDS_BUCKETS,
)
trial_ticks = PlainHistogram(
    PREFIX + "trial_ticks",
    "Ticks of trials ended through a datalog stream, the first to the ENDED sample's.",
    buckets=_TRIAL_TICKS_BUCKETS,
)

# Gauges: the figures of the process's datastore, read when scraped (`watch`).
datalog_streams = Gauge(PREFIX + "datalog_streams", "Datalog streams open.")
live_readers = Gauge(
    PREFIX + "live_readers", "RetrieveSamples streams open and RetrieveSampleRange calls under way."
)
held_bytes = Gauge(
    PREFIX + "held_bytes",
    "Bytes of samples received and not yet committed, and acquired for the samples being read, "
    "every stream together.",
)
held_bytes_budget = Gauge(
    PREFIX + "held_bytes_budget", "The budget of held_bytes (--ingestion_bytes): past it streams wait."
)


def watch(
    *,
    open_streams: Callable[[], float],
    readers: Callable[[], float],
    held: Callable[[], float],
    budget: float,
) -> None:
    """Publish these figures of the process's datastore (the last one created, in tests that run
    several)."""
    datalog_streams.set_function(open_streams)
    live_readers.set_function(readers)
    held_bytes.set_function(held)
    held_bytes_budget.set(budget)


class ActorClassLabels:
    """The `actor_class` label of each actor class: itself for the first `limit` classes seen
    (short enough), OTHER_ACTOR_CLASS for any other."""

    def __init__(self, limit: int = MAX_ACTOR_CLASS_LABELS) -> None:
        self.limit = limit
        self._known: set[str] = set()

    def label(self, actor_class: str) -> str:
        if actor_class in self._known:
            return actor_class
        if len(self._known) >= self.limit or len(actor_class.encode()) > MAX_ACTOR_CLASS_LABEL_BYTES:
            return OTHER_ACTOR_CLASS
        self._known.add(actor_class)
        return actor_class


actor_class_labels = ActorClassLabels()
