"""What the benchmarks share besides their processes (urc/processes.py): CPU accounting from
/proc, percentiles, progress lines, a worker with negligible GPU time, the shared trace."""

import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ scripts run from the root

from loadgen.report import percentile as loadgen_percentile  # noqa: E402
from urc.processes import Child, start_worker  # noqa: E402

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
SHARED_TRACE = Path(__file__).resolve().parents[1] / "traces/mooncake_synthetic_trace.jsonl"


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (all its threads) and its live descendants so far (a
    gateway with --processes N: the parent and its N children); 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except OSError:
        return 0.0
    own = (int(fields[11]) + int(fields[12])) * TICK_S  # utime, stime
    return own + sum(cpu_seconds(child) for child in children)


def machine_cpu_seconds() -> float:
    """Busy CPU seconds of the whole machine so far (every process, ours and others')."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks
    return (user + nice + system + irq + softirq + steal) * TICK_S


def percentile(values: list[float], q: float) -> float:
    """loadgen's percentile (linear interpolation) for q in [0, 1]; NaN for no values."""
    value = loadgen_percentile(values, q * 100)
    return math.nan if value is None else value


def log(message: str) -> None:
    """A progress line on stderr (stdout holds the results)."""
    print(message, file=sys.stderr, flush=True)


def fast_worker(*extra: str, decode_step_ms: float = 0.01) -> Child:
    """An emulated worker with negligible modelled GPU time: what remains is HTTP and routing."""
    fast = ["--prefill-tokens-per-s", "1e9", "--decode-per-request-ms", "0"]
    return start_worker(*fast, "--decode-base-ms", str(decode_step_ms), *extra)
