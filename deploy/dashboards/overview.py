"""The overview of the training runs: what RL researchers look at first (ingestion, returns per
actor class, trial lengths), with the registry's traffic and the directory's health beside."""

from __future__ import annotations

from grafana_foundation_sdk.builders.dashboard import Dashboard

from deploy.dashboards.panels import JOB, chart, dashboard, quantile, query, rate, row, single

UID = "cogment-aux-overview"
RETURNS = "cogment_trial_datastore_trial_return"


def build() -> Dashboard:
    board = dashboard(
        UID,
        "Cogment / Training overview",
        "The training runs at a glance: trials, their returns per actor class, the data stored and "
        "the models served.",
        "cogment_build_info",
    )
    return (
        board.with_row(row("Services"))
        .with_panel(
            chart(
                "Replicas ready",
                "Ready replicas of each service.",
                "short",
                query(f"sum by (cogment_service) (cogment_ready{{{JOB}}})", "{{cogment_service}}"),
                width=12,
            )
        )
        .with_panel(
            chart(
                "Dependencies up",
                "1 while every replica of a service reaches the dependency.",
                "short",
                query(
                    f"min by (cogment_service, dependency) (cogment_dependency_up{{{JOB}}})",
                    "{{cogment_service}} {{dependency}}",
                ),
                width=12,
            )
        )
        .with_row(row("Trials"))
        .with_panel(
            single(
                "Trials running",
                "Datalog streams open: trials being recorded.",
                query(f"sum(cogment_trial_datastore_datalog_streams{{{JOB}}})"),
            )
        )
        .with_panel(
            single(
                "Trials ended",
                "Trials ended through a datalog stream over the dashboard's time range.",
                query(f"sum(increase(cogment_trial_datastore_trials_ended_total{{{JOB}}}[$__range]))"),
            )
        )
        .with_panel(
            single(
                "Trials interrupted",
                "Datalog streams closed before their trial ended, over the dashboard's time range.",
                query(f"sum(increase(cogment_trial_datastore_trials_interrupted_total{{{JOB}}}[$__range]))"),
            )
        )
        .with_panel(
            chart(
                "Samples ingested",
                "Samples stored per second (one per tick of a trial).",
                "short",
                query(rate("cogment_trial_datastore_ingested_samples_total", JOB), "samples"),
                width=12,
            )
        )
        .with_panel(
            chart(
                "Return per actor class",
                "Median and 90th percentile of the actors' returns in trials ended over the rate "
                "interval, by actor class (the first 32 classes; _other for the rest). Estimated "
                "from histogram buckets.",
                "short",
                query(quantile(0.5, RETURNS, JOB, "actor_class"), "p50 {{actor_class}}"),
                query(quantile(0.9, RETURNS, JOB, "actor_class"), "p90 {{actor_class}}"),
            )
        )
        .with_panel(
            chart(
                "Trial length",
                "Median ticks of the trials ended over the rate interval.",
                "short",
                query(quantile(0.5, "cogment_trial_datastore_trial_ticks", JOB), "ticks p50"),
            )
        )
        .with_panel(
            chart(
                "Trial duration",
                "Median and 90th percentile of the trials' durations, first sample to last.",
                "s",
                query(quantile(0.5, "cogment_trial_datastore_trial_duration_seconds", JOB), "p50"),
                query(quantile(0.9, "cogment_trial_datastore_trial_duration_seconds", JOB), "p90"),
            )
        )
        .with_row(row("Models and services"))
        .with_panel(
            chart(
                "Model traffic",
                "Version data received and sent per second by the Model Registry.",
                "Bps",
                query(rate("cogment_model_registry_received_bytes_total", JOB), "received"),
                query(rate("cogment_model_registry_sent_bytes_total", JOB), "sent"),
            )
        )
        .with_panel(
            chart(
                "Versions created",
                "Versions created per second, archived or transient.",
                "ops",
                query(
                    rate("cogment_model_registry_versions_created_total", JOB, "archived"),
                    "archived={{archived}}",
                ),
            )
        )
        .with_panel(
            chart(
                "Directory entries",
                "Entries registered in the Directory, healthy or not.",
                "short",
                query(
                    f"sum by (health) (max by (type, health) (cogment_directory_entries{{{JOB}}}))",
                    "{{health}}",
                ),
            )
        )
    )
