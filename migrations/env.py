"""Alembic environment: one migration history for the whole suite.

Run through `shared.db.Database.migrate()` (at service start-up and by `python -m shared.migrate`),
which passes an open connection in `config.attributes["connection"]`.
"""

from alembic import context

from shared.schema import metadata

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations with `python -m shared.migrate --database_url URL`")

context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
