"""SQL storage of the Model Registry: models, version metadata and the blobs to collect.

Version data lives in a blob store; rows here name it by `blob_key`. Every piece of registry
state lives in the database, so several replicas on one database serve the same registry.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Integer, bindparam, delete, false, func, insert, select, update

from services.model_registry.model import ModelInfo, VersionInfo, VersionRecord
from shared.db import Database, Transaction, in_batches
from shared.db.sql import binary_order
from shared.digest import sha256_hex
from shared.schema import registry_blob_garbage as garbage
from shared.schema import registry_models as models
from shared.schema import registry_versions as versions

# Serializes evictions across replicas (any constant shared by every replica; see Transaction.lock).
EVICTION_LOCK_ID = 0x7265675F65766963


def model_key(model_id: str) -> str:
    """What models are keyed by (see shared.digest)."""
    return sha256_hex(model_id)


def _canonical_json(user_data: dict[str, str]) -> str:
    # dict(): a protobuf map (not a dict) serializes too.
    return json.dumps(dict(user_data), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


_VERSION_COLUMNS = (
    versions.c.version_number,
    versions.c.creation_timestamp,
    versions.c.archived,
    versions.c.data_hash,
    versions.c.data_size,
    versions.c.user_data,
)


def _version_info(model_id: str, row: Sequence[Any]) -> VersionInfo:
    """A version from a row starting with _VERSION_COLUMNS (by position)."""
    number, created, archived, data_hash, data_size, user_data = row[:6]
    return VersionInfo(
        model_id=model_id,
        version_number=int(number),
        creation_timestamp=int(created),
        archived=bool(archived),
        data_hash=data_hash,
        data_size=int(data_size),
        user_data=json.loads(user_data),
    )


# Hot statements, built once.
_GET_MODELS = select(models.c.model_id, models.c.user_data).where(
    models.c.model_key.in_(bindparam("keys", expanding=True))
)
_LIST_MODELS_PAGE = select(models.c.model_id, models.c.user_data)
_GET_VERSION = select(*_VERSION_COLUMNS, versions.c.blob_key).where(
    versions.c.model_key == bindparam("key"), versions.c.version_number == bindparam("number")
)
_GET_VERSIONS = select(*_VERSION_COLUMNS).where(
    versions.c.model_key == bindparam("key"),
    versions.c.version_number.in_(bindparam("numbers", expanding=True)),
)
# No row: unknown model; NULL: a model without versions.
_LATEST_NUMBER = select(
    select(func.max(versions.c.version_number))
    .where(versions.c.model_key == models.c.model_key)
    .scalar_subquery()
).where(models.c.model_key == bindparam("key"))
_LIST_VERSIONS = (
    select(*_VERSION_COLUMNS)
    .where(versions.c.model_key == bindparam("key"), versions.c.version_number >= bindparam("first"))
    .order_by(versions.c.version_number)
)
_LIST_VERSIONS_LIMITED = _LIST_VERSIONS.limit(bindparam("limit", type_=Integer))
_TAKE_NUMBER = (
    update(models)
    .where(models.c.model_key == bindparam("key"))
    .values(next_version=models.c.next_version + 1)
    .returning(models.c.next_version)
)
# The version an upload's blob was committed as (blob keys are unique).
_VERSION_OF_BLOB = select(*_VERSION_COLUMNS).where(versions.c.blob_key == bindparam("blob_key"))
_INSERT_VERSION = insert(versions)
_FORGET_GARBAGE = delete(garbage).where(garbage.c.blob_key == bindparam("key"))
# Archived versions are never touched: only transient ones are evicted. The `< now` condition
# saves a write when the version was already used at this instant.
_TOUCH = (
    update(versions)
    .where(
        versions.c.model_key == bindparam("key"),
        versions.c.version_number == bindparam("number"),
        versions.c.archived == false(),
        versions.c.last_used_at < bindparam("now"),
    )
    .values(last_used_at=bindparam("now"))
)
_LOCK_MODEL = select(models.c.model_key).where(models.c.model_key == bindparam("key")).with_for_update()
_DELETE_MODEL_VERSIONS = (
    delete(versions).where(versions.c.model_key == bindparam("key")).returning(versions.c.blob_key)
)
_DELETE_MODEL = delete(models).where(models.c.model_key == bindparam("key"))
_COUNT_TRANSIENT = select(func.count()).select_from(versions).where(versions.c.archived == false())
# Least recently used first. The victims are locked, skipping rows another transaction holds (a
# version being touched or deleted with its model): eviction never waits on them, so it cannot
# deadlock with those (a database whose writers are serialized ignores the clause).
_EVICTION_VICTIMS = (
    select(versions.c.model_key, versions.c.version_number, versions.c.blob_key, models.c.model_id)
    .join(models, models.c.model_key == versions.c.model_key)
    .where(versions.c.archived == false())
    .order_by(versions.c.last_used_at, versions.c.version_number, versions.c.model_key)
    .limit(bindparam("count", type_=Integer))
    .with_for_update(of=versions, skip_locked=True)
)
_DELETE_VERSION = delete(versions).where(
    versions.c.model_key == bindparam("key"), versions.c.version_number == bindparam("number")
)
# Replicas taking garbage at once each get different keys (SKIP LOCKED).
_TAKE_GARBAGE = (
    delete(garbage)
    .where(
        garbage.c.blob_key.in_(
            select(garbage.c.blob_key)
            .where(garbage.c.delete_after <= bindparam("now"))
            .order_by(garbage.c.delete_after)
            .limit(bindparam("limit", type_=Integer))
            .with_for_update(skip_locked=True)
        )
    )
    .returning(garbage.c.blob_key)
)


def model_changes_key(model_id: str) -> str:
    """The change-feed key of a model's versions (new versions, deletion)."""
    return f"model:{model_key(model_id)}"


