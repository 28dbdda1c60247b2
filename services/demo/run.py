"""A demo run, in order:

1. Checks that each service it is given answers, before writing anything: the trial datastore
   (and that none of the run's trial ids is stored already), the model registry, the directory.
2. Model registry: creates the model `--model_id` and publishes the three stages of its policy
   (`untrained`, `halfway`, `greedy`) as archived versions, those the model does not hold yet
   (`services.demo.publishing`).
3. Directory: registers the environment as a permanent ENVIRONMENT_SERVICE entry, updated in place
   when the demo runs again.
4. Trial datastore: records `--trials` trials of `--ticks` ticks and `--actors` players each,
   `--concurrency` at once, exactly as the Cogment 2.x orchestrator logs trials through `DatalogSP`
   (`services.demo.orchestration`): the parameters first, one sample per tick with every
   player's observation, action, rewards and messages, late rewards as out-of-sync samples, and
   the final ENDED sample. The trials are `<prefix>0`, `<prefix>1`..., with the properties
   `demo=cogment-aux` and `run=<run id>`; the environment and its players are
   `services.demo.world`, deterministic given `--seed`.

Then the commands that show what it recorded, published and registered, through the services as
the run reached them (their endpoints and TLS flags).
"""

from __future__ import annotations

import contextlib
import re
import secrets
import shlex
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import TextIO, TypeVar

import grpc

from services.cli import CLIENTS
from services.datastore.client.api import DatastoreClient
from services.demo.orchestration import ENVIRONMENT_IMPLEMENTATION, TrialPlan, players_of
from services.demo.publishing import (
    DISCOVERY_URL,
    ENVIRONMENT_PROPERTIES,
    local_policies,
    publish_policies,
    register_environment,
)
from services.demo.recording import DatalogRecorder
from services.demo.report import DemoReport, EnvironmentReport, ModelReport, TrialsReport
from services.demo.world import GRID_SIZE, trial_seed
from services.directory.client.api import DirectoryClient
from services.model_registry.client.api import ModelRegistryClient
from shared.api import common_pb2, directory_pb2
from shared.cli import ProgressUnit, Values, make_progress, tls_flags, tls_of
from shared.client import ClientError, ServiceClient
from shared.endpoints import GrpcEndpoint, format_properties

DEFAULT_DATASET_DIRECTORY = "demo-dataset"
# Automatic progress bars only for runs of at least this many ticks (a few seconds).
PROGRESS_MIN_TICKS = 5_000
TICKS = ProgressUnit(lambda done, total, rate: f"{done}/{total} ticks {rate:.0f}/s", PROGRESS_MIN_TICKS)
MAX_SEED = 2**63 - 1
# Trial ids listed one by one in the suggested export command, at most (more: a brace expansion).
LISTED_TRIAL_IDS = 10
_SHELL_SAFE = re.compile(r"[A-Za-z0-9_.,:=@%+/-]+")

T = TypeVar("T")


async def _calling(client: ServiceClient, what: str, step: Awaitable[T]) -> T:
    """`step`, its gRPC error said as the client says it (`cannot reach the ... at ...`)."""
    try:
        return await step
    except grpc.aio.AioRpcError as error:
        raise ClientError(client.describe_rpc_error(error, what)) from None


@dataclass(frozen=True)
class Clients:
    """The connections of a run, None for a skipped service."""

    datastore: DatastoreClient | None
    registry: ModelRegistryClient | None
    directory: DirectoryClient | None


