"""The clients over TLS and mTLS, against real services started as users start them
(`python -m services.<name> --tls_cert ... --tls_key ...`, with `--tls_client_ca` for mTLS): each
command-line client run in a process of its own, as `cogment-aux client <name>` and as
`python -m services.<name>.client`, and the Python APIs. Every failure to connect is one line
saying what to change (`shared.client`'s hints), exit status 1; a usage mistake exits with 2."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from services.datastore.client.api import DatastoreClient
from services.datastore.client.training import TrainingData
from services.model_registry.client.api import ModelRegistryClient
from shared.api import datalog_pb2_grpc
from shared.channel import ClientTls
from shared.client import ClientError
from shared.tls_files import ENCRYPTED_KEY
from tests.helpers.datastore import datalog_inputs, full_trial, trial_params
from tests.helpers.services import PROJECT_ROOT, RunningService, clean_environment, start_service
from tests.helpers.tls import Pki, encrypted_key, make_pki, openssl_available

COGMENT_AUX = shutil.which("cogment-aux", path=str(Path(sys.executable).parent))


@dataclass(frozen=True)
class Client:
    name: str  # as `cogment-aux client <name>` names it
    module: str  # `python -m <module>`
    service_module: str  # `python -m <service_module>` serves it
    service: str  # as its messages name the service
    endpoint_env: str
    default_endpoint: str
    command: tuple[str, ...]  # a command that reads, whatever the service holds
    answer: str  # a regular expression its output matches


CLIENTS = {
    client.name: client
    for client in [
        Client(
            "directory",
            "services.directory.client",
            "services.directory",
            "directory",
            "COGMENT_DIRECTORY_ENDPOINT",
            "grpc://localhost:9005",
            ("inquire", "--service_id", "1"),
            r"\[0\] Services found",
        ),
        Client(
            "model_registry",
            "services.model_registry.client",
            "services.model_registry",
            "model registry",
            "COGMENT_MODEL_REGISTRY_ENDPOINT",
            "grpc://localhost:9002",
            ("list_models",),
            r"\[\d+\] Models found",
        ),
        Client(
            "trial_datastore",
            "services.datastore.client",
            "services.datastore",
            "trial datastore",
            "COGMENT_TRIAL_DATASTORE_ENDPOINT",
            "grpc://localhost:9003",
            ("list_trials",),
            r"\d+ trials retrieved",
        ),
    ]
}
# Each client's "another service": where a client pointed at the wrong port lands.
OTHER = {"directory": "model_registry", "model_registry": "trial_datastore", "trial_datastore": "directory"}

CA_HINT = (
    ": the server may require TLS: give the CA bundle that signed its certificate with --tls_ca (or use "
    "a grpcs:// endpoint to trust the system's CAs)"
)
CLIENT_CERTIFICATE_HINT = ": the server may require a client certificate: give --tls_cert and --tls_key"
REFUSED_CERTIFICATE_HINT = ": the server may not accept this client certificate (--tls_cert)"
PLAINTEXT_HINT = ": the server does not speak TLS: use a grpc:// endpoint without --tls_* flags"


@dataclass
class Servers:
    """One client's service over TLS and over mTLS."""

    client: Client
    tls: RunningService
    mtls: RunningService


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    if not openssl_available():
        pytest.skip("the openssl command is needed to make test certificates")
    return make_pki(tmp_path_factory.mktemp("pki"))


def rogue_ca(pki: Pki) -> Path:
    """A CA bundle that did not sign the server's certificate (make_pki's other CA)."""
    return pki.ca.with_name("rogue-ca.pem")


def tls_flags(pki: Pki, *, mtls: bool) -> list[str]:
    flags = ["--tls_cert", str(pki.server.cert), "--tls_key", str(pki.server.key)]
    return [*flags, "--tls_client_ca", str(pki.ca)] if mtls else flags


@pytest.fixture(scope="module")
def plaintext(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RunningService]]:
    """Each service without TLS, by client name."""
    log_dir = tmp_path_factory.mktemp("plaintext")
    started: dict[str, RunningService] = {}
    try:
        for name, client in CLIENTS.items():
            started[name] = start_service(client.service_module, [], log_dir=log_dir)
        yield started
    finally:
        for service in started.values():
            service.stop()


