"""`cogment-aux demo [flags]` (or `python -m services.demo`): fill a running suite with demo data.

In order:

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

Then it prints what it did and the commands to look at it (`--console_output json`: one JSON
object). A progress bar shows on standard error for long runs when it is a terminal.

Each service is skipped when its endpoint is empty (`--model_registry_endpoint ""`, or the
variable set to an empty value); by default all three are used, at the quick start's ports.

Exit codes: 0 success; 1 failure (a service that cannot be reached or refuses a call: one line
`Error: ...` naming it); 2 invalid flags or environment variables; 130 interrupted; 141 output
closed before everything was written (`| head`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shlex
import sys
import urllib.parse
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TextIO, TypeVar

# Read by grpc when it is first imported: its core's own log lines (a failed TLS handshake, at
# info level) would come above the one line the demo prints for a failure, saying more.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import grpc

from services.cli import CLIENTS
from services.datastore.client.api import DEFAULT_ENDPOINT as DATASTORE_ENDPOINT
from services.datastore.client.api import DatastoreClient
from services.demo.orchestration import ENVIRONMENT_IMPLEMENTATION, TrialPlan, players_of
from services.demo.publishing import (
    DEFAULT_MODEL_ID,
    DISCOVERY_URL,
    ENVIRONMENT_PROPERTIES,
    PolicyVersion,
    local_policies,
    publish_policies,
    register_environment,
)
from services.demo.recording import DatalogRecorder
from services.demo.world import GRID_SIZE, trial_seed
from services.directory.client.api import DEFAULT_ENDPOINT as DIRECTORY_ENDPOINT
from services.directory.client.api import DirectoryClient
from services.model_registry.client.api import DEFAULT_ENDPOINT as REGISTRY_ENDPOINT
from services.model_registry.client.api import ModelRegistryClient, hash_hex
from shared.api import common_pb2, directory_pb2
from shared.cli import (
    CONSOLE_OUTPUT_OPTION,
    PROGRESS_OPTION,
    TLS_OPTIONS,
    ProgressUnit,
    Values,
    check_tls,
    endpoint_arg,
    make_progress,
    run_to_exit_status,
    timeout_option,
    tls_flags,
    tls_of,
)
from shared.client import ClientError, ServiceClient
from shared.config import Option, build_parser, non_negative_float, non_negative_int, positive_int, resolve
from shared.endpoints import GrpcEndpoint, format_properties

PROG = "python -m services.demo"
DEFAULT_USER_ID = "cogment-aux-demo"
# Where the environment is registered: the port the Cogment tutorials give their environment.
DEFAULT_ENVIRONMENT_ENDPOINT = GrpcEndpoint("localhost", 9001)
DEFAULT_DATASET_DIRECTORY = "demo-dataset"
# Automatic progress bars only for runs of at least this many ticks (a few seconds).
PROGRESS_MIN_TICKS = 5_000
TICKS = ProgressUnit(lambda done, total, rate: f"{done}/{total} ticks {rate:.0f}/s", PROGRESS_MIN_TICKS)
MAX_SEED = 2**63 - 1
# Trial ids listed one by one in the suggested export command, at most (more: a brace expansion).
LISTED_TRIAL_IDS = 10
_SHELL_SAFE = re.compile(r"[A-Za-z0-9_.,:=@%+/-]+")

T = TypeVar("T")


def optional_endpoint_arg(text: str) -> GrpcEndpoint | None:
    """An endpoint URL, or None (the service is skipped) for an empty value."""
    return endpoint_arg(text) if text.strip() else None


def seed_arg(text: str) -> int:
    value = non_negative_int(text)
    if value > MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected a seed from 0 to {MAX_SEED}, got {text!r}")
    return value


DESCRIPTION = """\
Fill a running Cogment suite with demo data: record trials into a trial datastore as the 2.x
orchestrator logs them, publish the versions of a policy to a model registry, and register the
trials' environment in a directory."""
EPILOG = """\
The trials: players on a grid look for a goal, each tick logged as the orchestrator does (the
parameters first, one sample per tick with every player's observation, action, rewards and
messages, late rewards as out-of-sync samples, a final ENDED sample). Their observations and
actions are messages of services.demo.api.spec_pb2. The same --seed plays the same trials.

Nothing is written until every service given has answered. Each service is skipped when its
endpoint is empty (--model_registry_endpoint ''). Running the demo again publishes no new version
(the weights do not change) and updates the environment's directory entry in place.

Exit codes: 0 success, 1 failure (a service that cannot be reached or refuses: one line naming
it), 2 invalid usage, 130 interrupted, 141 output closed before everything was written (e.g. by
`| head`)."""
SKIP = "an empty value skips it"
OPTIONS: list[Option] = [
    Option(
        "trial_datastore_endpoint",
        f"the trial datastore to record the trials into ({SKIP})",
        DATASTORE_ENDPOINT,
        "COGMENT_TRIAL_DATASTORE_ENDPOINT",
        optional_endpoint_arg,
    ),
    Option(
        "model_registry_endpoint",
        f"the model registry to publish the policy's versions to ({SKIP})",
        REGISTRY_ENDPOINT,
        "COGMENT_MODEL_REGISTRY_ENDPOINT",
        optional_endpoint_arg,
    ),
    Option(
        "directory_endpoint",
        f"the directory to register the environment in ({SKIP})",
        DIRECTORY_ENDPOINT,
        "COGMENT_DIRECTORY_ENDPOINT",
        optional_endpoint_arg,
    ),
    Option(
        "directory_authentication_token",
        "the authentication token of the environment's entry in the directory",
        "",
        "COGMENT_DIRECTORY_AUTHENTICATION_TOKEN",
    ),
    Option("trials", "trials to record", 8, parse=positive_int),
    Option(
        "ticks", "ticks of each trial: one sample each, the last one ends the trial", 100, parse=positive_int
    ),
    Option("actors", "players in each trial", 3, parse=positive_int),
    Option("concurrency", "trials recorded at once, each on its own datalog stream", 4, parse=positive_int),
    Option(
        "seed",
        "seed of the trials' random draws: the same seed plays the same trials (default: a random one, "
        "printed)",
        None,
        parse=seed_arg,
    ),
    Option("trial_id_prefix", "trial ids are this prefix, then 0, 1... (default: demo-<run id>-)", ""),
    Option(
        "user_id", "the user the trials are recorded for (the orchestrator's user-id header)", DEFAULT_USER_ID
    ),
    Option(
        "tick_interval",
        "seconds each trial waits after a tick's sample, to pace the load (0: as fast as the datastore "
        "acknowledges)",
        0.0,
        parse=non_negative_float,
    ),
    Option("model_id", "the model the policy's versions are published to", DEFAULT_MODEL_ID),
    Option(
        "environment_endpoint",
        "the endpoint the environment is registered with (the demo serves nothing there: its trials are "
        "played in its own process)",
        DEFAULT_ENVIRONMENT_ENDPOINT,
        parse=endpoint_arg,
    ),
    timeout_option(
        "timeout of each call, and of each sample's acknowledgement, in seconds or as a duration "
        "(30s, 1m30s, 500ms)"
    ),
    CONSOLE_OUTPUT_OPTION,
    PROGRESS_OPTION,
    *TLS_OPTIONS,
]


