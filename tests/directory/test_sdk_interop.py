"""Interoperability of our Directory with the OFFICIAL Cogment Python SDK 2.10.1.

The SDK cannot live in the project's environment (Python <3.11, grpcio <1.49,
protobuf <4), so it runs in a separate Python 3.10 venv (``tests/interop/sdk_env.py``)
and drives our directory from ``tests/interop/sdk_directory_script.py``; the script
prints one JSON object describing what the SDK registered, resolved and
deregistered, and the tests below assert on it.  See the script's docstring for
what the SDK sends to a directory.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers.sdk import run_sdk_script
from tests.helpers.services import RunningService, start_service
from tests.interop.sdk_env import PROJECT_ROOT, no_proxy_env

SCRIPT = PROJECT_ROOT / "tests" / "interop" / "sdk_directory_script.py"
SCRIPT_TIMEOUT = 240  # seconds; the script bounds itself at 120 s

ACTOR_IMPL = "interop_actor_impl"
ACTOR_CLASSES = ("interop_class_a", "interop_class_b")
ENV_IMPL = "interop_env_impl"
SDK_PROPS = {"__registration_source": "PythonSDK-Implicit", "__version": "2.10.1"}

# Building the SDK venv in a fresh clone downloads a few wheels: allow more than the default.
pytestmark = pytest.mark.timeout(1200)


# Directory configurations the SDK is run against.  "health_checked" makes the directory
# health-check the SDK-served services (ServiceActorSP/EnvironmentSP/TrialHooksSP/DatalogSP
# Status of the real SDK) and the fake datastore/registry on every inquiry and periodically.
DIRECTORY_CONFIGS = {
    "default": [],
    "health_checked": ["--check_on_inquire", "--health_check_interval", "0.2"],
}


@pytest.fixture(scope="module", params=sorted(DIRECTORY_CONFIGS))
def directory_config(request: pytest.FixtureRequest) -> str:
    config: str = request.param
    return config


@pytest.fixture(scope="module")
def directory_service(
    directory_config: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningService]:
    """OUR directory as a subprocess (``python -m services.directory``) on a fresh SQLite file."""
    work = tmp_path_factory.mktemp(f"sdk-interop-directory-{directory_config}")
    args = ["--database_url", f"sqlite+aiosqlite:///{work / 'd.db'}", *DIRECTORY_CONFIGS[directory_config]]
    with start_service("services.directory", args, env=no_proxy_env(), log_dir=work) as service:
        yield service


@pytest.fixture(scope="module")
def sdk_report(
    sdk_python: pathlib.Path, directory_service: RunningService, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Run the SDK script once against our directory and return its JSON report."""
    workdir = tmp_path_factory.mktemp("sdk-interop-run")
    args = [directory_service.endpoint, "all"]
    report = run_sdk_script(sdk_python, SCRIPT, args, workdir, SCRIPT_TIMEOUT)
    report["_directory_log"] = str(directory_service.log_path)
    return report


def _grpc(port: int) -> str:
    return f"grpc://127.0.0.1:{port}"


def _explain(report: dict[str, Any], what: Any) -> str:
    return (
        f"{what}\nscript errors: {report.get('errors')}\nscript stderr tail:\n{report['_stderr_tail']}"
        f"\ndirectory log: {report['_directory_log']}"
    )


def test_sdk_script_ran_cleanly(sdk_report: dict[str, Any]) -> None:
    assert sdk_report["sdk_version"] == "2.10.1"
    assert sdk_report["errors"] == [], _explain(sdk_report, "the SDK script reported errors")
    assert sdk_report["_returncode"] == 0, _explain(sdk_report, "non-zero exit")


