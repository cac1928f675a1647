"""The command's logging: the standard ``logging`` module, as text or one JSON object a line."""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import Any

from ..integrations._json import json_safe

__all__ = ["LEVELS", "JsonFormatter", "configure"]

LEVELS = ("critical", "error", "warning", "info", "debug")
TEXT_FORMAT = "%(asctime)s %(levelname)s [%(process)d] %(name)s: %(message)s"

#: The attributes every ``LogRecord`` has; any other one came in ``extra=``.
_STANDARD = frozenset(
    logging.LogRecord("", 0, "", 0, "", (), None).__dict__.keys()
    | {"message", "asctime", "taskName"}
)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line.

    Keys: ``time`` (ISO 8601, UTC, milliseconds), ``level``, ``logger``, ``message``,
    ``pid``, ``exception`` (the formatted traceback, when there is one), then every
    field the record got through ``extra=`` (the bus's ``asyncbus_*`` fields among
    them), made JSON-safe.
    """

    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        if record.exc_info:
            document["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            document["exception"] = record.exc_text
        if record.stack_info:
            document["stack"] = self.formatStack(record.stack_info)
        for key, value in record.__dict__.items():
            if key not in _STANDARD and key not in document:
                document[key] = json_safe(value)
        return json.dumps(document, ensure_ascii=False, allow_nan=False)


def configure(level: str, format: str) -> None:
    """Send every record at ``level`` or above to stderr, as ``text`` or ``json``.

    Replaces the root logger's handlers: the command owns the process's logging (a
    module that configures logging itself when imported overrides this).
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
