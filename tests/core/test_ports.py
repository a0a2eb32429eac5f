"""Ports handed to child processes: distinct, free, and outside the kernel's ephemeral range
(where outgoing connections and binds to port 0 would take them before the child binds)."""

from __future__ import annotations

import socket

from core.ports import ephemeral_range, free_ports


def test_ports_are_distinct_free_and_not_ephemeral() -> None:
    low, high = ephemeral_range()
    ports = free_ports(12)
    assert len(set(ports)) == 12
    if low - 15000 >= 1000:  # room below the range (Linux's default 32768-60999)
        assert all(not low <= port <= high for port in ports), ports
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_taken_port_is_never_handed_out() -> None:
    held = [socket.socket() for _ in range(50)]
    try:
        for sock in held:
            sock.bind(("127.0.0.1", free_ports(1)[0]))
        taken = {sock.getsockname()[1] for sock in held}
        assert len(taken) == 50
        assert not taken & set(free_ports(20))
    finally:
        for sock in held:
            sock.close()
