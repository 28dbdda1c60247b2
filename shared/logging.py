"""structlog set-up shared by the services and command-line tools.

Levels follow the reference (`trace`, `debug`, `info`, `warning`, `error`, `off`); formats are
`text` (human readable, the default) and `json` (one object per line, forced when logging to a
file). Logs go to stderr unless `--log_file` names a file, which is appended to.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog

from shared.config import Option

# The reference's levels as standard-library levels (what libraries logging through it follow).
LEVELS = {
    "trace": 5,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "off": logging.CRITICAL + 10,
}
# structlog filters at the standard levels only (any other is a KeyError at start-up). Nothing
# here logs below debug, so trace filters as debug does; off filters as critical does, and
# `_drop_every_event` drops what remains.
_STRUCTLOG_LEVELS = {name: min(max(level, logging.DEBUG), logging.CRITICAL) for name, level in LEVELS.items()}


def logging_options() -> list[Option]:
    return [
        Option("log_level", "log level", "info", "COGMENT_LOG_LEVEL", str.lower, choices=list(LEVELS)),
        Option("log_format", "log format", "text", "COGMENT_LOG_FORMAT", str.lower, choices=["text", "json"]),
        Option("log_file", "append logs to this file (JSON) instead of stderr", None, "COGMENT_LOG_FILE"),
    ]


_log_stream: TextIO | None = None


def configure_logging(
    level: str = "info", log_format: str = "text", log_file: str | None = None, *, service: str | None = None
) -> None:
    """Log at `level` in `log_format` to stderr or `log_file`. With `service`, every line of the
    process says `service=<name>`, those of libraries logging through the standard library (alembic,
    grpc, asyncio) included: processes sharing a stderr (`python -m services`) or a log collector
    can then be told apart, whatever logged the line."""
    global _log_stream
    if _log_stream is not None and _log_stream is not sys.stderr:
        _log_stream.close()
    _log_stream = open(log_file, "a", encoding="utf-8", buffering=1) if log_file else sys.stderr  # noqa: SIM115
    if log_file:
        log_format = "json"
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if log_format == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    # What every line gets, before it is rendered.
    shared_processors: list[Any] = [
        *([_service_adder(service)] if service else []),
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
    ]
    structlog.configure(
        processors=[
            *([_drop_every_event] if level == "off" else []),
            structlog.contextvars.merge_contextvars,
            *shared_processors,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_STRUCTLOG_LEVELS[level]),
        # One write per line (print writes the newline apart): processes sharing a stderr, as
        # under `python -m services`, do not interleave within lines.
        logger_factory=structlog.WriteLoggerFactory(_log_stream),
        # Loggers bind their configuration on first use instead of on every call (hot path).
        cache_logger_on_first_use=True,
    )
    # Libraries logging through the standard library (alembic, grpc) follow the same level, and
    # their lines are rendered as the others (JSON lines stay JSON).
    handler = logging.StreamHandler(_log_stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared_processors],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    logging.basicConfig(level=max(LEVELS[level], logging.WARNING), handlers=[handler], force=True)
    # Python's warnings (a library's SAWarning, a DeprecationWarning) are log lines too, rendered
    # as the others: a plain line would break a JSON log, and its collector.
    logging.captureWarnings(True)
    # The S3 client (urllib3) logs a warning per retried attempt: during an outage, a few lines a
    # second. The dependency watcher already says once that the blob store is away, and once that
    # it is back (shared.dependencies); the attempts are for debugging.
    debugging = LEVELS[level] <= logging.DEBUG
    logging.getLogger("urllib3").setLevel(logging.WARNING if debugging else logging.ERROR)


def _service_adder(service: str) -> Any:
    def add_service(_logger: Any, _method: str, event: dict[str, Any]) -> dict[str, Any]:
        event.setdefault("service", service)
        return event

    return add_service


def _drop_every_event(_logger: Any, _method: str, _event: Any) -> Any:
    raise structlog.DropEvent


def get_logger(name: str) -> Any:
    return structlog.get_logger(name)
