"""Running an SDK script of tests/interop/ to its end under the SDK's own interpreter (the
`sdk_python` fixture) and reading the JSON report it prints last."""

from __future__ import annotations

import json
import pathlib
import subprocess
from collections.abc import Sequence
from typing import Any

import pytest

from tests.interop.sdk_env import sdk_script_env


def run_sdk_script(
    sdk_python: pathlib.Path,
    script: pathlib.Path,
    args: Sequence[str],
    workdir: pathlib.Path,
    timeout_s: float,
) -> dict[str, Any]:
    """`script` with `args`, run in `workdir`: its report, plus `_stderr_tail` and `_returncode`.
    The test fails if the script runs past `timeout_s` or its last line is not JSON."""
    try:
        proc = subprocess.run(
            [str(sdk_python), str(script), *args],
            cwd=workdir,
            env=sdk_script_env(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"SDK script hung for {timeout_s}s; stderr tail:\n{str(exc.stderr)[-4000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    if not lines:
        pytest.fail(f"SDK script printed nothing (rc={proc.returncode}); stderr tail:\n{proc.stderr[-4000:]}")
    try:
        report: dict[str, Any] = json.loads(lines[-1])
    except ValueError:
        pytest.fail(f"SDK script output is not JSON: {lines[-1][:2000]}\nstderr:\n{proc.stderr[-4000:]}")
    report["_stderr_tail"] = proc.stderr[-6000:]
    report["_returncode"] = proc.returncode
    return report
