"""Joining the worker threads a server started.

A daemon thread still unwinding when the interpreter exits is ended by CPython inside whatever
C++ destructor it was running (torch frees a tensor by taking the GIL), and that aborts the
process ("terminate called without an active exception"). So a server's ``stop`` / ``close``
joins the threads it started before it returns (kvdb/replication/node.py, the vLLM lookup
service in kvdb/integrations/vllm/service.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable


def join_all(threads: Iterable[threading.Thread], timeout_s: float) -> None:
    """Join every thread (but the calling one) within ``timeout_s`` in all."""
    deadline = time.monotonic() + timeout_s
    me = threading.current_thread()
    for t in threads:
        if t is not me:
            t.join(max(0.0, deadline - time.monotonic()))