def test_sdk_self_registration_visible_via_inquiry(sdk_report: dict[str, Any]) -> None:
    registered = sdk_report["sdk_registered"]
    port = sdk_report["served_port"]
    assert isinstance(port, int) and port > 0

    expected_types = {
        "actor": "ACTOR_SERVICE",
        "environment": "ENVIRONMENT_SERVICE",
        "prehook": "PRE_HOOK_SERVICE",
        "datalog": "DATALOG_SERVICE",
    }
    all_ids: list[int] = []
    for kind, type_name in expected_types.items():
        info = registered[kind]
        assert info["code"] == "OK", _explain(sdk_report, f"raw inquire for {kind}: {info}")
        entries = info["entries"]
        assert len(entries) == (2 if kind == "actor" else 1), _explain(sdk_report, f"{kind}: {entries}")
        for entry in entries:
            assert entry["type"] == type_name
            assert entry["protocol"] == "GRPC"
            assert entry["host"] == "127.0.0.1"
            assert entry["port"] == port
            assert entry["permanent"] is False
            assert entry["service_id"] > 0
            props = entry["properties"]
            for key, value in {**SDK_PROPS, "team": "blue"}.items():
                assert props.get(key) == value, (kind, props)
            all_ids.append(entry["service_id"])

    assert len(set(all_ids)) == len(all_ids) == 5, all_ids
    assert registered["environment"]["entries"][0]["properties"]["__implementation"] == ENV_IMPL
    actors = registered["actor"]["entries"]
    assert {a["properties"]["__implementation"] for a in actors} == {ACTOR_IMPL}
    # The SDK registers class a, then class b: the most recently registered comes first.
    assert [a["properties"]["__actor_class"] for a in actors] == [ACTOR_CLASSES[1], ACTOR_CLASSES[0]]


@pytest.mark.parametrize(
    "key",
    [
        "actor_a",
        "actor_b",
        "actor_a_class_only",
        "actor_impl_only",
        "actor_user_prop",
        "actor_sdk_props",
        "environment",
        "prehook",
        "datalog",
    ],
)
def test_discovery_resolves_to_sdk_served_endpoint(sdk_report: dict[str, Any], key: str) -> None:
    result = sdk_report["discovery"][key]
    assert result["error"] is None, _explain(sdk_report, result)
    assert result["resolved"] == _grpc(sdk_report["served_port"]), _explain(sdk_report, result)


def test_service_id_discovery(sdk_report: dict[str, Any]) -> None:
    by_id = sdk_report["id_discovery"]
    registered_ids = {
        str(e["service_id"]) for info in sdk_report["sdk_registered"].values() for e in info["entries"]
    }
    assert set(by_id) == registered_ids and len(registered_ids) == 5
    for result in by_id.values():
        assert result["error"] is None, result
        assert result["resolved"] == _grpc(sdk_report["served_port"]), result

    aux = sdk_report["aux"]
    assert aux["discovery"]["ds1_by_id"]["resolved"] == _grpc(aux["aux1_port"])
    assert aux["discovery"]["ds2_by_id"]["resolved"] == _grpc(aux["aux2_port"])
    assert aux["discovery"]["mr1_by_id"]["resolved"] == _grpc(aux["aux1_port"])


@pytest.mark.parametrize(
    "key",
    [
        "nomatch_actor_class",
        "nomatch_wrong_value",
        "nomatch_wrong_type",
        "nomatch_empty_value",
        "nomatch_modelregistry",
        "nomatch_unknown_id",
        "nomatch_id_zero",
    ],
)
def test_no_match_returns_nothing_without_error(sdk_report: dict[str, Any], key: str) -> None:
    # The SDK returns the unresolved cogment:// endpoint when the inquiry stream is
    # empty; a gRPC error status would surface here as an AioRpcError.
    result = sdk_report["discovery"][key]
    assert result["error"] is None, _explain(sdk_report, result)
    assert result["resolved"] == result["url"], _explain(sdk_report, result)


def test_no_match_is_empty_ok_stream(sdk_report: dict[str, Any]) -> None:
    assert sdk_report["raw_nomatch"] == {"code": "OK", "entries": []}
    assert sdk_report["raw_nomatch_id"] == {"code": "OK", "entries": []}


