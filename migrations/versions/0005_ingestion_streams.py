"""Trial Datastore: each ingestion stream's stored samples, so that a retried append stores nothing
twice; each lease's holder, so that a holder known to be gone does not keep its trials open.

Revision ID: 0005_ingestion_streams
Revises: 0004_trial_leases
Create Date: 2026-11-28
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_ingestion_streams"
down_revision: str | None = "0004_trial_leases"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# BIGINT on PostgreSQL; INTEGER on SQLite, as in 0003.
TRIAL_SEQ = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    with op.batch_alter_table("datastore_trials") as batch:
        batch.add_column(
            sa.Column("lease_holder", sa.String(length=32), server_default=sa.text("''"), nullable=False)
        )
    op.create_table(
        "datastore_ingestion_streams",
        sa.Column("trial_seq", TRIAL_SEQ, nullable=False),
        sa.Column("stream_id", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("appended", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["trial_seq"],
            ["datastore_trials.trial_seq"],
            name="fk_datastore_ingestion_streams_trial_seq_datastore_trials",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("trial_seq", "stream_id", name="pk_datastore_ingestion_streams"),
    )


def downgrade() -> None:
    op.drop_table("datastore_ingestion_streams")
    with op.batch_alter_table("datastore_trials") as batch:
        batch.drop_column("lease_holder")
