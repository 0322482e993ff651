"""Free loopback ports for what a run starts on this machine: engine servers and the weight-sync rendezvous.

A port found free here can be taken by another process before it is bound; callers that start a server on it
retry with a new one (the engine launchers, the weight-sync group's rendezvous).
"""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A currently free TCP port on ``host`` (loopback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
