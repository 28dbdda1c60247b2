"""A dependency's metrics follow its probes: `cogment_dependency_up` and
`cogment_dependency_changes_total` (shared/dependencies.py)."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY

from shared import dependencies
from shared.dependencies import Dependencies, Dependency

pytestmark = pytest.mark.timeout(30)

SERVICE = "dependency_metrics_test"  # a label no service uses: other tests' figures stay apart


def value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"cogment_service": SERVICE, **labels})


async def test_up_and_transitions_follow_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dependencies, "PROBE_PERIOD_S", 0.05)
    monkeypatch.setattr(dependencies, "PROBE_PERIOD_AWAY_S", 0.05)
    answering = True

    async def probe() -> None:
        if not answering:
            raise OSError("refused")

    watched = Dependencies([Dependency("blob store", probe)], service=SERVICE)
    down = asyncio.Event()

    async def changed(ready: bool) -> None:
        if not ready:
            down.set()

    watched.on_change(changed)
    watched.start()
    try:
        assert value("cogment_dependency_up", dependency="blob_store") == 1
        assert value("cogment_dependency_changes_total", dependency="blob_store", state="down") is None

        answering = False
        watched.suspect()
        await down.wait()
        assert value("cogment_dependency_up", dependency="blob_store") == 0
        assert value("cogment_dependency_changes_total", dependency="blob_store", state="down") == 1

        answering = True
        assert await watched.wait_ready(10)
        assert value("cogment_dependency_up", dependency="blob_store") == 1
        assert value("cogment_dependency_changes_total", dependency="blob_store", state="up") == 1
        assert value("cogment_dependency_changes_total", dependency="blob_store", state="down") == 1
    finally:
        await watched.stop()
