"""The SQL layer shared by every service (see database.py, the one door to it)."""

from shared.db.database import (
    DEFAULT_DATA_DIR,
    IN_LIST_BATCH,
    URL_FORMS,
    Database,
    Transaction,
    default_database_url,
    in_batches,
)
from shared.db.migrations import MIGRATIONS_DIR, alembic_config, current_revision

__all__ = [
    "DEFAULT_DATA_DIR",
    "IN_LIST_BATCH",
    "MIGRATIONS_DIR",
    "URL_FORMS",
    "Database",
    "Transaction",
    "alembic_config",
    "current_revision",
    "default_database_url",
    "in_batches",
]
