"""`python -m services [flags]`: every service in its own process, as in production (what `make
run` starts). What it does, and its exit status, are in DESCRIPTION and EPILOG (`--help`)."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from shared.config import Option, parse_options
from shared.logging import configure_logging, get_logger, logging_options
from shared.server import SERVING_FD_ENV

# Each service, and the prefix of its environment variables.
SERVICES = {
    "directory": "COGMENT_DIRECTORY",
    "model_registry": "COGMENT_MODEL_REGISTRY",
    "datastore": "COGMENT_TRIAL_DATASTORE",
    "console": "COGMENT_CONSOLE",
}
POLL_INTERVAL_S = 0.2
# What a service stopped by the supervisor (or by the terminal's Ctrl-C, which reaches every
# process of the group) may end with: a clean exit, or the signal itself before it handled it.
STOPPED_CLEANLY = {0, -signal.SIGTERM, -signal.SIGINT}

DESCRIPTION = """\
Run the Directory, the Model Registry and the Trial Datastore, each in its own process on its
default port (9005, 9002, 9003), on the embedded default: SQLite and local files under
./.cogment-aux/, and the web console beside them (http://127.0.0.1:9010/)."""
_PREFIXES = ", ".join(f"{prefix}_*" for prefix in SERVICES.values())
EPILOG = f"""\
Each service also reads its own environment variables
({_PREFIXES}),
listed by `cogment-aux services <name> --help` and in the README; the logging flags above are
passed to every service. A service's flags go in one argument; write it with `=` when it starts
with `--`:
  cogment-aux services all --directory="--port 9105" --trial_datastore="--port 9103 --ingestion_lease 90"
(`python -m services` is the same command.)

Ctrl-C or SIGTERM stops every service (a second one kills them); the exit status is then 0. When
a service ends by itself, the others are stopped and the exit status is that service's: its own
if it failed, 128 + the signal if one killed it, 1 if it exited cleanly unasked.
"""

OPTIONS = [
    *logging_options(),
    *(
        Option(
            name,
            f"flags of the {name} service, in one argument",
            "",
            metavar="FLAGS",
            # The datastore's name in `cogment-aux services trial_datastore`.
            aliases=["trial_datastore"] if name == "datastore" else [],
        )
        for name in SERVICES
    ),
]

log = get_logger("services")


@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]
    # The read end of the pipe the service writes a line to once it serves (`SERVING_FD_ENV`).
    serving_pipe: int
    serving: bool = False

    def check_serving(self) -> bool:
        """Whether the service said it serves; never blocks. Call it once more after the process
        ended: what it wrote before is still in the pipe."""
        if not self.serving and self.serving_pipe >= 0:
            try:
                said = os.read(self.serving_pipe, 64)
            except BlockingIOError:
                return False  # nothing yet
            self.serving = bool(said)
            os.close(self.serving_pipe)  # it said so, or it closed its end: nothing more will come
            self.serving_pipe = -1
        return self.serving

    def close(self) -> None:
        if self.serving_pipe >= 0:
            os.close(self.serving_pipe)
            self.serving_pipe = -1


def _start(name: str, command: list[str]) -> Child:
    read_end, write_end = os.pipe()
    try:
        os.set_blocking(read_end, False)
        process = subprocess.Popen(
            command, pass_fds=(write_end,), env={**os.environ, SERVING_FD_ENV: str(write_end)}
        )
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)  # the service holds it now: the pipe reads as closed once it exits
    return Child(name, process, read_end)


def _flags_of(name: str, text: str, prog: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as error:  # a usage error, as argparse reports them
        print(f"{prog}: error: --{name}: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # e.g. a real-time signal
        return f"signal {number}"


def _exit_status(returncode: int) -> int:
    """The supervisor's exit status for a service that ended unasked with `returncode`."""
    if returncode < 0:
        return 128 - returncode  # killed by a signal, as shells report it
    return returncode or 1


def main(argv: Sequence[str] | None = None, prog: str = "python -m services") -> int:
    values = parse_options(OPTIONS, argv, prog=prog, description=DESCRIPTION, epilog=EPILOG)
    configure_logging(values["log_level"], values["log_format"], values["log_file"])
    logging_flags = ["--log_level", values["log_level"], "--log_format", values["log_format"]]
    if values["log_file"]:
        logging_flags += ["--log_file", values["log_file"]]
    commands = {
        name: [sys.executable, "-m", f"services.{name}", *logging_flags, *_flags_of(name, values[name], prog)]
        for name in SERVICES
    }
    children: list[Child] = []
    signals_received = 0

    def forward() -> None:
        # The first signal asks the services to stop; another one does not wait for them.
        sent = signal.SIGTERM if signals_received <= 1 else signal.SIGKILL
        for child in children:
            if child.process.poll() is None:
                child.process.send_signal(sent)

    def on_signal(_signum: int, _frame: object) -> None:
        nonlocal signals_received
        signals_received += 1
        forward()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    ended: Child | None = None
    status = 0
    try:
        for name, command in commands.items():
            if signals_received:
                break
            children.append(_start(name, command))
            log.info("started", service=name, pid=children[-1].process.pid)
        if signals_received:  # a child started while the signal was handled has not had it
            forward()
        while not signals_received:
            for child in children:
                child.check_serving()
            ended = next((child for child in children if child.process.poll() is not None), None)
            if ended is not None:
                break
            time.sleep(POLL_INTERVAL_S)
        if ended is not None and not signals_received:
            returncode = ended.process.returncode
            # One that never served failed to start: its own line (`cannot start`) said why.
            log.error(
                "a service ended: stopping the others"
                if ended.check_serving()
                else "a service failed to start: stopping the others",
                service=ended.name,
                pid=ended.process.pid,
                exit_status=None if returncode < 0 else returncode,
                signal=_signal_name(-returncode) if returncode < 0 else None,
            )
            status = _exit_status(returncode)
    finally:
        if not signals_received:  # a service ended, or the supervisor failed: stop the others
            forward()
        for child in children:
            returncode = child.process.wait()
            if child is not ended and returncode not in STOPPED_CLEANLY:
                # Stopped while it was still starting, it may have failed to start all the same
                # (its port taken by another `python -m services`): its own line said why.
                log.error(
                    "a service failed to stop cleanly"
                    if child.check_serving()
                    else "a service failed to start",
                    service=child.name,
                    exit_status=returncode,
                )
                status = status or _exit_status(returncode)
            child.close()
    return status


if __name__ == "__main__":
    sys.exit(main())
