"""The directory's key: what registration secrets are derived from and tokens are digested with.

A copy of the database alone must yield neither a secret nor a token, so the key lives outside
it: `--secret_key` (every replica the same; the Helm chart fills it from a generated Secret), else
a file in the data directory created with mode 0600 (the embedded SQLite default).

Earlier releases kept a generated key in the database (`directory_settings`). On SQLite it is
moved to the key file at start, so the secrets issued with it stay valid. On PostgreSQL without
`--secret_key` it stays there, as the one place the replicas share, and a warning says why that
is weak. A configured key that differs from it replaces it (secrets issued before no longer
deregister: those entries are left to their health checks).
"""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

from services.directory.store import DirectoryStore
from shared.logging import get_logger
from shared.private_file import write_private_file

KEY_FILE = "directory.key"

log = get_logger("directory.secret_key")


async def directory_key(configured: str | None, data_dir: str, store: DirectoryStore) -> bytes:
    stored = await store.stored_secret_key()
    if configured:
        if stored is not None:
            if stored != configured:
                log.warning(
                    "a different key was kept in the database: secrets issued with it no longer "
                    "deregister (their entries are removed by health checks once their services stop)"
                )
            await store.forget_stored_secret_key()
        return configured.encode("utf-8")
    if store.db.shared_between_hosts:
        if stored is None:
            stored = await store.create_stored_secret_key(secrets.token_urlsafe(32))
        log.warning(
            "the directory's key is kept in the database (every replica needs it): a copy of the "
            "database yields the registration secrets; set --secret_key (COGMENT_DIRECTORY_SECRET_KEY) "
            "to keep it outside"
        )
        return stored.encode("utf-8")
    key = await asyncio.to_thread(_read_or_create, Path(data_dir) / KEY_FILE, stored)
    if stored is not None:
        await store.forget_stored_secret_key()  # now in the key file
    return key.encode("utf-8")


def _read_or_create(path: Path, initial: str | None) -> str:
    """The key in `path`, else `initial` (or a new key) written there, readable by this user only."""
    try:
        return path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        pass
    key = initial or secrets.token_urlsafe(32)
    write_private_file(path, key)
    return key
