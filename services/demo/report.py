"""What a demo run did (None: a service skipped) and the commands that show it, printed for a
person or as one JSON object (`--console_output json`)."""

from __future__ import annotations

import urllib.parse
from dataclasses import asdict, dataclass
from typing import Any, TextIO

from services.demo.orchestration import ENVIRONMENT_IMPLEMENTATION
from services.demo.publishing import PolicyVersion
from services.model_registry.client.api import hash_hex
from shared.cli import Values
from shared.endpoints import format_properties


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
