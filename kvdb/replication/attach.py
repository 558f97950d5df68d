"""Replication attaches to a Db from above: what ``kvdb.open(..., peers=, replicas=)`` adds.

The Db imports nothing of this package; it offers a hook (``Db.attach_replication``,
kvdb/db/attached.py) and this module fills it with a ``Replicator`` (replicator.py): the Db then
forwards ``push`` / ``sync_replicas`` / ``reseed_replica`` / ``replication_status`` to it, a
local lookup miss asks the ``peers`` (``Replicator.fetch_missing``), and the log ships to the
``replicas`` (shipping.py). ``Db.close`` closes the Replicator.
"""

from __future__ import annotations

import weakref
from typing import Sequence

from kvdb.errors import InvalidInput
from kvdb.replication.replicator import Replicator

_attached: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Db -> its Replicator


def replicator_of(db) -> Replicator | None:
    """The Replicator attached to ``db`` by ``attach_replication``, if any (a NodeServer serving
    that Db shows its counters there, node.py)."""
    try:
        return _attached.get(db)
    except TypeError:  # not weak-referenceable: nothing was attached to it here
        return None


def attach_replication(db, peers: Sequence[str] = (), replicas: Sequence[str] = (), secret_file=None,
                       transport: str | None = None) -> Replicator:
    """Build the Db's Replicator and attach it; InvalidInput for bad options (the caller closes
    the Db then)."""
    if secret_file is None:
        raise InvalidInput("peers= / replicas= need replication_secret_file= (a shared secret, the same on every node)")
    for addr in [*peers, *replicas]:
        if not isinstance(addr, str) or ":" not in addr:
            raise InvalidInput(f"a peer address is 'host:port', got {addr!r}")
    rep = Replicator(db, replicas=list(replicas), peers=list(peers), secret_file=secret_file, transport=transport)
    try:
        db.attach_replication(rep, on_miss=rep.fetch_missing if rep.peer_addrs else None)
    except BaseException:
        rep.close()
        raise
    _attached[db] = rep
    return rep
