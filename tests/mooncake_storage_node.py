"""A Mooncake Store storage process for tests/mooncake_pool.py: lends SEGMENT bytes to the pool
of the master at 127.0.0.1:PORT, prints "ready" and sleeps until killed (it dies with its parent)."""

import ctypes
import os
import signal
import sys
import time

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: never outlive the test process

from mooncake.store import MooncakeDistributedStore  # noqa: E402

port, segment = sys.argv[1], int(sys.argv[2])
store = MooncakeDistributedStore()
rc = store.setup("127.0.0.1", "P2PHANDSHAKE", segment, 16 << 20, "tcp", "", f"127.0.0.1:{port}")
print("ready" if rc == 0 else f"setup failed {rc}", flush=True)
while True:
    time.sleep(3600)