def _open_clients(values: Values, stack: contextlib.AsyncExitStack) -> Clients:
    """A connection to each service not skipped, closed with `stack`."""
    timeout_s: float = values["timeout"]
    tls = tls_of(values)
    datastore = registry = directory = None
    if values["trial_datastore_endpoint"] is not None:
        datastore = DatastoreClient(values["trial_datastore_endpoint"], timeout_s, tls)
        stack.push_async_callback(datastore.close)
    if values["model_registry_endpoint"] is not None:
        registry = ModelRegistryClient(values["model_registry_endpoint"], timeout_s, tls)
        stack.push_async_callback(registry.close)
    if values["directory_endpoint"] is not None:
        token: str = values["directory_authentication_token"]
        directory = DirectoryClient(values["directory_endpoint"], token, timeout_s, tls)
        stack.push_async_callback(directory.close)
    return Clients(datastore, registry, directory)


async def _check_services(
    clients: Clients, recorder: DatalogRecorder | None, trial_ids: Sequence[str]
) -> None:
    """Each service answers (and none of the trial ids is stored), or a ClientError naming it."""
    if clients.datastore is not None and recorder is not None:
        await _calling(clients.datastore, "checking the trial ids", recorder.check_new(trial_ids))
    if clients.registry is not None:
        request = common_pb2.VersionRequest()
        version = clients.registry.stub.Version(request, timeout=clients.registry.timeout_s)
        await _calling(clients.registry, "checking the model registry", version)
    if clients.directory is not None:
        # Service id 0 never exists: the directory answers at once, with nothing.
        inquiry = clients.directory.inquire(directory_pb2.InquireRequest(service_id=0))
        await _calling(clients.directory, "checking the directory", inquiry)


async def _publish(registry: ModelRegistryClient, model_id: str) -> ModelReport:
    versions = await _calling(registry, f"publishing [{model_id}]", publish_policies(registry, model_id))
    return ModelReport(str(registry.endpoint), model_id, versions)


async def _register(directory: DirectoryClient, registered: GrpcEndpoint) -> EnvironmentReport:
    step = register_environment(directory, registered)
    service_id = await _calling(directory, "registering the environment", step)
    properties = dict(ENVIRONMENT_PROPERTIES)
    return EnvironmentReport(str(directory.endpoint), service_id, str(registered), properties, DISCOVERY_URL)


async def _record(
    recorder: DatalogRecorder,
    values: Values,
    trial_ids: Sequence[str],
    seed: int,
    properties: Mapping[str, str],
    model: ModelReport | None,
    err: TextIO,
) -> TrialsReport:
    """Record the trials, their players playing the versions of `model` (if published)."""
    published = {version.stage: version.version_number for version in model.versions} if model else {}
    policies = local_policies(values["model_id"], published)
    endpoint = str(recorder.datastore.endpoint)
    plans = (
        TrialPlan(
            trial_id=trial_id,
            seed=trial_seed(seed, index),
            ticks=values["ticks"],
            players=players_of(index, values["actors"], policies),
            properties=properties,
            datalog_endpoint=endpoint,
            grid_size=GRID_SIZE,
        )
        for index, trial_id in enumerate(trial_ids)
    )
    label = f"Recording {len(trial_ids)} trials"
    progress = make_progress(label, len(trial_ids) * values["ticks"], TICKS, values, err)
    completed = False
    try:
        recorded = await recorder.record_all(plans, values["concurrency"], progress.advance)
        completed = True
    finally:
        progress.close(completed)
    return TrialsReport(
        endpoint=endpoint,
        user_id=recorder.user_id,
        seed=seed,
        trial_ids=[trial.trial_id for trial in recorded],
        properties=dict(properties),
        ticks_per_trial=values["ticks"],
        actors=values["actors"],
        samples=sum(trial.samples for trial in recorded),
        ticks=sum(trial.ticks for trial in recorded),
        late_rewards=sum(trial.late_rewards for trial in recorded),
        messages=sum(trial.messages for trial in recorded),
    )


