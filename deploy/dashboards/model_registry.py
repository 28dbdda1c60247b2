"""The Model Registry's dashboard: version traffic, refused uploads, the hot-version cache, the
blob store and its `VersionUpdate` followers."""

from __future__ import annotations

from grafana_foundation_sdk.builders.dashboard import Dashboard

from deploy.dashboards.panels import JOB, chart, dashboard, quantile, query, rate, row, service_panels

UID = "cogment-aux-model-registry"
BLOB_SECONDS = "cogment_model_registry_blob_operation_duration_seconds"


def build() -> Dashboard:
    board = dashboard(
        UID,
        "Cogment / Model Registry",
        "Versions, their data traffic, the hot-version cache and the blob store of the Cogment "
        "Model Registry.",
        'cogment_build_info{cogment_service="model_registry"}',
    )
    board = board.with_row(row("Service"))
    for panel in service_panels("model_registry", "cogmentAPI.ModelRegistrySP"):
        board = board.with_panel(panel)
    board = (
        board.with_row(row("Versions"))
        .with_panel(
            chart(
                "Version data",
                "Bytes per second received by CreateVersion (refused uploads included) and sent by "
                "RetrieveVersionData.",
                "Bps",
                query(rate("cogment_model_registry_received_bytes_total", JOB), "received"),
                query(rate("cogment_model_registry_sent_bytes_total", JOB), "sent"),
            )
        )
        .with_panel(
            chart(
                "Versions created",
                "Versions created per second, archived or transient (transient ones are evicted "
                "past --cache_max_items).",
                "ops",
                query(
                    rate("cogment_model_registry_versions_created_total", JOB, "archived"),
                    "archived={{archived}}",
                ),
            )
        )
        .with_panel(
            chart(
                "Refused uploads",
                "CreateVersion calls refused per second, by reason: data of another SHA-256 (hash) "
                "or size than announced, an unknown model, or another mistake of the client.",
                "ops",
                query(rate("cogment_model_registry_refused_uploads_total", JOB, "reason"), "{{reason}}"),
            )
        )
        .with_row(row("Hot-version cache"))
        .with_panel(
            chart(
                "Cache memory",
                "Bytes of version data held in memory by each replica (--data_cache_bytes at most).",
                "bytes",
                query(f"cogment_model_registry_data_cache_bytes{{{JOB}}}", "{{instance}}"),
            )
        )
        .with_panel(
            chart(
                "Cache traffic",
                "Downloads per second served from memory (hits) or not (misses), and versions "
                "evicted to make room.",
                "ops",
                query(rate("cogment_model_registry_data_cache_hits_total", JOB), "hits"),
                query(rate("cogment_model_registry_data_cache_misses_total", JOB), "misses"),
                query(rate("cogment_model_registry_data_cache_evictions_total", JOB), "evictions"),
            )
        )
        .with_panel(
            chart(
                "VersionUpdate streams",
                "VersionUpdate streams open: the learners and actors following a model.",
                "short",
                query(f"sum(cogment_model_registry_version_update_streams{{{JOB}}})", "streams"),
            )
        )
        .with_row(row("Blob store"))
        .with_panel(
            chart(
                "Blob operation duration (p99)",
                "99th percentile of a blob store operation's duration, by operation.",
                "s",
                query(quantile(0.99, BLOB_SECONDS, JOB, "operation"), "{{operation}}"),
                width=12,
            )
        )
        .with_panel(
            chart(
                "Blob operation failures",
                "Blob store operations that failed per second (the store away, an I/O error), by operation.",
                "ops",
                query(
                    rate("cogment_model_registry_blob_operation_failures_total", JOB, "operation"),
                    "{{operation}}",
                ),
                width=12,
            )
        )
    )
    return board
