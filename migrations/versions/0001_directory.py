"""Directory tables.

Revision ID: 0001_directory
Revises:
Create Date: 2026-11-21
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001_directory"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "directory_services",
        sa.Column("service_id", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("registered_at", sa.BigInteger(), nullable=False),
        sa.Column("protocol", sa.SmallInteger(), nullable=False),
        sa.Column("host", sa.Text(), nullable=False),
        sa.Column("port", sa.Integer(), nullable=False),
        sa.Column("service_type", sa.Integer(), nullable=False),
        sa.Column("properties", sa.Text(), nullable=False),
        sa.Column("properties_digest", sa.String(length=64), nullable=False),
        sa.Column("permanent", sa.Boolean(), nullable=False),
        sa.Column("token_digest", sa.String(length=64), nullable=False),
        sa.Column("secret_nonce", sa.String(length=64), nullable=False),
        sa.Column("failed_checks", sa.Integer(), nullable=False),
        sa.Column("load", sa.SmallInteger(), nullable=False),
        sa.Column("last_check_at", sa.BigInteger(), nullable=False),
        sa.Column("next_check_at", sa.BigInteger(), nullable=True),
        sa.Column("claimed_until", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("service_id", name="pk_directory_services"),
    )
    op.create_index(
        "ix_directory_services_token_digest_service_type_registered_at",
        "directory_services",
        ["token_digest", "service_type", "registered_at"],
    )
    op.create_index("ix_directory_services_next_check_at", "directory_services", ["next_check_at"])
    op.create_index(
        "uq_directory_services_permanent_identity",
        "directory_services",
        ["token_digest", "service_type", "properties_digest"],
        unique=True,
        sqlite_where=sa.text("permanent = 1"),
        postgresql_where=sa.text("permanent"),
    )
    op.create_table(
        "directory_service_properties",
        sa.Column("service_id", sa.BigInteger(), nullable=False),
        sa.Column("pair_digest", sa.String(length=64), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("value", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["service_id"],
            ["directory_services.service_id"],
            name="fk_directory_service_properties_service_id_directory_services",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("service_id", "pair_digest", name="pk_directory_service_properties"),
    )
    op.create_index(
        "ix_directory_service_properties_pair_digest_service_id",
        "directory_service_properties",
        ["pair_digest", "service_id"],
    )
    op.create_table(
        "directory_settings",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("value", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_directory_settings"),
    )


def downgrade() -> None:
    op.drop_table("directory_settings")
    op.drop_table("directory_service_properties")
    op.drop_table("directory_services")
