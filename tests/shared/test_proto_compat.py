"""Our `cogmentAPI` protos put the same bytes on the wire as the official SDK 2.10.1's: every
message both define has identical fields (numbers, types, labels), and every method of the
services we serve has the same request and reply types and streaming."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.services import PROJECT_ROOT

DUMP = PROJECT_ROOT / "tests" / "interop" / "dump_descriptors.py"
# Named by the API reference page, absent from the SDK's protos: the client-stream ingestion.
ONLY_OURS = {
    "cogmentAPI.LogExporterSampleRequest",
    "cogmentAPI.LogExporterSampleReply",
    "cogmentAPI.LogExporterSP",
}


def _layouts(python: Path | str, package: str) -> dict[str, Any]:
    result = subprocess.run(
        [str(python), str(DUMP), package],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(result.stdout)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def layouts(sdk_python: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    return _layouts(sys.executable, "shared.api"), _layouts(sdk_python, "cogment.api")


def test_every_message_has_the_sdk_layout(layouts: tuple[dict[str, Any], dict[str, Any]]) -> None:
    ours, sdk = layouts[0]["messages"], layouts[1]["messages"]
    assert set(ours) - set(sdk) <= ONLY_OURS
    mismatches = {
        name: (fields, sdk[name]) for name, fields in ours.items() if name in sdk and fields != sdk[name]
    }
    assert mismatches == {}
    assert len(set(ours) & set(sdk)) > 60  # the comparison did cover the API


def test_every_served_method_has_the_sdk_signature(layouts: tuple[dict[str, Any], dict[str, Any]]) -> None:
    ours, sdk = layouts[0]["services"], layouts[1]["services"]
    for service in ("cogmentAPI.DirectorySP", "cogmentAPI.ModelRegistrySP", "cogmentAPI.TrialDatastoreSP",
                    "cogmentAPI.DatalogSP"):  # fmt: skip
        assert service in ours and service in sdk
        for method, signature in sdk[service].items():
            assert ours[service].get(method) == signature, (service, method)
