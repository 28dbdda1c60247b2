"""Model Registry: versions found by their blob key, so that a commit made again creates nothing twice.

Revision ID: 0006_version_blob_key
Revises: 0005_ingestion_streams
Create Date: 2026-11-28
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0006_version_blob_key"
down_revision: str | None = "0005_ingestion_streams"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Blob keys were always drawn at random per upload: existing rows hold no duplicate.
    with op.batch_alter_table("registry_versions") as batch:
        batch.create_index("ix_registry_versions_blob_key", ["blob_key"], unique=True)


def downgrade() -> None:
    with op.batch_alter_table("registry_versions") as batch:
        batch.drop_index("ix_registry_versions_blob_key")
