"""Trial Datastore: ingestion leases, so that trials whose ingesting process died get closed.

Revision ID: 0004_trial_leases
Revises: 0003_trial_datastore
Create Date: 2026-11-24
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004_trial_leases"
down_revision: str | None = "0003_trial_datastore"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("datastore_trials") as batch:
        batch.add_column(
            sa.Column("lease_until", sa.BigInteger(), server_default=sa.text("0"), nullable=False)
        )
        batch.create_index("ix_datastore_trials_lease_until", ["lease_until"])


def downgrade() -> None:
    with op.batch_alter_table("datastore_trials") as batch:
        batch.drop_index("ix_datastore_trials_lease_until")
        batch.drop_column("lease_until")
