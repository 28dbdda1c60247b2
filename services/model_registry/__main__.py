"""`python -m services.model_registry [flags]`: run the Model Registry service (see `--help`)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from services.model_registry.service import OPTIONS, ModelRegistryService
from shared.config import parse_options
from shared.logging import configure_logging
from shared.server import serve


def main(argv: Sequence[str] | None = None) -> int:
    values = parse_options(
        OPTIONS,
        argv,
        prog="python -m services.model_registry",
        description="Cogment Model Registry: models and their versions, data in a local directory or S3.",
    )
    configure_logging(values["log_level"], values["log_format"], values["log_file"])
    asyncio.run(serve(ModelRegistryService(values)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
