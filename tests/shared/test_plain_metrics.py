"""PlainCounter and PlainHistogram expose what they were given, as prometheus_client would."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from shared.metrics import PlainCounter, PlainHistogram


def _samples(*collectors: object) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    registry = CollectorRegistry()
    for collector in collectors:
        registry.register(collector)  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_counter_counts_each_label_tuple() -> None:
    counter = PlainCounter("cogment_test_things_total", "Things.", ["source"], registered=False)
    counter.inc("memory")
    counter.inc("memory")
    counter.inc("database", amount=3)
    samples = _samples(counter)
    assert samples[("cogment_test_things_total", frozenset({("source", "memory")}))] == 2
    assert samples[("cogment_test_things_total", frozenset({("source", "database")}))] == 3
    assert counter.value("memory") == 2
    assert counter.value("other") == 0


def test_histogram_buckets_are_cumulative_and_inclusive() -> None:
    histogram = PlainHistogram(
        "cogment_test_wait_seconds", "Waits.", ["kind"], buckets=(0.1, 1), registered=False
    )
    for value in (0.05, 0.1, 0.5, 2):
        histogram.observe(value, "a")
    samples = _samples(histogram)

    def bucket(le: str) -> float:
        return samples[("cogment_test_wait_seconds_bucket", frozenset({("kind", "a"), ("le", le)}))]

    assert (bucket("0.1"), bucket("1.0"), bucket("+Inf")) == (2, 3, 4)
    assert samples[("cogment_test_wait_seconds_count", frozenset({("kind", "a")}))] == 4
    assert samples[("cogment_test_wait_seconds_sum", frozenset({("kind", "a")}))] == 2.65
    assert histogram.count("a") == 4
