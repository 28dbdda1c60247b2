"""`python -m services.model_registry [flags]`: run the Model Registry service (see `--help`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from services.model_registry.service import ModelRegistryService
from shared.server import run_service_main


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    return run_service_main(ModelRegistryService, argv, prog)


if __name__ == "__main__":
    sys.exit(main())
