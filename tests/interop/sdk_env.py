"""Separate virtual environment holding the official Cogment Python SDK.

The SDK (PyPI ``cogment`` 2.10.1) declares ``Requires-Python <3.11`` and pins
``grpcio <1.49`` / ``protobuf <4``, so it cannot share the project's
environment.  :func:`ensure_sdk_python` builds (once) a Python 3.10 venv at
``<project root>/.venv-sdk`` with ``cogment[generate]==2.10.1`` and ``psutil``
(imported by the SDK but not declared) and returns its interpreter.

Safety against half-built environments: the build runs under an exclusive
``fcntl`` lock (kept outside the repository, in the temp dir) and the venv is
only considered valid when its completion marker (written last, containing the
requirement list) exists AND ``import cogment, psutil`` succeeds.  Anything
else is wiped and rebuilt.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

PROJECT_ROOT = pathlib.Path(__file__).resolve().parents[2]
SDK_VENV = PROJECT_ROOT / ".venv-sdk"
SDK_REQUIREMENTS = ("cogment[generate]==2.10.1", "psutil")
_MARKER_NAME = ".cogment-aux-sdk-complete"
_IMPORT_CHECK = "import cogment, psutil"
_CHECK_TIMEOUT = 120
_INSTALL_TIMEOUT = 1800


class SdkEnvError(RuntimeError):
    """The SDK environment could not be created."""


def _venv_python(venv: pathlib.Path) -> pathlib.Path:
    return venv / "bin" / "python"


def _marker_text() -> str:
    return "\n".join(SDK_REQUIREMENTS) + "\n"


def _is_valid(venv: pathlib.Path) -> bool:
    marker = venv / _MARKER_NAME
    python = _venv_python(venv)
    try:
        if marker.read_text() != _marker_text():
            return False
    except OSError:
        return False
    if not python.exists():
        return False
    try:
        result = subprocess.run(
            [str(python), "-c", _IMPORT_CHECK],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=_CHECK_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0


def _probe_python310(candidate: str) -> str | None:
    """Return the real interpreter path if ``candidate`` runs a Python 3.10."""
    try:
        result = subprocess.run(
            [
                candidate,
                "-c",
                "import sys; assert sys.version_info[:2] == (3, 10); print(sys.executable)",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if result.returncode != 0:
        return None
    path = result.stdout.strip()
    return path or None


def find_python310() -> str:
    """Locate a working Python 3.10 interpreter (pyenv on these machines).

    ``shutil.which("python3.10")`` may return a pyenv shim that refuses to run
    when 3.10 is not among the selected pyenv versions, so every candidate is
    actually executed and its real ``sys.executable`` returned.
    """
    candidates: list[str] = []
    override = os.environ.get("COGMENT_AUX_SDK_PYTHON310")
    if override:
        candidates.append(override)
    which = shutil.which("python3.10")
    if which:
        candidates.append(which)
    pyenv_roots = [os.environ.get("PYENV_ROOT"), os.path.expanduser("~/.pyenv")]
    for root in pyenv_roots:
        if root:
            candidates.extend(
                sorted(glob.glob(os.path.join(root, "versions", "3.10*", "bin", "python3.10")), reverse=True)
            )
    candidates.extend(["/usr/local/bin/python3.10", "/usr/bin/python3.10"])
    seen: set[str] = set()
    for candidate in candidates:
        if candidate in seen:
            continue
        seen.add(candidate)
        real = _probe_python310(candidate)
        if real:
            return real
    raise SdkEnvError(
        "No Python 3.10 interpreter found (tried: " + ", ".join(seen) + "); "
        "the official Cogment SDK 2.10.1 requires Python <3.11. "
        "Set COGMENT_AUX_SDK_PYTHON310 to a python3.10 executable."
    )


def _run(cmd: list[str], timeout: int) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if result.returncode != 0:
        raise SdkEnvError(
            f"command failed ({result.returncode}): {' '.join(cmd)}\n"
            f"stdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}"
        )


def _lock_path(venv: pathlib.Path) -> pathlib.Path:
    digest = hashlib.sha256(str(venv).encode()).hexdigest()[:16]
    return pathlib.Path(tempfile.gettempdir()) / f"cogment-aux-venv-sdk-{digest}.lock"


def ensure_sdk_python(venv: pathlib.Path | None = None) -> pathlib.Path:
    """Return the interpreter of the SDK venv, building the venv if needed.

    Idempotent and safe to call concurrently (several pytest processes).
    """
    venv = pathlib.Path(venv) if venv is not None else SDK_VENV
    if _is_valid(venv):
        return _venv_python(venv)
    with open(_lock_path(venv), "a+") as lock_file:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        try:
            if _is_valid(venv):  # built by someone else while we waited
                return _venv_python(venv)
            python310 = find_python310()
            if venv.exists() or venv.is_symlink():
                if venv.is_dir() and not venv.is_symlink():
                    shutil.rmtree(venv)
                else:
                    venv.unlink()
            _run([python310, "-m", "venv", str(venv)], timeout=300)
            python = str(_venv_python(venv))
            _run(
                [python, "-m", "pip", "install", "--disable-pip-version-check", "--quiet", *SDK_REQUIREMENTS],
                timeout=_INSTALL_TIMEOUT,
            )
            _run([python, "-c", _IMPORT_CHECK], timeout=_CHECK_TIMEOUT)
            tmp_marker = venv / (_MARKER_NAME + ".tmp")
            tmp_marker.write_text(_marker_text())
            os.replace(tmp_marker, venv / _MARKER_NAME)
            if not _is_valid(venv):
                raise SdkEnvError(f"SDK venv {venv} still invalid after building it")
            return _venv_python(venv)
        finally:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)


if __name__ == "__main__":  # manual use: python tests/interop/sdk_env.py
    print(ensure_sdk_python())
    sys.exit(0)


def no_proxy_env() -> dict[str, str]:
    """gRPC honours http(s)_proxy: keep loopback traffic away from any proxy."""
    env = {}
    for var in ("no_proxy", "NO_PROXY", "no_grpc_proxy"):
        current = os.environ.get(var, "")
        env[var] = ",".join(x for x in (current, "127.0.0.1", "localhost") if x)
    return env


def sdk_script_env() -> dict[str, str]:
    """Environment of the SDK script: no inherited Cogment settings, nothing from our venv."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("COGMENT_") and k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
    }
    env.update(no_proxy_env())
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env