def _check(values: Values, usage: Any) -> None:
    check_tls(values, usage)
    endpoints = ("trial_datastore_endpoint", "model_registry_endpoint", "directory_endpoint")
    if all(values[name] is None for name in endpoints):
        usage("every service is skipped: give at least one endpoint")


# ---- what a run did ----


@dataclass(frozen=True)
class TrialsReport:
    """The trials recorded: where, for whom, with which seed, and what their datalogs held."""

    endpoint: str
    user_id: str
    seed: int
    trial_ids: list[str]
    properties: dict[str, str]
    ticks_per_trial: int
    actors: int
    samples: int
    ticks: int
    late_rewards: int
    messages: int


@dataclass(frozen=True)
class ModelReport:
    """The model of the policy, and the version of each of its stages."""

    endpoint: str
    model_id: str
    versions: list[PolicyVersion]


@dataclass(frozen=True)
class EnvironmentReport:
    """The environment's entry in the directory."""

    endpoint: str
    service_id: int
    registered_endpoint: str
    properties: dict[str, str]
    discovery_url: str


@dataclass(frozen=True)
class DemoReport:
    """What a run did (None: the service was skipped), and the commands that show it."""

    run_id: str
    trials: TrialsReport | None
    model: ModelReport | None
    environment: EnvironmentReport | None
    next_commands: list[str]


