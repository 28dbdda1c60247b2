"""`python -m services.directory [flags]`: run the Directory service (see `--help`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from services.directory.service import DirectoryService
from shared.server import run_service_main


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    return run_service_main(DirectoryService, argv, prog)


if __name__ == "__main__":
    sys.exit(main())
