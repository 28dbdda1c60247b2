"""The digest of a model version's data as the Model Registry reports it (`data_hash`)."""

from __future__ import annotations

import base64
import hashlib


def sha256_b64(data: bytes) -> str:
    """Base64 of the SHA-256 of `data`: 44 characters."""
    return base64.b64encode(hashlib.sha256(data).digest()).decode()
