"""Rules every service applies to client input: text the databases can store, paging handles,
and how input is quoted back in error messages. Each raises `InvalidArgument`."""

from __future__ import annotations

from shared.errors import InvalidArgument

# Client input quoted in an error message is cut here: gRPC refuses trailers over 8 KiB.
QUOTE_LIMIT = 200
# Largest position of a 32-bit SQL integer column (e.g. version numbers on PostgreSQL).
MAX_INT32_POSITION = 2**31 - 1
# Largest position of a signed 64-bit SQL column (e.g. a trial's creation sequence).
MAX_INT64_POSITION = 2**63 - 1


def quoted(text: str) -> str:
    """`text` (client input) as an error message may hold it: at most QUOTE_LIMIT characters."""
    return text if len(text) <= QUOTE_LIMIT else text[:QUOTE_LIMIT] + "…"


def checked_text(value: str, what: str) -> str:
    """`value`, if a text column can hold it: PostgreSQL's text cannot hold NUL characters."""
    if "\x00" in value:
        raise InvalidArgument(f"{what} cannot contain NUL characters")
    return value


def checked_id(value: str, what: str) -> str:
    """A non-empty identifier a text column can hold (`what` names it, e.g. "model id")."""
    if not value:
        raise InvalidArgument(f"empty {what}")
    return checked_text(value, f"{what}s")


def parse_handle(handle: str, field: str, maximum: int) -> int:
    """A paging handle: an ASCII decimal position (empty = 0), as the reference parses them.

    Positions past `maximum` (the largest the column can hold) mean "past the end" and are
    clamped to it, so they never overflow a query's parameter.
    """
    if not handle:
        return 0
    if not (handle.isascii() and handle.isdecimal()):
        raise InvalidArgument(f"Invalid value for `{field}` [{quoted(handle)}]: expected a decimal position")
    digits = handle.lstrip("0") or "0"
    return maximum if len(digits) > len(str(maximum)) else min(int(digits), maximum)
