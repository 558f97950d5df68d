"""Where a log-shipping leader sends a batch of records from (shipping.py), when the Transfer
Engine writes it into the follower's region."""

from __future__ import annotations

import numpy as np
import torch

from kvdb.replication.transport import Transport


class SendBuffers:
    """Records that lie back to back in one segment map (the usual case) go straight from the
    map, registered with the engine once per map: no copy. Others are copied into a registered
    staging buffer of two halves, allocated on first need. ``release`` unregisters all of it."""

    def __init__(self, transport: Transport, half: int) -> None:
        self.transport = transport
        self.half = half
        self._maps: dict[int, int] = {}  # id(map) -> registered base address
        self._staging: torch.Tensor | None = None

    def source(self, recs, off: int) -> int:
        """The address to send ``recs`` ([(lsn, memoryview)]) from; ``off`` picks the staging half."""
        first = recs[0][1]
        owner = getattr(first, "obj", None)
        addrs = [np.frombuffer(b, dtype=np.uint8).ctypes.data for _, b in recs]
        contiguous = owner is not None and all(
            getattr(b, "obj", None) is owner and a + b.nbytes == nxt
            for (_, b), a, nxt in zip(recs, addrs, addrs[1:] + [addrs[-1] + recs[-1][1].nbytes]))
        if contiguous:
            if id(owner) not in self._maps:
                base = np.frombuffer(owner, dtype=np.uint8).ctypes.data
                self.transport.register_range(base, len(owner), owner)
                self._maps[id(owner)] = base
            return addrs[0]
        if self._staging is None:
            self._staging = torch.empty(2 * self.half, dtype=torch.uint8)
            self.transport.register(self._staging)
        dst = self._staging.numpy()
        pos = off
        for _, b in recs:
            dst[pos : pos + b.nbytes] = np.frombuffer(b, dtype=np.uint8)
            pos += b.nbytes
        return self._staging.data_ptr() + off

    def release(self) -> None:
        for base in self._maps.values():
            self.transport.unregister_range(base)
        self._maps.clear()
        if self._staging is not None:
            self.transport.unregister(self._staging)
            self._staging = None
