"""Test-only helpers over urc/processes.py: a worker for the length of a `with`, bounded polls."""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable, Iterator

from urc.processes import Child, start_worker


@contextlib.contextmanager
def running_worker(
    module: str, *args: str, stop: signal.Signals = signal.SIGTERM
) -> Iterator[Child]:
    """A worker for the length of a `with`; on leaving, `stop` it and require exit code 0."""
    child = start_worker(*args, module=module)
    try:
        yield child
    finally:
        if (code := child.stop(stop)) != 0:
            raise child.fail(f"exited with {code} on {stop.name}")


def wait_for(predicate: Callable[[], object], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return bool(predicate())