@pytest.fixture(scope="module", params=list(CLIENTS))
def servers(
    request: pytest.FixtureRequest, pki: Pki, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Servers]:
    client = CLIENTS[request.param]
    log_dir = tmp_path_factory.mktemp(client.name)
    with (
        start_service(client.service_module, tls_flags(pki, mtls=False), log_dir=log_dir) as tls,
        start_service(client.service_module, tls_flags(pki, mtls=True), log_dir=log_dir) as mtls,
    ):
        yield Servers(client, tls, mtls)


def run(
    client: Client, *args: str, env: Mapping[str, str] | None = None, as_module: bool = False
) -> subprocess.CompletedProcess[str]:
    """The client's command line, as `cogment-aux client <name>` (or `python -m <module>`), with
    none of this process's COGMENT_* variables, nor a GRPC_VERBOSITY that would add grpc's own
    log lines to what the client says."""
    assert COGMENT_AUX is not None, "the package's console script: pip install -e . installs it"
    command = [sys.executable, "-m", client.module] if as_module else [COGMENT_AUX, "client", client.name]
    environment = clean_environment(dict(env or {}))
    environment.pop("GRPC_VERBOSITY", None)
    return subprocess.run(
        [*command, *args], cwd=PROJECT_ROOT, env=environment, capture_output=True, text=True, timeout=60
    )


def answered(client: Client, result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, result.stderr
    assert re.search(client.answer, result.stdout), result.stdout
    assert result.stderr == ""


def failed_with(result: subprocess.CompletedProcess[str], start: str, end: str) -> None:
    """Exit status 1, one line on standard error from `start` to `end` (between them, grpc's own
    words for the failure, which its versions phrase differently)."""
    assert result.returncode == 1, result.stdout
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(start), lines[0]
    assert lines[0].endswith(end), lines[0]


def unreachable(client: Client, endpoint: str) -> str:
    return f"Error: cannot reach the {client.service} at {endpoint} ("


def endpoint_flags(endpoint: str) -> list[str]:
    return ["--endpoint", endpoint]


# ---- connecting ----


def test_tls_with_the_ca(servers: Servers, pki: Pki) -> None:
    client = servers.client
    result = run(client, *client.command, *endpoint_flags(servers.tls.endpoint), "--tls_ca", str(pki.ca))
    answered(client, result)


def test_mtls_with_a_client_certificate(servers: Servers, pki: Pki) -> None:
    client = servers.client
    certificate = [
        "--tls_ca",
        str(pki.ca),
        "--tls_cert",
        str(pki.client.cert),
        "--tls_key",
        str(pki.client.key),
    ]
    answered(client, run(client, *client.command, *endpoint_flags(servers.mtls.endpoint), *certificate))
    # The python -m form takes the same flags.
    result = run(
        client, *client.command, *endpoint_flags(servers.mtls.endpoint), *certificate, as_module=True
    )
    answered(client, result)


def test_mtls_from_environment_variables(servers: Servers, pki: Pki) -> None:
    client = servers.client
    env = {
        client.endpoint_env: servers.mtls.endpoint,
        "COGMENT_CLIENT_TLS_CA": str(pki.ca),
        "COGMENT_CLIENT_TLS_CERT": str(pki.client.cert),
        "COGMENT_CLIENT_TLS_KEY": str(pki.client.key),
    }
    answered(client, run(client, *client.command, env=env))


def test_grpcs_endpoint(servers: Servers, pki: Pki) -> None:
    client = servers.client
    # The certificate names localhost too.
    endpoint = f"grpcs://localhost:{servers.tls.port}"
    answered(client, run(client, *client.command, *endpoint_flags(endpoint), "--tls_ca", str(pki.ca)))
    # Without --tls_ca, the system's CAs, which did not sign the test CA's certificate.
    result = run(client, *client.command, *endpoint_flags(endpoint))
    failed_with(
        result,
        unreachable(client, endpoint),
        ": its certificate is not signed by the system's CAs (give --tls_ca)",
    )


# ---- what a failed connection is told ----


def test_plaintext_client_meets_a_tls_server(servers: Servers) -> None:
    client = servers.client
    for server in (servers.tls, servers.mtls):
        result = run(client, *client.command, *endpoint_flags(server.endpoint))
        failed_with(result, unreachable(client, server.endpoint), CA_HINT)


def test_tls_client_without_a_certificate_meets_an_mtls_server(servers: Servers, pki: Pki) -> None:
    client = servers.client
    endpoint = servers.mtls.endpoint
    result = run(client, *client.command, *endpoint_flags(endpoint), "--tls_ca", str(pki.ca))
    failed_with(result, unreachable(client, endpoint), CLIENT_CERTIFICATE_HINT)
    # A certificate that another CA signed is refused the same way, and said so.
    rogue = ["--tls_cert", str(pki.rogue_client.cert), "--tls_key", str(pki.rogue_client.key)]
    result = run(client, *client.command, *endpoint_flags(endpoint), "--tls_ca", str(pki.ca), *rogue)
    failed_with(result, unreachable(client, endpoint), REFUSED_CERTIFICATE_HINT)


def test_tls_client_meets_a_plaintext_server(
    servers: Servers, plaintext: dict[str, RunningService], pki: Pki
) -> None:
    client = servers.client
    endpoint = plaintext[client.name].endpoint
    result = run(client, *client.command, *endpoint_flags(endpoint), "--tls_ca", str(pki.ca))
    failed_with(result, unreachable(client, endpoint), PLAINTEXT_HINT)


def test_untrusted_server_certificate(servers: Servers, pki: Pki) -> None:
    client = servers.client
    endpoint = servers.tls.endpoint
    result = run(client, *client.command, *endpoint_flags(endpoint), "--tls_ca", str(rogue_ca(pki)))
    failed_with(
        result,
        unreachable(client, endpoint),
        f": its certificate is not signed by the CA bundle [{rogue_ca(pki)}]",
    )


def test_another_services_port(servers: Servers, plaintext: dict[str, RunningService]) -> None:
    client = servers.client
    endpoint = plaintext[OTHER[client.name]].endpoint
    result = run(client, *client.command, *endpoint_flags(endpoint))
    failed_with(
        result,
        f"Error: the server at {endpoint} does not serve the {client.service} (",
        f"): is it another service's port? The quick start serves the {client.service} at "
        f"{client.default_endpoint}",
    )


@pytest.mark.parametrize("servers", ["directory"], indirect=True)
def test_wait_for_ready_says_why_it_waited_in_vain(servers: Servers, pki: Pki) -> None:
    client = servers.client
    # It waits until the timeout, whatever fails; then it says what its last attempt met.
    for server, flags, hint in [
        (servers.tls, [], CA_HINT),
        (servers.mtls, ["--tls_ca", str(pki.ca)], CLIENT_CERTIFICATE_HINT),
    ]:
        result = run(client, "wait_for_ready", "--timeout", "1", *endpoint_flags(server.endpoint), *flags)
        failed_with(result, f"Error: the directory at {server.endpoint} did not answer within 1 s (", hint)
    certificate = [
        "--tls_ca",
        str(pki.ca),
        "--tls_cert",
        str(pki.client.cert),
        "--tls_key",
        str(pki.client.key),
    ]
    result = run(client, "wait_for_ready", *endpoint_flags(servers.mtls.endpoint), *certificate)
    assert (result.returncode, result.stdout) == (0, f"The directory at {servers.mtls.endpoint} is ready\n")


# ---- mistakes in the TLS flags and files (no connection is attempted) ----


@pytest.mark.parametrize("client", list(CLIENTS.values()), ids=list(CLIENTS))
@pytest.mark.parametrize("given", ["--tls_cert", "--tls_key"])
def test_a_certificate_without_its_key_is_a_usage_error(client: Client, given: str, pki: Pki) -> None:
    result = run(client, *client.command, given, str(pki.client.cert))
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        f"cogment-aux client {client.name} {client.command[0]}: error: --tls_cert and --tls_key go "
        "together: a client certificate needs its key"
    )


