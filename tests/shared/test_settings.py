"""Each service's typed settings match its option table one for one, and take the parsed values;
their `--help` keeps every environment variable name whole."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, fields

import pytest

from services.__main__ import OPTIONS as SUPERVISOR_OPTIONS
from services.datastore.service import OPTIONS as DATASTORE_OPTIONS
from services.datastore.service import DatastoreSettings
from services.directory.service import OPTIONS as DIRECTORY_OPTIONS
from services.directory.service import DirectorySettings
from services.model_registry.service import OPTIONS as MODEL_REGISTRY_OPTIONS
from services.model_registry.service import ModelRegistrySettings
from shared.config import Option, build_parser, parse_options
from shared.settings import Settings

SERVICES = [
    (DirectorySettings, DIRECTORY_OPTIONS),
    (ModelRegistrySettings, MODEL_REGISTRY_OPTIONS),
    (DatastoreSettings, DATASTORE_OPTIONS),
]


@pytest.mark.parametrize(
    ("settings_type", "options"), SERVICES, ids=lambda item: getattr(item, "__name__", "")
)
def test_settings_fields_are_the_options(settings_type: type[Settings], options: list[Option]) -> None:
    assert sorted(field.name for field in fields(settings_type)) == sorted(option.flag for option in options)


@pytest.mark.parametrize(
    ("settings_type", "options"), SERVICES, ids=lambda item: getattr(item, "__name__", "")
)
def test_settings_built_in_code_are_the_defaults_but_what_is_given(
    settings_type: type[Settings], options: list[Option]
) -> None:
    assert settings_type.options is options
    parsed = parse_options(options, ["--port", "0"], prog="t", description="t", environ={})
    assert settings_type.with_defaults(port=0) == settings_type.from_values(parsed)
    with pytest.raises(TypeError, match="has no option prot"):
        settings_type.with_defaults(prot=0)


@pytest.mark.parametrize(
    ("settings_type", "options"), SERVICES, ids=lambda item: getattr(item, "__name__", "")
)
def test_settings_hold_the_parsed_values(settings_type: type[Settings], options: list[Option]) -> None:
    values = parse_options(
        options, ["--port", "1234", "--shutdown_grace", "2.5"], prog="t", description="t", environ={}
    )
    settings = settings_type.from_values(values)
    assert settings.port == 1234  # type: ignore[attr-defined]
    assert settings.shutdown_grace == 2.5  # type: ignore[attr-defined]
    with pytest.raises(FrozenInstanceError):
        settings.port = 1  # type: ignore[attr-defined,misc]


def test_values_that_do_not_match_the_fields_are_refused() -> None:
    values = parse_options(DIRECTORY_OPTIONS, [], prog="t", description="t", environ={})
    with pytest.raises(ValueError, match=r"missing \[\], unknown \['no_such_option'\]"):
        DirectorySettings.from_values({**values, "no_such_option": 1})
    del values["port"]
    with pytest.raises(ValueError, match=r"missing \['port'\], unknown \[\]"):
        DirectorySettings.from_values(values)


HELP_OPTIONS = [
    ("directory", DIRECTORY_OPTIONS),
    ("model_registry", MODEL_REGISTRY_OPTIONS),
    ("datastore", DATASTORE_OPTIONS),
    ("services", SUPERVISOR_OPTIONS),
]


@pytest.mark.parametrize(("name", "options"), HELP_OPTIONS, ids=[name for name, _ in HELP_OPTIONS])
@pytest.mark.parametrize("columns", [40, 80, 120])
def test_help_never_splits_an_environment_variable(
    monkeypatch: pytest.MonkeyPatch, name: str, options: list[Option], columns: int
) -> None:
    """Each variable appears whole on one line, however narrow the terminal (argparse used to cut
    the longest ones, `COGMENT_MODEL_REGISTRY_SENT_MODEL_VERSIO` / `N_DATA_CHUNK_SIZE`)."""
    monkeypatch.setenv("COLUMNS", str(columns))
    lines = build_parser(options, prog=name, description="d").format_help().splitlines()
    variables = [option.env for option in options if option.env]
    assert variables
    for variable in variables:
        assert any(f"[env {variable}]" in line for line in lines), (variable, lines)
    # And no line holds a piece of one: a name ends at its bracket.
    pieces = {line.strip() for line in lines if line.strip().startswith("COGMENT_")}
    assert pieces == set()
