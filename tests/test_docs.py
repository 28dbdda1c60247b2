"""The README documents what the code has: every flag and environment variable, and the two
quick-start commands, which `.ci/run` uses."""

from __future__ import annotations

import re

import pytest

from services.directory.service import OPTIONS as DIRECTORY_OPTIONS
from shared.config import Option
from tests.helpers.services import PROJECT_ROOT

README = (PROJECT_ROOT / "README.md").read_text()


@pytest.mark.parametrize("option", DIRECTORY_OPTIONS, ids=lambda option: option.flag)
def test_every_directory_flag_is_documented(option: Option) -> None:
    assert f"`--{option.flag}`" in README
    if option.env:
        assert f"`{option.env}`" in README


def test_quick_start_commands_exist_and_ci_runs_the_test_command() -> None:
    quick_start = README.split("## Quick start", 1)[1].split("##", 1)[0]
    commands = re.findall(r"^(make \w+)", quick_start, flags=re.MULTILINE)
    assert commands == ["make run", "make test"]
    makefile = (PROJECT_ROOT / "Makefile").read_text()
    assert re.search(r"^run:", makefile, flags=re.MULTILINE) and re.search(
        r"^test:", makefile, flags=re.MULTILINE
    )
    ci = (PROJECT_ROOT / ".ci" / "run").read_text()
    assert [line for line in ci.splitlines() if line.startswith("make")] == ["make test"]
