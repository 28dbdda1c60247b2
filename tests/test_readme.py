"""The README's and docs/clients.md's examples cannot drift from the code:

* every client example of the README (a line of an `sh` block that runs `cogment-aux client ...`
  or `python -m services.<name>.client ...`) runs, as written, against services this test starts
  on free ports: the commands use the default endpoints, and the `COGMENT_*_ENDPOINT` variables,
  which override them, point at the test's services;
* every `cogment-aux ...` and `python -m ...` command the README names has a `--help`, and parses
  with the flags it is shown with (run in this process, stopped once its arguments are parsed);
* every Python example of docs/clients.md runs, its default endpoints replaced by the test's.

Placeholders (`MODEL`, `SERVICE_ID`..., and `<run id>`, read as `RUN_ID`) are replaced as
`PLACEHOLDERS` says: a capitalized word it does not list fails the test, so that an example added
to the README says how it runs. A `...` word ("and more of the same") is left out. The demo
(`cogment-aux demo`) runs too: the commands it suggests, which the README shows, need its trials.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import grpc
import pytest

import services.cli
from services.datastore.client.cli import PROGRAM as DATASTORE_PROGRAM
from services.directory.client.cli import PROGRAM as DIRECTORY_PROGRAM
from services.model_registry.client.api import ModelRegistryClient
from services.model_registry.client.cli import PROGRAM as REGISTRY_PROGRAM
from shared.api import datalog_pb2_grpc
from shared.cli import ClientProgram
from tests.helpers.datastore import datalog_inputs, full_trial, trial_params
from tests.helpers.services import PROJECT_ROOT, RunningService, clean_environment, start_service
from tests.helpers.tls import Pki, make_pki, openssl_available

README = (PROJECT_ROOT / "README.md").read_text()
DOCS = (PROJECT_ROOT / "docs" / "clients.md").read_text()
BIN = Path(sys.executable).parent  # where `cogment-aux` and `python` are installed


@dataclass(frozen=True)
class Captured:
    """A value that an earlier example printed: group 1 of `pattern` in the output of the
    example running `command` (`<client> <command>`, e.g. `directory register`)."""

    command: str
    pattern: str


@dataclass(frozen=True)
class Written:
    """A file the test writes in the examples' directory before they run (its path replaces the
    placeholder)."""

    name: str
    data: bytes


@dataclass(frozen=True)
class Logged:
    """A trial the test logs in the datastore before the examples run (its id replaces the
    placeholder)."""

    trial_id: str


# What each placeholder of the README's commands stands for in the examples that run: a literal,
# a file or a trial the test makes first, or what an earlier example printed. (In the commands
# that are only parsed: `PARSED_AS`.)
PLACEHOLDERS: Mapping[str, str | Written | Logged | Captured] = {
    "SERVICE_ID": Captured("directory register", r"Service ID \[(\d+)\]"),
    "SECRET": Captured("directory register", r"Secret \[([^\]]+)\]"),
    "MODEL": "readme-model",
    # Uploaded and downloaded by the registry's examples, then exported into and imported from.
    "FILE": Written("data.bin", b"weights of the README's example"),
    "TRIAL_ID": Logged("readme-trial"),
    "RUN_ID": Captured("demo", r"\brun=([0-9a-f]+)"),
}
# A value of each placeholder's form, for the commands that are only parsed.
PARSED_AS: Mapping[str, str] = {
    "SERVICE_ID": "1",
    "SECRET": "secret",
    "MODEL": "policy",
    "FILE": "file",
    "TRIAL_ID": "trial-1",
    "RUN_ID": "0a1b2c",
    "ID": "trial-1",
    "DIR": "dataset",
    "URL": "sqlite+aiosqlite:///test.db",
    "HANDLE": "0",
    "N": "1",
}
# Where a placeholder ends the words a command is run with: only its `--help` is checked.
UNPARSED = {"COMMAND"}
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z0-9_]*\b")
# `<run id>`, a placeholder in words (without `|`: `<a|b>` are a synopsis' alternatives).
WORDS_PLACEHOLDER = re.compile(r"<([a-z][a-z ]*)>")
CLIENT_PROGRAMS: Mapping[str, ClientProgram[Any]] = {
    "directory": DIRECTORY_PROGRAM,
    "model_registry": REGISTRY_PROGRAM,
    "trial_datastore": DATASTORE_PROGRAM,
}
CLIENT_MODULES = {
    "services.directory.client": "directory",
    "services.model_registry.client": "model_registry",
    "services.datastore.client": "trial_datastore",
}
# The endpoints the examples use (the quick start's), and each one's variable.
ENDPOINT_VARIABLES = {
    "directory": "COGMENT_DIRECTORY_ENDPOINT",
    "model_registry": "COGMENT_MODEL_REGISTRY_ENDPOINT",
    "trial_datastore": "COGMENT_TRIAL_DATASTORE_ENDPOINT",
}
DEFAULT_ENDPOINTS = {
    "directory": "grpc://localhost:9005",
    "model_registry": "grpc://localhost:9002",
    "trial_datastore": "grpc://localhost:9003",
}
SERVICE_MODULES = {
    "directory": "services.directory",
    "model_registry": "services.model_registry",
    "trial_datastore": "services.datastore",
}


# ---- what the documents hold ----


def without_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def capitalized(line: str) -> str:
    """`line` with `<run id>` written `RUN_ID`."""
    return WORDS_PLACEHOLDER.sub(lambda match: "_".join(match.group(1).upper().split()), line)


def shell_lines(text: str) -> list[str]:
    """The commands of the `sh` blocks, continuation lines joined, placeholders capitalized."""
    lines: list[str] = []
    for block in code_blocks(text, "sh"):
        lines += [
            capitalized(line.strip()) for line in block.replace("\\\n", " ").splitlines() if line.strip()
        ]
    return lines


def inline_commands(text: str) -> list[str]:
    """The code spans outside code blocks that begin with `cogment-aux` or `python -m` (a span may
    be cut across lines)."""
    spans = (
        capitalized(" ".join(span.split())) for span in re.findall(r"`([^`]+)`", without_code_blocks(text))
    )
    return [span for span in spans if span.startswith(("cogment-aux", "python -m "))]


def pipeline(line: str) -> list[list[str]]:
    """The commands of a shell line (split at pipes), as words, comments left out; `a|b`, one
    word, is a synopsis' alternatives."""
    commands: list[list[str]] = [[]]
    for word in shlex.split(line, comments=True):
        if word == "|":
            commands.append([])
        else:
            commands[-1].append(word)
    return commands


