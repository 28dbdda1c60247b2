"""`python -m services.console [flags]`: run the web console (see `--help`)."""

from __future__ import annotations

import sys

from services.console.service import main

if __name__ == "__main__":
    sys.exit(main())
