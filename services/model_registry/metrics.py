"""The Model Registry's own Prometheus metrics (`cogment_model_registry_*`, README "Metrics").

Counters and histograms are plain numbers (shared.metrics), updated per call, per blob store
operation or per version, never per byte; gauges are read from the registry when scraped. Every
label value comes from a fixed set chosen here: no model id, no client-sent text.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from prometheus_client import Gauge

from shared.metrics import PlainCounter, PlainHistogram

PREFIX = "cogment_model_registry_"

# The `reason` label of a refused upload.
REFUSED_HASH = "hash"
REFUSED_SIZE = "size"
REFUSED_UNKNOWN_MODEL = "unknown_model"
REFUSED_OTHER = "other"

# The `operation` label of blob store figures: opening an upload, writing one chunk of it,
# committing it, aborting it (or removing what a failed one left), reading (opening a blob, or
# waiting for one chunk of a streamed read), loading a whole blob into memory (the hot versions'
# cache), deleting a blob, cleaning up abandoned uploads, and the readiness probe.
BLOB_OPERATIONS = ("open_upload", "write", "commit", "abort", "read", "load", "delete", "cleanup", "probe")

received_bytes_total = PlainCounter(
    PREFIX + "received_bytes_total", "Bytes of version data received by CreateVersion."
)
sent_bytes_total = PlainCounter(
    PREFIX + "sent_bytes_total", "Bytes of version data sent by RetrieveVersionData."
)
versions_created_total = PlainCounter(
    PREFIX + "versions_created_total", "Versions created, archived or transient.", ["archived"]
)
refused_uploads_total = PlainCounter(
    PREFIX + "refused_uploads_total",
    "CreateVersion calls refused: hash or size mismatch, unknown model, another client error.",
    ["reason"],
)
data_cache_hits_total = PlainCounter(PREFIX + "data_cache_hits_total", "Version data served from memory.")
data_cache_misses_total = PlainCounter(
    PREFIX + "data_cache_misses_total", "Version data not in memory, read from the blob store."
)
data_cache_evictions_total = PlainCounter(
    PREFIX + "data_cache_evictions_total", "Versions' data dropped from memory to make room for others."
)
data_cache_bytes = Gauge(PREFIX + "data_cache_bytes", "Bytes of version data held in memory.")
blob_operation_duration_seconds = PlainHistogram(
    PREFIX + "blob_operation_duration_seconds", "Time a blob store operation takes.", ["operation"]
)
blob_operation_failures_total = PlainCounter(
    PREFIX + "blob_operation_failures_total",
    "Blob store operations that failed (a missing blob or a hash mismatch is no failure).",
    ["operation"],
)
version_update_streams = Gauge(PREFIX + "version_update_streams", "VersionUpdate streams open.")


def watch(*, subscribers: Callable[[], float]) -> None:
    """Publish these figures of the process's registry (the last one created, in tests)."""
    version_update_streams.set_function(subscribers)


@contextlib.contextmanager
def blob_operation(operation: str, answers: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Time one operation of BLOB_OPERATIONS; an exception raised is a failure unless it is one
    of `answers` (BlobNotFound, DigestMismatch: the store answered). A cancellation is neither."""
    started = time.monotonic()
    try:
        yield
    except Exception as error:
        if not isinstance(error, answers):
            blob_operation_failures_total.inc(operation)
        raise
    finally:
        blob_operation_duration_seconds.observe(time.monotonic() - started, operation)
