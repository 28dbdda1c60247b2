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

LEVELS = {
    "trace": 5,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "off": logging.CRITICAL + 10,
}


def logging_options() -> list[Option]:
    return [
        Option("log_level", "log level", "info", "COGMENT_LOG_LEVEL", str.lower, choices=list(LEVELS)),
        Option("log_format", "log format", "text", "COGMENT_LOG_FORMAT", str.lower, choices=["text", "json"]),
        Option("log_file", "append logs to this file (JSON) instead of stderr", None, "COGMENT_LOG_FILE"),
    ]


_log_stream: TextIO | None = None


def configure_logging(level: str = "info", log_format: str = "text", log_file: str | None = None) -> None:
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
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(_log_stream),
        # Loggers bind their configuration on first use instead of on every call (hot path).
        cache_logger_on_first_use=True,
    )
    # Libraries logging through the standard library (alembic, grpc) follow the same level.
    logging.basicConfig(level=max(LEVELS[level], logging.WARNING), stream=_log_stream, force=True)


def get_logger(name: str) -> Any:
    return structlog.get_logger(name)
