"""The parts every dashboard is built from, with Grafana's Foundation SDK: the dashboard itself
(its data source and `job` variables), rows, time series and stat panels, the PromQL shapes they
chart, and the row of what every service exposes (readiness, version, dependencies, gRPC calls).

Panels select their series by `job=~"$job"`: the Prometheus job of the scraped pods (with the
chart's ServiceMonitors, one per Kubernetes Service), so that two releases are told apart. The
families common to every service also carry `cogment_service`, which names the service whatever
the scrape configuration calls its job.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as grafana
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dashboard_model
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    VariableOption,
    VariableRefresh,
    VariableSort,
)

DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
JOB = 'job=~"$job"'
# The matcher of every job: what the `job` variable's "All" stands for.
ANY_JOB = ".+"
# Panels and rows are placed on Grafana's 24-column grid.
GRID_WIDTH = 24
PANEL_HEIGHT = 8
# Each query of a panel is named by a letter, as Grafana's editor names them.
REF_IDS = "ABCDEFGH"

Panel = cogbuilder.Builder[dashboard_model.Panel]


def query(expr: str, legend: str = "") -> prometheus.Dataquery:
    """A PromQL query of the dashboard's data source; `legend` names its series ("{{label}}")."""
    target = prometheus.Dataquery().expr(expr).datasource(DATASOURCE).range()
    return target.legend_format(legend) if legend else target


def rate(family: str, selector: str, by: str = "") -> str:
    """Per-second rate of a counter family, summed (by the labels in `by`, comma-separated)."""
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({family}{{{selector}}}[$__rate_interval]))"


def quantile(q: float, histogram: str, selector: str, by: str = "") -> str:
    """The `q` quantile of a histogram family over the rate interval (by the labels in `by`)."""
    grouping = f"le, {by}" if by else "le"
    return (
        f"histogram_quantile({q}, sum by ({grouping}) "
        f"(rate({histogram}_bucket{{{selector}}}[$__rate_interval])))"
    )


def chart(title: str, description: str, unit: str, *targets: prometheus.Dataquery, width: int = 8) -> Panel:
    """A time series panel; `unit` is Grafana's (short, s, bytes, Bps, percentunit...)."""
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(DATASOURCE)
        .span(width)
        .height(PANEL_HEIGHT)
        .fill_opacity(10)
        .legend(
            common_builders.VizLegendOptions()
            .show_legend(True)
            .display_mode(common.LegendDisplayMode.LIST)
            .placement(common.LegendPlacement.BOTTOM)
        )
    )
    if unit != "percentunit":
        panel = panel.min(0)
    for ref_id, target in zip(REF_IDS, targets, strict=False):
        panel = panel.with_target(target.ref_id(ref_id))
    return panel


def single(
    title: str, description: str, target: prometheus.Dataquery, unit: str = "short", width: int = 4
) -> Panel:
    """A stat panel: the last value of each series, large."""
    return (
        stat.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(DATASOURCE)
        .span(width)
        .height(PANEL_HEIGHT // 2)
        .graph_mode(common.BigValueGraphMode.NONE)
        .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]))
        .with_target(target.ref_id(REF_IDS[0]))
    )


def row(title: str) -> grafana.Row:
    return grafana.Row(title)


def service_panels(cogment_service: str, grpc_services: str) -> list[Panel]:
    """What every service exposes: replicas ready, versions running, its dependencies, and its
    gRPC calls (`grpc_services`: a regular expression of the gRPC services it serves)."""
    common_selector = f'cogment_service="{cogment_service}", {JOB}'
    calls = f'grpc_service=~"{grpc_services}", {JOB}'
    return [
        single(
            "Replicas ready",
            "Replicas whose health for the empty service name is SERVING (cogment_ready).",
            query(f"sum(cogment_ready{{{common_selector}}})"),
        ),
        single(
            "Replicas not ready",
            "Replicas that answer scrapes but are not ready: a dependency away, or shutting down.",
            query(f"count(cogment_ready{{{common_selector}}} == 0) or vector(0)"),
        ),
        single(
            "Version",
            "The cogment-aux versions running, with their number of replicas.",
            query(f"count by (version) (cogment_build_info{{{common_selector}}})", "{{version}}"),
            width=4,
        ),
        chart(
            "Dependencies up",
            "1 while every replica reaches the dependency, 0 while one does not.",
            "short",
            query(f"min by (dependency) (cogment_dependency_up{{{common_selector}}})", "{{dependency}}"),
            width=6,
        ),
        chart(
            "Dependency changes",
            "A dependency going away (down) and coming back (up), by replica.",
            "short",
            query(
                f"sum by (dependency, state) (increase(cogment_dependency_changes_total{{{common_selector}}}"
                "[$__rate_interval]))",
                "{{dependency}} {{state}}",
            ),
            width=6,
        ),
        chart(
            "Calls",
            "gRPC calls completed per second, by method.",
            "reqps",
            query(rate("grpc_server_handled_total", calls, "grpc_method"), "{{grpc_method}}"),
        ),
        chart(
            "Failed calls",
            "gRPC calls per second that ended with another status than OK, by method and status. "
            "UNAVAILABLE: a dependency away; INTERNAL: a bug (the logs say which).",
            "reqps",
            query(
                rate("grpc_server_handled_total", f'{calls}, grpc_code!="OK"', "grpc_method, grpc_code"),
                "{{grpc_method}} {{grpc_code}}",
            ),
        ),
        chart(
            "Call latency (p99)",
            "99th percentile of the time from a call's start to its end, by method (streams "
            "included: a long-lived stream counts its whole life).",
            "s",
            query(quantile(0.99, "grpc_server_handling_seconds", calls, "grpc_method"), "{{grpc_method}}"),
        ),
        chart(
            "Memory",
            "Resident memory of each replica.",
            "bytes",
            query(
                "process_resident_memory_bytes * on (instance, job) group_left "
                f"cogment_build_info{{{common_selector}}}",
                "{{instance}}",
            ),
            width=12,
        ),
        chart(
            "CPU",
            "CPU time used per second by each replica (1 = one core).",
            "short",
            query(
                "rate(process_cpu_seconds_total[$__rate_interval]) * on (instance, job) group_left "
                f"cogment_build_info{{{common_selector}}}",
                "{{instance}}",
            ),
            width=12,
        ),
    ]


def dashboard(uid: str, title: str, description: str, jobs_of: str) -> grafana.Dashboard:
    """A dashboard with a Prometheus data source variable and a `job` variable listing the jobs
    that expose `jobs_of` (a series selector), all selected by default."""
    datasource = grafana.DatasourceVariable("datasource").label("Data source").type("prometheus")
    job = (
        grafana.QueryVariable("job")
        .label("Job")
        .datasource(DATASOURCE)
        .query(f"label_values({jobs_of}, job)")
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(ANY_JOB)
        .current(VariableOption(selected=True, text="All", value="$__all"))
    )
    return (
        grafana.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["cogment", "cogment-aux"])
        .time("now-1h", "now")
        .refresh("30s")
        .timezone("browser")
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .readonly()
        .with_variable(datasource)
        .with_variable(job)
    )
