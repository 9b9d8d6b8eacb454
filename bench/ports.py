"""The one free_port of the benches (each starts torchrun or a server on a port nobody holds)."""
from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port free on loopback now (the OS's pick; another process may still take it before it is bound)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
