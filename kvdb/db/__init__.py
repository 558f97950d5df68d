"""Db: the embedded database (``kvdb.open``). The states, the lock and the lookup counting are
documented at the top of ``kvdb.db.core``, the data directory at the top of ``kvdb.db.open``.

Modules: ``core`` (the class: states, close, stats), ``open`` (the directory: lock, key secret,
manifest, recovery steps, options), ``write`` (put, the one write path, write-back, flush,
delete), ``read`` (lookups, get, pin), ``moves`` (prefetch, offload, the device watermark),
``landing`` (zero-copy landing of blocks written into reserved frames), ``attached`` (the hook
replication attaches to from above), ``plans/`` (the planner's engine API and the moves it
plans), ``mover`` (the background thread and its timer heap), ``handles`` (PinnedPages,
ReservedFrames). Nothing here imports a layer above the Db (kvdb/replication/, kvdb/cli/).
"""

from kvdb.db.core import DURABILITIES, Db
from kvdb.db.handles import PinnedPages, ReservedFrames

__all__ = ["DURABILITIES", "Db", "PinnedPages", "ReservedFrames"]
