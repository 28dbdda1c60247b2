"""What libraries log through the standard library: the S3 client's per-attempt retry warnings
are left to debugging (the dependency watcher says once that the blob store is away), and Python's
warnings are log lines like the others (JSON stays JSON)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

PROJECT_ROOT = Path(__file__).resolve().parents[2]

# A request through the S3 client's HTTP library to a port that refuses connections.
SCRIPT = """
import sys, urllib3
from shared.logging import configure_logging
configure_logging(sys.argv[1], "json", None, service="model_registry")
http = urllib3.PoolManager(retries=urllib3.Retry(total=2, backoff_factor=0))
try:
    http.request("GET", f"http://127.0.0.1:{sys.argv[2]}/bucket")
except urllib3.exceptions.MaxRetryError:
    print("failed")
"""


@pytest.mark.parametrize(("level", "retries_logged"), [("info", False), ("warning", False), ("debug", True)])
def test_the_s3_clients_retries_are_logged_only_at_debug(level: str, retries_logged: bool) -> None:
    with socket.socket() as refusing:  # bound, not listening: connections are refused
        refusing.bind(("127.0.0.1", 0))
        port = refusing.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-c", SCRIPT, level, str(port)],
            cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    assert result.stdout == "failed\n", result.stderr
    lines = [json.loads(line) for line in result.stderr.splitlines()]
    retries = [line for line in lines if line["event"].startswith("Retrying")]
    assert bool(retries) is retries_logged, lines
    assert all(
        line["service"] == "model_registry" and line["logger"] == "urllib3.connectionpool" for line in retries
    )


def test_python_warnings_are_log_lines_like_the_others() -> None:
    script = (
        "import warnings\n"
        "from shared.logging import configure_logging\n"
        "configure_logging('info', 'json', None, service='datastore')\n"
        "warnings.warn('a connection was not checked in', RuntimeWarning)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=30
    )
    [line] = [json.loads(line) for line in result.stderr.splitlines()]
    assert "RuntimeWarning: a connection was not checked in" in line["event"]
    assert (line["level"], line["logger"], line["service"]) == ("warning", "py.warnings", "datastore")
