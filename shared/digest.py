"""SHA-256 digests that stand for text in keys and indexes.

Ids, property names and values have any length, and PostgreSQL cannot index text over ~2.7 kB:
rows are keyed and matched by these digests instead, the text itself kept unindexed.
"""

from __future__ import annotations

import hashlib


def sha256_hex(value: str) -> str:
    return hashlib.sha256(value.encode("utf-8")).hexdigest()


def pair_digest(name: str, value: str) -> str:
    """What property matching compares: equal exactly when both name and value are equal (the
    name's length prefix keeps `("ab", "c")` and `("a", "bc")` apart)."""
    return sha256_hex(f"{len(name)}:{name}={value}")
