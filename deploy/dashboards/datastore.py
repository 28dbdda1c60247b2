"""The Trial Datastore's dashboard: ingestion from the orchestrators (rates, group commits, the
wait for acknowledgement, the memory held for the writer), trials, and readers."""

from __future__ import annotations

from grafana_foundation_sdk.builders.dashboard import Dashboard

from deploy.dashboards.panels import JOB, chart, dashboard, quantile, query, rate, row, service_panels

UID = "cogment-aux-trial-datastore"


def build() -> Dashboard:
    board = dashboard(
        UID,
        "Cogment / Trial Datastore",
        "Ingestion, trials and replays of the Cogment Trial Datastore.",
        'cogment_build_info{cogment_service="trial_datastore"}',
    )
    board = board.with_row(row("Service"))
    for panel in service_panels("trial_datastore", "cogmentAPI.(TrialDatastoreSP|DatalogSP|LogExporterSP)"):
        board = board.with_panel(panel)
    board = (
        board.with_row(row("Ingestion"))
        .with_panel(
            chart(
                "Samples ingested",
                "Samples committed per second, by the API they came through.",
                "short",
                query(rate("cogment_trial_datastore_ingested_samples_total", JOB, "api"), "{{api}}"),
            )
        )
        .with_panel(
            chart(
                "Bytes ingested",
                "Bytes of samples committed per second, in their stored form.",
                "Bps",
                query(rate("cogment_trial_datastore_ingested_bytes_total", JOB, "api"), "{{api}}"),
            )
        )
        .with_panel(
            chart(
                "Time to acknowledgement",
                "Median and 99th percentile of the time from a sample's arrival to its commit "
                "(after which the orchestrator hears it is stored).",
                "s",
                query(quantile(0.5, "cogment_trial_datastore_ack_wait_seconds", JOB), "p50"),
                query(quantile(0.99, "cogment_trial_datastore_ack_wait_seconds", JOB), "p99"),
            )
        )
        .with_panel(
            chart(
                "Held for the writer",
                "Bytes received and not yet committed, per replica, against their budget "
                "(--ingestion_bytes): at the budget, streams wait for commits to make room.",
                "bytes",
                query(f"cogment_trial_datastore_held_bytes{{{JOB}}}", "held {{instance}}"),
                query(f"cogment_trial_datastore_held_bytes_budget{{{JOB}}}", "budget {{instance}}"),
            )
        )
        .with_panel(
            chart(
                "Group commits",
                "Median and 99th percentile of the samples per ingestion transaction and of its duration.",
                "short",
                query(quantile(0.5, "cogment_trial_datastore_commit_batch_samples", JOB), "samples p50"),
                query(quantile(0.99, "cogment_trial_datastore_commit_batch_samples", JOB), "samples p99"),
            )
        )
        .with_panel(
            chart(
                "Commit duration",
                "Median and 99th percentile of an ingestion transaction's duration, an outage it rode "
                "out included.",
                "s",
                query(quantile(0.5, "cogment_trial_datastore_commit_duration_seconds", JOB), "p50"),
                query(quantile(0.99, "cogment_trial_datastore_commit_duration_seconds", JOB), "p99"),
            )
        )
        .with_panel(
            chart(
                "Held through outages",
                "Ingestion transactions per second held until the database came back.",
                "ops",
                query(rate("cogment_trial_datastore_outage_held_batches_total", JOB), "held batches"),
                width=12,
            )
        )
        .with_panel(
            chart(
                "Datalog streams",
                "DatalogSP and LogExporterSP streams open: the trials being recorded.",
                "short",
                query(f"sum(cogment_trial_datastore_datalog_streams{{{JOB}}})", "streams"),
                width=12,
            )
        )
        .with_row(row("Trials"))
        .with_panel(
            chart(
                "Trials",
                "Datalog streams opened, closed after their trial ended, closed before (interrupted), "
                "and trials closed as interrupted after their ingesting replica died (lease "
                "closures), per second.",
                "ops",
                query(rate("cogment_trial_datastore_trials_started_total", JOB), "started"),
                query(rate("cogment_trial_datastore_trials_ended_total", JOB), "ended"),
                query(rate("cogment_trial_datastore_trials_interrupted_total", JOB), "interrupted"),
                query(rate("cogment_trial_datastore_lease_closures_total", JOB), "lease closures"),
            )
        )
        .with_panel(
            chart(
                "Readers",
                "RetrieveSamples streams and RetrieveSampleRange calls open, and samples read per second.",
                "short",
                query(f"sum(cogment_trial_datastore_live_readers{{{JOB}}})", "readers"),
                query(rate("cogment_trial_datastore_replayed_samples_total", JOB), "samples read per second"),
            )
        )
    )
    return board
