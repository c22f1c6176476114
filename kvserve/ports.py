"""Ports to hand to a socket that binds later (another process's, a ZMQ publisher's), taken
below the kernel's ephemeral range.

Why not bind(0) and release: that port comes from the ephemeral range, where any outgoing
connection on the host (a router's health check, a ZMQ connect) may be given it before its
owner binds it; CI lost a KV events port that way (2026-11-28). Below the range only another
listener can take it, and none in this process is handed the same port twice."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_ports = random.Random()  # its own generator: code that seeds `random` must not repeat ports
_handed_out: set[int] = set()
_TRIES = 256
_SPAN = 16384  # ports below the ephemeral range drawn from


def free_port(host: str = "127.0.0.1") -> int:
    """A port of `host` ("" for every interface) free now and never handed out before in this
    process; the kernel's pick from the ephemeral range when there is no room below it."""
    low = _ephemeral_low()
    if low - 1024 >= 4096:
        for _ in range(_TRIES):
            port = _ports.randrange(max(1024, low - _SPAN), low)
            if port not in _handed_out and _bindable(host, port):
                _handed_out.add(port)
                return port
    with socket.socket(_family(host)) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; other systems differ, and the bind check still holds


def _bindable(host: str, port: int) -> bool:
    with socket.socket(_family(host)) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
