"""Trial Datastore tables.

Revision ID: 0003_trial_datastore
Revises: 0002_model_registry
Create Date: 2026-11-22
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003_trial_datastore"
down_revision: str | None = "0002_model_registry"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# BIGINT on PostgreSQL; INTEGER on SQLite, where only an INTEGER primary key is the rowid.
TRIAL_SEQ = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "datastore_trials",
        sa.Column("trial_seq", TRIAL_SEQ, autoincrement=True, nullable=False),
        sa.Column("trial_key", sa.String(length=64), nullable=False),
        sa.Column("trial_id", sa.Text(), nullable=False),
        sa.Column("user_id", sa.Text(), nullable=False),
        sa.Column("params", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("samples_count", sa.BigInteger(), nullable=False),
        sa.Column("last_state", sa.SmallInteger(), nullable=False),
        sa.Column("ended", sa.Boolean(), nullable=False),
        sa.Column("closed", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("trial_seq", name="pk_datastore_trials"),
        sa.UniqueConstraint("trial_key", name="uq_datastore_trials_trial_key"),
        sqlite_autoincrement=True,
    )
    op.create_table(
        "datastore_trial_properties",
        sa.Column("trial_seq", TRIAL_SEQ, nullable=False),
        sa.Column("pair_digest", sa.String(length=64), nullable=False),
        sa.ForeignKeyConstraint(
            ["trial_seq"],
            ["datastore_trials.trial_seq"],
            name="fk_datastore_trial_properties_trial_seq_datastore_trials",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("trial_seq", "pair_digest", name="pk_datastore_trial_properties"),
    )
    op.create_index(
        "ix_datastore_trial_properties_pair_digest_trial_seq",
        "datastore_trial_properties",
        ["pair_digest", "trial_seq"],
    )
    op.create_table(
        "datastore_samples",
        sa.Column("trial_seq", TRIAL_SEQ, nullable=False),
        sa.Column("sample_seq", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["trial_seq"],
            ["datastore_trials.trial_seq"],
            name="fk_datastore_samples_trial_seq_datastore_trials",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("trial_seq", "sample_seq", name="pk_datastore_samples"),
    )


def downgrade() -> None:
    op.drop_table("datastore_samples")
    op.drop_table("datastore_trial_properties")
    op.drop_table("datastore_trials")
