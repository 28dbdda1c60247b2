"""`python -m services.directory.client <command> [flags]`: the command line (`cli`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from services.directory.client import cli


def main(argv: Sequence[str] | None = None, prog: str = "python -m services.directory.client") -> int:
    return cli.main(argv, prog=prog)


if __name__ == "__main__":
    sys.exit(main())
