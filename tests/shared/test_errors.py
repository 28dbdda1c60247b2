"""How failures are classified into statuses (shared/errors.py): one place for every service."""

from __future__ import annotations

import errno
import sqlite3

import grpc
import psycopg
import pytest
from sqlalchemy.exc import OperationalError

from shared.errors import (
    DependencyError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ServiceError,
    Unavailable,
    classify,
)


def raised_from(error: BaseException, cause: BaseException) -> BaseException:
    try:
        try:
            raise cause
        except BaseException as inner:
            raise error from inner
    except BaseException as outer:
        return outer


def test_service_errors_carry_their_status_and_are_their_own_classification() -> None:
    assert InvalidArgument.code is grpc.StatusCode.INVALID_ARGUMENT
    assert NotFound.code is grpc.StatusCode.NOT_FOUND
    error = NotFound("no model")
    assert classify(error) is error


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        raised_from(RuntimeError("write failed"), OSError(errno.EDQUOT, "Disk quota exceeded")),
        OperationalError("INSERT", {}, sqlite3.OperationalError("database or disk is full")),
        raised_from(DependencyError("blob store: upload failed"), OSError(errno.ENOSPC, "full")),
    ],
    ids=["enospc", "quota-in-chain", "sqlite-full", "blob-store-full"],
)
def test_a_full_disk_is_resource_exhausted(error: BaseException) -> None:
    assert isinstance(classify(error), ResourceExhausted)


@pytest.mark.parametrize(
    "error",
    [
        OperationalError("SELECT 1", {}, psycopg.OperationalError("connection refused")),
        OperationalError(
            "SELECT 1", {}, Exception("server closed the connection"), connection_invalidated=True
        ),
        DependencyError("blob store: connection reset"),
        ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"),
    ],
    ids=["postgresql-down", "connection-invalidated", "blob-store", "refused"],
)
def test_an_unreachable_dependency_is_unavailable(error: BaseException) -> None:
    failure = classify(error)
    assert isinstance(failure, Unavailable)
    assert failure.code is grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(
    "error",
    [
        ValueError("bad"),
        KeyError("k"),
        OperationalError("SELECT", {}, sqlite3.OperationalError("no such table")),
    ],
    ids=["value-error", "key-error", "sql-bug"],
)
def test_anything_else_is_a_bug(error: BaseException) -> None:
    assert classify(error) is None
    assert not isinstance(error, ServiceError)
