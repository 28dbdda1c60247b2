"""Files that hold secrets (a key, registration secrets): readable by this user only, and never
seen half-written."""

from __future__ import annotations

import os
from pathlib import Path


def write_private_file(path: Path, text: str) -> None:
    """Write `text` to `path`: created with mode 0600 under a temporary name, synced, then renamed
    over `path` (its directory is created if needed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)
