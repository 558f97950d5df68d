"""Db: the embedded database (``kvdb.open``). The data directory, the lock, the states and the
lookup counting are documented at the top of ``kvdb.db.core``.

Modules: ``core`` (the Db: open / close, writes, reads, pins, moves, stats), ``handles``
(PinnedPages, ReservedFrames), ``sessions`` (the planner's engine API and the moves it
plans), ``mover`` (the background thread and its timer heap), ``landing`` (zero-copy
landing of blocks written into reserved frames), ``replication`` (push, followers, remote
lookup).
"""

from kvdb.db.core import DURABILITIES, Db, open
from kvdb.db.handles import PinnedPages, ReservedFrames

__all__ = ["DURABILITIES", "Db", "PinnedPages", "ReservedFrames", "open"]
