"""Interoperability of our Model Registry with the OFFICIAL Cogment Python SDK 2.10.1.

The SDK runs in its own Python 3.10 venv (``tests/interop/sdk_env.py``) and drives our registry
(``python -m services.model_registry`` on a fresh SQLite file and blob directory) from
``tests/interop/sdk_model_registry_script.py``, which prints one JSON report per scenario; the
tests below assert on it.  See the script's docstring for what the SDK sends to a registry.
"""

from __future__ import annotations

import itertools
import pathlib
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers.digest import sha256_b64
from tests.helpers.sdk import run_sdk_script
from tests.helpers.services import RunningService, start_service
from tests.interop.sdk_env import PROJECT_ROOT, no_proxy_env

SCRIPT = PROJECT_ROOT / "tests" / "interop" / "sdk_model_registry_script.py"
SCRIPT_TIMEOUT = 150  # seconds; the script bounds itself at 90 s

# Building the SDK venv in a fresh clone downloads a few wheels: allow more than the default.
pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def registry_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    """OUR model registry as a subprocess on a fresh SQLite file and blob directory."""
    tmp = tmp_path_factory.mktemp("sdk-interop-model-registry")
    args = ["--database_url", f"sqlite+aiosqlite:///{tmp}/r.db", "--archive_dir", str(tmp / "blobs")]
    with start_service("services.model_registry", args, env=no_proxy_env(), log_dir=tmp) as service:
        yield service


def _run_script(
    sdk_python: pathlib.Path, service: RunningService, scenario: str, workdir: pathlib.Path
) -> dict[str, Any]:
    started = time.monotonic()
    report = run_sdk_script(sdk_python, SCRIPT, [service.endpoint, scenario], workdir, SCRIPT_TIMEOUT)
    report["_registry_log"] = str(service.log_path)
    report["_elapsed_s"] = time.monotonic() - started
    return report


