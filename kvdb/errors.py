"""The exception tree of kvdb (docs/style.md "Errors").

Every error kvdb raises on purpose is a ``KvdbError``. Outcomes that are part of normal
operation -- a cache miss, no free frame, a rejected hint -- are return values, never
exceptions. Messages say what was wrong and what to do about it.

    KvdbError
    ├── CorruptionError      stored bytes fail a checksum, key or format check
    ├── StorageIOError       the file layer failed (ENOSPC, EIO, ...); the Db becomes failed
    │   └── DbFailedError    a call on a Db in the sticky failed state
    ├── CapacityError        a capacity that cannot hold even one page, or a full pinned tier
    ├── InvalidInput         bad arguments (also a ValueError)
    ├── NotFound             an unknown key, session or path (also a KeyError)
    ├── DbLockedError        the path is open in another process or Db
    ├── StoreChangedError    a read-only inspection's store changed too fast to inspect; try again
    ├── ReplicationError     a peer or stream failed
    │   ├── AuthError        a peer failed authentication
    │   └── NamespaceError   a peer or follower holds another namespace (model, layout, key secret, ...)
    └── EndpointError        the vLLM connector's local socket refused or failed a peer
        └── FrameTooLarge    a request over the endpoint's frame limit, refused before it was sent
"""

from __future__ import annotations


class KvdbError(Exception):
    """Base of every error kvdb raises on purpose."""


class CorruptionError(KvdbError):
    """Stored bytes failed a checksum, key or format check."""


class StorageIOError(KvdbError):
    """The file layer failed. The Db that saw it is in the sticky failed state."""


class DbFailedError(StorageIOError):
    """The Db is in the sticky failed state after an I/O error: close it and open it again."""


class CapacityError(KvdbError):
    """A capacity too small for one page, or no evictable page where one is required."""


class InvalidInput(KvdbError, ValueError):
    """An argument is malformed: wrong shape, dtype, device, range or type."""


class NotFound(KvdbError, KeyError):
    """A key, session or path that is not there."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class DbLockedError(KvdbError):
    """The data directory is already open (in this or another process)."""


class StoreChangedError(KvdbError):
    """A read-only view (``read_only`` open, ``kvdb verify`` / ``stats`` / ``ls`` / ``get`` /
    ``wal dump``) saw its store's files created or deleted by a live writer during every attempt
    (kvdb/cold/view.py): no verdict, damage or not. Run it again."""


class ReplicationError(KvdbError):
    """A replication peer or stream failed."""


class AuthError(ReplicationError):
    """A peer failed authentication (no or wrong shared secret)."""


class NamespaceError(ReplicationError):
    """A peer or follower holds blocks of another namespace (model, revision, layout, dtype, key
    algorithm, rank or key secret: kvdb/replication/namespace.py); nothing was sent, fetched or
    applied."""


class EndpointError(KvdbError):
    """A local endpoint (the vLLM connector's socket, kvdb/integrations/vllm/endpoint.py) could
    not be served or reached: a name already bound, a peer of another user or one that failed
    the secret's proof."""


class FrameTooLarge(EndpointError):
    """A request over the endpoint's frame limit, refused before anything was sent."""
