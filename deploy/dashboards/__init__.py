"""Grafana dashboards as code (Grafana's Foundation SDK), shipped with the Helm chart.

`python -m deploy.dashboards` writes each one as JSON under deploy/helm/dashboards/, where the
chart reads them into ConfigMaps for the Grafana sidecar (metrics.dashboards.enabled); `--check`
fails when the files differ from the code, as CI runs it. tests/deploy/test_prometheus.py runs
every panel's queries against a real Prometheus scraping the services.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from grafana_foundation_sdk.builders.dashboard import Dashboard
from grafana_foundation_sdk.cog.encoder import JSONEncoder

from deploy.dashboards import datastore, directory, model_registry, overview

OUTPUT_DIR = Path(__file__).resolve().parents[1] / "helm" / "dashboards"
# File name (without .json) -> the dashboard's builder.
DASHBOARDS: dict[str, Callable[[], Dashboard]] = {
    "overview": overview.build,
    "directory": directory.build,
    "model-registry": model_registry.build,
    "trial-datastore": datastore.build,
}


def render(name: str) -> str:
    """One dashboard's JSON, as Grafana imports it (keys sorted, so that the files diff well)."""
    model = DASHBOARDS[name]().build()
    for number, panel in enumerate(model.panels or [], start=1):  # Grafana links panels by id
        panel.id_val = number
    return json.dumps(model, cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def rendered() -> dict[Path, str]:
    """Every dashboard's file and its content."""
    return {OUTPUT_DIR / f"{name}.json": render(name) for name in DASHBOARDS}