def test_most_recent_registration_wins_and_sdk_clients_reach_it(sdk_report: dict[str, Any]) -> None:
    aux = sdk_report["aux"]
    aux1, aux2 = _grpc(aux["aux1_port"]), _grpc(aux["aux2_port"])
    discovery = aux["discovery"]
    assert discovery["ds_latest"]["resolved"] == aux2, discovery["ds_latest"]
    assert discovery["ds_any"]["resolved"] == aux2, discovery["ds_any"]
    assert discovery["ds_first"]["resolved"] == aux1
    assert discovery["ds_second"]["resolved"] == aux2
    assert discovery["mr"]["resolved"] == aux1
    assert discovery["ds_wrong_type"]["resolved"] == discovery["ds_wrong_type"]["url"]
    assert all(length > 0 for length in aux["secret_lengths"].values()), aux["secret_lengths"]

    public = aux["public_clients"]
    assert public["datastore_latest"] == {"hit": ["aux2"], "error": None}
    assert public["datastore_first"] == {"hit": ["aux1"], "error": None}
    assert public["model_registry"] == {"hit": ["aux1"], "error": None}


def test_deregistration_through_sdk_directory_object(sdk_report: dict[str, Any]) -> None:
    aux = sdk_report["aux"]
    # A wrong secret must not remove the entry.
    assert aux["after_bad_secret_deregister"]["resolved"] == _grpc(aux["aux1_port"])
    for key, result in aux["after_deregister"].items():
        assert result["error"] is None, (key, result)
        assert result["resolved"] == result["url"], (key, result)


def test_authentication_token_through_context_metadata(sdk_report: dict[str, Any]) -> None:
    tok = sdk_report["token"]
    aux1 = _grpc(sdk_report["aux"]["aux1_port"])
    assert tok["with_token"]["resolved"] == aux1
    assert tok["with_token_by_id"]["resolved"] == aux1
    # A discovery URL carrying `__authentication-token` resolves without the metadata too.
    assert tok["token_in_query"]["resolved"] == aux1
    # Entries registered with a token are invisible without it (and with another one).
    assert tok["without_token"]["resolved"] == tok["without_token"]["url"]
    assert tok["without_token_by_id"]["resolved"] == tok["without_token_by_id"]["url"]
    assert tok["raw_wrong_token"] == {"code": "OK", "entries": []}
    # Deregistration needs the token too.
    assert tok["after_deregister_without_token"]["resolved"] == aux1
    after = tok["after_deregister_with_token"]
    assert after["resolved"] == after["url"]


def test_sdk_deregisters_on_shutdown(sdk_report: dict[str, Any]) -> None:
    dereg = sdk_report["sdk_deregistration"]
    assert dereg["serve_task_finished"] is True
    assert len(dereg["ids"]) == 5
    assert dereg["remaining_ids"] == [], _explain(sdk_report, dereg)
    for result in dereg["discovery_after"].values():
        assert result["error"] is None
        assert result["resolved"] == result["url"], result


def test_health_checks_reach_live_services(sdk_report: dict[str, Any]) -> None:
    """The directory's checks (Status: the first one right after registration, then periodic or
    at inquiry) reached the fake datastore/registry, which still resolved. With check_on_inquire
    the SDK-served entries resolving in the other tests proves the same for the real SDK's
    ServiceActorSP/EnvironmentSP/TrialHooksSP/DatalogSP Status."""
    health_calls = sdk_report["aux"]["health_calls"]
    assert any(c.endswith("/Status") for c in health_calls["aux1"]), health_calls
    assert any(c.endswith("/Status") for c in health_calls["aux2"]), health_calls


def test_unreachable_entry_is_not_handed_out(sdk_report: dict[str, Any], directory_config: str) -> None:
    dead = sdk_report["aux"]["dead"]
    # Whatever the configuration, the failed health check hides it quickly.
    assert dead["hidden_after_s"] is not None, _explain(sdk_report, dead)
    if directory_config == "health_checked":
        # Checked before answering: never handed out at all.
        assert dead["by_props"]["resolved"] == dead["by_props"]["url"], dead
        assert dead["by_id"]["resolved"] == dead["by_id"]["url"], dead
