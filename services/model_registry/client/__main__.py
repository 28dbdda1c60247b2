"""`python -m services.model_registry.client <command> [flags]`: the command line (`cli`)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

# Read by grpc when it is first imported: its core's own log lines (a failed TLS handshake, at
# info level) would come above the one line the client prints for each failure, saying more.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from services.model_registry.client import cli


def main(argv: Sequence[str] | None = None, prog: str = "python -m services.model_registry.client") -> int:
    return cli.main(argv, prog=prog)


if __name__ == "__main__":
    sys.exit(main())
