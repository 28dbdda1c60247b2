"""The chart's PrometheusRule (metrics.prometheusRule.enabled), checked with Prometheus's own
`promtool` (Debian's `prometheus` package): the rendered rules pass `promtool check rules`, and
`promtool test rules` shows each alert firing on its condition, with its labels and annotations,
and quiet otherwise (and for another release's series)."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers.helm import of_kind, render

RELEASE = "cogment"
NAMESPACE = "training"
JOBS = {
    "directory": "cogment-cogment-aux-directory",
    "model_registry": "cogment-cogment-aux-model-registry",
    "trial_datastore": "cogment-cogment-aux-datastore",
}
INSTANCE = "10.0.0.7:9100"
HELD_BATCHES = "cogment_trial_datastore_outage_held_batches_total"
BLOB_FAILURES = "cogment_model_registry_blob_operation_failures_total"
REFUSED = "cogment_model_registry_refused_uploads_total"


def promtool() -> str:
    found = shutil.which("promtool")
    assert found, "promtool not found: install Debian's prometheus package (.ci/run does)"
    return found


def target(service: str, namespace: str = NAMESPACE) -> dict[str, str]:
    """The labels Prometheus gives a series of one replica of `service` in the release."""
    return {"namespace": namespace, "job": JOBS[service], "instance": INSTANCE}


def series(name: str, labels: dict[str, str]) -> str:
    matchers = ", ".join(f'{key}="{value}"' for key, value in labels.items())
    return f"{name}{{{matchers}}}"


@dataclass
class Case:
    """Series (promtool's expanding notation, one value per minute), and an alert's evaluation at
    `at`: the labels of the alerts expected then (their own, beside alertname and severity)."""

    alert: str
    title: str
    inputs: dict[str, str]
    at: str
    firing: list[dict[str, str]] = field(default_factory=list)
    value: str = ""  # what `{{ $value | humanizePercentage }}` renders, where an annotation has it


DIRECTORY, REGISTRY, DATASTORE = target("directory"), target("model_registry"), target("trial_datastore")
DEPENDENCY = {**DIRECTORY, "cogment_service": "directory", "dependency": "database"}
NOT_READY = {**DATASTORE, "cogment_service": "trial_datastore"}
ELSEWHERE = {**target("directory", "another-team"), "cogment_service": "directory", "dependency": "database"}
DATALOG = {
    **DATASTORE,
    "grpc_type": "bidi_stream",
    "grpc_service": "cogmentAPI.DatalogSP",
    "grpc_method": "RunTrialDatalog",
}
CALL = {key: DATALOG[key] for key in ("namespace", "job", "instance", "grpc_service", "grpc_method")}
HEALTHY = {**DIRECTORY, "type": "actor", "health": "healthy"}
UNHEALTHY = {**DIRECTORY, "type": "actor", "health": "unhealthy"}

CASES = [
    Case(
        "CogmentDependencyDown",
        "down for 2 minutes",
        {series("cogment_dependency_up", DEPENDENCY): "1 1 0 0 0"},
        "4m",
        [DEPENDENCY],
    ),
    Case(
        "CogmentDependencyDown",
        "down for less than a minute",
        {series("cogment_dependency_up", DEPENDENCY): "1 1 0 1 1"},
        "4m",
    ),
    Case(
        "CogmentDependencyDown",
        "another namespace's",
        {series("cogment_dependency_up", ELSEWHERE): "1 1 0 0 0"},
        "4m",
    ),
    Case(
        "CogmentReplicaNotReady",
        "not ready for 6 minutes",
        {series("cogment_ready", NOT_READY): "1 0x7"},
        "7m",
        [NOT_READY],
    ),
    Case(
        "CogmentReplicaNotReady",
        "not ready for 3 minutes",
        {series("cogment_ready", NOT_READY): "1 0 0 0 1 1 1 1"},
        "7m",
    ),
    Case(
        "CogmentReplicaUnreachable",
        "unscraped for 6 minutes",
        {series("up", REGISTRY): "1 0x7"},
        "7m",
        [REGISTRY],
    ),
    Case("CogmentReplicaUnreachable", "scraped", {series("up", REGISTRY): "1x7"}, "7m"),
    Case(
        "CogmentIngestionNearBudget",
        "90% held for 6 minutes",
        {
            series("cogment_trial_datastore_held_bytes", DATASTORE): "900x7",
            series("cogment_trial_datastore_held_bytes_budget", DATASTORE): "1000x7",
        },
        "6m",
        [DATASTORE],
    ),
    Case(
        "CogmentIngestionNearBudget",
        "70% held",
        {
            series("cogment_trial_datastore_held_bytes", DATASTORE): "700x7",
            series("cogment_trial_datastore_held_bytes_budget", DATASTORE): "1000x7",
        },
        "6m",
    ),
    Case(
        "CogmentIngestionHeld",
        "batches held a minute ago",
        {series(HELD_BATCHES, DATASTORE): "0 0 3x8"},
        "3m",
        [DATASTORE],
    ),
    Case("CogmentIngestionHeld", "none held", {series(HELD_BATCHES, DATASTORE): "0x8"}, "3m"),
    Case(
        "CogmentIngestionHeld", "none held for 6 minutes", {series(HELD_BATCHES, DATASTORE): "0 0 3x8"}, "9m"
    ),
    Case(
        "CogmentHealthChecksFailing",
        "2 of 5 failing for 11 minutes",
        {
            series("cogment_directory_entries", HEALTHY): "3x12",
            series("cogment_directory_entries", UNHEALTHY): "2x12",
        },
        "11m",
        [{"namespace": NAMESPACE, "job": JOBS["directory"]}],
        value="40%",
    ),
    Case(
        "CogmentHealthChecksFailing",
        "1 of 5 failing",
        {
            series("cogment_directory_entries", HEALTHY): "4x12",
            series("cogment_directory_entries", UNHEALTHY): "1x12",
        },
        "11m",
    ),
    Case(
        "CogmentUploadsRefused",
        "the first refusal of its reason (the series appears with it)",
        {series(REFUSED, {**REGISTRY, "reason": "size"}): "_ 1 1"},
        "2m",
        [{"namespace": NAMESPACE, "job": JOBS["model_registry"], "reason": "size"}],
    ),
    Case(
        "CogmentUploadsRefused",
        "none refused for 11 minutes",
        {series(REFUSED, {**REGISTRY, "reason": "size"}): "_ 1x14"},
        "12m",
    ),
    Case(
        "CogmentUploadsRefused",
        "one refused",
        {series(REFUSED, {**REGISTRY, "reason": "hash"}): "0 1 1"},
        "2m",
        [{"namespace": NAMESPACE, "job": JOBS["model_registry"], "reason": "hash"}],
    ),
    Case(
        "CogmentUploadsRefused",
        "none refused",
        {series(REFUSED, {**REGISTRY, "reason": "hash"}): "0 0 0"},
        "2m",
    ),
    Case(
        "CogmentBlobStoreErrors",
        "writes failed",
        {series(BLOB_FAILURES, {**REGISTRY, "operation": "write"}): "0 2 2"},
        "2m",
        [{**REGISTRY, "operation": "write"}],
    ),
    Case(
        "CogmentBlobStoreErrors",
        "probes failed (CogmentDependencyDown's)",
        {series(BLOB_FAILURES, {**REGISTRY, "operation": "probe"}): "0 5 10"},
        "2m",
    ),
    Case(
        "CogmentStorageFull",
        "RESOURCE_EXHAUSTED answered",
        {series("grpc_server_handled_total", {**DATALOG, "grpc_code": "RESOURCE_EXHAUSTED"}): "0 1 1"},
        "2m",
        [CALL],
    ),
    Case(
        "CogmentStorageFull",
        "OK answered",
        {series("grpc_server_handled_total", {**DATALOG, "grpc_code": "OK"}): "0 100 200"},
        "2m",
    ),
    Case(
        "CogmentInternalErrors",
        "INTERNAL answered",
        {series("grpc_server_handled_total", {**DATALOG, "grpc_code": "INTERNAL"}): "0 1 1"},
        "2m",
        [CALL],
    ),
    Case(
        "CogmentInternalErrors",
        "the first INTERNAL of a method (the series appears with it)",
        {series("grpc_server_handled_total", {**DATALOG, "grpc_code": "INTERNAL"}): "_ _ 1 1"},
        "3m",
        [CALL],
    ),
    Case(
        "CogmentInternalErrors",
        "UNAVAILABLE answered",
        {series("grpc_server_handled_total", {**DATALOG, "grpc_code": "UNAVAILABLE"}): "0 1 1"},
        "2m",
    ),
]


@pytest.fixture(scope="module")
def rules(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The rendered PrometheusRule's groups as a rule file, and its rules by alert name."""
    manifests = render(
        set_values={"metrics.enabled": "true", "metrics.prometheusRule.enabled": "true"},
        release=RELEASE,
        namespace=NAMESPACE,
    )
    [rule] = of_kind(manifests, "PrometheusRule")
    path = tmp_path_factory.mktemp("rules") / "cogment-aux.rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    by_alert = {item["alert"]: item for group in rule["spec"]["groups"] for item in group["rules"]}
    return path, by_alert


def test_the_rendered_rules_pass_promtool_check(rules: tuple[Path, dict[str, Any]]) -> None:
    path, _ = rules
    result = subprocess.run(
        [promtool(), "check", "rules", str(path)], capture_output=True, text=True, check=False, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_is_unit_tested_and_says_what_to_do(rules: tuple[Path, dict[str, Any]]) -> None:
    _, by_alert = rules
    assert {case.alert for case in CASES} == set(by_alert)
    for name, rule in by_alert.items():
        assert any(case.alert == name and case.firing for case in CASES), f"{name}: never fires"
        assert any(case.alert == name and not case.firing for case in CASES), f"{name}: never quiet"
        assert rule["labels"]["severity"] in {"critical", "warning"}
        assert set(rule["annotations"]) == {"summary", "description"}
        assert len(rule["annotations"]["description"]) > 120, f"{name}: a description that says what to do"


def expand(template: str, labels: dict[str, str], value: str) -> str:
    """An annotation as Prometheus renders it for these labels (the templates the rules use)."""
    text = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda match: labels[match[1]], template)
    text = text.replace("{{ $value | humanizePercentage }}", value)
    assert "{{" not in text, f"a template the test does not expand: {text}"
    return text


@pytest.mark.parametrize("case", CASES, ids=[f"{case.alert}: {case.title}" for case in CASES])
def test_promtool_unit_tests(case: Case, rules: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path, by_alert = rules
    rule = by_alert[case.alert]
    expected = [
        {
            "exp_labels": {"alertname": case.alert, "severity": rule["labels"]["severity"], **labels},
            "exp_annotations": {
                key: expand(template, labels, case.value) for key, template in rule["annotations"].items()
            },
        }
        for labels in case.firing
    ]
    tests = {
        "rule_files": [str(path)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": name, "values": values} for name, values in case.inputs.items()],
                "alert_rule_test": [{"eval_time": case.at, "alertname": case.alert, "exp_alerts": expected}],
            }
        ],
    }
    test_file = tmp_path / "test.yaml"
    test_file.write_text(yaml.safe_dump(tests, sort_keys=False))
    result = subprocess.run(
        [promtool(), "test", "rules", str(test_file)], capture_output=True, text=True, check=False, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