def client_of(words: Sequence[str]) -> tuple[str, str] | None:
    """(client, command) of a client command line's words, or None if it runs no client."""
    if words[:2] == ["cogment-aux", "client"] and len(words) > 3:
        return words[2], words[3]
    if words[:2] == ["python", "-m"] and len(words) > 3 and words[2] in CLIENT_MODULES:
        return CLIENT_MODULES[words[2]], words[3]
    return None


def example_name(words: Sequence[str]) -> str | None:
    """`<client> <command>` of a client command's words, `demo` for the demo, else None."""
    if words[:2] == ["cogment-aux", "demo"]:
        return "demo"
    client = client_of(words)
    return " ".join(client) if client else None


def examples(text: str) -> list[str]:
    """The lines of `sh` blocks that run a client, or the demo."""
    return [line for line in shell_lines(text) if example_name(pipeline(line)[0])]


def placeholders(line: str) -> set[str]:
    return {name for words in pipeline(line) for word in words for name in PLACEHOLDER.findall(word)}


def expand(words: Sequence[str]) -> Iterator[list[str]]:
    """The commands a synopsis names: `a|b|c` and `<a|b|c>` are alternatives, `[...]` (optional
    parts) and `...` are left out, `ID...` is `ID`."""
    kept: list[list[str]] = []
    optional = False
    for word in words:
        if word.startswith("["):
            optional = not word.endswith("]")
            continue
        if optional:
            optional = not word.endswith("]")
            continue
        if word == "...":
            continue
        word = word.removesuffix("...")
        inner = re.search(r"<([^<>]*\|[^<>]*)>", word)
        if inner:
            kept.append([word.replace(inner.group(0), choice) for choice in inner.group(1).split("|")])
        elif "|" in word and not word.startswith("-"):
            kept.append(word.split("|"))
        else:
            kept.append([word])
    for choice in itertools.product(*kept):
        yield list(choice)


def named_commands(text: str) -> list[list[str]]:
    """Every `cogment-aux ...` and `python -m ...` command the text names, in `sh` blocks or in
    code spans, alternatives expanded."""
    found: list[list[str]] = []
    for line in [*shell_lines(text), *inline_commands(text)]:
        for words in pipeline(line):
            if words[:1] == ["cogment-aux"] or (words[:2] == ["python", "-m"] and len(words) > 2):
                for command in expand(words):
                    if command not in found:
                        found.append(command)
    return found


# ---- running a command in this process, its arguments parsed only ----


class Parsed(Exception):
    """Raised instead of returning parsed arguments: the command is not run."""


