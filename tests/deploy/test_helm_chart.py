"""The Helm chart (deploy/helm) and the container image definition, checked without a cluster:
`helm lint --strict`, `helm template` for the default and the scale-out values, the rendered
manifests validated against Kubernetes' schemas (`kubernetes-validate --strict`), and what the
manifests say checked against the services' own options."""

from __future__ import annotations

import base64
import importlib.metadata
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
import yaml

from deploy.dashboards import DASHBOARDS
from services.cli import main as cogment_aux
from services.console.service import OPTIONS as CONSOLE_OPTIONS
from services.datastore.service import OPTIONS as DATASTORE_OPTIONS
from services.directory.service import OPTIONS as DIRECTORY_OPTIONS
from services.model_registry.service import OPTIONS as REGISTRY_OPTIONS
from shared.config import Option
from shared.migrate import OPTIONS as MIGRATE_OPTIONS
from tests.helpers.helm import (
    CHART_DIR,
    DOCKERFILE,
    POSTGRESQL_S3_VALUES,
    PROJECT_ROOT,
    SCALE_OUT_VALUES,
    Manifest,
    by_component,
    env_of,
    helm,
    image_entrypoint,
    of_kind,
    pod_spec,
    render,
    render_text,
    template_args,
)

# The chart's minimum (Chart.yaml kubeVersion) and a current release; kubernetes-validate 1.37
# ships the schemas of 1.25 to 1.37.
KUBERNETES_VERSIONS = ["1.27.0", "1.35.0"]
# What each container runs: the image's entrypoint, `cogment-aux`, with these args.
COMPONENTS = {
    "directory": ["services", "directory"],
    "model-registry": ["services", "model_registry"],
    "datastore": ["services", "trial_datastore"],
}
CONSOLE = ["services", "console"]
MIGRATE = ["migrate"]
OPTIONS_BY_COMMAND: dict[tuple[str, ...], list[Option]] = {
    ("services", "console"): CONSOLE_OPTIONS,
    ("services", "directory"): DIRECTORY_OPTIONS,
    ("services", "model_registry"): REGISTRY_OPTIONS,
    ("services", "trial_datastore"): DATASTORE_OPTIONS,
    ("migrate",): MIGRATE_OPTIONS,
}
DEFAULT_PORTS = {"directory": 9005, "model-registry": 9002, "datastore": 9003}
HEALTH_PORT = 8081
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")


def probe_target(probe: str, port: int) -> dict[str, object]:
    """What a gRPC probe checks: readiness (and start-up) the service "", liveness "liveness"."""
    return {"port": port, "service": "liveness"} if probe == "livenessProbe" else {"port": port}


ENV_PREFIXES = {
    "directory": "COGMENT_DIRECTORY",
    "model-registry": "COGMENT_MODEL_REGISTRY",
    "datastore": "COGMENT_TRIAL_DATASTORE",
}


@pytest.fixture(scope="module")
def default_manifests() -> list[Manifest]:
    return render()


@pytest.fixture(scope="module")
def scale_out_manifests() -> list[Manifest]:
    return render([SCALE_OUT_VALUES])


def service_deployments(manifests: list[Manifest]) -> dict[str, Manifest]:
    """The Deployments of the gRPC services by component (the console's is checked on its own)."""
    return {name: m for name, m in by_component(manifests, "Deployment").items() if name != "console"}


def containers(manifests: list[Manifest]) -> Iterator[tuple[Manifest, dict[str, Any], dict[str, Any]]]:
    for workload in of_kind(manifests, "Deployment") + of_kind(manifests, "Job"):
        spec = pod_spec(workload)
        for container in spec["containers"]:
            yield workload, spec, container


# ---- helm lint, kubernetes schemas ----