@pytest.fixture(scope="module")
def sdk_report(
    sdk_python: pathlib.Path, registry_service: RunningService, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Run the SDK script's main scenario once against our registry."""
    return _run_script(sdk_python, registry_service, "main", tmp_path_factory.mktemp("sdk-interop-run"))


def _explain(report: dict[str, Any], what: Any) -> str:
    return (
        f"{what}\nscript errors: {report.get('errors')}\nscript stderr tail:\n{report['_stderr_tail']}"
        f"\nregistry log: {report['_registry_log']}"
    )


def _assert_info(info: dict[str, Any], *, model: str, iteration: int, size: int, data_hash: str) -> None:
    assert info["model_name"] == model
    assert info["iteration"] == iteration
    assert info["size"] == size
    assert info["hash"] == data_hash
    assert len(info["hash"]) == 44


def test_sdk_script_ran_cleanly(sdk_report: dict[str, Any]) -> None:
    assert sdk_report["sdk_version"] == "2.10.1"
    assert sdk_report["errors"] == [], _explain(sdk_report, "the SDK script reported errors")
    assert sdk_report["_returncode"] == 0, _explain(sdk_report, "non-zero exit")


def test_publish_and_store_versions(sdk_report: dict[str, Any]) -> None:
    pub = sdk_report["published"]
    model = pub["model"]
    start_ns = sdk_report["start_ns"]
    for key, number, archived, props in (
        ("v1", 1, False, {"epoch": "1"}),
        ("v2", 2, True, {"epoch": "2", "é": "ü"}),
        ("v3", 3, False, {}),
    ):
        info = pub[key]
        expected = pub["expected"][key]
        _assert_info(info, model=model, iteration=number, size=expected["size"], data_hash=expected["hash"])
        assert info["stored"] is archived, info
        assert info["properties"] == props, info
        # nanoseconds since the epoch, set by the registry (the SDK sends no timestamp)
        assert start_ns - 60 * 10**9 < info["timestamp"] < start_ns + 120 * 10**9, info
    assert pub["v1"]["timestamp"] <= pub["v2"]["timestamp"] <= pub["v3"]["timestamp"]
    # The SDK creates the model (no user data) on first publish, then update_model_info sets it;
    # later publishes must not touch it.
    assert pub["model_info"] == {"name": model, "properties": {}}
    assert pub["model_info_updated"] == {"owner": "interop", "kind": "policy"}
    assert pub["model_info_after_v4"] == {"owner": "interop", "kind": "policy"}
    assert pub["v4"]["iteration"] == 4


@pytest.mark.parametrize("number", [1, 2, 3, 4, -1, -2, -4])
def test_version_info_and_data_by_number(sdk_report: dict[str, Any], number: int) -> None:
    lookups = sdk_report["lookups"]
    pub = sdk_report["published"]
    expected_number = number if number > 0 else 4 + number + 1
    info = lookups[f"info_{number}"]
    assert info["error"] is None, _explain(sdk_report, info)
    assert info["info"] == pub[f"v{expected_number}"], info
    data = lookups[f"data_{number}"]
    assert data["error"] is None, _explain(sdk_report, data)
    assert data["matches"] is True, data
    assert data["hash"] == pub[f"v{expected_number}"]["hash"]
    assert data["size"] == pub[f"v{expected_number}"]["size"]
    assert lookups["data_default_is_latest"] is True


@pytest.mark.parametrize("number", [0, 5, 99, -5, -99])
def test_missing_version_of_known_model(sdk_report: dict[str, Any], number: int) -> None:
    # The SDK maps any error to "model exists, version does not" -> None (after RetrieveModels).
    lookups = sdk_report["lookups"]
    assert lookups[f"missing_info_{number}"] == {"info": None, "error": None}
    assert lookups[f"missing_data_{number}"] == {"is_none": True, "error": None}


def test_zero_byte_version(sdk_report: dict[str, Any]) -> None:
    zero = sdk_report["zero"]
    # The SDK itself refuses to publish 0 bytes, before sending anything.
    assert zero["public_publish"]["error"] == {"type": "CogmentError", "message": "Model is empty"}
    # Uploaded as the SDK's wire format would carry it (a header alone), it reads back through the
    # public API as b"" with the SHA-256 of nothing, sent as one empty chunk.
    assert zero["raw_upload"]["error"] is None, zero
    assert zero["raw_upload"]["value"] == {"iteration": 1, "hash": sha256_b64(b"")}
    assert zero["expected_hash"] == sha256_b64(b"")
    info = zero["info"]
    _assert_info(info, model=info["model_name"], iteration=1, size=0, data_hash=sha256_b64(b""))
    assert info["stored"] is True and info["properties"] == {"why": "zero"}
    assert zero["data"] == {"error": None, "value_repr": "b''"}
    assert zero["raw_chunks"] == {"code": "OK", "chunks": [0]}


def test_list_models_pages_by_ten(sdk_report: dict[str, Any]) -> None:
    listed = sdk_report["list_models"]
    prefix = sdk_report["prefix"]
    expected = sorted([f"{prefix}-basic", f"{prefix}-empty", *(f"{prefix}-page-{i:02d}" for i in range(12))])
    assert sorted(listed["names"]) == expected
    assert listed["duplicates"] == 0
    for i in range(12):
        assert listed["properties"][f"{prefix}-page-{i:02d}"] == {"i": str(i)}
    assert listed["properties"][f"{prefix}-empty"] == {"size": "0"}
    calls = listed["calls"]
    assert len(calls) >= 2, calls
    assert all(c["count"] == 10 and c["ids"] == [] and "error" not in c for c in calls), calls
    assert [c["replied"] for c in calls[:-1]] == [10] * (len(calls) - 1), calls
    assert calls[-1]["replied"] < 10
    assert sum(c["replied"] for c in calls) == listed["total"]
    # each request carries the previous reply's handle
    assert calls[0]["handle"] == ""
    for previous, current in itertools.pairwise(calls):
        assert current["handle"] == previous["next"], calls


@pytest.mark.parametrize("count", [12, 20])
def test_list_iterations_pages_by_ten(sdk_report: dict[str, Any], count: int) -> None:
    versions = sdk_report["versions"][str(count)]
    assert versions["created"] == list(range(1, count + 1))
    listed = versions["listed"]
    assert [v["iteration"] for v in listed] == list(range(1, count + 1))
    assert [v["hash"] for v in listed] == versions["expected_hashes"]
    assert [v["size"] for v in listed] == [100 + i for i in range(count)]
    assert [v["stored"] for v in listed] == [i % 3 == 0 for i in range(count)]
    assert [v["properties"] for v in listed] == [{"i": str(i)} for i in range(count)]
    calls = versions["calls"]
    # 12 -> pages of 10 and 2; 20 -> 10, 10 and an empty third page (the SDK stops on a short page)
    expected_pages = [10, 2] if count == 12 else [10, 10, 0]
    assert [c["replied"] for c in calls] == expected_pages, calls
    assert all(c["count"] == 10 and c["numbers"] == [] and "error" not in c for c in calls), calls
    assert calls[0]["handle"] == ""
    for previous, current in itertools.pairwise(calls):
        assert current["handle"] == previous["next"], calls


def test_model_without_versions(sdk_report: dict[str, Any]) -> None:
    versions = sdk_report["versions"]
    assert versions["no_versions"] == {"error": None, "listed": []}
    assert versions["no_versions_latest"] == {"info": None, "error": None}


def test_version_update_stream(sdk_report: dict[str, Any]) -> None:
    tracking = sdk_report["tracking"]
    first = tracking["updates_first"]
    assert first["kind"] == "info", _explain(sdk_report, first)
    assert first["value"]["iteration"] == 2  # the latest at once, not the whole history
    assert tracking["updates_nothing_more"] == {"kind": "timeout"}
    after_publish = tracking["updates_after_publish"]
    assert after_publish["kind"] == "info", after_publish
    assert after_publish["value"]["iteration"] == 3
    assert after_publish["value"]["stored"] is False
    assert after_publish["value"]["properties"] == {"n": "3"}
    after_store = tracking["updates_after_store"]
    assert after_store["kind"] == "info", after_store
    assert after_store["value"]["iteration"] == 4
    assert after_store["value"]["stored"] is True


def test_track_latest_model(sdk_report: dict[str, Any]) -> None:
    tracking = sdk_report["tracking"]
    assert tracking["track_initial"]["matches"] is True
    assert tracking["track_initial"]["info"]["iteration"] == 4
    newer = tracking["track_newer"]
    assert newer["published"] == 5
    assert newer["info"]["iteration"] == 5 and newer["matches"] is True
    # A model without versions becomes available with its first version (deserialized).
    assert tracking["later_available_before_publish"] is False
    later = tracking["later"]
    assert "error" not in later, _explain(sdk_report, later)
    assert later["model"] == {"len": 33}
    assert later["info"]["iteration"] == 1 and later["info"]["size"] == 33


def test_known_sdk_bug_is_deserialized(sdk_report: dict[str, Any]) -> None:
    """SDK 2.10.1's LatestModel.is_deserialized() reads a misspelt attribute: it always raises.
    Documented here so a fixed SDK shows up."""
    error = sdk_report["tracking"]["is_deserialized"]["error"]
    assert error is not None and error["type"] == "AttributeError"


@pytest.mark.parametrize(
    "key",
    [
        "get_iteration_info",
        "get_iteration_info_latest",
        "retrieve_model",
        "list_iterations",
        "track_latest_model",
    ],
)
def test_unknown_model_raises_cogment_error(sdk_report: dict[str, Any], key: str) -> None:
    result = sdk_report["unknown"][key]
    assert result["value"] is None, _explain(sdk_report, result)
    assert result["error"] is not None and result["error"]["type"] == "CogmentError", result


def test_unknown_model_grpc_errors(sdk_report: dict[str, Any]) -> None:
    unknown = sdk_report["unknown"]
    assert unknown["get_model_info"] == {"value": None, "error": None}  # the SDK swallows errors here
    assert unknown["remove_model"]["error"]["code"] == "NOT_FOUND"
    # VersionUpdate on an unknown model: INVALID_ARGUMENT (anything but UNAVAILABLE is raised)
    assert unknown["iteration_updates"]["error"]["code"] == "INVALID_ARGUMENT", unknown["iteration_updates"]
    for name, result in unknown["raw"].items():
        assert result["code"] == "NOT_FOUND", (name, result)


def test_delete_model(sdk_report: dict[str, Any]) -> None:
    deletion = sdk_report["deletion"]
    assert deletion["stream_first"]["kind"] == "info"
    assert deletion["remove"] == {"value": None, "error": None}
    # An open VersionUpdate stream on the deleted model ends (it does not hang).
    assert deletion["stream_after_delete"]["kind"] in ("end", "error"), deletion["stream_after_delete"]
    assert deletion["get_model_info"] == "None"
    for key in ("retrieve_model", "get_iteration_info", "list_iterations"):
        assert deletion[key] is not None and deletion[key]["type"] == "CogmentError", (key, deletion[key])
    assert deletion["remove_again"]["code"] == "NOT_FOUND"
    assert deletion["still_listed"] is False
    assert deletion["others_listed"] is True
    assert deletion["recreated"]["iteration"] == 1 and deletion["recreated"]["size"] == 5


@pytest.mark.timeout(60)
def test_large_version_roundtrip(
    sdk_python: pathlib.Path, registry_service: RunningService, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A 50 MiB version, sent by the SDK in 2 MiB chunks and read back under the default 4 MiB
    receive limit; bounded at 60 s (a few seconds on loopback)."""
    report = _run_script(sdk_python, registry_service, "large", tmp_path_factory.mktemp("sdk-interop-large"))
    assert report["errors"] == [], _explain(report, "the SDK script reported errors")
    large = report["large"]
    info = large["info"]
    _assert_info(
        info,
        model=info["model_name"],
        iteration=1,
        size=large["expected_size"],
        data_hash=large["expected_hash"],
    )
    assert info["stored"] is True and info["properties"] == {"size": "50MiB"}
    assert large["downloaded_size"] == large["expected_size"]
    assert large["downloaded_matches"] is True
    assert large["downloaded_hash"] == large["expected_hash"]
    assert large["raw_code"] == "OK"
    assert large["raw_max_chunk"] < 4 * 1024 * 1024
    assert large["raw_chunk_count"] >= large["expected_size"] // (4 * 1024 * 1024)
    assert report["_elapsed_s"] < 60
