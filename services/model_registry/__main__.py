"""`python -m services.model_registry [flags]`: run the Model Registry service (see `--help`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from services.model_registry.service import OPTIONS, ModelRegistryService
from shared.server import run_service_main


def main(argv: Sequence[str] | None = None) -> int:
    return run_service_main(
        OPTIONS,
        ModelRegistryService,
        argv,
        prog="python -m services.model_registry",
        description="Cogment Model Registry: models and their versions, data in a local directory or S3.",
    )


if __name__ == "__main__":
    sys.exit(main())
