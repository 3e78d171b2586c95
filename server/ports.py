"""TCP ports a server listens on: one free now, one checked before a slow start, one held for front ends.

Linux lets a bind past an earlier server's sockets in TIME-WAIT only with SO_REUSEADDR, and past a live listener only
where both have SO_REUSEPORT (and one user). So a port is checked and held with SO_REUSEADDR alone: free of
listeners, whatever an earlier run left in TIME-WAIT."""

from __future__ import annotations

import errno
import socket


class PortInUse(RuntimeError):
    """The port a server was asked for is taken: something else listens on it (an earlier server's sockets in
    TIME-WAIT do not take it)."""

    def __init__(self, host: str, port: int):
        super().__init__(f"cannot listen on {host}:{port}: the port is in use")


def free_port() -> int:
    """A TCP port nobody listens on now, on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bound(host: str, port: int) -> socket.socket:
    """A socket bound to (`host`, `port`) with SO_REUSEADDR alone, not listening (port 0: a free one); `PortInUse`
    if something listens there."""
    held = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        held.bind((host, port))
    except OSError as e:
        held.close()
        if e.errno == errno.EADDRINUSE:
            raise PortInUse(host, port) from None
        raise
    return held


def check_free(host: str, port: int) -> None:
    """`PortInUse` if something listens on (`host`, `port`) now: a start that takes long (a model loads) says so
    first. The listen itself still checks: another may take the port meanwhile."""
    bound(host, port).close()


def reserve(host: str, port: int) -> socket.socket:
    """`bound`, then SO_REUSEPORT in place of SO_REUSEADDR (Linux reads them at each later bind): it holds the port
    (port 0: a free one) until front ends of this user, which bind with both, listen beside it; a listener without
    SO_REUSEPORT started meanwhile cannot, nor can another `--frontends` server, which meets the first bind."""
    held = bound(host, port)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    return held
