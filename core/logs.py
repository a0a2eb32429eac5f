"""Logging for every urc process that serves (docs/operability.md): the standard library's
root logger, configured once at start-up, as text (ISO time, level, logger, message, then
key=value fields) or one JSON object per line; and request ids, taken from the client or made."""

from __future__ import annotations

import itertools
import json
import logging
import re
import secrets
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID = 128
_PLAIN = re.compile(r"[!#-<>-\[\]-~]+")  # printable ASCII but space, `"`, `=` and `\\`
_CHATTY = ("httpx", "httpcore", "urllib3")  # a line per HTTP call at INFO: shown at debug only


def configure_logging(level: str = "info", fmt: str = "text", stream: TextIO | None = None) -> None:
    """One handler on the root logger, to stderr; a second call replaces the first's."""
    if level not in LEVELS or fmt not in FORMATS:
        raise ValueError(f"log level must be one of {LEVELS}, format one of {FORMATS}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(level.upper())
    quiet = logging.DEBUG if level == "debug" else logging.WARNING
    for name in _CHATTY:
        logging.getLogger(name).setLevel(quiet)


def iso_time(created: float) -> str:
    """UTC, milliseconds: 2025-01-31T12:00:00.123Z."""
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created))
    return f"{seconds}.{int(created * 1000) % 1000:03d}Z"


def fields_of(record: logging.LogRecord) -> Mapping[str, Any]:
    """The `extra={"fields": {...}}` of a call: structured fields (access lines have them)."""
    fields = getattr(record, "fields", None)
    return fields if isinstance(fields, Mapping) else {}


def logfmt_value(value: Any) -> str:
    """A value of a key=value pair: `-` for None, quoted when it has spaces, quotes or `=`."""
    if value is None:
        return "-"
    if value is True or value is False:
        return "true" if value else "false"
    if type(value) is int or type(value) is float:
        return str(value)
    text = str(value)
    return text if _PLAIN.fullmatch(text) else json.dumps(text)


class TextFormatter(logging.Formatter):
    """`2025-01-31T12:00:00.123Z INFO urc.access: message key=value ...`."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{iso_time(record.created)} {record.levelname} {record.name}: {record.getMessage()}"
        fields = fields_of(record)
        if fields:
            line += " " + " ".join(f"{k}={logfmt_value(v)}" for k, v in fields.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        elif record.stack_info:
            line += "\n" + self.formatStack(record.stack_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, then the record's fields."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": iso_time(record.created),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in fields_of(record).items():
            doc.setdefault(key, value)
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str, ensure_ascii=False)


def valid_request_id(value: str) -> bool:
    """A client's x-request-id we pass on: printable ASCII, 1 to 128 characters."""
    return 0 < len(value) <= MAX_REQUEST_ID and value.isascii() and value.isprintable()


class RequestIds:
    """Ids for requests that came without one: a random prefix per process, then a counter
    (unique across replicas and restarts without a random draw per request)."""

    def __init__(self) -> None:
        self.prefix = secrets.token_hex(6)
        self._count = itertools.count(1)

    def next(self) -> str:
        return f"{self.prefix}-{next(self._count):x}"

    def of(self, sent: str | None) -> str:
        """The client's id when it is valid, else a new one."""
        return sent if sent is not None and valid_request_id(sent) else self.next()
