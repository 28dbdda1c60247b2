"""The errors every service raises, and how a failure is classified into a gRPC status.

A service's rules raise a `ServiceError`: the error carries its status code, and the shared call
observer (`shared.observer`) ends the call with that code and the error's message. Nothing else
maps errors to statuses.

Failures of what a service depends on (the database, the blob store, the disk) are not turned
into ServiceErrors where they happen: `classify` recognises them where the call ends, so every
service answers an outage, or a full disk, the same way.
"""

from __future__ import annotations

import errno
import sqlite3
from collections.abc import Iterator
from typing import ClassVar

import grpc
import psycopg
from sqlalchemy.exc import DBAPIError, InterfaceError
from sqlalchemy.exc import TimeoutError as PoolTimeout


class ServiceError(Exception):
    """An error the client is told about as it is: `code`, and the message."""

    code: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL


class InvalidArgument(ServiceError):
    """The request itself is wrong: sending it again will not help."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServiceError):
    """Something the request names does not exist."""

    code = grpc.StatusCode.NOT_FOUND


class PermissionDenied(ServiceError):
    """The caller's credentials do not allow what it asks."""

    code = grpc.StatusCode.PERMISSION_DENIED


class FailedPrecondition(ServiceError):
    """The request is valid, but not in the current state of what it names."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(ServiceError):
    """A limit was reached (storage full, a configured bound): retry later, or ask for less."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    """A dependency cannot be reached: the client may retry."""

    code = grpc.StatusCode.UNAVAILABLE


class StartupError(Exception):
    """A problem the operator has to fix before a program can start (its configuration, a
    dependency it cannot reach): said in one log line, exit status 1."""


def describe(error: BaseException) -> str:
    """`error` on one line, for an operator: a database error's own message, without the SQL
    and the documentation link SQLAlchemy wraps it in."""
    original = error.orig if isinstance(error, DBAPIError) and error.orig is not None else error
    return " ".join(str(original).split()) or type(original).__name__


class DependencyError(Exception):
    """Raised by an adapter (e.g. a blob store) for its backend's failures: the backend could
    not serve the request. Classified as UNAVAILABLE, or RESOURCE_EXHAUSTED for a full disk."""


def _chain(error: BaseException) -> Iterator[BaseException]:
    """`error` and the errors behind it: raised from, raised while handling, or wrapped by the
    database layer (a DBAPIError's `orig`), each once."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        pending += [current.__context__, current.__cause__, getattr(current, "orig", None)]


def _is_disk_full(error: BaseException) -> bool:
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if isinstance(error, sqlite3.OperationalError) and "disk is full" in str(error):
        return True
    return isinstance(error, psycopg.errors.DiskFull)


def _is_unreachable(error: BaseException) -> bool:
    if isinstance(error, DBAPIError) and error.connection_invalidated:
        return True
    # A pool with no connection to give (TimeoutError) is a database that does not keep up.
    return isinstance(
        error, (DependencyError, InterfaceError, PoolTimeout, psycopg.OperationalError, ConnectionError)
    )


def classify(error: BaseException) -> ServiceError | None:
    """The ServiceError that `error` stands for; None when it is none of the known kinds (a bug)."""
    if isinstance(error, ServiceError):
        return error
    chain = list(_chain(error))
    if any(_is_disk_full(link) for link in chain):
        return ResourceExhausted("the service's storage is full")
    if any(_is_unreachable(link) for link in chain):
        return Unavailable("a dependency of the service cannot be reached (database or blob store): retry")
    return None
