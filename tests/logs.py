"""What the tests read in a process's log (core/logs.py): text lines' key=value fields, JSON
lines, the access lines of a gateway."""

from __future__ import annotations

import json
import shlex

from tests.processes import wait_for
from urc.processes import Child


def logfmt(line: str) -> dict[str, str]:
    """The key=value fields of a text log line (a quoted value unquoted)."""
    fields = {}
    for token in shlex.split(line.partition(": ")[2], posix=True):
        key, sep, value = token.partition("=")
        if sep:
            fields[key] = value
    return fields


def text_lines(child: Child, logger: str) -> list[dict[str, str]]:
    """The fields of `child`'s text lines from `logger`."""
    marker = f" {logger}: "
    return [logfmt(line) for line in list(child.lines) if marker in line]


def json_lines(child: Child) -> list[dict]:
    """Every JSON object line of `child` (its log; the announcement lines are not JSON)."""
    return [json.loads(line) for line in list(child.lines) if line.startswith("{")]


def access_line(child: Child, request_id: str, json_format: bool = False) -> dict:
    """The gateway's access line of `request_id`, once written (bounded wait)."""

    def find() -> dict | None:
        if json_format:
            lines = [d for d in json_lines(child) if d["logger"] == "urc.access"]
        else:
            lines = text_lines(child, "urc.access")
        return next((d for d in lines if d.get("request_id") == request_id), None)

    assert wait_for(lambda: find() is not None, 10), child.lines[-20:]
    found = find()
    assert found is not None
    return found
