"""Apply the suite's schema migrations: `python -m shared.migrate --database_url URL`.

The services also migrate at start-up; this command exists for deployments that run migrations
once, before the replicas start (e.g. a Kubernetes Job).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from shared.config import Option, parse_options
from shared.db import DEFAULT_DATA_DIR, Database, default_database_url
from shared.errors import StartupError, classify, describe
from shared.logging import configure_logging, get_logger, logging_options

OPTIONS = [
    Option("database_url", "SQLAlchemy URL of the database to migrate", None, "COGMENT_DATABASE_URL"),
    Option(
        "service",
        "with no URL: migrate this service's default SQLite file",
        "directory",
        choices=["directory", "model_registry", "datastore"],
    ),
    Option("data_dir", "directory of the default SQLite files", DEFAULT_DATA_DIR, "COGMENT_DATA_DIR"),
    *logging_options(),
]


async def migrate(database: Database) -> str | None:
    try:
        await database.migrate()
        return await database.revision()
    finally:
        await database.close()


def main(argv: Sequence[str] | None = None, prog: str = "python -m shared.migrate") -> int:
    values = parse_options(OPTIONS, argv, prog=prog, description=__doc__.splitlines()[0])
    configure_logging(values["log_level"], values["log_format"], values["log_file"])
    log = get_logger("shared.migrate")
    url = values["database_url"] or default_database_url(values["data_dir"], values["service"])
    try:
        database = Database(url)
    except StartupError as error:
        log.error("cannot migrate", error=str(error))
        return 1
    try:
        revision = asyncio.run(migrate(database))
    except Exception as error:
        if classify(error) is None:
            raise  # a bug: its traceback
        log.error("cannot migrate", database=database.display_url, error=describe(error))
        return 1
    log.info("schema up to date", database=database.display_url, revision=revision)
    return 0


if __name__ == "__main__":
    sys.exit(main())
