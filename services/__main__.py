"""`python -m services`: run every service on the embedded default, each on its default port.

Each service runs in its own process (as it would in production); Ctrl-C or SIGTERM stops them
all gracefully. Flags are not forwarded: run `python -m services.<name> --help` for those.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

SERVICES = ["services.directory", "services.model_registry", "services.datastore"]


def main() -> int:
    children = [subprocess.Popen([sys.executable, "-m", module]) for module in SERVICES]

    def stop(_signum: int, _frame: object) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while all(child.poll() is None for child in children):
        time.sleep(0.2)
    stop(signal.SIGTERM, None)  # one exited: take the others down too
    return max(child.wait() for child in children)


if __name__ == "__main__":
    sys.exit(main())
