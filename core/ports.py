"""Ports to hand to another process before it binds them (engines, workers, gateways started
as children). Between our check and its bind the port is free for anyone to take, and the
likeliest taker is the kernel itself: it hands ports of its ephemeral range to every outgoing
connection and to every bind to port 0 (which is how engines pick their internal ports). So
ports are drawn from outside that range, where only a process that names a port can collide."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 15000  # below: ports that well-known services tend to name
_HIGHEST = 65535
_MIN_POOL = 1000  # a smaller pool outside the ephemeral range: let the kernel choose


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it picks itself (Linux; elsewhere the IANA range)."""
    try:
        low, high = _RANGE_FILE.read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535


def _pool() -> range | None:
    low, high = ephemeral_range()
    below = range(_LOWEST, min(low, _HIGHEST + 1))
    above = range(max(high + 1, _LOWEST), _HIGHEST + 1)
    widest = max(below, above, key=len)
    return widest if len(widest) >= _MIN_POOL else None


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports free on `host` now, outside the ephemeral range where it leaves room
    (held open together while checked, so that none is handed out twice)."""
    pool = _pool()
    socks: list[socket.socket] = []
    try:
        for attempt in range(64 * n):
            if len(socks) == n:
                break
            # a draw that is taken (or drawn twice) fails to bind; late on, the kernel chooses
            port = random.choice(pool) if pool is not None and attempt < 32 * n else 0
            sock = socket.socket()
            try:
                sock.bind((host, port))
            except OSError:
                sock.close()
                continue
            socks.append(sock)
        if len(socks) < n:
            raise OSError(f"no {n} free ports on {host}")
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def check_listen(host: str, port: int) -> None:
    """The OSError a server would meet binding `host:port` now (as asyncio binds: every address
    `host` resolves to, SO_REUSEADDR); nothing for port 0 or a free port. Nothing is held."""
    if port == 0:
        return
    for family, kind, proto, _, address in socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    ):
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
