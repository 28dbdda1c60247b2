"""`cogment-aux`, the installed command: each form runs the `python -m` module it names, with its
flags and its `--help` under its own name, and client code never loads server code."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from services.cli import CLIENTS, COMMANDS, SERVICES
from tests.helpers.services import PROJECT_ROOT, clean_environment

COMMAND = shutil.which("cogment-aux", path=str(Path(sys.executable).parent))


def cogment_aux(*args: str, cwd: Path = PROJECT_ROOT) -> subprocess.CompletedProcess[str]:
    assert COMMAND is not None, "the package's console script: pip install -e . installs it"
    return subprocess.run(
        [COMMAND, *args], cwd=cwd, env=clean_environment(), capture_output=True, text=True, timeout=60
    )


def test_help_lists_every_form() -> None:
    result = cogment_aux("--help")
    assert result.returncode == 0, result.stderr
    for name in [*SERVICES, *CLIENTS, *COMMANDS]:
        assert name in result.stdout


@pytest.mark.parametrize(
    ("args", "prog"),
    [
        (["services", "directory"], "cogment-aux services directory"),
        (["services", "model_registry"], "cogment-aux services model_registry"),
        (["services", "trial_datastore"], "cogment-aux services trial_datastore"),
        (["services", "all"], "cogment-aux services all"),
        (["client", "directory"], "cogment-aux client directory"),
        (["client", "model_registry"], "cogment-aux client model_registry"),
        (["client", "trial_datastore"], "cogment-aux client trial_datastore"),
        (["migrate"], "cogment-aux migrate"),
    ],
)
def test_each_form_has_the_help_of_its_module_under_its_own_name(args: list[str], prog: str) -> None:
    result = cogment_aux(*args, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: {prog} "), result.stdout


@pytest.mark.parametrize(
    ("args", "said"),
    [
        ([], "a command is needed"),
        (["serve"], "unknown command 'serve'"),
        (["services"], "services needs a name"),
        (["services", "datastore"], "unknown services 'datastore': choose from directory, model_registry"),
        (["client", "registry"], "unknown client 'registry'"),
    ],
)
def test_unknown_forms_are_usage_errors(args: list[str], said: str) -> None:
    result = cogment_aux(*args)
    assert result.returncode == 2
    assert said in result.stderr.splitlines()[-1], result.stderr


def test_a_client_command_runs_and_exits_as_its_module_does() -> None:
    # Nothing listens on port 1: the client's own failure, exit status 1, one line.
    result = cogment_aux("client", "trial_datastore", "list_trials", "--endpoint", "grpc://127.0.0.1:1")
    assert result.returncode == 1
    assert result.stderr.startswith("Error: cannot reach the trial datastore at grpc://127.0.0.1:1"), (
        result.stderr
    )
    assert len(result.stderr.splitlines()) == 1


def test_migrate_creates_the_schema_from_an_empty_directory(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'suite.db'}"
    result = cogment_aux("migrate", "--database_url", url, "--log_format", "json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    done = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    assert any(line["event"] == "schema up to date" and line["revision"] for line in done), result.stderr


def test_client_code_loads_no_server_module() -> None:
    code = (
        "import sys\n"
        "import services.directory.client.__main__, services.model_registry.client.__main__\n"
        "import services.datastore.client.__main__, services.datastore.client.training\n"
        "import services.demo.__main__\n"
        "allowed = {'services.cli', 'services.directory', 'services.model_registry', 'services.datastore'}\n"
        "server = [name for name in sys.modules if name.startswith('services.') and '.client' not in name\n"
        "          and not name.startswith('services.demo') and name not in allowed]\n"
        "print(','.join(sorted(server)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == ""
