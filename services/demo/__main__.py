"""`python -m services.demo [flags]`: fill a running suite with demo data (see `--help`)."""

from __future__ import annotations

import sys

from services.demo.cli import main

if __name__ == "__main__":
    sys.exit(main())