async def run_demo(values: Values, prog: str, err: TextIO) -> DemoReport:
    """Do what the flags ask (the module's documentation); what was done. Nothing is written
    until every service given has answered."""
    seed: int = values["seed"] if values["seed"] is not None else secrets.randbelow(MAX_SEED + 1)
    run_id = secrets.token_hex(3)
    prefix: str = values["trial_id_prefix"] or f"demo-{run_id}-"
    trial_ids = [f"{prefix}{index}" for index in range(values["trials"])]
    properties = {"demo": "cogment-aux", "run": run_id}
    async with contextlib.AsyncExitStack() as stack:
        clients = _open_clients(values, stack)
        recorder = None
        if clients.datastore is not None:
            recorder = DatalogRecorder(clients.datastore, values["user_id"], values["tick_interval"])
        await _check_services(clients, recorder, trial_ids)
        model = None if clients.registry is None else await _publish(clients.registry, values["model_id"])
        environment = None
        if clients.directory is not None:
            environment = await _register(clients.directory, values["environment_endpoint"])
        trials = None
        if recorder is not None:
            trials = await _record(recorder, values, trial_ids, seed, properties, model, err)
        commands = next_commands(values, prog, clients, trials, model, environment)
    return DemoReport(run_id, trials, model, environment, commands)


# ---- what to try next ----


def _client_command(prog: str, service: str) -> str:
    """How to run a service's client (`service` as `cogment-aux client` names it), as the demo was
    run (`cogment-aux` or `python -m`)."""
    if prog.startswith("python -m"):
        return f"python -m {CLIENTS[service].module.removesuffix('.__main__')}"
    return f"{prog.split()[0]} client {service}"


def _quoted(word: str) -> str:
    return word if _SHELL_SAFE.fullmatch(word) else shlex.quote(word)


def _connection_flags(client: ServiceClient, endpoint_flag: str) -> list[str]:
    """The flags a command-line client needs to reach the service `client` reached: its endpoint
    (`endpoint_flag`) when not the default, and its TLS flags."""
    endpoint = [] if client.endpoint == client.default_endpoint else [endpoint_flag, client.endpoint.url]
    return [*endpoint, *tls_flags(client)]


def next_commands(
    values: Values,
    prog: str,
    clients: Clients,
    trials: TrialsReport | None,
    model: ModelReport | None,
    environment: EnvironmentReport | None,
) -> list[str]:
    """Commands that show what the run recorded, published and registered, through `clients`."""
    commands = []
    if trials is not None and clients.datastore is not None:
        client = _client_command(prog, "trial_datastore")
        flags = _connection_flags(clients.datastore, "--endpoint")
        listing = [
            "list_trials",
            "--properties",
            format_properties(trials.properties),
            "--count",
            str(len(trials.trial_ids)),
        ]
        commands.append(" ".join([client, *map(_quoted, [*listing, *flags])]))
        ids = trials.trial_ids
        prefix = values["trial_id_prefix"] or ids[0].rsplit("-", 1)[0] + "-"
        note = ""
        if len(ids) > LISTED_TRIAL_IDS and _SHELL_SAFE.fullmatch(prefix) and "," not in prefix:
            selection = f"{prefix}{{0..{len(ids) - 1}}}"
            note = "  # bash and zsh expand {a..b} into every trial id"
        else:
            selection = " ".join(map(_quoted, ids))
        export = ["--format", "parquet", "--file", DEFAULT_DATASET_DIRECTORY, *flags]
        commands.append(f"{client} export {selection} {' '.join(map(_quoted, export))}{note}")
    if model is not None and clients.registry is not None:
        client = _client_command(prog, "model_registry")
        flags = _connection_flags(clients.registry, "--endpoint")
        commands.append(" ".join([client, *map(_quoted, ["list_versions", model.model_id, *flags])]))
    if environment is not None and clients.directory is not None:
        client = _client_command(prog, "directory")
        flags = _connection_flags(clients.directory, "--directory_endpoint")
        inquiry = [
            "inquire",
            "--type",
            "environment",
            "--properties",
            f"__implementation={ENVIRONMENT_IMPLEMENTATION}",
        ]
        commands.append(" ".join([client, *map(_quoted, [*inquiry, *flags])]))
    return commands
