"""The directory command-line client, run as users run it (`python -m services.directory.client`)
against a directory subprocess."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.version import PACKAGE_VERSION
from tests.helpers.services import PROJECT_ROOT, RunningService, clean_environment, start_service

REGISTERED = re.compile(r"^Service ID \[(\d+)\] \tSecret \[(\S+)\]$")


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    tmp = tmp_path_factory.mktemp("directory")
    with start_service(
        "services.directory", ["--database_url", f"sqlite+aiosqlite:///{tmp / 'd.db'}"], log_dir=tmp
    ) as service:
        yield service


def run_client(
    *args: str, env: dict[str, str] | None = None, timeout_s: float = 30.0
) -> subprocess.CompletedProcess[str]:
    environment = clean_environment(env)
    result = subprocess.run(
        [sys.executable, "-m", "services.directory.client", *args],
        cwd=PROJECT_ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert "Traceback" not in result.stderr, result.stderr
    return result


def ok(*args: str, env: dict[str, str] | None = None) -> str:
    result = run_client(*args, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout


def register(endpoint: str, *args: str) -> tuple[str, str]:
    lines = ok("register", "--directory_endpoint", endpoint, *args).splitlines()
    assert len(lines) == 1
    match = REGISTERED.match(lines[0])
    assert match, lines
    return match.group(1), match.group(2)


def unique() -> str:
    return uuid.uuid4().hex[:12]


def test_register_inquire_deregister_round_trip(directory: RunningService) -> None:
    tag = unique()
    service_id, secret = register(
        directory.endpoint,
        "--host", "127.0.0.1", "--port", "4242", "--protocol", "cogment",
        "--type", "actor", "--properties", f"tag={tag}, role",
    )  # fmt: skip

    out = ok(
        "inquire", "--directory_endpoint", directory.endpoint, "--type", "actor", "--properties", f"tag={tag}"
    )
    assert out.splitlines() == [
        "[1] Services found",
        f"Service ID [{service_id}]",
        "\tEndpoint [cogment://127.0.0.1:4242] SSL required [false]",
        "\tType [actor]",
        "\tPermanent [false]",
        "\t[__registration_source] = [Cogment-Command_Line]",
        f"\t[__version] = [{PACKAGE_VERSION}]",
        "\t[role] = []",
        f"\t[tag] = [{tag}]",
    ]
    # Global flags also go before the command; `--service_id` finds it too.
    by_id = ok("--directory_endpoint", directory.endpoint, "inquire", "--service_id", service_id)
    assert by_id.splitlines()[:2] == ["[1] Services found", f"Service ID [{service_id}]"]
    # Another type does not match.
    assert ok(
        "inquire", "--endpoint", directory.endpoint, "--type", "environment", "--properties", f"tag={tag}"
    ) == ("[0] Services found\n")

    assert (
        ok("deregister", "--endpoint", directory.endpoint, "--service_id", service_id, "--secret", secret)
        == ""
    )
    assert (
        ok("inquire", "--endpoint", directory.endpoint, "--service_id", service_id) == "[0] Services found\n"
    )
    again = run_client(
        "deregister", "--endpoint", directory.endpoint, "--service_id", service_id, "--secret", secret
    )
    assert again.returncode == 1
    assert again.stderr.strip() == (
        f"Error: Service deregistration failed [Failed to deregister service ID [{service_id}]: "
        f"Unknown service ID [{service_id}]]"
    )


def test_environment_variables_and_json_output(directory: RunningService) -> None:
    tag = unique()
    env = {
        "COGMENT_DIRECTORY_ENDPOINT": directory.endpoint,
        "COGMENT_DIRECTORY_AUTHENTICATION_TOKEN": f"token-{tag}",
        "COGMENT_CLIENT_TIMEOUT": "10s",
        "COGMENT_CLIENT_CONSOLE_OUTPUT": "json",
    }
    registered = json.loads(
        ok(
            "register", "--host", "127.0.0.1", "--port", str(directory.port), "--ssl_required", "--permanent",
            "--type", "directory", "--properties", f"tag={tag}",
            env=env,
        )
    )  # fmt: skip
    assert registered["status"] == "OK"
    service_id, secret = registered["service_id"], registered["secret"]

    found = json.loads(ok("inquire", "--properties", f"tag={tag}", env=env))
    [service] = found["services"]
    assert service["service_id"] == service_id
    assert service["endpoint"] == {"protocol": "GRPC_SSL", "host": "127.0.0.1", "port": directory.port}
    assert service["details"]["type"] == "DIRECTORY_SERVICE"
    assert service["details"]["properties"]["tag"] == tag
    assert service["details"]["properties"]["__registration_source"] == "Cogment-Command_Line"
    assert service["permanent"] is True

    # Text output, forced by the flag over the environment variable.
    text = ok("inquire", "--service_id", service_id, "--console_output", "text", env=env)
    assert (
        "\tEndpoint [grpc://127.0.0.1:" in text
        and "SSL required [true]" in text
        and "Permanent [true]" in text
    )

    assert json.loads(ok("deregister", "--service_id", service_id, "--secret", secret, env=env)) == {
        "status": "OK",
        "error_msg": "",
    }
    assert json.loads(ok("inquire", "--service_id", service_id, env=env)) == {"services": []}


def test_token_scoping(directory: RunningService) -> None:
    tag = unique()
    endpoint = ["--directory_endpoint", directory.endpoint]
    service_id, secret = register(
        directory.endpoint,
        "--auth_token", f"a-{tag}", "--host", "h", "--protocol", "cogment", "--type", "other",
        "--properties", f"tag={tag}",
    )  # fmt: skip
    query = ["inquire", *endpoint, "--properties", f"tag={tag}"]
    assert ok(*query) == "[0] Services found\n"
    assert ok(*query, "--directory_authentication_token", f"b-{tag}") == "[0] Services found\n"
    assert ok(*query, "--directory_authentication_token", f"a-{tag}").startswith("[1] Services found\n")
    assert ok(*query, env={"COGMENT_DIRECTORY_AUTHENTICATION_TOKEN": f"a-{tag}"}).startswith(
        "[1] Services found\n"
    )

    wrong = run_client("deregister", *endpoint, "--service_id", service_id, "--secret", secret)
    assert wrong.returncode == 1
    assert "Authentication failure" in wrong.stderr
    ok("deregister", *endpoint, "--auth_token", f"a-{tag}", "--service_id", service_id, "--secret", secret)


def test_a_secret_that_begins_with_a_dash_is_taken_as_the_secret(directory: RunningService) -> None:
    """Secrets are base64url: one in 64 begins with '-', which argparse takes for a flag."""
    service_id, _ = register(directory.endpoint, "--host", "h", "--protocol", "cogment", "--type", "other")
    wrong = run_client(
        "deregister", "--endpoint", directory.endpoint, "--service_id", service_id, "--secret", "-x"
    )
    assert wrong.returncode == 1, wrong.stderr
    assert "Authentication failure" in wrong.stderr
    missing = run_client("deregister", "--endpoint", directory.endpoint, "--secret", "--service_id", "1")
    assert missing.returncode == 2  # a flag where the secret should be: still a usage error
    assert "--secret: expected one argument" in missing.stderr


def test_refused_registration(directory: RunningService) -> None:
    result = run_client("register", "--endpoint", directory.endpoint, "--type", "actor", "--port", "1")
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.strip() == "Error: Service registration failed [Empty host]"


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (
            ["inquire", "--service_id", "5", "--type", "actor"],
            {},
            "Can only inquire with a service ID or type",
        ),
        (
            ["inquire", "--service_id", "5", "--properties", "a=1"],
            {},
            "Can only inquire with a service ID or type",
        ),
        (["inquire", "--service_id", "-5"], {}, "invalid service id '-5'"),
        (["inquire", "--properties", "a=b=c"], {}, "more than one '='"),
        (["register", "--host", "h"], {}, "register needs --type"),
        (["register", "--type", "actors"], {}, "invalid service type [actors]"),
        (["register", "--type", "actor", "--protocol", "http"], {}, "invalid choice: 'http'"),
        (["register", "--type", "actor", "--protocol", "cogment", "--ssl_required"], {}, "only applies to"),
        (["register", "--type", "actor", "--port", "70000"], {}, "expected a port number"),
        (["deregister", "--secret", "s"], {}, "deregister needs --service_id"),
        (["inquire", "--directory_endpoint", "localhost:9005"], {}, "invalid endpoint [localhost:9005]"),
        (["inquire"], {"COGMENT_DIRECTORY_ENDPOINT": "grpc://[::1"}, "COGMENT_DIRECTORY_ENDPOINT"),
        (["inquire"], {"COGMENT_CLIENT_TIMEOUT": "soon"}, "invalid duration 'soon'"),
        (["inquire", "--timeout", "0"], {}, "must be positive"),
        (["inquire"], {"COGMENT_CLIENT_CONSOLE_OUTPUT": "xml"}, "COGMENT_CLIENT_CONSOLE_OUTPUT"),
        (["frobnicate"], {}, "invalid choice: 'frobnicate'"),
        ([], {}, "required: COMMAND"),
    ],
)
def test_usage_errors(args: list[str], env: dict[str, str], message: str) -> None:
    result = run_client(*args, env=env)
    assert result.returncode == 2
    assert message in result.stderr
    assert result.stdout == ""


def test_wait_for_ready(directory: RunningService) -> None:
    ready = f"The directory at {directory.endpoint} is ready\n"
    assert ok("wait_for_ready", "--directory_endpoint", directory.endpoint) == ready
    assert ok("WaitForReady", env={"COGMENT_DIRECTORY_ENDPOINT": directory.endpoint}) == ready
    printed = ok("wait_for_ready", "--directory_endpoint", directory.endpoint, "--console_output", "json")
    assert json.loads(printed) == {"ready": True, "endpoint": directory.endpoint}


def test_wait_for_ready_does_not_wait_out_the_registration_lag(tmp_path: Path) -> None:
    # An inquiry that cannot match (id 0) is answered at once: with a 30 s lag, a 3 s timeout
    # is plenty (it used to report that the directory did not answer).
    args = ["--database_url", f"sqlite+aiosqlite:///{tmp_path / 'd.db'}", "--registration_lag", "30"]
    with start_service("services.directory", args, log_dir=tmp_path) as lagging:
        ok("wait_for_ready", "--directory_endpoint", lagging.endpoint, "--timeout", "3")


def test_wait_for_ready_times_out(closed_port: int) -> None:
    started = time.monotonic()
    result = run_client("WaitForReady", "--endpoint", f"grpc://127.0.0.1:{closed_port}", "--timeout", "1")
    assert result.returncode == 1
    assert time.monotonic() - started < 10
    assert f"the directory at grpc://127.0.0.1:{closed_port} did not answer within 1 s" in result.stderr

    env = {"COGMENT_DIRECTORY_ENDPOINT": f"grpc://127.0.0.1:{closed_port}", "COGMENT_CLIENT_TIMEOUT": "500ms"}
    result = run_client("wait_for_ready", env=env)
    assert result.returncode == 1
    assert "did not answer within 0.5 s" in result.stderr


def test_other_commands_fail_at_once_when_the_directory_cannot_be_reached(closed_port: int) -> None:
    # With a 60 s timeout: refused connections are not waited out (the subprocess's own 30 s
    # limit would fail this test if they were).
    endpoint = f"grpc://127.0.0.1:{closed_port}"
    for command in (["inquire"], ["register", "--type", "actor", "--host", "127.0.0.1", "--port", "1"]):
        result = run_client(*command, "--endpoint", endpoint, "--timeout", "60")
        assert result.returncode == 1
        assert f"cannot reach the directory at {endpoint}" in result.stderr


def test_wait_for_ready_waits_for_the_directory(tmp_path: Path, closed_port: int) -> None:
    endpoint = f"grpc://127.0.0.1:{closed_port}"
    waiting = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.directory.client",
            "wait_for_ready",
            "--endpoint",
            endpoint,
            "--timeout",
            "30",
        ],
        cwd=PROJECT_ROOT,
        env=clean_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(0.5)
        assert waiting.poll() is None  # still waiting
        args = ["--port", str(closed_port), "--database_url", f"sqlite+aiosqlite:///{tmp_path / 'd.db'}"]
        with start_service("services.directory", args, log_dir=tmp_path) as directory:
            assert directory.port == closed_port
            _, stderr = waiting.communicate(timeout=20)
            assert waiting.returncode == 0, stderr
    finally:
        if waiting.poll() is None:
            waiting.kill()
            waiting.wait()