@pytest.mark.parametrize("client", list(CLIENTS.values()), ids=list(CLIENTS))
def test_tls_files_that_cannot_be_used_are_one_line_naming_them(
    client: Client, pki: Pki, tmp_path: Path
) -> None:
    missing = tmp_path / "missing.pem"
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("not a certificate\n")
    encrypted = encrypted_key(pki.client.key, tmp_path)
    cases = [
        (["--tls_ca", str(missing)], f"Error: cannot read [{missing}]: No such file or directory"),
        (["--tls_ca", str(tmp_path)], f"Error: cannot read [{tmp_path}]: Is a directory"),
        (["--tls_ca", str(pki.ca), "--tls_cert", str(missing), "--tls_key", str(pki.client.key)],
         f"Error: cannot read [{missing}]: No such file or directory"),
        (["--tls_ca", str(not_pem)], f"Error: [{not_pem}] is not a PEM CA bundle"),
        (["--tls_ca", str(pki.ca), "--tls_cert", str(not_pem), "--tls_key", str(pki.client.key)],
         f"Error: [{not_pem}] is not a PEM certificate"),
        (["--tls_ca", str(pki.ca), "--tls_cert", str(pki.client.cert), "--tls_key", str(not_pem)],
         f"Error: [{not_pem}] is not the PEM private key of the certificate [{pki.client.cert}]"),
        (["--tls_ca", str(pki.ca), "--tls_cert", str(pki.client.cert), "--tls_key", str(pki.server.key)],
         f"Error: [{pki.server.key}] is not the PEM private key of the certificate [{pki.client.cert}]"),
        # OpenSSL would ask for its pass phrase on the terminal, and wait.
        (["--tls_ca", str(pki.ca), "--tls_cert", str(pki.client.cert), "--tls_key", str(encrypted)],
         f"Error: [{encrypted}]: {ENCRYPTED_KEY}"),
    ]  # fmt: skip
    for flags, message in cases:
        result = run(client, *client.command, *flags)
        assert (result.returncode, result.stdout, result.stderr) == (1, "", message + "\n"), flags


