"""The directory's key lives outside its database: a copy of the database yields neither the
registration secrets nor the tokens, and a database of an earlier release (key inside, unkeyed
token digests) keeps working, its issued secrets included."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from sqlalchemy import select

from services.directory import core
from services.directory.core import derive_secret
from services.directory.model import Endpoint, Registration
from services.directory.secret_key import KEY_FILE
from services.directory.store import SECRET_KEY_SETTING, DirectoryStore
from shared import schema
from shared.api import directory_pb2
from shared.db import Database
from shared.digest import sha256_hex
from tests.helpers.directory import ACTOR, COGMENT, deregister, register, request, visible_ids
from tests.helpers.running import DirectoryFactory

OK = directory_pb2.DeregisterReply.OK


async def _stored(database: Database) -> tuple[list[str], list[str]]:
    """(token digests of the entries, keys kept in the settings table)."""
    digests = [row[0] for row in await database.fetch(select(schema.directory_services.c.token_digest))]
    keys = [
        row[0]
        for row in await database.fetch(
            select(schema.directory_settings.c.value).where(
                schema.directory_settings.c.name == SECRET_KEY_SETTING
            )
        )
    ]
    return digests, keys


async def test_a_copy_of_the_database_yields_neither_secrets_nor_tokens(
    database_url: str, directory_factory: DirectoryFactory, tmp_path: Path
) -> None:
    # The default on SQLite (a key file); on PostgreSQL, the key the Helm chart gives every replica.
    on_postgresql = database_url.startswith("postgresql")
    flags = ["--data_dir", str(tmp_path / "data")] + (["--secret_key", "k" * 43] if on_postgresql else [])
    async with directory_factory(*flags) as directory:
        (reply,) = await register(directory, request(ACTOR, {"k": "1"}), token="weak")
        digests, keys = await _stored(directory.service.database)
        assert keys == []  # no key in the database
        assert digests == [digests[0]] and digests[0] != sha256_hex("weak")  # no guessable digest
        if not on_postgresql:
            assert (tmp_path / "data" / KEY_FILE).stat().st_mode & 0o777 == 0o600
    # The key outlives the process: the secret still deregisters after a restart.
    async with directory_factory(*flags) as directory:
        assert await visible_ids(directory, token="weak") == [reply.service_id]
        (done,) = await deregister(directory, (reply.service_id, reply.secret), token="weak")
        assert done.status == OK


async def test_an_earlier_releases_database_keeps_its_tokens_and_secrets(
    database_url: str, directory_factory: DirectoryFactory, tmp_path: Path
) -> None:
    # As an earlier release left it: its key in the settings table, unkeyed token digests.
    database = Database(database_url)
    await database.migrate()
    store = DirectoryStore(database)
    legacy_key = await store.create_stored_secret_key("the-old-key")
    registration = Registration(Endpoint(COGMENT, "client", 0), ACTOR, {"old": "1"}, permanent=False)
    service_id, nonce, _ = await store.add(registration, sha256_hex("old-token"), time.time_ns())
    await database.close()
    issued_secret = derive_secret(legacy_key.encode(), service_id, nonce)

    async with directory_factory("--data_dir", str(tmp_path / "data")) as directory:
        assert await visible_ids(directory, token="old-token") == [service_id]
        digests, keys = await _stored(directory.service.database)
        assert digests != [sha256_hex("old-token")]  # keyed now
        if not directory.service.database.shared_between_hosts:
            assert keys == []  # moved out, to the key file
            assert (tmp_path / "data" / KEY_FILE).read_text() == "the-old-key"
        (done,) = await deregister(directory, (service_id, issued_secret), token="old-token")
        assert done.status == OK


def test_token_digests_remembered_are_few_and_short(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core, "TOKEN_DIGESTS_REMEMBERED", 4)
    directory = core.Directory(None, None, b"key")  # type: ignore[arg-type]  # digests only
    for number in range(10):
        token = f"token-{number}"
        assert directory._token_digest(token) == core.keyed_digest(b"key", sha256_hex(token))
        assert len(directory._token_digests) <= 4
    long_token = "t" * (core.REMEMBERED_TOKEN_CHARS + 1)
    assert directory._token_digest(long_token) == core.keyed_digest(b"key", sha256_hex(long_token))
    assert long_token not in directory._token_digests
