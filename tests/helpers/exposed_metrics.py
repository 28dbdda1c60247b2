"""What this process's Prometheus registry exposes, parsed back from its text format: the
services tests run in-process register their metrics there (what `--metrics_port` serves)."""

from __future__ import annotations

from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def exposed(prefix: str) -> Samples:
    """Every exposed sample whose name starts with `prefix`: (name, labels) -> value."""
    text = generate_latest(REGISTRY).decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith(prefix)
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)