class RegistryStore:
    """Every write that changes a model's versions says so (`model_changes_key`), so
    VersionUpdate streams in every replica look again (see shared.notify)."""

    def __init__(self, database: Database) -> None:
        self.db = database
        self._insert_garbage = database.insert(garbage).on_conflict_do_nothing()
        upsert = database.insert(models)
        self._upsert_model = upsert.on_conflict_do_update(
            index_elements=[models.c.model_key], set_={"user_data": upsert.excluded.user_data}
        )

    # ---- Models ----

    async def upsert_model(self, model_id: str, user_data: dict[str, str], now_ns: int) -> None:
        """Create the model, or replace its user data (its versions are untouched)."""
        row = {
            "model_key": model_key(model_id),
            "model_id": model_id,
            "user_data": _canonical_json(user_data),
            "created_at": now_ns,
            "next_version": 1,
        }
        statement = self._upsert_model
        await self.db.write(lambda transaction: transaction.execute(statement, row))

    async def get_models(self, model_ids: Sequence[str]) -> dict[str, ModelInfo]:
        """The known models among `model_ids`, by id."""
        keys = list({model_key(model_id) for model_id in model_ids})
        found: dict[str, ModelInfo] = {}
        for batch in in_batches(keys):
            rows = await self.db.fetch(_GET_MODELS, {"keys": batch})
            for model_id, user_data in rows:
                found[model_id] = ModelInfo(model_id, json.loads(user_data))
        return found

    async def list_models(self, offset: int, limit: int | None) -> list[ModelInfo]:
        """Models ordered by id, compared by code point (binary collation on both databases)."""
        statement = _LIST_MODELS_PAGE.order_by(binary_order(models.c.model_id)).offset(max(offset, 0))
        if limit is not None:
            statement = statement.limit(max(limit, 0))
        rows = await self.db.fetch(statement)
        return [ModelInfo(model_id, json.loads(user_data)) for model_id, user_data in rows]

    async def delete_model(self, model_id: str, garbage_after_ns: int) -> list[str] | None:
        """Delete a model and its versions, their blobs going to garbage; returns their blob keys
        (None: no such model)."""
        key = model_key(model_id)
        insert_garbage = self._insert_garbage

        def write(transaction: Transaction) -> list[str] | None:
            # The model row first: a concurrent commit_version either finished (its version is
            # deleted below) or waits and then finds no model.
            if transaction.execute(_LOCK_MODEL, {"key": key}).first() is None:
                return None
            # Versions deleted explicitly (rather than by cascade) to collect their blob keys.
            blob_keys = transaction.execute(_DELETE_MODEL_VERSIONS, {"key": key}).scalars().all()
            if blob_keys:
                transaction.execute(
                    insert_garbage,
                    [{"blob_key": blob_key, "delete_after": garbage_after_ns} for blob_key in blob_keys],
                )
            transaction.execute(_DELETE_MODEL, {"key": key})
            transaction.changed([model_changes_key(model_id)])
            return list(blob_keys)

        return await self.db.write(write)

    # ---- Versions ----

    async def record_upload(self, blob_key: str, delete_after_ns: int) -> None:
        """An upload starts: its blob is garbage until a version commits it."""
        statement = self._insert_garbage
        row = {"blob_key": blob_key, "delete_after": delete_after_ns}
        await self.db.write(lambda transaction: transaction.execute(statement, row))

    async def commit_version(
        self,
        model_id: str,
        blob_key: str,
        *,
        archived: bool,
        data_hash: str,
        data_size: int,
        user_data: dict[str, str],
        creation_timestamp: int,
        now_ns: int,
    ) -> VersionInfo | None:
        """Add a version under the model's next number; None (nothing changed) if the model is gone.

        Idempotent: made again with the same `blob_key` (the answer to the first commit was lost
        with the connection), it returns the version the first one made, as it was made, and
        changes nothing.
        """
        key = model_key(model_id)
        user_data_json = _canonical_json(user_data)

        def write(transaction: Transaction) -> VersionInfo | None:
            # The model's row lock first: it serializes commits on the model across replicas
            # (where the database serializes its writers, the write transaction already does),
            # and an earlier commit of this blob still under way on a broken connection has
            # committed or rolled back once it is held, so the lookup below sees its outcome.
            if transaction.execute(_LOCK_MODEL, {"key": key}).first() is None:
                return None
            made = transaction.execute(_VERSION_OF_BLOB, {"blob_key": blob_key}).first()
            if made is not None:
                return _version_info(model_id, made)
            number = int(transaction.execute(_TAKE_NUMBER, {"key": key}).scalar_one()) - 1
            transaction.execute(
                _INSERT_VERSION,
                {
                    "model_key": key,
                    "version_number": number,
                    "creation_timestamp": creation_timestamp,
                    "archived": archived,
                    "data_hash": data_hash,
                    "data_size": data_size,
                    "user_data": user_data_json,
                    "blob_key": blob_key,
                    "last_used_at": now_ns,
                },
            )
            transaction.execute(_FORGET_GARBAGE, {"key": blob_key})
            transaction.changed([model_changes_key(model_id)])
            return VersionInfo(
                model_id=model_id,
                version_number=number,
                creation_timestamp=creation_timestamp,
                archived=archived,
                data_hash=data_hash,
                data_size=data_size,
                user_data=dict(user_data),
            )

        return await self.db.write(write)

    async def get_version(self, model_id: str, version_number: int) -> VersionRecord | None:
        rows = await self.db.fetch(_GET_VERSION, {"key": model_key(model_id), "number": version_number})
        if not rows:
            return None
        return VersionRecord(_version_info(model_id, rows[0]), rows[0][6])

    async def get_versions(self, model_id: str, numbers: Sequence[int]) -> dict[int, VersionInfo]:
        """The existing versions among `numbers`, by number (one query per IN_LIST_BATCH)."""
        key = model_key(model_id)
        wanted = sorted(set(numbers))
        found: dict[int, VersionInfo] = {}
        for batch in in_batches(wanted):
            parameters = {"key": key, "numbers": batch}
            for row in await self.db.fetch(_GET_VERSIONS, parameters):
                info = _version_info(model_id, row)
                found[info.version_number] = info
        return found

    async def latest_number(self, model_id: str) -> int | None:
        """The highest version number; 0 for a model without versions, None for an unknown model."""
        rows = await self.db.fetch(_LATEST_NUMBER, {"key": model_key(model_id)})
        if not rows:
            return None
        return int(rows[0][0] or 0)

    async def list_versions(self, model_id: str, first_number: int, limit: int | None) -> list[VersionInfo]:
        """Existing versions numbered from `first_number`, ascending, at most `limit`."""
        parameters: dict[str, Any] = {"key": model_key(model_id), "first": first_number}
        statement = _LIST_VERSIONS
        if limit is not None:
            statement, parameters["limit"] = _LIST_VERSIONS_LIMITED, max(limit, 0)
        rows = await self.db.fetch(statement, parameters)
        return [_version_info(model_id, row) for row in rows]

    async def touch(self, model_id: str, version_number: int, now_ns: int) -> None:
        """Mark a transient version as used now (eviction takes the least recently used)."""
        parameters = {"key": model_key(model_id), "number": version_number, "now": now_ns}
        await self.db.write(lambda transaction: transaction.execute(_TOUCH, parameters))

    async def evict_transient(self, max_items: int, garbage_after_ns: int) -> list[tuple[str, int, str]]:
        """Delete the least recently used transient versions beyond `max_items` (all models
        together), their blobs going to garbage; returns the (model id, number, blob key) evicted."""
        insert_garbage = self._insert_garbage

        def write(transaction: Transaction) -> list[tuple[str, int, str]]:
            # One evicting replica at a time: two would count the same excess and evict twice as
            # many versions. Released at the end of the transaction.
            transaction.lock(EVICTION_LOCK_ID)
            excess = int(transaction.execute(_COUNT_TRANSIENT).scalar_one()) - max(max_items, 0)
            if excess <= 0:
                return []
            victims = transaction.execute(_EVICTION_VICTIMS, {"count": excess}).all()
            if not victims:
                return []
            transaction.execute(
                _DELETE_VERSION, [{"key": key, "number": number} for key, number, _, _ in victims]
            )
            transaction.execute(
                insert_garbage,
                [{"blob_key": blob_key, "delete_after": garbage_after_ns} for _, _, blob_key, _ in victims],
            )
            return [(model_id, int(number), blob_key) for _, number, blob_key, model_id in victims]

        return await self.db.write(write)

    # ---- Garbage ----

    async def take_garbage(self, now_ns: int, limit: int) -> list[str]:
        """Remove and return up to `limit` blob keys whose `delete_after` has come (<= now)."""
        if limit <= 0:
            return []
        parameters = {"now": now_ns, "limit": limit}
        return await self.db.write(
            lambda transaction: list(transaction.execute(_TAKE_GARBAGE, parameters).scalars().all())
        )

    async def return_garbage(self, keys: Sequence[str], delete_after_ns: int) -> None:
        """Put back keys whose blobs could not be deleted (keys already there are kept as they are)."""
        if not keys:
            return
        rows = [{"blob_key": key, "delete_after": delete_after_ns} for key in dict.fromkeys(keys)]
        statement = self._insert_garbage
        await self.db.write(lambda transaction: transaction.execute(statement, rows))