def _parse_only(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> NoReturn:
    original_parse_args(self, *args, **kwargs)
    raise Parsed


original_parse_args = argparse.ArgumentParser.parse_args


def run_in_process(words: Sequence[str], monkeypatch: pytest.MonkeyPatch, *, parse_only: bool) -> int | str:
    """The exit status of `cogment-aux ...` or `python -m ...` run in this process, or "parsed"
    when `parse_only` stopped it once its arguments parsed."""
    with monkeypatch.context() as patch:
        # A client's __main__ sets it (for grpc's next start): undone after.
        patch.delenv("GRPC_VERBOSITY", raising=False)
        if parse_only:
            patch.setattr(argparse.ArgumentParser, "parse_args", _parse_only)
        try:
            if words[0] == "cogment-aux":
                patch.setattr(sys, "argv", list(words))
                return services.cli.main(list(words[1:]))
            patch.setattr(sys, "argv", [words[2], *words[3:]])
            # Run afresh, as `python -m` does (runpy warns about a module imported already).
            for name in (words[2], f"{words[2]}.__main__"):  # a module, or a package's __main__
                patch.delitem(sys.modules, name, raising=False)
            runpy.run_module(words[2], run_name="__main__", alter_sys=True)
            return 0
        except Parsed:
            return "parsed"
        except SystemExit as exit:
            return exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)


def program_path(words: Sequence[str]) -> list[str]:
    """The words that name the program and its command, before the first flag or placeholder."""
    path: list[str] = []
    for word in words:
        if (word.startswith("-") and path[-1:] != ["python"]) or PLACEHOLDER.search(word):
            break
        path.append(word)
    return path


# ---- the README's commands ----


def test_the_readme_shows_every_command_of_every_client() -> None:
    shown = {client_of(words) for line in examples(README) for words in pipeline(line)}
    expected = {
        (name, command.name) for name, program in CLIENT_PROGRAMS.items() for command in program.commands
    }
    assert expected <= shown, f"commands without an example: {sorted(expected - shown)}"


@pytest.mark.parametrize("words", named_commands(README), ids=" ".join)
def test_every_command_the_readme_names_has_its_help_and_parses(
    words: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = program_path(words)
    assert run_in_process([*path, "--help"], monkeypatch, parse_only=False) == 0, capsys.readouterr().err
    rest = words[len(path) :]
    if not rest or UNPARSED & set(rest):
        return
    if "--help" in rest or "-h" in rest:
        assert run_in_process(words, monkeypatch, parse_only=False) == 0, capsys.readouterr().err
        return
    unknown = {name for word in rest for name in PLACEHOLDER.findall(word)} - PARSED_AS.keys()
    assert not unknown, f"placeholders without a value in PARSED_AS: {sorted(unknown)}"
    concrete = [PLACEHOLDER.sub(lambda match: PARSED_AS[match.group(0)], word) for word in words]
    assert run_in_process(concrete, monkeypatch, parse_only=True) == "parsed", capsys.readouterr().err


# ---- services for the examples ----


@pytest.fixture(scope="module")
def services_started(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RunningService]]:
    """The three services, plaintext, on free ports, by client name."""
    log_dir = tmp_path_factory.mktemp("services")
    started: dict[str, RunningService] = {}
    try:
        for name, module in SERVICE_MODULES.items():
            started[name] = start_service(module, [], log_dir=log_dir)
        yield started
    finally:
        for service in started.values():
            service.stop()


def log_trial(address: str, trial_id: str, ticks: int = 3) -> None:
    """A whole trial, logged through DatalogSP as the orchestrator logs it."""
    with grpc.insecure_channel(address) as channel:
        acks = datalog_pb2_grpc.DatalogSPStub(channel).RunTrialDatalog(
            iter(datalog_inputs(trial_params(env="cartpole"), full_trial(ticks))),
            metadata=(("trial-id", trial_id), ("user-id", "readme")),
            timeout=30,
        )
        assert len(list(acks)) == ticks + 1


