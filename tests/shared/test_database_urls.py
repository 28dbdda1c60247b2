"""Database URLs as operators write them: a password that needs URL-encoding works encoded, and
is refused (in one line that does not show it) when it is not."""

from __future__ import annotations

import subprocess
import sys
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from tests.fixtures.postgres import HOST, PostgresCluster, new_database_name
from tests.helpers.services import PROJECT_ROOT, clean_environment, start_service

pytestmark = pytest.mark.timeout(120)

# Every character that means something in a URL, and a space.
PASSWORD = "p@ss:w/rd?#[]%&+= x"


@pytest.fixture
def role_database(postgres_cluster: PostgresCluster) -> Iterator[tuple[str, int]]:
    """A database owned by a role that logs in with PASSWORD; (its name, the server's port)."""
    name = new_database_name()
    with psycopg.connect(postgres_cluster.conninfo(), autocommit=True) as admin:
        admin.execute(
            sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(sql.Identifier(name), sql.Literal(PASSWORD))
        )
        admin.execute(
            sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(name), sql.Identifier(name))
        )
    try:
        assert postgres_cluster.port is not None
        yield name, postgres_cluster.port
    finally:
        postgres_cluster.drop_database(name)
        with psycopg.connect(postgres_cluster.conninfo(), autocommit=True) as admin:
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def url(name: str, port: int, password: str) -> str:
    return f"postgresql+psycopg://{name}:{password}@{HOST}:{port}/{name}"


def test_a_url_encoded_password_logs_in(role_database: tuple[str, int], tmp_path: Path) -> None:
    name, port = role_database
    encoded = url(name, port, urllib.parse.quote(PASSWORD, safe=""))
    migrate = subprocess.run(
        [sys.executable, "-m", "shared.migrate", "--database_url", encoded],
        cwd=PROJECT_ROOT, env=clean_environment(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert migrate.returncode == 0, migrate.stderr
    with start_service("services.directory", ["--database_url", encoded], log_dir=tmp_path) as directory:
        assert directory.events("serving")
        assert directory.terminate() == 0


@pytest.mark.parametrize(
    ("password", "fragments"),
    [(PASSWORD, ["w/rd", "rd?#", "+= x"]), ("p@ss", ["p@ss", "ss@"])],
    ids=["every-character", "one-at"],
)
def test_a_password_left_unencoded_is_refused_in_one_line(
    role_database: tuple[str, int], password: str, fragments: list[str]
) -> None:
    name, port = role_database
    result = subprocess.run(
        [sys.executable, "-m", "services.directory", "--port", "0", "--bind_address", "127.0.0.1",
         "--log_level", "info", "--database_url", url(name, port, password)],
        cwd=PROJECT_ROOT, env=clean_environment(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1
    [line] = result.stderr.splitlines()  # before anything else is logged (the URL, hidden or not)
    assert "cannot start" in line and "URL-encode a password" in line
    assert not [fragment for fragment in fragments if fragment in line]  # nothing of the password
