"""`cogment-aux demo [flags]` (or `python -m services.demo`): fill a running suite with demo data
(`services.demo.run` says what a run does, in order).

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
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

# Read by grpc when it is first imported: its core's own log lines (a failed TLS handshake, at
# info level) would come above the one line the demo prints for a failure, saying more.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from services.datastore.client.api import DEFAULT_ENDPOINT as DATASTORE_ENDPOINT
from services.demo.publishing import DEFAULT_MODEL_ID
from services.demo.report import print_report, report_json
from services.demo.run import MAX_SEED, run_demo
from services.directory.client.api import DEFAULT_ENDPOINT as DIRECTORY_ENDPOINT
from services.model_registry.client.api import DEFAULT_ENDPOINT as REGISTRY_ENDPOINT
from shared.cli import (
    CONSOLE_OUTPUT_OPTION,
    PROGRESS_OPTION,
    TLS_OPTIONS,
    Values,
    check_tls,
    endpoint_arg,
    run_to_exit_status,
    timeout_option,
)
from shared.config import Option, build_parser, non_negative_float, non_negative_int, positive_int, resolve
from shared.endpoints import GrpcEndpoint

PROG = "python -m services.demo"
DEFAULT_USER_ID = "cogment-aux-demo"
# Where the environment is registered: the port the Cogment tutorials give their environment.
DEFAULT_ENVIRONMENT_ENDPOINT = GrpcEndpoint("localhost", 9001)


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
