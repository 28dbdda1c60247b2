"""Model Registry tables.

Revision ID: 0002_model_registry
Revises: 0001_directory
Create Date: 2026-11-28
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002_model_registry"
down_revision: str | None = "0001_directory"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "registry_models",
        sa.Column("model_key", sa.String(length=64), nullable=False),
        sa.Column("model_id", sa.Text(), nullable=False),
        sa.Column("user_data", sa.Text(), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("next_version", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("model_key", name="pk_registry_models"),
    )
    op.create_table(
        "registry_versions",
        sa.Column("model_key", sa.String(length=64), nullable=False),
        sa.Column("version_number", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("creation_timestamp", sa.BigInteger(), nullable=False),
        sa.Column("archived", sa.Boolean(), nullable=False),
        sa.Column("data_hash", sa.String(length=64), nullable=False),
        sa.Column("data_size", sa.BigInteger(), nullable=False),
        sa.Column("user_data", sa.Text(), nullable=False),
        sa.Column("blob_key", sa.String(length=255), nullable=False),
        sa.Column("last_used_at", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["model_key"],
            ["registry_models.model_key"],
            name="fk_registry_versions_model_key_registry_models",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("model_key", "version_number", name="pk_registry_versions"),
    )
    op.create_index(
        "ix_registry_versions_archived_last_used_at",
        "registry_versions",
        ["archived", "last_used_at"],
    )
    op.create_table(
        "registry_blob_garbage",
        sa.Column("blob_key", sa.String(length=255), nullable=False),
        sa.Column("delete_after", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("blob_key", name="pk_registry_blob_garbage"),
    )
    op.create_index(
        "ix_registry_blob_garbage_delete_after",
        "registry_blob_garbage",
        ["delete_after"],
    )


def downgrade() -> None:
    op.drop_table("registry_blob_garbage")
    op.drop_table("registry_versions")
    op.drop_table("registry_models")
