"""The demo's tests' helpers: the suite of services they run it against, and how they run it: in
a thread (its `main`, while the services serve from the test's event loop) or as a subprocess, as
users do."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.demo.cli import main
from tests.helpers.running import RunningDatastore, RunningDirectory, RunningRegistry
from tests.helpers.services import PROJECT_ROOT, clean_environment

PROG = "cogment-aux demo"


@dataclass
class Suite:
    datastore: RunningDatastore
    registry: RunningRegistry
    directory: RunningDirectory

    @property
    def datastore_endpoint(self) -> str:
        return f"grpc://127.0.0.1:{self.datastore.service.port}"

    @property
    def registry_endpoint(self) -> str:
        return f"grpc://127.0.0.1:{self.registry.service.port}"

    @property
    def directory_endpoint(self) -> str:
        return f"grpc://127.0.0.1:{self.directory.port}"

    def endpoint_flags(self) -> list[str]:
        return [
            "--trial_datastore_endpoint", self.datastore_endpoint,
            "--model_registry_endpoint", self.registry_endpoint,
            "--directory_endpoint", self.directory_endpoint,
        ]  # fmt: skip


@dataclass
class Run:
    code: int
    out: str
    err: str

    @property
    def report(self) -> dict[str, Any]:
        assert self.code == 0, self.err
        report: dict[str, Any] = json.loads(self.out)
        return report


async def run_demo(suite: Suite, *flags: str, environ: dict[str, str] | None = None) -> Run:
    """The demo's `main` in a thread against `suite` (JSON output), then `flags`."""
    out, err = io.StringIO(), io.StringIO()
    argv = [*suite.endpoint_flags(), "--console_output", "json", *flags]
    code = await asyncio.to_thread(main, argv, PROG, environ or {}, out, err)
    return Run(code, out.getvalue(), err.getvalue())


def command_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """A subprocess's environment as a user's shell would give it: none of this process's
    COGMENT_* variables, nor the GRPC_VERBOSITY that importing the demo set here (the program
    must set it itself, before grpc loads, to keep grpc's own log lines off its standard error)."""
    environment = clean_environment(env)
    if "GRPC_VERBOSITY" not in (env or {}):
        environment.pop("GRPC_VERBOSITY", None)
    return environment


async def run_command(
    command: Sequence[str], cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """A subprocess, waited for in a thread (the services serve from this event loop)."""
    return await asyncio.to_thread(
        subprocess.run,
        list(command),
        cwd=cwd or PROJECT_ROOT,
        env=command_environment(env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]