# ---- the run ----


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


# ---- output ----


def print_report(report: DemoReport, values: Values, out: TextIO) -> None:
    trials, model, environment = report.trials, report.model, report.environment
    if trials is not None:
        count = len(trials.trial_ids)
        print(
            f"Recorded {count} {'trial' if count == 1 else 'trials'} of {trials.ticks_per_trial} ticks and "
            f"{trials.actors} {'player' if trials.actors == 1 else 'players'} in the trial datastore at "
            f"{trials.endpoint} (user {trials.user_id}, seed {trials.seed}):",
            file=out,
        )
        print(
            f"  {trials.samples} samples: {trials.ticks} ticks and {trials.late_rewards} late rewards "
            f"(out-of-sync samples); {trials.messages} messages between players",
            file=out,
        )
        shown = trials.trial_ids if count <= 3 else [trials.trial_ids[0], "...", trials.trial_ids[-1]]
        print(f"  trials {' '.join(shown)}, properties {format_properties(trials.properties)}", file=out)
    if model is not None:
        print(f"Model {model.model_id} in the model registry at {model.endpoint}:", file=out)
        for version in model.versions:
            what = "published" if version.published else "already there"
            print(
                f"  version {version.version_number} ({version.stage}) {what}, {version.data_size} bytes, "
                f"SHA-256 {hash_hex(version.data_hash)}",
                file=out,
            )
    if environment is not None:
        print(
            f"Environment {ENVIRONMENT_IMPLEMENTATION} registered in the directory at "
            f"{environment.endpoint}: service id {environment.service_id}, permanent, endpoint "
            f"{environment.registered_endpoint}",
            file=out,
        )
        print(f"  discovered as {environment.discovery_url}", file=out)
    if report.next_commands:
        print("\nNext, try:", file=out)
        for command in report.next_commands:
            print(f"  {command}", file=out)
        if environment is not None and values["directory_authentication_token"]:
            print("  (the inquiry with the same directory authentication token)", file=out)
    if trials is not None:
        # Where `make run` and `cogment-aux services all` serve the web console by default.
        query = urllib.parse.urlencode({"properties": format_properties(trials.properties)})
        print(f"\nIn a browser (the web console): http://127.0.0.1:9010/trials?{query}", file=out)


def report_json(report: DemoReport) -> dict[str, Any]:
    return asdict(report)


# ---- the program ----


def main(
    argv: Sequence[str] | None = None,
    prog: str = PROG,
    environ: Mapping[str, str] | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    output = out or sys.stdout
    errors = err or sys.stderr
    parser = build_parser(OPTIONS, prog=prog, description=DESCRIPTION, epilog=EPILOG)
    values = resolve(parser, OPTIONS, parser.parse_args(sys.argv[1:] if argv is None else argv), environ)
    _check(values, parser.error)

    async def run() -> None:
        report = await run_demo(values, prog, errors)
        if values["console_output"] == "json":
            print(json.dumps(report_json(report)), file=output)
        else:
            print_report(report, values, output)

    return run_to_exit_status(run, output, errors)


if __name__ == "__main__":
    sys.exit(main())
