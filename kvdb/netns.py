"""A private network namespace with only loopback up, for tests and loopback benchmarks.

The Mooncake Transfer Engine binds its listeners to 0.0.0.0 whatever it is told, so every
multi-node test and the replication benchmark run inside a fresh network namespace: nothing
they open is reachable from outside the machine.

``private_netns()`` moves the *calling thread* into a new namespace (``unshare(CLONE_NEWNET)``
acts on one thread), brings ``lo`` up, and moves the thread back on exit. Threads and child
processes started from that thread while inside inherit the namespace, so node servers (threads
or ``subprocess`` children) and the in-process engine all share ONE namespace; sockets and
listeners keep their namespace after the thread leaves. It needs CAP_SYS_ADMIN (root, or root
in a container); ``netns_unavailable()`` says why not otherwise, so callers can skip.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import signal
import socket
import struct
from contextlib import contextmanager

from kvdb.errors import KvdbError

CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_IFF_RUNNING = 0x40

_libc = None


def _c():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _bring_lo_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifr = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, ifr))[1]
        fcntl.ioctl(s.fileno(), _SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | _IFF_UP | _IFF_RUNNING))


def netns_unavailable() -> str | None:
    """None when ``private_netns`` works here, else the reason (for a test's skip message)."""
    if not os.path.exists("/proc/thread-self/ns/net"):
        return "network namespaces need Linux"
    try:
        with private_netns():
            pass
    except KvdbError as e:
        return str(e)
    return None


@contextmanager
def private_netns():
    """Run the body in a new network namespace with only loopback up (calling thread only)."""
    try:
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    except OSError as e:
        raise KvdbError(f"cannot open this thread's network namespace: {e}") from None
    try:
        if _c().unshare(CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise KvdbError(f"unshare(CLONE_NEWNET) failed: {os.strerror(err)} "
                                   "(needs CAP_SYS_ADMIN: run as root or in a privileged container)")
        try:
            _bring_lo_up()
            yield
        finally:
            if _c().setns(home, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise KvdbError(f"setns back to the original network namespace failed: {os.strerror(err)}")
    finally:
        os.close(home)


def die_with_parent() -> None:
    """A ``preexec_fn``: the child gets SIGKILL when its parent dies (PR_SET_PDEATHSIG), so no
    node, pool or engine process outlives a killed test or benchmark run."""
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)

