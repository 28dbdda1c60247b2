"""The README documents what the code has: every flag and environment variable, and the two
quick-start commands, which `.ci/run` uses."""

from __future__ import annotations

import re

import pytest

from services.console.service import OPTIONS as CONSOLE_OPTIONS
from services.datastore.service import OPTIONS as DATASTORE_OPTIONS
from services.directory.service import OPTIONS as DIRECTORY_OPTIONS
from services.model_registry.service import OPTIONS as MODEL_REGISTRY_OPTIONS
from shared.config import Option
from shared.settings import server_options
from tests.helpers.services import PROJECT_ROOT

README = (PROJECT_ROOT / "README.md").read_text()


# Flags every service has: the README lists them in the directory's table, and says the other
# services' variables differ only by their prefix.
COMMON_FLAGS = {option.flag for option in server_options("COGMENT_DIRECTORY", 0)}
DIRECTORY_ENV = {option.flag: option.env for option in DIRECTORY_OPTIONS}


@pytest.mark.parametrize(
    "option",
    [*DIRECTORY_OPTIONS, *MODEL_REGISTRY_OPTIONS, *DATASTORE_OPTIONS, *CONSOLE_OPTIONS],
    ids=lambda option: option.env or option.flag,
)
def test_every_flag_is_documented(option: Option) -> None:
    assert f"`--{option.flag}`" in README
    listed_once = option.flag in COMMON_FLAGS and option.env != DIRECTORY_ENV.get(option.flag)
    if option.env and not listed_once:
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