# ---- the Python APIs ----


@pytest.mark.parametrize("servers", ["model_registry"], indirect=True)
async def test_model_registry_api_over_mtls(servers: Servers, pki: Pki) -> None:
    tls = ClientTls(str(pki.ca), str(pki.client.cert), str(pki.client.key))
    async with ModelRegistryClient(servers.mtls.endpoint, tls=tls) as registry:
        await registry.create_model("tls-model", {"over": "mtls"})
        published = await registry.publish_version("tls-model", b"weights over mTLS")
        info, data = await registry.retrieve_version("tls-model")
        assert (info.version_number, data) == (published.version_number, b"weights over mTLS")
        assert [model.model_id for model in await registry.list_models()] == ["tls-model"]
        await registry.delete_model("tls-model")
    # Without the client certificate, the server refuses the connection: the error says why.
    async with ModelRegistryClient(servers.mtls.endpoint, tls=ClientTls(str(pki.ca))) as registry:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await registry.list_models()
        described = registry.describe_rpc_error(error.value, "list_models")
        assert described.endswith(CLIENT_CERTIFICATE_HINT), described


async def ingest(address: str, tls: ClientTls, trial_id: str, ticks: int) -> None:
    """A whole trial, through DatalogSP as the orchestrator logs it, over TLS."""
    async with grpc.aio.secure_channel(address, tls.credentials()) as channel:
        call = datalog_pb2_grpc.DatalogSPStub(channel).RunTrialDatalog(
            iter(datalog_inputs(trial_params(), full_trial(ticks))),
            metadata=(("trial-id", trial_id), ("user-id", "tls-user")),
        )
        assert len([ack async for ack in call]) == ticks + 1


@pytest.mark.parametrize("servers", ["trial_datastore"], indirect=True)
async def test_datastore_api_over_mtls(servers: Servers, pki: Pki) -> None:
    tls = ClientTls(str(pki.ca), str(pki.client.cert), str(pki.client.key))
    await ingest(servers.mtls.address, tls, "mtls-trial", 3)
    async with DatastoreClient(servers.mtls.endpoint, tls=tls) as datastore:
        listed = await datastore.list_trials()
        assert [info.trial_id for info in listed.trial_infos] == ["mtls-trial"]
        samples = [sample async for sample in datastore.read_samples(["mtls-trial"])]
        assert [sample.tick_id for sample in samples] == [0, 1, 2]
        assert await datastore.delete_trials(["mtls-trial", "never-stored"]) == ["mtls-trial"]
        assert not (await datastore.list_trials()).trial_infos


@pytest.mark.parametrize("servers", ["trial_datastore"], indirect=True)
def test_training_data_from_a_datastore_over_tls(servers: Servers, pki: Pki) -> None:
    tls = ClientTls(str(pki.ca))
    asyncio.run(ingest(servers.tls.address, tls, "tls-trial", 4))
    data = TrainingData.from_datastore(
        servers.tls.endpoint, ["tls-trial"], tls=tls, actor_names=["alice"], decode_observation=bytes.decode
    )
    arrays = data.d4rl()
    # alice sees "obs-<tick>" (tests.helpers.datastore.datalog_sample): 4 steps, 3 transitions.
    assert list(arrays["observations"]) == ["obs-0", "obs-1", "obs-2"]
    assert list(arrays["terminals"]) == [False, False, True]
    # Without the CA, what the command line would say.
    with pytest.raises(ClientError, match=re.escape(CA_HINT)):
        TrainingData.from_datastore(servers.tls.endpoint, ["tls-trial"])
