"""Smoke tests for the real-component fixtures: each fails if its fixture is broken."""

from __future__ import annotations

import io
import os
import secrets
from typing import TYPE_CHECKING

import psycopg
import pytest
from minio import Minio
from minio.error import S3Error
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine

if TYPE_CHECKING:
    # Only for annotations: importing the plugin modules before pytest registers them would
    # keep pytest from assert-rewriting them.
    from tests.fixtures.postgres import PostgresCluster
    from tests.fixtures.seaweedfs import SeaweedS3


MIB = 1024 * 1024


def _client(server: SeaweedS3, secret_key: str | None = None) -> Minio:
    return Minio(
        server.endpoint,
        access_key=server.access_key,
        secret_key=secret_key or server.secret_key,
        secure=False,
    )


# -- PostgreSQL ------------------------------------------------------------------------------------


def test_postgres_cluster_is_private_and_tuned(postgres_cluster: PostgresCluster) -> None:
    assert postgres_cluster.port not in (None, 5432)
    with psycopg.connect(postgres_cluster.conninfo()) as conn:
        settings: dict[str, str] = dict(
            conn.execute(
                "SELECT name, setting FROM pg_settings WHERE name IN "
                "('fsync', 'synchronous_commit', 'full_page_writes', 'max_connections', 'listen_addresses', "
                "'data_directory')"
            ).fetchall()
        )
    assert settings["fsync"] == "off"
    assert settings["synchronous_commit"] == "off"
    assert settings["full_page_writes"] == "off"
    assert int(settings["max_connections"]) >= 200
    assert settings["listen_addresses"] == "127.0.0.1"
    assert postgres_cluster.tmpdir is not None
    assert settings["data_directory"].startswith(str(postgres_cluster.tmpdir))


async def test_postgres_url_async_roundtrip(postgres_url: str) -> None:
    url = make_url(postgres_url)
    assert url.drivername == "postgresql+psycopg"
    assert url.host == "127.0.0.1"
    engine = create_async_engine(postgres_url)
    try:
        async with engine.begin() as conn:
            # Fresh and empty: no user tables yet.
            count = await conn.scalar(text("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'"))
            assert count == 0
            await conn.execute(text("CREATE TABLE items (id serial PRIMARY KEY, name text NOT NULL)"))
            await conn.execute(text("INSERT INTO items (name) VALUES ('a'), ('b')"))
        async with engine.connect() as conn:
            rows = (await conn.execute(text("SELECT name FROM items ORDER BY id"))).scalars().all()
        assert rows == ["a", "b"]
    finally:
        await engine.dispose()


def test_postgres_url_is_fresh_per_test(postgres_url: str) -> None:
    # Same table name as the test above: it would clash if databases were shared.
    conninfo = make_url(postgres_url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(conninfo) as conn:
        conn.execute("CREATE TABLE items (id int)")
        conn.execute("INSERT INTO items VALUES (1)")
        assert conn.execute("SELECT count(*) FROM items").fetchone() == (1,)


def test_create_and_drop_database(postgres_cluster: PostgresCluster) -> None:
    url = postgres_cluster.create_database("smoke_named_db")
    assert url.endswith("/smoke_named_db")
    # An open connection must not block the drop (WITH FORCE).
    leaked = psycopg.connect(postgres_cluster.conninfo("smoke_named_db"))
    try:
        postgres_cluster.drop_database("smoke_named_db")
    finally:
        leaked.close()
    with psycopg.connect(postgres_cluster.conninfo()) as conn:
        found = conn.execute("SELECT 1 FROM pg_database WHERE datname = 'smoke_named_db'").fetchone()
    assert found is None


# -- SeaweedFS S3 ----------------------------------------------------------------------------------


def test_s3_put_get_roundtrip(seaweed_s3: SeaweedS3) -> None:
    assert seaweed_s3.endpoint.startswith("127.0.0.1:")
    client = _client(seaweed_s3)
    bucket = f"smoke-{secrets.token_hex(6)}"
    client.make_bucket(bucket)
    assert client.bucket_exists(bucket)
    client.put_object(bucket, "dir/hello.txt", io.BytesIO(b"hello"), 5, content_type="text/plain")
    response = client.get_object(bucket, "dir/hello.txt")
    try:
        assert response.read() == b"hello"
    finally:
        response.close()
        response.release_conn()
    assert [o.object_name for o in client.list_objects(bucket, prefix="dir/")] == ["dir/hello.txt"]
    client.remove_object(bucket, "dir/hello.txt")
    client.remove_bucket(bucket)
    assert not client.bucket_exists(bucket)


def test_s3_multipart_upload(seaweed_s3: SeaweedS3) -> None:
    client = _client(seaweed_s3)
    bucket = f"smoke-{secrets.token_hex(6)}"
    client.make_bucket(bucket)
    data = os.urandom(12 * MIB)
    # 5 MiB parts: 12 MiB goes up as a 3-part multipart upload.
    client.put_object(bucket, "big.bin", io.BytesIO(data), len(data), part_size=5 * MIB)
    stat = client.stat_object(bucket, "big.bin")
    assert stat.size == len(data)
    assert stat.etag is not None and stat.etag.endswith("-3")  # S3's multipart ETag: md5-of-md5s "-N"
    response = client.get_object(bucket, "big.bin")
    try:
        assert response.read() == data
    finally:
        response.close()
        response.release_conn()


def test_s3_rejects_wrong_secret(seaweed_s3: SeaweedS3) -> None:
    with pytest.raises(S3Error):
        _client(seaweed_s3, secret_key="not-the-secret").list_buckets()
