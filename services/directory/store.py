"""SQL storage of directory entries. Every piece of directory state lives here, so several
replicas on one database serve the same directory."""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Sequence
from typing import Any

from sqlalchemy import ColumnElement, and_, delete, exists, func, insert, select, text, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError

from services.directory.model import (
    MAX_SERVICE_ID,
    UNKNOWN_SERVICE,
    CheckResult,
    CheckTarget,
    Endpoint,
    Entry,
    Inquiry,
    Registration,
)
from shared.db import Database
from shared.schema import directory_service_properties as properties_table
from shared.schema import directory_services as services
from shared.schema import directory_settings as settings

SECRET_KEY_SETTING = "secret_key"
_ENTRY_COLUMNS = (
    services.c.service_id,
    services.c.protocol,
    services.c.host,
    services.c.port,
    services.c.service_type,
    services.c.properties,
    services.c.permanent,
    services.c.registered_at,
    services.c.load,
    services.c.failed_checks,
    services.c.last_check_at,
)


def sha256_hex(value: str) -> str:
    return hashlib.sha256(value.encode("utf-8")).hexdigest()


def canonical_properties(properties: dict[str, str]) -> str:
    return json.dumps(properties, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _entry(row: Any) -> Entry:
    return Entry(
        service_id=row.service_id,
        endpoint=Endpoint(row.protocol, row.host, row.port),
        service_type=row.service_type,
        properties=json.loads(row.properties),
        permanent=bool(row.permanent),
        registered_at=row.registered_at,
        load=row.load,
        failed_checks=row.failed_checks,
        last_check_at=row.last_check_at,
    )


class DirectoryStore:
    def __init__(self, database: Database) -> None:
        self.db = database

    async def secret_key(self, configured: str | None) -> bytes:
        """The key secrets are derived from: the configured one, else one generated once and
        shared by every replica through the database."""
        if configured:
            return configured.encode("utf-8")
        async with self.db.write() as connection:
            generated = secrets.token_urlsafe(32)
            await connection.execute(self._insert_ignore_setting(SECRET_KEY_SETTING, generated))
            stored = await connection.scalar(
                select(settings.c.value).where(settings.c.name == SECRET_KEY_SETTING)
            )
        return str(stored).encode("utf-8")

    def _insert_ignore_setting(self, name: str, value: str) -> Any:
        dialect = postgresql if self.db.is_postgresql else sqlite
        return dialect.insert(settings).values(name=name, value=value).on_conflict_do_nothing()

    async def add(self, registration: Registration, token_digest: str, now_ns: int) -> tuple[int, str, bool]:
        """Store a registration; returns (service id, secret nonce, created).

        A permanent registration whose token, type and full property map match a permanent
        entry updates that entry's endpoint in place (same id and nonce) instead.
        """
        properties_json = canonical_properties(registration.properties)
        while True:
            service_id = secrets.randbelow(MAX_SERVICE_ID) + 1
            nonce = secrets.token_hex(16)
            row = {
                "service_id": service_id,
                "registered_at": now_ns,
                "protocol": registration.endpoint.protocol,
                "host": registration.endpoint.host,
                "port": registration.endpoint.port,
                "service_type": registration.service_type,
                "properties": properties_json,
                "properties_digest": sha256_hex(properties_json),
                "permanent": registration.permanent,
                "token_digest": token_digest,
                "secret_nonce": nonce,
                "failed_checks": 0,
                "load": 0,
                "last_check_at": 0,
                "next_check_at": now_ns if registration.health_checked else None,
                "claimed_until": 0,
            }
            try:
                async with self.db.write() as connection:
                    if registration.permanent:
                        stored_id, stored_nonce = (
                            await connection.execute(self._upsert_permanent(row))
                        ).one()
                    else:
                        await connection.execute(insert(services).values(row))
                        stored_id, stored_nonce = service_id, nonce
                    created = stored_id == service_id
                    if created and registration.properties:
                        await connection.execute(
                            insert(properties_table),
                            [
                                {"service_id": service_id, "name": name, "value": value}
                                for name, value in registration.properties.items()
                            ],
                        )
                return int(stored_id), str(stored_nonce), created
            except IntegrityError:
                # A service id collision (one chance in 2^63): draw another one.
                continue

    def _upsert_permanent(self, row: dict[str, Any]) -> Any:
        dialect: Any = postgresql if self.db.is_postgresql else sqlite
        predicate = text("permanent") if self.db.is_postgresql else text("permanent = 1")
        statement = dialect.insert(services).values(row)
        return statement.on_conflict_do_update(
            index_elements=[services.c.token_digest, services.c.service_type, services.c.properties_digest],
            index_where=predicate,
            set_={
                "protocol": statement.excluded.protocol,
                "host": statement.excluded.host,
                "port": statement.excluded.port,
                "failed_checks": 0,
                "load": 0,
            },
        ).returning(services.c.service_id, services.c.secret_nonce)

    async def credentials(self, service_id: int) -> tuple[str, str] | None:
        """(token digest, secret nonce) of an entry, or None when there is no such entry."""
        if not 0 < service_id <= MAX_SERVICE_ID:
            return None
        async with self.db.read() as connection:
            row = (
                await connection.execute(
                    select(services.c.token_digest, services.c.secret_nonce).where(
                        services.c.service_id == service_id
                    )
                )
            ).one_or_none()
        return None if row is None else (row.token_digest, row.secret_nonce)

    async def remove(self, service_id: int) -> bool:
        async with self.db.write() as connection:
            result = await connection.execute(delete(services).where(services.c.service_id == service_id))
        return bool(result.rowcount)

    async def find(self, inquiry: Inquiry, token_digest: str) -> list[Entry]:
        """Healthy entries visible with this token that match the inquiry, most recent first."""
        conditions: list[ColumnElement[bool]] = [
            services.c.token_digest == token_digest,
            services.c.failed_checks == 0,
        ]
        if inquiry.service_id is not None:
            if not 0 < inquiry.service_id <= MAX_SERVICE_ID:
                return []
            conditions.append(services.c.service_id == inquiry.service_id)
        else:
            if any("\x00" in part for pair in inquiry.properties.items() for part in pair):
                return []  # nothing stored can contain NUL (PostgreSQL refuses it in text)
            if inquiry.service_type != UNKNOWN_SERVICE:
                conditions.append(services.c.service_type == inquiry.service_type)
            for name, value in inquiry.properties.items():
                conditions.append(
                    exists().where(
                        properties_table.c.service_id == services.c.service_id,
                        properties_table.c.name == name,
                        properties_table.c.value == value,
                    )
                )
        statement = (
            select(*_ENTRY_COLUMNS)
            .where(and_(*conditions))
            .order_by(services.c.registered_at.desc(), services.c.service_id.desc())
        )
        async with self.db.read() as connection:
            rows = (await connection.execute(statement)).all()
        return [_entry(row) for row in rows]

    async def count(self) -> int:
        async with self.db.read() as connection:
            return int(await connection.scalar(select(func.count()).select_from(services)) or 0)

    async def count_healthy(self) -> tuple[int, int]:
        """(all entries, entries whose last check failed)."""
        async with self.db.read() as connection:
            row = (
                await connection.execute(
                    select(func.count(), func.count().filter(services.c.failed_checks > 0)).select_from(
                        services
                    )
                )
            ).one()
        return int(row[0]), int(row[1])

    async def claim_due_checks(self, now_ns: int, lease_ns: int, limit: int) -> list[CheckTarget]:
        """Take up to `limit` entries due for a health check, for `lease_ns`.

        On PostgreSQL, SKIP LOCKED lets replicas claim disjoint entries at the same time; an
        entry stays claimed until its lease expires, so a crashed replica's claims are taken over.
        """
        due = (
            select(services.c.service_id)
            .where(services.c.next_check_at <= now_ns, services.c.claimed_until < now_ns)
            .order_by(services.c.next_check_at)
            .limit(limit)
            .with_for_update(skip_locked=True)
        )
        statement = (
            update(services)
            .where(services.c.service_id.in_(due.scalar_subquery()))
            .values(claimed_until=now_ns + lease_ns)
            .returning(
                services.c.service_id,
                services.c.protocol,
                services.c.host,
                services.c.port,
                services.c.service_type,
                services.c.failed_checks,
                services.c.load,
            )
        )
        async with self.db.write() as connection:
            rows = (await connection.execute(statement)).all()
        return [
            CheckTarget(
                row.service_id,
                Endpoint(row.protocol, row.host, row.port),
                row.service_type,
                row.failed_checks,
                row.load,
            )
            for row in rows
        ]

    async def record_checks(
        self,
        results: Sequence[tuple[CheckTarget, CheckResult]],
        now_ns: int,
        next_check_ns: int,
        max_failed_checks: int,
    ) -> list[int]:
        """Store check outcomes and release the claims; returns the ids removed for failing
        `max_failed_checks` checks in a row."""
        removed: list[int] = []
        async with self.db.write() as connection:
            for target, result in results:
                values: dict[str, Any] = {
                    "last_check_at": now_ns,
                    "next_check_at": next_check_ns,
                    "claimed_until": 0,
                }
                if result.healthy:
                    values["failed_checks"] = 0
                    if result.load is not None:
                        values["load"] = result.load
                else:
                    # Counted in SQL: two checks of one entry (periodic and at inquiry) may overlap.
                    values["failed_checks"] = services.c.failed_checks + 1
                    values["load"] = 255
                failed = await connection.scalar(
                    update(services)
                    .where(services.c.service_id == target.service_id)
                    .values(values)
                    .returning(services.c.failed_checks)
                )
                if failed is not None and failed >= max_failed_checks:
                    await connection.execute(
                        delete(services).where(services.c.service_id == target.service_id)
                    )
                    removed.append(target.service_id)
        return removed
