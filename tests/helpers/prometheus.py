"""A real Prometheus server (Debian's `prometheus` package) for tests: started on 127.0.0.1 with a
configuration the test writes, its HTTP API queried, stopped and its data removed on exit."""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from tests.helpers.fake_services import free_port

START_TIMEOUT_S = 60.0


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    assert found, "prometheus not found: install Debian's prometheus package (.ci/run does)"
    return found


class Prometheus:
    """`prometheus` scraping `jobs` (job name -> (targets, labels)) every second, with `rule_files`."""

    def __init__(
        self,
        work_dir: Path,
        jobs: dict[str, tuple[list[str], dict[str, str]]],
        rule_files: list[Path] | None = None,
    ) -> None:
        self.work_dir = work_dir
        self.port = free_port()
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(path) for path in rule_files or []],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": targets, "labels": labels}]}
                for job, (targets, labels) in jobs.items()
            ],
        }
        self.config_path = work_dir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = work_dir / "prometheus.log"
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Prometheus:
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(
                [
                    prometheus_binary(),
                    f"--config.file={self.config_path}",
                    f"--storage.tsdb.path={self.work_dir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._ready():
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"prometheus did not start; its log:\n{self.log_path.read_text()}")
            time.sleep(0.2)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._process is not None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None
        shutil.rmtree(self.work_dir / "data", ignore_errors=True)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, ConnectionError):
            return False

    def api(self, path: str, **params: str | list[str]) -> Any:
        """The `data` of an HTTP API answer (/api/v1/<path>); fails on an error answer."""
        query = urllib.parse.urlencode(params, doseq=True)
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{query}"
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                answer = json.load(response)
        except urllib.error.HTTPError as error:
            raise AssertionError(f"{path} {params}: {error.code} {error.read().decode()}") from None
        assert answer["status"] == "success", answer
        return answer["data"]

    def query(self, expr: str) -> float:
        """The single value of an instant query (at now)."""
        result = self.api("query", query=expr)["result"]
        assert len(result) == 1, f"{expr}: {result}"
        return float(result[0]["value"][1])

    def query_range(self, expr: str, start: float, end: float, step_s: float = 1.0) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.api(
            "query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step_s:g}s"
        )["result"]
        return result


def finite_values(series: list[dict[str, Any]]) -> list[float]:
    """The values of a range query's series that a chart would draw (not NaN, not infinite)."""
    return [
        number
        for one in series
        for _, value in one["values"]
        if not math.isnan(number := float(value)) and not math.isinf(number)
    ]