def example_environment(services: Mapping[str, RunningService]) -> dict[str, str]:
    """Only the test's services in reach: the endpoint variables, `cogment-aux` on the PATH."""
    endpoints = {ENDPOINT_VARIABLES[name]: service.endpoint for name, service in services.items()}
    return clean_environment({**endpoints, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"})


def test_the_readme_client_examples_run_as_written(
    services_started: dict[str, RunningService], tmp_path: Path
) -> None:
    lines = examples(README)
    assert lines, "the README shows no client example"
    values: dict[str, str] = {}
    for name, value in PLACEHOLDERS.items():
        if isinstance(value, str):
            values[name] = value
        elif isinstance(value, Written):
            (tmp_path / value.name).write_bytes(value.data)
            values[name] = str(tmp_path / value.name)
        elif isinstance(value, Logged):
            log_trial(services_started["trial_datastore"].address, value.trial_id)
            values[name] = value.trial_id
    environment = example_environment(services_started)

    for line in lines:
        missing = placeholders(line) - values.keys()
        assert not missing, f"{line}\nplaceholders without a value yet: {sorted(missing)} (see PLACEHOLDERS)"
        # Names in comments stay as they are.
        command = PLACEHOLDER.sub(
            lambda match: shlex.quote(values[match.group(0)]) if match.group(0) in values else match.group(0),
            re.sub(r"\s\.\.\.(?=\s|$)", "", line),
        )
        result = subprocess.run(
            ["sh", "-c", command],
            cwd=tmp_path,
            env=environment,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, f"{line}\n{result.stdout}{result.stderr}"
        ran = example_name(pipeline(line)[0])
        for name, source in PLACEHOLDERS.items():
            if isinstance(source, Captured) and source.command == ran:
                found = re.search(source.pattern, result.stdout)
                assert found, f"{line}\ndid not print {name} ({source.pattern}):\n{result.stdout}"
                values[name] = found.group(1)


# ---- docs/clients.md's Python examples ----


# Files the examples read, written first in their directory.
POLICY_FILE = ("policy.pt", b"weights of step 200")
DOCS_TRIALS = ["trial-1", "trial-2"]  # logged before the examples


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    if not openssl_available():
        pytest.skip("the openssl command is needed to make test certificates")
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def mtls_registry(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    """A registry that requires client certificates: the TLS example's."""
    flags = [
        "--tls_cert",
        str(pki.server.cert),
        "--tls_key",
        str(pki.server.key),
        "--tls_client_ca",
        str(pki.ca),
    ]
    with start_service("services.model_registry", flags, log_dir=tmp_path_factory.mktemp("mtls")) as service:
        yield service


def with_test_endpoints(block: str, endpoints: Mapping[str, str]) -> str:
    used = set(re.findall(r"grpcs?://[\w.\-\[\]:]+", block))
    unknown = used - endpoints.keys()
    assert not unknown, f"an example uses {sorted(unknown)}: use the default endpoints (DEFAULT_ENDPOINTS)"
    for default, endpoint in endpoints.items():
        block = block.replace(default, endpoint)
    return block


def python_example(source: str, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", source],
        cwd=cwd,
        env=clean_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finished(process: subprocess.Popen[str], source: str) -> str:
    """The example's output, once it ended well."""
    out, err = process.communicate(timeout=120)
    assert (process.returncode, err) == (0, ""), f"{source}\n{out}{err}"
    return out


async def publish_final_version(endpoint: str) -> None:
    async with ModelRegistryClient(endpoint) as registry:
        await registry.publish_version("policy", b"final weights", user_data={"final": "true"})


def test_the_docs_python_examples_run(
    services_started: dict[str, RunningService], mtls_registry: RunningService, pki: Pki, tmp_path: Path
) -> None:
    blocks = code_blocks(DOCS, "python")
    assert len(blocks) >= 6, "docs/clients.md lost its examples"
    policy_file, policy_data = POLICY_FILE
    (tmp_path / policy_file).write_bytes(policy_data)
    for pem, name in [(pki.ca, "ca.pem"), (pki.client.cert, "client.pem"), (pki.client.key, "client.key")]:
        shutil.copy(pem, tmp_path / name)
    for trial_id in DOCS_TRIALS:
        log_trial(services_started["trial_datastore"].address, trial_id)
    plaintext = {DEFAULT_ENDPOINTS[client]: service.endpoint for client, service in services_started.items()}
    # The TLS example's registry requires client certificates; its certificate names localhost.
    over_tls = {**plaintext, DEFAULT_ENDPOINTS["model_registry"]: f"grpc://localhost:{mtls_registry.port}"}

    for block in blocks:
        tls = "ClientTls(" in block
        source = with_test_endpoints(block, over_tls if tls else plaintext)
        process = python_example(source, tmp_path)
        if "follow_versions(" in block:
            # It follows until a version says it is the last: publish one once it follows.
            assert process.stdout is not None
            first = process.stdout.readline()
            assert first.startswith("loaded version "), f"{first}{process.stderr and process.stderr.read()}"
            asyncio.run(publish_final_version(services_started["model_registry"].endpoint))
            assert finished(process, source).startswith("loaded version "), source
            continue
        out = finished(process, source)
        if tls:
            # What the example says it prints.
            assert "give --tls_cert and --tls_key" in out, out
            assert "cannot read [missing.pem]: No such file or directory" in out, out
