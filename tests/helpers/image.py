"""The image the Dockerfile describes, built and run without a daemon (buildah, podman), and the
Helm chart's containers run from it as the chart says.

There is no image registry here: `python:3.11-slim` is replaced by a STAND-IN built from Debian's
packages (bookworm's Python 3.11 with venv and pip, `python` and `pip` on the PATH) by
`mmdebstrap`, once: its tarball is cached under the virtual environment (or the temp dir), keyed by
its recipe, and imported into podman's store under a tag holding the same key. The Dockerfile is
built as it is against it (`--build-arg PYTHON_IMAGE=<stand-in>`, `--pull=never`).

What this host needs, as measured: builds run with `--isolation chroot`; containers run with
`runc` and resource limits within the caller's hard ones (there is no CAP_SYS_RESOURCE, and podman
4.3 lowers its own process limit to 32768 before it starts runc), both set in a `containers.conf`
named by CONTAINERS_CONF; containers use the host's network, their services on 127.0.0.1. The
package index is reached through a proxy whose CA only the host's bundle holds: the build mounts
that bundle read-only where the stand-in's own is, and the stand-in tells pip to use it (PIP_CERT).

`Podman` removes every container (with its anonymous volumes) and image it created when closed,
and, when created, those left behind by test runs that died.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import resource
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.helpers.helm import DOCKERFILE, PROJECT_ROOT, Secrets, fill_volume

TOOLS = ("podman", "buildah")
LABEL = "cogment-aux-test.pid"  # on every container: the pid of the test run that made it
IMAGE_REPOSITORY = "localhost/cogment-aux-test"
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")

# The stand-in for python:3.11-slim. Changing any of this changes the cache key.
STAND_IN_REPOSITORY = "localhost/cogment-aux-test-python"
STAND_IN_MMDEBSTRAP = (
    "--variant=minbase",
    "--include=ca-certificates,python3,python3-venv,python3-pip,python-is-python3",
    '--aptopt=APT::Install-Recommends "false"',
    "--format=tar",
    "bookworm",
)
STAND_IN_SOURCES = (
    "deb http://deb.debian.org/debian bookworm main",
    "deb http://deb.debian.org/debian bookworm-updates main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
)
STAND_IN_CONFIG = (
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "ENV LANG=C.UTF-8",
    f"ENV PIP_CERT={HOST_CA_BUNDLE}",
    'CMD ["python3"]',
)


def missing_tools() -> list[str]:
    return [tool for tool in TOOLS if shutil.which(tool) is None]


def _cache_dir() -> Path:
    # As tests/helpers/helm.py: the virtual environment when there is one, else the temp dir.
    base = Path(sys.prefix) if sys.prefix != sys.base_prefix else Path(tempfile.gettempdir())
    return base / "cache" / "cogment-aux-image"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _containers_conf(directory: Path) -> Path:
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], 32768)
    path = directory / "containers.conf"
    path.write_text(
        '[engine]\nruntime = "runc"\n'
        f'[containers]\ndefault_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]\n'
    )
    return path


class Podman:
    """podman and buildah with this test run's configuration."""

    def __init__(self, workdir: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.env = {**os.environ, "CONTAINERS_CONF": str(_containers_conf(workdir))}
        self.containers: list[str] = []
        self.images: list[str] = []
        self._remove_stale()

    def run(
        self, tool: str, *args: str, timeout: float = 120, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [tool, *args],
            capture_output=True,
            text=True,
            env=self.env,
            stdin=subprocess.DEVNULL,
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"{tool} {' '.join(args)} failed ({result.returncode}):\n"
                f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
            )
        return result

    def podman(
        self, *args: str, timeout: float = 120, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return self.run("podman", *args, timeout=timeout, check=check)

    def image_exists(self, reference: str) -> bool:
        return self.podman("image", "exists", reference, check=False).returncode == 0

    def inspect_image(self, reference: str) -> dict[str, Any]:
        (found,) = json.loads(self.podman("image", "inspect", reference).stdout)
        return dict(found)

    def container_name(self, what: str) -> str:
        return f"cogment-aux-test-{os.getpid()}-{secrets.token_hex(3)}-{what}"

    def _remove_stale(self) -> None:
        """Containers and images of test runs that died without cleaning up."""
        listed = self.podman(
            "ps",
            "--all",
            "--filter",
            f"label={LABEL}",
            "--format",
            f'{{{{.Names}}}} {{{{index .Labels "{LABEL}"}}}}',
        )
        for line in listed.stdout.splitlines():
            name, _, pid = line.partition(" ")
            if pid.isdigit() and not _pid_alive(int(pid)):
                self.remove(name)
        images = self.podman("images", "--filter", f"reference={IMAGE_REPOSITORY}", "--format", "{{.Tag}}")
        for tag in images.stdout.splitlines():
            pid = tag.partition("-")[0]
            if pid.isdigit() and not _pid_alive(int(pid)):
                self.podman("rmi", "--force", f"{IMAGE_REPOSITORY}:{tag}", check=False)

    def remove(self, container: str) -> None:
        """Remove a container, running or not, with its anonymous volumes."""
        self.podman("rm", "--force", "--volumes", "--time", "0", container, check=False, timeout=60)

    def close(self) -> None:
        """Remove what this run created: containers (their anonymous volumes too), then images."""
        for name in reversed(self.containers):
            self.remove(name)
        self.containers.clear()
        for image in reversed(self.images):
            self.podman("rmi", "--force", image, check=False, timeout=60)
        self.images.clear()


# ---- the image ----


def stand_in_key() -> str:
    recipe = json.dumps([STAND_IN_MMDEBSTRAP, STAND_IN_SOURCES, STAND_IN_CONFIG])
    return hashlib.sha256(recipe.encode()).hexdigest()[:12]


def stand_in_python_image(podman: Podman) -> str:
    """The stand-in for python:3.11-slim: from podman's store, else from the cached tarball, else
    made by mmdebstrap (about a minute) and cached."""
    key = stand_in_key()
    reference = f"{STAND_IN_REPOSITORY}:3.11-slim-{key}"
    if podman.image_exists(reference):
        return reference
    cache = _cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / "stand-in.lock").open("a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # one build at a time; others wait and reuse it
        if podman.image_exists(reference):
            return reference
        tarball = cache / f"python-3.11-slim-{key}.tar"
        if not tarball.is_file():
            mmdebstrap = shutil.which("mmdebstrap")
            assert mmdebstrap, (
                "mmdebstrap builds the stand-in for python:3.11-slim: apt-get install mmdebstrap"
            )
            partial = cache / f"{tarball.name}.partial"
            podman.run(mmdebstrap, *STAND_IN_MMDEBSTRAP, str(partial), *STAND_IN_SOURCES, timeout=900)
            os.replace(partial, tarball)  # atomic: an interrupted build leaves no tarball behind
        changes = [arg for change in STAND_IN_CONFIG for arg in ("--change", change)]
        podman.podman("import", *changes, str(tarball), reference, timeout=300)
    return reference


def build_image(podman: Podman, tag: str, python_image: str) -> None:
    """Build the Dockerfile, unchanged, from the repository's tree, on `python_image`; `tag` is
    removed when `podman` is closed. Without --layers: a build leaves no intermediate image."""
    podman.images.append(tag)
    mounts = ["--volume", f"{HOST_CA_BUNDLE}:{HOST_CA_BUNDLE}:ro"] if HOST_CA_BUNDLE.is_file() else []
    podman.run(
        "buildah",
        "build",
        "--isolation",
        "chroot",
        "--layers=false",
        "--pull=never",
        "--build-arg",
        f"PYTHON_IMAGE={python_image}",
        *mounts,
        "--tag",
        tag,
        "--file",
        str(DOCKERFILE),
        str(PROJECT_ROOT),
        timeout=900,
    )


# ---- running containers ----


@dataclass
class Container:
    podman: Podman
    name: str

    def logs(self) -> str:
        """What it wrote, standard output first (the services log on standard error)."""
        result = self.podman.podman("logs", self.name)
        return result.stdout + result.stderr

    def output(self) -> str:
        """What it wrote on its standard output."""
        return self.podman.podman("logs", self.name).stdout

    def events(self) -> list[dict[str, Any]]:
        """Its log, one JSON object per line (it fails on a line that is not JSON)."""
        found = []
        for line in self.logs().splitlines():
            if line.strip():
                try:
                    found.append(json.loads(line))
                except ValueError as error:
                    raise AssertionError(f"{self.name} logged a line that is not JSON: {line!r}") from error
        return found

    def state(self) -> dict[str, Any]:
        (found,) = json.loads(self.podman.podman("container", "inspect", self.name).stdout)
        state: dict[str, Any] = found["State"]
        return state

    def running(self) -> bool:
        return bool(self.state()["Running"])

    def mount_source(self, destination: str) -> Path:
        """Where on this host the volume mounted at `destination` is."""
        (found,) = json.loads(self.podman.podman("container", "inspect", self.name).stdout)
        (source,) = [mount["Source"] for mount in found["Mounts"] if mount["Destination"] == destination]
        return Path(source)

    def wait(self, timeout: float) -> int:
        """Its exit status, once it ended by itself."""
        return int(self.podman.podman("wait", self.name, timeout=timeout).stdout.strip())

    def stop(self, grace_s: int) -> int:
        """SIGTERM, then SIGKILL after `grace_s` as Kubernetes does; its exit status."""
        self.podman.podman("stop", "--time", str(grace_s), self.name, timeout=grace_s + 60)
        return int(self.state()["ExitCode"])

    def exec(self, *command: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return self.podman.podman("exec", self.name, *command, timeout=timeout, check=False)


def run_container(podman: Podman, what: str, args: Sequence[str]) -> Container:
    """`podman run --detach` with `args` (options, the image, its arguments); the container is
    removed when `podman` closes."""
    name = podman.container_name(what)
    podman.containers.append(name)
    podman.podman(
        "run", "--detach", "--name", name, "--label", f"{LABEL}={os.getpid()}", "--pull=never", *args
    )
    return Container(podman, name)


def _bytes(quantity: str) -> int:
    """A Kubernetes memory quantity (512Mi, 1Gi, 100M, 1000) in bytes."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "K": 10**3, "M": 10**6, "G": 10**9}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return int(float(quantity.removesuffix(suffix)) * factor)
    return int(quantity)


def _cpus(quantity: str) -> str:
    return str(int(quantity.removesuffix("m")) / 1000) if quantity.endswith("m") else quantity


def chart_container_options(
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    *,
    env: Mapping[str, str],
    volumes_dir: Path,
    secrets: Secrets,
) -> list[str]:
    """The `podman run` options that do what the pod spec says of `container`: its user and
    groups (fsGroup as a supplementary group, owning the writable volumes as kubelet makes it),
    its security context (read-only root, no capability, no privilege escalation; podman's
    default seccomp profile is the runtime's default), its memory and CPU limits, its volumes
    (host directories: Secrets written into read-only ones) and `env`. The network is the
    host's; the command is the image's entrypoint unless the container sets one."""
    pod_security = pod.get("securityContext", {})
    security = {**pod_security, **container.get("securityContext", {})}
    user, group = security["runAsUser"], security.get("runAsGroup", security["runAsUser"])
    assert not (security.get("runAsNonRoot") and user == 0), "kubelet refuses to run it as root"
    options = ["--network", "host", "--user", f"{user}:{group}"]
    fs_group = pod_security.get("fsGroup")
    if fs_group is not None:
        options += ["--group-add", str(fs_group)]
    if security.get("readOnlyRootFilesystem"):
        options += ["--read-only", "--read-only-tmpfs=false"]  # only the pod's volumes are writable
    for capability in security.get("capabilities", {}).get("drop", []):
        options += ["--cap-drop", capability]
    if security.get("allowPrivilegeEscalation") is False:
        options += ["--security-opt", "no-new-privileges"]
    limits = container.get("resources", {}).get("limits", {})
    if "memory" in limits:
        options += ["--memory", str(_bytes(str(limits["memory"])))]
    if "cpu" in limits:
        options += ["--cpus", _cpus(str(limits["cpu"]))]

    volumes = {volume["name"]: volume for volume in pod.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        local = volumes_dir / mount["name"]
        fill_volume(volume, local, secrets)
        writable = "emptyDir" in volume or "persistentVolumeClaim" in volume
        if writable and fs_group is not None:
            os.chown(local, 0, int(fs_group))
            local.chmod(0o2775)  # what kubelet does to a volume of a pod with an fsGroup
        else:
            for path in [local, *local.rglob("*")]:
                path.chmod(0o755 if path.is_dir() else 0o444)
        read_only = mount.get("readOnly") or not writable
        options += ["--volume", f"{local}:{mount['mountPath']}{':ro' if read_only else ''}"]

    for name, value in env.items():
        options += ["--env", f"{name}={value}"]
    if container.get("command"):
        options += ["--entrypoint", json.dumps(list(container["command"]))]
    return options
