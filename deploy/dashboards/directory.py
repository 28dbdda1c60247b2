"""The Directory's dashboard: its entries and their health checks, registrations and inquiries."""

from __future__ import annotations

from grafana_foundation_sdk.builders.dashboard import Dashboard

from deploy.dashboards.panels import JOB, chart, dashboard, quantile, query, rate, row, service_panels

UID = "cogment-aux-directory"
CHECK_SECONDS = "cogment_directory_health_check_seconds"


def build() -> Dashboard:
    board = dashboard(
        UID,
        "Cogment / Directory",
        "Entries, health checks, registrations and inquiries of the Cogment Directory.",
        'cogment_build_info{cogment_service="directory"}',
    )
    board = board.with_row(row("Service"))
    for panel in service_panels("directory", "cogmentAPI.DirectorySP"):
        board = board.with_panel(panel)
    board = (
        board.with_row(row("Entries and health checks"))
        .with_panel(
            chart(
                "Entries",
                "Registered entries by service type and health (unhealthy: failed its last check). "
                "Replicas share the entries: the largest count of any replica.",
                "short",
                query(f"max by (type, health) (cogment_directory_entries{{{JOB}}})", "{{type}} {{health}}"),
            )
        )
        .with_panel(
            chart(
                "Unhealthy share",
                "Share of the entries that failed their last health check.",
                "percentunit",
                query(
                    f'sum(max by (type) (cogment_directory_entries{{health="unhealthy", {JOB}}})) '
                    f"/ sum(max by (type, health) (cogment_directory_entries{{{JOB}}}))",
                    "unhealthy",
                ),
            )
        )
        .with_panel(
            chart(
                "Health checks",
                "Health checks per second by outcome, and entries removed after failing their "
                "checks in a row.",
                "ops",
                query(rate("cogment_directory_health_checks_total", JOB, "outcome"), "{{outcome}}"),
                query(rate("cogment_directory_removed_unhealthy_total", JOB), "removed"),
            )
        )
        .with_panel(
            chart(
                "Health check duration",
                "Median and 99th percentile of a health check's duration, by outcome (a check times "
                "out after 2 s or 5 s).",
                "s",
                query(quantile(0.5, CHECK_SECONDS, JOB, "outcome"), "p50 {{outcome}}"),
                query(quantile(0.99, CHECK_SECONDS, JOB, "outcome"), "p99 {{outcome}}"),
                width=12,
            )
        )
        .with_panel(
            chart(
                "Index lag (p99)",
                "99th percentile of the time from hearing of a change to the in-memory index holding it.",
                "s",
                query(quantile(0.99, "cogment_directory_index_lag_seconds", JOB), "p99"),
                width=12,
            )
        )
        .with_row(row("Registrations and inquiries"))
        .with_panel(
            chart(
                "Registrations",
                "Registrations per second by outcome (refused: the client's mistake; failed: the "
                "database or a bug).",
                "ops",
                query(rate("cogment_directory_registrations_total", JOB, "outcome"), "{{outcome}}"),
            )
        )
        .with_panel(
            chart(
                "Deregistrations",
                "Deregistrations per second by outcome.",
                "ops",
                query(rate("cogment_directory_deregistrations_total", JOB, "outcome"), "{{outcome}}"),
            )
        )
        .with_panel(
            chart(
                "Inquiries",
                "Inquiries per second by where they were answered from (memory: the index; "
                "database: while the index is not current) and whether they found entries.",
                "ops",
                query(
                    rate("cogment_directory_inquiries_total", JOB, "source, outcome"),
                    "{{source}} {{outcome}}",
                ),
            )
        )
    )
    return board
