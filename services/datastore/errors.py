"""Errors of the Trial Datastore's rules, mapped to gRPC status codes by the servicer."""

from __future__ import annotations


class DatastoreError(Exception):
    pass


class InvalidRequest(DatastoreError):
    """The client sent something the datastore cannot accept (INVALID_ARGUMENT)."""


class NotFound(DatastoreError):
    """A trial the request names does not exist (NOT_FOUND)."""


class Unavailable(DatastoreError):
    """The database failed: the client may retry (UNAVAILABLE)."""
