"""Reading a service's /metrics (started with `--metrics_port`, see tests/helpers/services.py)."""

from __future__ import annotations

import urllib.request

from tests.helpers.eventually import wait_until
from tests.helpers.services import RunningService

# The families of ours: prometheus_client's own (python_*, process_*) are left out.
OUR_PREFIXES = ("cogment_", "grpc_server_")


def metrics_text(service: RunningService, timeout_s: float = 10.0) -> str:
    """The service's /metrics, once its `serving metrics` line says where."""
    [endpoint] = wait_until(lambda: service.events("serving metrics"), "its metrics to be served", timeout_s)
    with urllib.request.urlopen(f"http://127.0.0.1:{endpoint['port']}/metrics", timeout=5) as response:
        assert response.status == 200
        return str(response.read().decode())


def family_types(text: str) -> dict[str, str]:
    """Our families by exposed name (counters with `_total`), from their `# TYPE` lines: a
    family is there even before it has a sample."""
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            if name.startswith(OUR_PREFIXES):
                types[name] = kind
    return types


def our_series(text: str) -> list[str]:
    """Our sample lines (one per series, histogram buckets included)."""
    return [line for line in text.splitlines() if line.startswith(OUR_PREFIXES)]
