"""Rules every service applies to client input: text the databases can store, paging handles,
the limits on what one request may ask, and how input is quoted back in error messages. Each
raises `InvalidArgument`, naming the limit it enforces.

The limits (README, "Limits and memory") keep any one record well inside a default 4 MiB reply.
"""

from __future__ import annotations

from collections.abc import Mapping, Sized

from shared.errors import InvalidArgument

# Client input quoted in an error message is cut here: gRPC refuses trailers over 8 KiB.
QUOTE_LIMIT = 200
MiB = 1024 * 1024
# An id (model, trial, user) or a host name.
MAX_ID_BYTES = 256 * 1024
# A model's or a version's user data, names and values together; a trial's serialized parameters.
MAX_USER_DATA_BYTES = 1 * MiB
MAX_TRIAL_PARAMS_BYTES = 1 * MiB
# Properties of a registration, an inquiry, a trial or a trial filter: how many, and their names
# and values together.
MAX_PROPERTIES = 64
MAX_PROPERTIES_BYTES = 2 * MiB
# The largest message a service accepts. gRPC's default is 4 MiB, but what a service sends back
# must be accepted again: a stored trial sample (reward user data is copied per receiver) can be
# larger, and its export re-imported.
MAX_RECEIVE_MESSAGE_BYTES = 64 * MiB
# Ids or version numbers one request lists.
MAX_LISTED_ITEMS = 10_000
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


def checked_size(size: int, what: str, limit: int, name: str) -> None:
    """Refuse `size` (bytes, or items) over `limit`; `name` is the limit's name in the README."""
    if size > limit:
        raise InvalidArgument(f"{what}: {size} is over the limit of {limit} ({name})")


def utf8_size(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def checked_name_size(value: str, what: str) -> None:
    """An id or a host name is at most MAX_ID_BYTES (`what` names it, e.g. "user id")."""
    checked_size(utf8_size(value), f"{what} bytes", MAX_ID_BYTES, "MAX_ID_BYTES")


def checked_id(value: str, what: str) -> str:
    """A non-empty id a text column can hold, within MAX_ID_BYTES (`what`: e.g. "model id")."""
    if not value:
        raise InvalidArgument(f"empty {what}")
    checked_name_size(value, what)
    return checked_text(value, f"{what}s")


def text_bytes(texts: Mapping[str, str]) -> int:
    """The UTF-8 size of a map's names and values together."""
    return sum(utf8_size(name) + utf8_size(value) for name, value in texts.items())


def checked_properties(properties: Mapping[str, str], what: str) -> Mapping[str, str]:
    """At most MAX_PROPERTIES properties, of MAX_PROPERTIES_BYTES together (`what` names them)."""
    checked_size(len(properties), what, MAX_PROPERTIES, "MAX_PROPERTIES")
    # UTF-8 takes 4 bytes per character at most: most maps are measured without being encoded.
    if sum(len(name) + len(value) for name, value in properties.items()) * 4 > MAX_PROPERTIES_BYTES:
        checked_size(text_bytes(properties), f"{what} bytes", MAX_PROPERTIES_BYTES, "MAX_PROPERTIES_BYTES")
    return properties


def checked_list(items: Sized, what: str) -> None:
    """A list of ids or numbers within MAX_LISTED_ITEMS."""
    checked_size(len(items), what, MAX_LISTED_ITEMS, "MAX_LISTED_ITEMS")


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
