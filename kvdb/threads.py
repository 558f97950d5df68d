"""Joining the worker threads a server started; handing work to a pool that may refuse it.

A daemon thread still unwinding when the interpreter exits is ended by CPython inside whatever
C++ destructor it was running (torch frees a tensor by taking the GIL), and that aborts the
process ("terminate called without an active exception"). So a server's ``stop`` / ``close``
joins the threads it started before it returns (kvdb/replication/node.py, the vLLM lookup
service in kvdb/integrations/vllm/service.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future


def join_all(threads: Iterable[threading.Thread], timeout_s: float) -> None:
    """Join every thread (but the calling one) within ``timeout_s`` in all."""
    deadline = time.monotonic() + timeout_s
    me = threading.current_thread()
    for t in threads:
        if t is not me:
            t.join(max(0.0, deadline - time.monotonic()))


def submit_or_none(pool: Executor | None, fn: Callable, *args) -> Future | None:
    """``pool.submit(fn, *args)``, or None when there is no pool or it no longer takes work: the
    caller then runs ``fn`` itself. Once the interpreter has begun to exit, concurrent.futures
    refuses new futures ("cannot schedule new futures after interpreter shutdown") and Python
    3.12+ refuses new threads, yet the exit hook's write-back (kvdb/db/core.py) still has to go
    through the same pipelined paths (kvdb/wal/writer.py ``append_rows``, kvdb/cold/read.py)."""
    if pool is None:
        return None
    try:
        return pool.submit(fn, *args)
    except RuntimeError:
        return None
