"""Envoy in bench/gateway_overhead.py: its report lines (Envoy + urc epp against Envoy round
robin and urc gateway) and the Envoy config of a base checkout's urc epp."""

import json
import subprocess
import sys

import overhead_load as load
from overhead_load import ratio


def envoy_lines(result: load.Result, routers: list[str]) -> list[str]:
    """Envoy + urc epp against Envoy round robin and urc gateway: added p50 / p99, ratios;
    the picker's CPU per request against the gateway's (with --base: the base's too)."""
    out = ["", "Envoy + urc epp, added p50 / p99 (ms): against Envoy round robin and urc gateway"]
    epps = [n for n in routers if n.startswith("envoy-epp")]
    for row in result.latency:
        p50, p99 = row.added_p50_ms, row.added_p99_ms
        line = f"  {row.metric:<20} c={row.concurrency:<3}"
        for name in ("envoy-rr", "urc"):
            line += f" {name} {p50[name]:.2f} / {p99[name]:.2f} "
        for name in epps:
            line += f"  {name} {p50[name]:.2f} / {p99[name]:.2f}"
            line += f" (/urc {ratio(p50[name], p50['urc'])} / {ratio(p99[name], p99['urc'])})"
        out.append(line)
    for row in result.throughput:
        cpu = row.cpu_us_per_request
        line = f"  CPU per request, {row.metric}: urc gateway {cpu['urc']['urc']:.0f} us"
        for name in epps:
            picker = cpu[name][name.replace("envoy", "picker")]
            line += f"   {name}: urc epp {picker:.0f} us ({ratio(picker, cpu['urc']['urc'])}x)"
            line += f" + Envoy {cpu[name][name]:.0f} us"
        out.append(line)
    return out


def checkout_config(checkout: str, kwargs: dict, port: int, admin_port: int) -> dict:
    """`epp_envoy_config(port, admin_port, **kwargs)` of the checkout in the folder `checkout`."""
    code = f"import json, sys; sys.path.insert(0, {checkout!r}); "
    code += "from urc.envoy_epp import epp_envoy_config as c; "
    code += f"print(json.dumps(c({port}, {admin_port}, **{kwargs!r})))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(run.stdout.splitlines()[-1])
