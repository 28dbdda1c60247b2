"""`python -m services.directory [flags]`: run the Directory service (see `--help`)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from services.directory.service import OPTIONS, DirectoryService
from shared.config import parse_options
from shared.logging import configure_logging
from shared.server import serve


def main(argv: Sequence[str] | None = None) -> int:
    values = parse_options(
        OPTIONS,
        argv,
        prog="python -m services.directory",
        description="Cogment Directory: service registration, discovery and health checking.",
    )
    configure_logging(values["log_level"], values["log_format"], values["log_file"])
    asyncio.run(serve(DirectoryService(values)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
