"""This process's TCP connections, and shutting some of them down from another thread.

A wait in C++ (a collective, ``init_process_group``'s store requests) cannot be interrupted from Python;
what ends it at once is its connection failing. The watch (``peers.abort_group``, ``setup_watch``)
uses these to stop a wait for a rank that is known to be gone.
"""
from __future__ import annotations

import contextlib
import os
import socket


def tcp_connections() -> set:
    """This process's established TCP connections as (fd, local address, remote address)."""
    try:
        import psutil
        me = psutil.Process()
        listing = me.net_connections(kind="inet") if hasattr(me, "net_connections") else me.connections(kind="inet")
        return {(c.fd, tuple(c.laddr), tuple(c.raddr)) for c in listing
                if c.status == psutil.CONN_ESTABLISHED and c.fd != -1 and c.raddr}
    except Exception:   # noqa: BLE001 - without psutil (or its permission) a wait lasts until its own timeout
        return set()


def shut_down(connections) -> int:
    """Shut down each (fd, local, remote) connection that is still open with the same two ends (an fd number
    may have been reused since it was listed); how many were."""
    still_open = tcp_connections() & set(connections)
    for fd, _, _ in still_open:
        with contextlib.suppress(OSError):
            with socket.socket(fileno=os.dup(fd)) as s:   # a duplicate: shutdown reaches the shared socket
                s.shutdown(socket.SHUT_RDWR)
    return len(still_open)