@pytest.mark.parametrize(
    "values", [[], [SCALE_OUT_VALUES], [POSTGRESQL_S3_VALUES]], ids=["default", "scale-out", "postgresql-s3"]
)
def test_helm_lint_strict(values: list[Path]) -> None:
    args = ["lint", "--strict", str(CHART_DIR)] + [f"--values={path}" for path in values]
    result = helm(*args, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize(
    "values", [[], [SCALE_OUT_VALUES], [POSTGRESQL_S3_VALUES]], ids=["default", "scale-out", "postgresql-s3"]
)
def test_rendered_manifests_pass_kubernetes_validate_strict(values: list[Path], tmp_path: Path) -> None:
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(render_text(values))
    command = [sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet"]
    for version in KUBERNETES_VERSIONS:
        command += ["--kubernetes-version", version]
    result = subprocess.run(
        [*command, str(rendered)], capture_output=True, text=True, timeout=120, check=False
    )
    output = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode == 0, "\n".join(output)
    # The only kinds without a Kubernetes schema are the Prometheus Operator's ServiceMonitor
    # (checked against its Service below) and PrometheusRule (tests/deploy/test_prometheus_rules.py).
    unknown = [line for line in output if "ServiceMonitor" not in line and "PrometheusRule" not in line]
    assert unknown == [], "\n".join(unknown)


def _merged(base: Any, override: Any) -> Any:
    """Values as Helm merges a values file over the defaults."""
    if isinstance(base, dict) and isinstance(override, dict):
        return {
            key: _merged(base.get(key), override[key]) if key in override else base[key]
            for key in base.keys() | override.keys()
        }
    return override


def test_the_chart_validates_values_against_its_schema() -> None:
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    defaults = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    jsonschema.validate(defaults, schema)
    jsonschema.validate(_merged(defaults, yaml.safe_load(SCALE_OUT_VALUES.read_text())), schema)
    misspelled = helm(*template_args(set_values={"directory.replicas": "2"}), check=False)
    assert misspelled.returncode != 0 and "replicas" in misspelled.stderr
    wrong_type = helm(*template_args(set_values={"database.type": "mysql"}), check=False)
    assert wrong_type.returncode != 0 and "database" in wrong_type.stderr


def _documented(path: Path) -> list[str]:
    """Keys of values.yaml without a comment line right above them (children of Kubernetes
    objects passed through as they are excepted)."""
    passthrough = {
        "resources",
        "podSecurityContext",
        "containerSecurityContext",
        "startup",
        "liveness",
        "readiness",
    }
    undocumented = []
    parents: list[tuple[int, str]] = []
    previous = ""
    for line in path.read_text().splitlines():
        match = re.match(r"^(\s*)([A-Za-z][\w.-]*):", line)
        if match:
            indent, key = len(match.group(1)), match.group(2)
            while parents and parents[-1][0] >= indent:
                parents.pop()
            inside_passthrough = any(name in passthrough for _, name in parents)
            if not previous.lstrip().startswith("#") and not inside_passthrough:
                undocumented.append(".".join([name for _, name in parents] + [key]))
            parents.append((indent, key))
        if line.strip():
            previous = line
    return undocumented


def test_every_value_is_documented() -> None:
    assert _documented(CHART_DIR / "values.yaml") == []
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())

    def walk(value: Any, node: dict[str, Any], where: str) -> Iterator[str]:
        if not isinstance(value, dict) or "properties" not in node:
            return
        for key, child in value.items():
            if key not in node["properties"]:
                yield f"{where}{key} (not in the schema)"
                continue
            if "description" not in node["properties"][key]:
                yield f"{where}{key} (no description)"
            yield from walk(child, node["properties"][key], f"{where}{key}.")

    assert list(walk(values, schema, "")) == []


def test_the_chart_readme_lists_every_value() -> None:
    readme = (CHART_DIR / "README.md").read_text()
    listed = set(re.findall(r"^\| `([^`]+)` \|", readme, re.MULTILINE))
    undocumented = []
    for line_key in _value_paths(yaml.safe_load((CHART_DIR / "values.yaml").read_text())):
        top, _, rest = line_key.partition(".")
        if line_key not in listed and not (top in SERVICE_KEYS and f"<service>.{rest}" in listed):
            undocumented.append(line_key)
    assert undocumented == []


SERVICE_KEYS = {"directory", "modelRegistry", "datastore"}
PASSTHROUGH_VALUES = {"resources", "podSecurityContext", "containerSecurityContext", "startup", "liveness",
                      "readiness", "labels"}  # fmt: skip


def _value_paths(values: dict[str, Any], prefix: str = "") -> Iterator[str]:
    """Leaf value paths (a Kubernetes object passed through, or an empty map, is one leaf)."""
    for key, value in values.items():
        if isinstance(value, dict) and value and key not in PASSTHROUGH_VALUES:
            yield from _value_paths(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


# ---- what the default values deploy ----


def test_default_values_deploy_three_services_on_sqlite(default_manifests: list[Manifest]) -> None:
    deployments = by_component(default_manifests, "Deployment")
    services = by_component(default_manifests, "Service")
    claims = by_component(default_manifests, "PersistentVolumeClaim")
    assert set(deployments) == set(services) == {*COMPONENTS, "console"}  # the console: below
    deployments = service_deployments(default_manifests)
    assert set(claims) == set(COMPONENTS)
    assert of_kind(default_manifests, "Job") == []  # no migration Job with SQLite
    assert of_kind(default_manifests, "PodDisruptionBudget") == []
    assert of_kind(default_manifests, "NetworkPolicy") == of_kind(default_manifests, "ServiceMonitor") == []
    assert of_kind(default_manifests, "ConfigMap") == of_kind(default_manifests, "PrometheusRule") == []
    for component, deployment in deployments.items():
        assert deployment["spec"]["replicas"] == 1
        # The SQLite file is on a ReadWriteOnce claim: the old pod lets go before the new one starts.
        assert deployment["spec"]["strategy"]["type"] == "Recreate"
        spec = pod_spec(deployment)
        (container,) = spec["containers"]
        assert container["args"] == COMPONENTS[component]
        port = DEFAULT_PORTS[component]
        assert container["ports"] == [
            {"name": "grpc", "containerPort": port, "protocol": "TCP"},
            {"name": "health", "containerPort": HEALTH_PORT, "protocol": "TCP"},
        ]
        # kubelet's native gRPC probes, on the plaintext health port (TLS or not).
        assert env_of(container)[f"{ENV_PREFIXES[component]}_HEALTH_PORT"]["value"] == str(HEALTH_PORT)
        for probe in PROBES:
            assert container[probe]["grpc"] == probe_target(probe, HEALTH_PORT), probe
            assert "tcpSocket" not in container[probe], probe
        data = next(v for v in spec["volumes"] if v["name"] == "data")
        assert data["persistentVolumeClaim"]["claimName"] == claims[component]["metadata"]["name"]
        assert {"name": "data", "mountPath": "/data"} in container["volumeMounts"]
        (service_port,) = services[component]["spec"]["ports"]
        assert (service_port["port"], service_port["targetPort"]) == (port, "grpc")
        assert services[component]["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
        assert "DATABASE_URL" not in " ".join(env_of(container))  # the default: SQLite in the data dir


def test_pods_are_locked_down(default_manifests: list[Manifest], scale_out_manifests: list[Manifest]) -> None:
    for workload, spec, container in [*containers(default_manifests), *containers(scale_out_manifests)]:
        name = workload["metadata"]["name"]
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] == 10001, name
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert spec["automountServiceAccountToken"] is False, name
        assert spec["enableServiceLinks"] is False, name
        security = container["securityContext"]
        assert security["readOnlyRootFilesystem"] is True, name
        assert security["allowPrivilegeEscalation"] is False, name
        assert security["capabilities"]["drop"] == ["ALL"], name
        resources = container["resources"]
        assert resources["requests"]["cpu"] and resources["requests"]["memory"], name
        assert resources["limits"]["memory"], name
        # What it writes goes to volumes: /tmp always, /data for the services (the console
        # keeps nothing).
        mounts = {mount["mountPath"] for mount in container["volumeMounts"]}
        assert "/tmp" in mounts, name
        if workload["kind"] == "Deployment" and container["args"] != CONSOLE:
            assert "/data" in mounts, name


def test_registry_and_datastore_register_in_the_chart_directory(default_manifests: list[Manifest]) -> None:
    deployments = by_component(default_manifests, "Deployment")
    directory = "grpc://cogment-cogment-aux-directory.cogment.svc.cluster.local:9005"
    assert "COGMENT_DIRECTORY_ENDPOINT" not in env_of(pod_spec(deployments["directory"])["containers"][0])
    for component, prefix in [
        ("model-registry", "COGMENT_MODEL_REGISTRY"),
        ("datastore", "COGMENT_TRIAL_DATASTORE"),
    ]:
        env = env_of(pod_spec(deployments[component])["containers"][0])
        assert env["COGMENT_DIRECTORY_ENDPOINT"]["value"] == directory
        host = env[f"{prefix}_DIRECTORY_REGISTRATION_HOST"]
        assert host["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert "COGMENT_DIRECTORY_AUTHENTICATION_TOKEN" not in env
        assert not [name for name in env if "DIRECTORY_TLS" in name]  # a plaintext directory

    with_token = by_component(
        render(
            set_values={
                "directoryRegistration.authenticationToken.existingSecret": "dir-token",
                "directoryRegistration.host": "service",
            }
        ),
        "Deployment",
    )
    env = env_of(pod_spec(with_token["datastore"])["containers"][0])
    assert env["COGMENT_DIRECTORY_AUTHENTICATION_TOKEN"]["valueFrom"] == {
        "secretKeyRef": {"name": "dir-token", "key": "token"}
    }
    assert env["COGMENT_TRIAL_DATASTORE_DIRECTORY_REGISTRATION_HOST"]["value"] == (
        "cogment-cogment-aux-datastore.cogment.svc.cluster.local"
    )
    without_directory = service_deployments(render(set_values={"directory.enabled": "false"}))
    assert set(without_directory) == {"model-registry", "datastore"}
    assert "COGMENT_DIRECTORY_ENDPOINT" not in env_of(
        pod_spec(without_directory["datastore"])["containers"][0]
    )


def _registration_tls(manifests: list[Manifest], component: str) -> tuple[dict[str, str], list[Any]]:
    """The directory TLS variables of a registering container, and its directory-tls sources."""
    spec = pod_spec(by_component(manifests, "Deployment")[component])
    (container,) = spec["containers"]
    prefix = ENV_PREFIXES[component]
    env = {
        name.removeprefix(f"{prefix}_DIRECTORY_TLS_"): entry["value"]
        for name, entry in env_of(container).items()
        if name.startswith(f"{prefix}_DIRECTORY_TLS_")
    }
    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    mounted = any(mount["name"] == "directory-tls" for mount in container["volumeMounts"])
    assert mounted == ("directory-tls" in volumes) == bool(env)
    sources = volumes["directory-tls"]["projected"]["sources"] if env else []
    return env, sources


def _secret_source(name: str, **items: str) -> dict[str, Any]:
    return {"secret": {"name": name, "items": [{"key": key, "path": path} for path, key in items.items()]}}


CA = "/etc/cogment-aux/directory-tls/ca.crt"
CLIENT = {"CERT": "/etc/cogment-aux/directory-tls/tls.crt", "KEY": "/etc/cogment-aux/directory-tls/tls.key"}


def test_registration_follows_the_tls_of_the_chart_directory() -> None:
    # TLS without client certificates: the CA of the directory's own certificate Secret.
    tls = {"tls.enabled": "true", "tls.existingSecret": "server-tls"}
    for component in ("model-registry", "datastore"):
        env, sources = _registration_tls(render(set_values=tls), component)
        assert env == {"CA": CA}
        assert sources == [_secret_source("server-tls", **{"ca.crt": "ca.crt"})]
    # The directory's own Secret, when it has one; an explicit CA Secret over it.
    env, sources = _registration_tls(
        render(set_values={**tls, "directory.tls.existingSecret": "dir-tls"}), "datastore"
    )
    assert sources == [_secret_source("dir-tls", **{"ca.crt": "ca.crt"})]
    explicit = {
        **tls,
        "directoryRegistration.tls.caSecret": "ca",
        "directoryRegistration.tls.caKey": "bundle.pem",
    }
    env, sources = _registration_tls(render(set_values=explicit), "datastore")
    assert sources == [_secret_source("ca", **{"ca.crt": "bundle.pem"})]
    # mTLS: by default, the pod's own certificate (which must allow clientAuth)...
    mtls = {**tls, "tls.clientCA.enabled": "true", "datastore.tls.existingSecret": "datastore-tls"}
    manifests = render(set_values=mtls)
    env, sources = _registration_tls(manifests, "model-registry")
    assert env == {"CA": CA, **CLIENT}
    assert sources[1] == _secret_source("server-tls", **{"tls.crt": "tls.crt", "tls.key": "tls.key"})
    env, sources = _registration_tls(manifests, "datastore")
    assert sources[1] == _secret_source("datastore-tls", **{"tls.crt": "tls.crt", "tls.key": "tls.key"})
    # ...or a client certificate Secret of its own.
    client = {
        "directoryRegistration.tls.clientCert.existingSecret": "client",
        "directoryRegistration.tls.clientCert.keyKey": "k",
    }
    env, sources = _registration_tls(render(set_values={**mtls, **client}), "datastore")
    assert sources[1] == _secret_source("client", **{"tls.crt": "tls.crt", "tls.key": "k"})
    # The directory's plaintext: so is the registration, whatever the other services do.
    plain_directory = {**tls, "directory.tls.enabled": "false", "console.enabled": "false"}
    assert _registration_tls(render(set_values=plain_directory), "datastore") == ({}, [])


def test_registration_in_an_external_directory_takes_explicit_tls() -> None:
    external = {"directoryRegistration.endpoint": "grpc://directory.example:9005"}
    # Plaintext by default, even when this release serves TLS.
    manifests = render(set_values={**external, "tls.enabled": "true", "tls.existingSecret": "server-tls"})
    env = env_of(pod_spec(by_component(manifests, "Deployment")["datastore"])["containers"][0])
    assert env["COGMENT_DIRECTORY_ENDPOINT"]["value"] == "grpc://directory.example:9005"
    assert _registration_tls(manifests, "datastore") == ({}, [])
    with_tls = {
        **external,
        "directoryRegistration.tls.enabled": "true",
        "directoryRegistration.tls.caSecret": "ext-ca",
    }
    env, sources = _registration_tls(render(set_values=with_tls), "model-registry")
    assert env == {"CA": CA}
    assert sources == [_secret_source("ext-ca", **{"ca.crt": "ca.crt"})]
    with_client = {
        **with_tls,
        "directoryRegistration.tls.clientCert.enabled": "true",
        "directoryRegistration.tls.clientCert.existingSecret": "ext-client",
    }
    env, sources = _registration_tls(render(set_values=with_client), "model-registry")
    assert env == {"CA": CA, **CLIENT}
    assert sources[1] == _secret_source("ext-client", **{"tls.crt": "tls.crt", "tls.key": "tls.key"})


def test_the_health_port_and_its_network_policy_rule_follow_the_values() -> None:
    manifests = render(
        set_values={
            "probes.healthPort": "8500",
            "networkPolicy.enabled": "true",
            "networkPolicy.healthFrom[0].ipBlock.cidr": "10.0.0.0/16",
        }
    )
    for component, deployment in service_deployments(manifests).items():
        (container,) = pod_spec(deployment)["containers"]
        assert {"name": "health", "containerPort": 8500, "protocol": "TCP"} in container["ports"]
        assert env_of(container)[f"{ENV_PREFIXES[component]}_HEALTH_PORT"]["value"] == "8500"
        assert all(container[probe]["grpc"] == probe_target(probe, 8500) for probe in PROBES)
    for component, policy in by_component(manifests, "NetworkPolicy").items():
        if component == "console":  # no health port: its probes are HTTP requests on its own port
            continue
        (rule,) = [rule for rule in policy["spec"]["ingress"] if rule["ports"][0]["port"] == "health"]
        assert rule["from"] == [{"ipBlock": {"cidr": "10.0.0.0/16"}}]
    # The console's probes reach its HTTP port from those peers too, when only clients may.
    closed = render(
        set_values={
            "networkPolicy.enabled": "true",
            "networkPolicy.allowExternal": "false",
            "networkPolicy.healthFrom[0].ipBlock.cidr": "10.0.0.0/16",
        }
    )
    console_rules = by_component(closed, "NetworkPolicy")["console"]["spec"]["ingress"]
    assert {
        "ports": [{"port": "http", "protocol": "TCP"}],
        "from": [{"ipBlock": {"cidr": "10.0.0.0/16"}}],
    } in (console_rules)


# ---- what the scale-out values deploy ----


def test_scale_out_values(scale_out_manifests: list[Manifest]) -> None:
    deployments = service_deployments(scale_out_manifests)
    assert of_kind(scale_out_manifests, "PersistentVolumeClaim") == []  # PostgreSQL and S3 hold the state
    budgets = by_component(scale_out_manifests, "PodDisruptionBudget")
    policies = by_component(scale_out_manifests, "NetworkPolicy")
    monitors = by_component(scale_out_manifests, "ServiceMonitor")
    services = by_component(scale_out_manifests, "Service")
    assert set(deployments) == set(monitors) == set(COMPONENTS)
    assert set(budgets) == set(policies) == {*COMPONENTS, "console"}
    for component, deployment in deployments.items():
        assert deployment["spec"]["replicas"] == 3
        assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
        labels = deployment["spec"]["selector"]["matchLabels"]
        assert budgets[component]["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": labels}}
        assert policies[component]["spec"]["podSelector"] == {"matchLabels": labels}
        # The ServiceMonitor (no Kubernetes schema) selects its Service and scrapes its metrics port.
        selected = monitors[component]["spec"]["selector"]["matchLabels"]
        assert selected.items() <= services[component]["metadata"]["labels"].items()
        assert selected == labels
        assert {"name": "metrics", "port": 9100, "targetPort": "metrics", "protocol": "TCP"} in (
            services[component]["spec"]["ports"]
        )
        assert monitors[component]["spec"]["endpoints"][0]["port"] == "metrics"

        spec = pod_spec(deployment)
        (container,) = spec["containers"]
        env = env_of(container)
        prefix = next(
            name.removesuffix("_PORT") for name in env if name.endswith("_PORT") and "METRICS" not in name
        )
        assert env[f"{prefix}_DATABASE_URL"]["valueFrom"] == {
            "secretKeyRef": {"name": "cogment-aux-database", "key": "database-url"}
        }
        assert env[f"{prefix}_METRICS_PORT"]["value"] == "9100"
        # TLS from the Secret, client certificates required.
        assert env[f"{prefix}_TLS_CERT"]["value"] == "/etc/cogment-aux/tls/tls.crt"
        assert env[f"{prefix}_TLS_KEY"]["value"] == "/etc/cogment-aux/tls/tls.key"
        assert env[f"{prefix}_TLS_CLIENT_CA"]["value"] == "/etc/cogment-aux/client-ca/ca.crt"
        volumes = {volume["name"]: volume for volume in spec["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == "cogment-aux-tls"
        assert volumes["client-ca"]["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
        assert "emptyDir" in volumes["data"]
        # kubelet's gRPC probes have no TLS: they check the plaintext health port.
        assert env[f"{prefix}_HEALTH_PORT"]["value"] == str(HEALTH_PORT)
        assert {"name": "health", "containerPort": HEALTH_PORT, "protocol": "TCP"} in container["ports"]
        for probe in PROBES:
            assert container[probe]["grpc"] == probe_target(probe, HEALTH_PORT), probe
        # The NetworkPolicy lets the probes reach it (kubelet probes from the node), and only the
        # release's pods and labelled clients reach the gRPC port.
        rules = {rule["ports"][0]["port"]: rule for rule in policies[component]["spec"]["ingress"]}
        assert rules["health"] == {"ports": [{"port": "health", "protocol": "TCP"}]}  # from anywhere
        assert len(rules["grpc"]["from"]) == 2

        # Registration in the release's directory, over mTLS, as the Service's DNS name.
        if component == "directory":
            assert "COGMENT_DIRECTORY_ENDPOINT" not in env and "directory-tls" not in volumes
            continue
        assert env["COGMENT_DIRECTORY_ENDPOINT"]["value"] == (
            "grpc://cogment-cogment-aux-directory.cogment.svc.cluster.local:9005"
        )
        assert env[f"{prefix}_DIRECTORY_REGISTRATION_HOST"]["value"] == (
            f"cogment-cogment-aux-{component}.cogment.svc.cluster.local"
        )
        assert env["COGMENT_DIRECTORY_AUTHENTICATION_TOKEN"]["valueFrom"] == {
            "secretKeyRef": {"name": "cogment-aux-directory-token", "key": "token"}
        }
        assert {name: env[f"{prefix}_DIRECTORY_TLS_{name}"]["value"] for name in ("CA", "CERT", "KEY")} == {
            "CA": "/etc/cogment-aux/directory-tls/ca.crt",
            "CERT": "/etc/cogment-aux/directory-tls/tls.crt",
            "KEY": "/etc/cogment-aux/directory-tls/tls.key",
        }
        assert {"name": "directory-tls", "mountPath": "/etc/cogment-aux/directory-tls", "readOnly": True} in (
            container["volumeMounts"]
        )
        # The CA from the directory's certificate Secret, the client certificate from its own.
        assert volumes["directory-tls"]["projected"]["sources"] == [
            {"secret": {"name": "cogment-aux-tls", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
            {
                "secret": {
                    "name": "cogment-aux-registration",
                    "items": [{"key": "tls.crt", "path": "tls.crt"}, {"key": "tls.key", "path": "tls.key"}],
                }
            },
        ]

    registry = env_of(pod_spec(deployments["model-registry"])["containers"][0])
    assert registry["COGMENT_MODEL_REGISTRY_S3_ENDPOINT"]["value"] == "minio.storage.svc.cluster.local:9000"
    for key, secret_key in [("ACCESS_KEY", "access-key"), ("SECRET_KEY", "secret-key")]:
        assert registry[f"COGMENT_MODEL_REGISTRY_S3_{key}"]["valueFrom"] == {
            "secretKeyRef": {"name": "cogment-aux-s3", "key": secret_key}
        }
    directory = env_of(pod_spec(deployments["directory"])["containers"][0])
    assert (
        directory["COGMENT_DIRECTORY_SECRET_KEY"]["valueFrom"]["secretKeyRef"]["name"]
        == "cogment-aux-directory"
    )


def test_dashboards_ship_as_configmaps_for_the_grafana_sidecar(scale_out_manifests: list[Manifest]) -> None:
    """Each dashboard of deploy/dashboards, as rendered into the chart, in a ConfigMap that the
    sidecar of kube-prometheus-stack loads (label grafana_dashboard: "1")."""
    maps = {m["metadata"]["name"]: m for m in of_kind(scale_out_manifests, "ConfigMap")}
    generated = {path.name: path.read_text() for path in (CHART_DIR / "dashboards").glob("*.json")}
    assert set(generated) == {f"{name}.json" for name in DASHBOARDS}
    shipped = {}
    for name, config_map in maps.items():
        assert name.startswith("cogment-cogment-aux-dashboard-")
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert config_map["metadata"]["annotations"] == {"grafana_folder": "Cogment"}
        ((key, text),) = config_map["data"].items()
        shipped[key.removeprefix("cogment-aux-")] = text
    assert shipped == {name: text.rstrip("\n") for name, text in generated.items()}
    uids = {json.loads(text)["uid"] for text in shipped.values()}
    assert len(uids) == len(shipped)
    (rule,) = of_kind(scale_out_manifests, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "prometheus"


def test_postgresql_s3_values_need_two_secrets_and_nothing_else() -> None:
    """The minimal install on the user's PostgreSQL and S3: no TLS, no operator resources."""
    manifests = render([POSTGRESQL_S3_VALUES])
    kinds = {manifest["kind"] for manifest in manifests}
    assert not kinds & {"ServiceMonitor", "PrometheusRule", "ConfigMap", "NetworkPolicy", "Certificate"}
    deployments = service_deployments(manifests)
    referenced = set()
    for _workload, spec, container in containers(manifests):
        assert not any("tls" in volume["name"] for volume in spec.get("volumes", []))
        for variable in container.get("env", []):
            if reference := variable.get("valueFrom", {}).get("secretKeyRef"):
                referenced.add(reference["name"])
    # The directory's key and the console's access token are in Secrets the chart generates itself.
    assert referenced == {
        "cogment-aux-database",
        "cogment-aux-s3",
        "cogment-cogment-aux-directory-key",
        "cogment-cogment-aux-console-token",
    }
    assert {name: deployment["spec"]["replicas"] for name, deployment in deployments.items()} == {
        "directory": 2,
        "model-registry": 2,
        "datastore": 2,
    }
    registry = env_of(pod_spec(deployments["model-registry"])["containers"][0])
    assert registry["COGMENT_MODEL_REGISTRY_S3_REGION"]["value"] == "eu-west-1"


def test_s3_credentials_from_the_pod_role_when_no_secret_is_named() -> None:
    manifests = render(
        [POSTGRESQL_S3_VALUES],
        set_values={"modelRegistry.storage.s3.existingSecret": "", "serviceAccountName": "cogment-s3-role"},
    )
    spec = pod_spec(by_component(manifests, "Deployment")["model-registry"])
    registry = env_of(spec["containers"][0])
    assert "COGMENT_MODEL_REGISTRY_S3_ENDPOINT" in registry
    assert "COGMENT_MODEL_REGISTRY_S3_ACCESS_KEY" not in registry
    assert "COGMENT_MODEL_REGISTRY_S3_SECRET_KEY" not in registry
    assert spec["serviceAccountName"] == "cogment-s3-role"


@pytest.mark.parametrize(
    ("values_files", "set_values", "expected"),
    [
        ([], {}, "false"),
        ([], {"datastore.replicaCount": "2", "database.type": "postgresql",
              "database.postgresql.existingSecret": "db"}, "true"),
        ([POSTGRESQL_S3_VALUES], {}, "true"),
        ([POSTGRESQL_S3_VALUES], {"directory.loadBalancing": "false"}, "false"),
        ([], {"directory.loadBalancing": "true"}, "true"),
    ],
    ids=["one-replica-each", "two-datastores", "example", "forced-off", "forced-on"],
)  # fmt: skip
def test_the_directory_balances_the_load_when_a_service_has_replicas(
    values_files: list[Path], set_values: dict[str, str], expected: str
) -> None:
    """The orchestrator takes the first endpoint it is given: without load balancing every trial
    would go to the same datastore replica."""
    directory = by_component(render(values_files, set_values=set_values), "Deployment")["directory"]
    assert (
        env_of(pod_spec(directory)["containers"][0])["COGMENT_DIRECTORY_LOAD_BALANCING"]["value"] == expected
    )


def test_migrations_run_once_as_a_hook_before_install_and_upgrade(
    scale_out_manifests: list[Manifest],
) -> None:
    (job,) = of_kind(scale_out_manifests, "Job")
    annotations = job["metadata"]["annotations"]
    assert annotations["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert "before-hook-creation" in annotations["helm.sh/hook-delete-policy"]
    spec = pod_spec(job)
    assert spec["restartPolicy"] == "Never"
    (container,) = spec["containers"]
    assert container["args"] == MIGRATE
    assert env_of(container)["COGMENT_DATABASE_URL"]["valueFrom"] == {
        "secretKeyRef": {"name": "cogment-aux-database", "key": "database-url"}
    }
    assert job["spec"].get("parallelism", 1) == 1 and job["spec"].get("completions", 1) == 1


def test_every_environment_variable_is_an_option_of_the_service(
    default_manifests: list[Manifest], scale_out_manifests: list[Manifest]
) -> None:
    """A misspelled variable would be silently ignored by the service: each one the chart sets
    must be one the service reads."""
    variants = [
        default_manifests,
        scale_out_manifests,
        render(
            [SCALE_OUT_VALUES],
            {
                "tls.enabled": "false",
                "directoryRegistration.enabled": "true",
                "directoryRegistration.authenticationToken.existingSecret": "t",
                "directoryRegistration.properties": "zone=a",
            },
        ),
    ]
    seen: set[str] = set()
    for manifests in variants:
        for workload, _spec, container in containers(manifests):
            known = {option.env for option in OPTIONS_BY_COMMAND[tuple(container["args"])] if option.env}
            unknown = set(env_of(container)) - known
            assert unknown == set(), f"{workload['metadata']['name']}: {sorted(unknown)}"
            seen.update(env_of(container))
    assert "COGMENT_DIRECTORY_AUTHENTICATION_TOKEN" in seen and "COGMENT_DATABASE_URL" in seen


# ---- the web console ----

CONSOLE_PROBES = {"httpGet": {"path": "/healthz", "port": "http"}}


def _console(manifests: list[Manifest]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The console's pod spec, its container, and its environment entries by name."""
    spec = pod_spec(by_component(manifests, "Deployment")["console"])
    (container,) = spec["containers"]
    return spec, container, env_of(container)


def _values(env: dict[str, Any], *names: str) -> dict[str, str]:
    return {name: env[name]["value"] for name in names if name in env}


ENDPOINT_VARIABLES = (
    "COGMENT_DIRECTORY_ENDPOINT",
    "COGMENT_MODEL_REGISTRY_ENDPOINT",
    "COGMENT_TRIAL_DATASTORE_ENDPOINT",
)


def test_the_console_reads_the_release_services_by_name_behind_a_generated_token(
    default_manifests: list[Manifest],
) -> None:
    spec, container, env = _console(default_manifests)
    assert container["args"] == CONSOLE
    assert _values(env, *ENDPOINT_VARIABLES) == {
        "COGMENT_DIRECTORY_ENDPOINT": "grpc://cogment-cogment-aux-directory.cogment.svc.cluster.local:9005",
        "COGMENT_MODEL_REGISTRY_ENDPOINT": "grpc://cogment-cogment-aux-model-registry.cogment.svc.cluster.local:9002",
        "COGMENT_TRIAL_DATASTORE_ENDPOINT": "grpc://cogment-cogment-aux-datastore.cogment.svc.cluster.local:9003",
    }  # fmt: skip
    # The pod's address, which the console serves only with its access token...
    assert _values(env, "COGMENT_CONSOLE_HOST", "COGMENT_CONSOLE_PORT") == {
        "COGMENT_CONSOLE_HOST": "0.0.0.0",
        "COGMENT_CONSOLE_PORT": "9010",
    }
    assert "COGMENT_CONSOLE_ALLOW_ANYONE_ON_THE_NETWORK" not in env
    # ...which the chart generates once and keeps.
    (token,) = [
        m for m in of_kind(default_manifests, "Secret") if m["metadata"]["name"].endswith("-console-token")
    ]
    assert token["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert len(base64.b64decode(token["data"]["token"])) == 32
    assert env["COGMENT_CONSOLE_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": token["metadata"]["name"],
        "key": "token",
    }
    # HTTP probes of /healthz on its one port; no TLS, no state.
    assert container["ports"] == [{"name": "http", "containerPort": 9010, "protocol": "TCP"}]
    for probe in PROBES:
        assert {key: container[probe][key] for key in CONSOLE_PROBES} == CONSOLE_PROBES, probe
    assert not [name for name in env if "TLS" in name]
    assert [volume["name"] for volume in spec["volumes"]] == ["tmp"]
    service = by_component(default_manifests, "Service")["console"]
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 9010, "targetPort": "http", "protocol": "TCP"}
    ]
    assert (
        service["spec"]["selector"]
        == by_component(default_manifests, "Deployment")["console"]["spec"]["selector"]["matchLabels"]
    )
    assert "console" not in by_component(default_manifests, "PodDisruptionBudget")  # one replica


def test_the_console_reaches_mtls_services_with_the_release_certificates(
    scale_out_manifests: list[Manifest],
) -> None:
    spec, container, env = _console(scale_out_manifests)
    assert {name: value.split("://")[0] for name, value in _values(env, *ENDPOINT_VARIABLES).items()} == {
        name: "grpcs" for name in ENDPOINT_VARIABLES
    }
    assert _values(env, "COGMENT_CLIENT_TLS_CA", "COGMENT_CLIENT_TLS_CERT", "COGMENT_CLIENT_TLS_KEY") == {
        "COGMENT_CLIENT_TLS_CA": "/etc/cogment-aux/client-tls/ca.crt",
        "COGMENT_CLIENT_TLS_CERT": "/etc/cogment-aux/client-tls/tls.crt",
        "COGMENT_CLIENT_TLS_KEY": "/etc/cogment-aux/client-tls/tls.key",
    }
    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    assert volumes["client-tls"]["projected"]["sources"] == [
        _secret_source("cogment-aux-tls", **{"ca.crt": "ca.crt"}),
        _secret_source("cogment-aux-registration", **{"tls.crt": "tls.crt", "tls.key": "tls.key"}),
    ]
    assert {"name": "client-tls", "mountPath": "/etc/cogment-aux/client-tls", "readOnly": True} in (
        container["volumeMounts"]
    )
    # The directory token the services registered with: the console sees their entries.
    assert env["COGMENT_DIRECTORY_AUTHENTICATION_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "cogment-aux-directory-token",
        "key": "token",
    }
    # Two replicas, a disruption budget, and only labelled clients reach the pages.
    assert by_component(scale_out_manifests, "Deployment")["console"]["spec"]["replicas"] == 2
    assert "console" in by_component(scale_out_manifests, "PodDisruptionBudget")
    policy = by_component(scale_out_manifests, "NetworkPolicy")["console"]["spec"]
    assert policy["ingress"] == [
        {
            "ports": [{"port": "http", "protocol": "TCP"}],
            "from": [{"podSelector": {"matchLabels": {"cogment-cogment-aux-client": "true"}}}],
        }
    ]


def test_the_console_values() -> None:
    # An access token of one's own: nothing generated.
    own = render(set_values={"console.authToken.existingSecret": "mine", "console.authToken.key": "t"})
    assert not [m for m in of_kind(own, "Secret") if m["metadata"]["name"].endswith("-console-token")]
    assert _console(own)[2]["COGMENT_CONSOLE_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "mine",
        "key": "t",
    }
    # No token at all, by the flag that names the risk.
    anyone = render(set_values={"console.allowAnyoneOnTheNetwork": "true"})
    env = _console(anyone)[2]
    assert "COGMENT_CONSOLE_AUTH_TOKEN" not in env
    assert env["COGMENT_CONSOLE_ALLOW_ANYONE_ON_THE_NETWORK"]["value"] == "true"
    assert not [m for m in of_kind(anyone, "Secret") if m["metadata"]["name"].endswith("-console-token")]
    # Endpoints given win; a service not deployed here is discovered through the directory (or
    # the directory the services register in).
    elsewhere = render(
        set_values={
            "directory.enabled": "false",
            "directoryRegistration.endpoint": "grpc://directory.example:9005",
            "modelRegistry.enabled": "false",
            "console.endpoints.trialDatastore": "grpc://datastore.example:9003",
            "console.protoModule": "services.demo.api.spec_pb2",
            "console.messages": "player=cogment_aux_demo.Observation\\,cogment_aux_demo.Action",
        }
    )
    env = _console(elsewhere)[2]
    assert _values(env, *ENDPOINT_VARIABLES) == {
        "COGMENT_DIRECTORY_ENDPOINT": "grpc://directory.example:9005",
        "COGMENT_MODEL_REGISTRY_ENDPOINT": "",  # discovered through the directory
        "COGMENT_TRIAL_DATASTORE_ENDPOINT": "grpc://datastore.example:9003",
    }
    # No directory at all: none (the console's pages say so), not the console's localhost default.
    alone = render(set_values={"directory.enabled": "false"})
    assert _console(alone)[2]["COGMENT_DIRECTORY_ENDPOINT"]["value"] == ""
    assert env["COGMENT_CONSOLE_PROTO_MODULE"]["value"] == "services.demo.api.spec_pb2"
    assert (
        env["COGMENT_CONSOLE_MESSAGES"]["value"]
        == "player=cogment_aux_demo.Observation,cogment_aux_demo.Action"
    )
    # TLS for services given by endpoint, with a CA of its own.
    external_tls = render(
        set_values={
            "console.tls.enabled": "true",
            "console.tls.caSecret": "their-ca",
            "console.tls.caKey": "ca.pem",
        }
    )
    spec, _container, env = _console(external_tls)
    assert env["COGMENT_CLIENT_TLS_CA"]["value"] == "/etc/cogment-aux/client-tls/ca.crt"
    assert "COGMENT_CLIENT_TLS_CERT" not in env
    (client_tls,) = [volume for volume in spec["volumes"] if volume["name"] == "client-tls"]
    assert client_tls["projected"]["sources"] == [_secret_source("their-ca", **{"ca.crt": "ca.pem"})]
    # Disabled: nothing of it.
    disabled = render(set_values={"console.enabled": "false"})
    assert not [
        m for m in disabled if m["metadata"]["labels"].get("app.kubernetes.io/component") == "console"
    ]


def test_the_console_follows_values_that_worked_before_it() -> None:
    """Values valid without the console stay valid with it on by default: TLS from the services'
    own certificate Secrets gives it their CA; services serving different TLS leave it out, and
    the install notes say why."""
    own_secrets = {
        "tls.enabled": "true",
        "directory.tls.existingSecret": "directory-tls",
        "modelRegistry.tls.existingSecret": "registry-tls",
        "datastore.tls.existingSecret": "datastore-tls",
    }
    spec, _container, env = _console(render(set_values=own_secrets))
    (client_tls,) = [volume for volume in spec["volumes"] if volume["name"] == "client-tls"]
    assert client_tls["projected"]["sources"] == [_secret_source("directory-tls", **{"ca.crt": "ca.crt"})]
    assert env["COGMENT_DIRECTORY_ENDPOINT"]["value"].startswith("grpcs://")
    mixed = [
        "--set",
        "tls.enabled=true",
        "--set",
        "tls.existingSecret=t",
        "--set",
        "directory.tls.enabled=false",
    ]
    installed = helm("install", "cogment", str(CHART_DIR), "--dry-run=client", "--namespace", "ml", *mixed)
    rendered = installed.stdout.split("MANIFEST:", 1)[1].split("NOTES:", 1)[0]
    manifests = [doc for doc in yaml.safe_load_all(rendered) if doc]
    assert of_kind(manifests, "Deployment")  # the services are there
    assert not [
        m for m in manifests if m["metadata"]["labels"].get("app.kubernetes.io/component") == "console"
    ]
    assert "WARNING: the console (console.enabled) is not deployed" in installed.stdout.split("NOTES:", 1)[1]


# ---- what the chart refuses ----


@pytest.mark.parametrize(
    ("set_values", "message"),
    [
        ({"directory.replicaCount": "2"}, "directory.replicaCount=2 is refused with database.type=sqlite"),
        ({"datastore.replicaCount": "3"}, "datastore.replicaCount=3 is refused with database.type=sqlite"),
        (
            {
                "database.type": "postgresql",
                "database.postgresql.existingSecret": "db",
                "modelRegistry.replicaCount": "2",
            },
            "modelRegistry.replicaCount=2 is refused with modelRegistry.storage.type=local",
        ),
        ({"database.type": "postgresql"}, "needs database.postgresql.existingSecret"),
        ({"modelRegistry.storage.type": "s3"}, "needs modelRegistry.storage.s3.endpoint"),
        ({"tls.enabled": "true"}, "no certificate Secret"),
        (
            {
                "directoryRegistration.endpoint": "grpc://directory.example:9005",
                "directoryRegistration.tls.enabled": "true",
            },
            "needs directoryRegistration.tls.caSecret",
        ),
        (
            {
                "tls.enabled": "true",
                "tls.existingSecret": "tls",
                "directoryRegistration.tls.enabled": "false",
            },
            "but this release's directory serves TLS",
        ),
        ({"directoryRegistration.tls.enabled": "true"}, "but this release's directory is plaintext"),
        (
            {
                "tls.enabled": "true",
                "tls.existingSecret": "tls",
                "tls.clientCA.enabled": "true",
                "directoryRegistration.tls.clientCert.enabled": "false",
            },
            "this release's directory requires client certificates",
        ),
        (
            {
                "directoryRegistration.endpoint": "grpc://directory.example:9005",
                "directoryRegistration.tls.clientCert.enabled": "true",
            },
            "a client certificate is only presented over TLS",
        ),
        (
            {
                "tls.enabled": "true",
                "directory.tls.existingSecret": "directory-tls",
                "tls.clientCA.enabled": "true",
                "tls.clientCA.existingSecret": "ca",
                "modelRegistry.tls.enabled": "false",
                "console.enabled": "false",
                "datastore.tls.enabled": "false",
            },
            "modelRegistry registers in a directory that requires client certificates, but has no",
        ),
        ({"console.tls.enabled": "true"}, "has no CA to check their certificates with"),
        (
            {
                "console.tls.enabled": "true",
                "console.tls.caSecret": "ca",
                "console.tls.clientCert.enabled": "true",
            },
            "reaches services that require client certificates but has no certificate",
        ),
        ({"probes.healthPort": "9002"}, "probes.healthPort=9002 is also modelRegistry.port"),
        (
            {"metrics.enabled": "true", "probes.healthPort": "9100"},
            "probes.healthPort=9100 is also metrics.port",
        ),
    ],
)
def test_the_chart_refuses_what_cannot_work(set_values: dict[str, str], message: str) -> None:
    result = helm(*template_args(set_values=set_values), check=False)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def test_sqlite_scales_to_one_replica_per_service_and_disabled_services_are_left_out() -> None:
    manifests = render(set_values={"modelRegistry.enabled": "false", "datastore.replicaCount": "1"})
    assert set(service_deployments(manifests)) == {"directory", "datastore"}
    assert set(by_component(manifests, "PersistentVolumeClaim")) == {"directory", "datastore"}


def test_notes_tell_how_to_reach_each_service() -> None:
    result = helm("install", "cogment", str(CHART_DIR), "--dry-run=client", "--namespace", "ml")
    notes = result.stdout.split("NOTES:", 1)[1]
    for name, port, command in [
        ("directory", 9005, "directory"),
        ("model-registry", 9002, "model_registry"),
        ("datastore", 9003, "trial_datastore"),
    ]:
        assert f"(cogment-aux services {command})" in notes
        assert f"grpc://cogment-cogment-aux-{name}.ml.svc.cluster.local:{port}" in notes
        assert f"kubectl --namespace ml port-forward svc/cogment-cogment-aux-{name} {port}:{port}" in notes
    assert "cogment://discover/modelregistry" in notes
    assert "e.g. cogment-aux client model_registry --endpoint grpc://localhost:9002 list_models" in notes
    scale_out = helm(
        "install",
        "cogment",
        str(CHART_DIR),
        "--dry-run=client",
        "--namespace",
        "ml",
        f"--values={SCALE_OUT_VALUES}",
    )
    assert "over TLS with a client certificate" in scale_out.stdout.split("NOTES:", 1)[1]
    # The console: how to open it, and how to read its access token.
    assert "kubectl --namespace ml port-forward svc/cogment-cogment-aux-console 9010:9010" in notes
    assert "then open http://localhost:9010/" in notes
    read_token = "get secret cogment-cogment-aux-console-token -o jsonpath='{.data.token}' | base64 -d"
    assert f"kubectl --namespace ml {read_token}" in notes


# ---- the image ----


def test_dockerfile_is_multi_stage_non_root_and_runs_cogment_aux() -> None:
    """What tests/deploy/test_image.py cannot see from a built image: how it is built."""
    text = DOCKERFILE.read_text()
    stages = re.findall(r"^FROM\s+(\S+)(?:\s+AS\s+(\S+))?", text, re.MULTILINE)
    assert len(stages) >= 2, "a builder stage and a runtime stage"
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim$", text, re.MULTILINE)
    assert all(image == "${PYTHON_IMAGE}" for image, _ in stages)
    builder, final = text[: text.rindex("\nFROM ")], text[text.rindex("\nFROM ") :]
    # The dependencies' layer depends on pyproject.toml alone; the sources come after it.
    copies = re.findall(r"^COPY (?!--from)(.+?) \./?\S*$", builder, re.MULTILINE)
    assert copies[0] == "pyproject.toml", copies
    assert builder.index("pip install -r") < builder.index("COPY shared")
    # The wheel `pip wheel .` builds, installed as a wheel (not the source tree, not editable).
    assert re.search(r"pip wheel --no-deps --wheel-dir (\S+) \.", builder)
    assert re.search(r"pip install /tmp/wheels/cogment_aux-\*\.whl", builder)
    assert not re.search(r"pip install (-e |--editable |--no-deps \.|\.$)", builder, re.MULTILINE)
    # The runtime stage takes the virtual environment and nothing else of the build.
    assert re.findall(r"^COPY .*$", final, re.MULTILINE) == ["COPY --from=builder /opt/venv /opt/venv"]
    users = re.findall(r"^USER\s+(\S+)", final, re.MULTILINE)
    assert users and users[-1].split(":")[0] == "10001"
    assert image_entrypoint() == ["cogment-aux"]
    assert re.search(r'^CMD \["services", "directory"\]$', final, re.MULTILINE)
    assert re.search(r'^VOLUME \["/data"\]$', final, re.MULTILINE)


def test_the_containers_run_cogment_aux_commands(
    default_manifests: list[Manifest], scale_out_manifests: list[Manifest], capsys: pytest.CaptureFixture[str]
) -> None:
    """Each container's args, after the image's entrypoint, are a command of `cogment-aux`, the
    package's console script."""
    (script,) = importlib.metadata.entry_points(group="console_scripts", name="cogment-aux")
    assert script.value == "services.cli:main"
    commands = {
        tuple(container["args"])
        for manifests in (default_manifests, scale_out_manifests)
        for _workload, _spec, container in containers(manifests)
    }
    assert commands == {*(tuple(args) for args in COMPONENTS.values()), tuple(CONSOLE), tuple(MIGRATE)}
    for command in sorted(commands):
        with pytest.raises(SystemExit) as exited:
            cogment_aux([*command, "--help"])
        assert exited.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: cogment-aux {' '.join(command)} ")


def test_every_service_listens_on_the_pods_address(
    default_manifests: list[Manifest], scale_out_manifests: list[Manifest]
) -> None:
    """The services' own default address is 127.0.0.1, which neither their Service nor kubelet's
    probes reach: the chart sets it."""
    for manifests in (default_manifests, scale_out_manifests, render([POSTGRESQL_S3_VALUES])):
        for component, deployment in service_deployments(manifests).items():
            (container,) = pod_spec(deployment)["containers"]
            name = f"{ENV_PREFIXES[component]}_BIND_ADDRESS"
            assert env_of(container)[name] == {"name": name, "value": "0.0.0.0"}, component


def test_dockerignore_keeps_the_build_context_small() -> None:
    patterns = {line.strip() for line in (PROJECT_ROOT / ".dockerignore").read_text().splitlines()}
    for needed in [
        ".git",
        ".venv",
        ".venv-*",
        "**/__pycache__",
        ".pytest_cache",
        ".mypy_cache",
        ".ruff_cache",
        ".hypothesis",
        ".cogment-aux",
        "tests",
    ]:
        assert needed in patterns, needed
    # ...but not what the image is built from.
    for kept in ["shared", "services", "migrations", "pyproject.toml", "README.md"]:
        assert kept not in patterns


def test_the_directory_key_comes_from_a_secret_the_chart_generates_once(
    default_manifests: list[Manifest],
) -> None:
    (key_secret,) = [
        m for m in of_kind(default_manifests, "Secret") if m["metadata"]["name"].endswith("-key")
    ]
    assert key_secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert len(base64.b64decode(key_secret["data"]["secret-key"])) == 43
    directory = env_of(pod_spec(by_component(default_manifests, "Deployment")["directory"])["containers"][0])
    assert directory["COGMENT_DIRECTORY_SECRET_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": key_secret["metadata"]["name"],
        "key": "secret-key",
    }
    # A named Secret is used as it is: nothing generated.
    named = render(set_values={"directory.secretKey.existingSecret": "mine"})
    assert [m for m in of_kind(named, "Secret") if m["metadata"]["name"].endswith("-key")] == []
