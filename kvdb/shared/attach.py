"""``kvdb.open(..., shared=, shared_bytes=)``: the shared tier made and attached to an open Db."""

from __future__ import annotations

from pathlib import Path

from kvdb.cold.codec import Sealer, read_key_file
from kvdb.errors import KvdbError
from kvdb.format.manifest import read_manifest
from kvdb.format.shared_object import namespace_name
from kvdb.shared.tier import SharedTier
from kvdb.shared.url import SharedConfig

#: what names a Db's objects in the pool (docs/shared.md S4), besides layout and model id
_MANIFEST_FIELDS = ("model_revision", "key_algo", "tp_rank", "tp_size", "pp_rank", "pp_size", "key_secret_id")


def namespace_of(db, sealed: bool) -> str:
    """The pool namespace of ``db``'s blocks: model, revision, layout, key algorithm, ranks, the
    key secret's id, the public key namespace and whether pages are sealed."""
    try:
        manifest = read_manifest(Path(db.path)) or {}
    except KvdbError:
        manifest = {}
    fields = {name: manifest.get(name) for name in _MANIFEST_FIELDS}
    fields["model_id"] = db.model_id
    fields["layout"] = db.layout.to_dict()
    public = getattr(db.keyspace, "public_namespace", None)
    fields["public"] = public.hex() if isinstance(public, bytes) else None
    fields["sealed"] = sealed
    return namespace_name(fields)


def attach_shared(db, cfg: SharedConfig, encryption_key_file=None) -> SharedTier:
    """Make the Db's shared tier (the client set up within the deadline; a pool not reachable
    now is probed later) and attach it."""
    sealer = Sealer(read_key_file(encryption_key_file)) if encryption_key_file is not None else None
    tier = SharedTier(db, cfg, namespace_of(db, sealer is not None), sealer)
    try:
        db.attach_shared(tier)
    except BaseException:
        tier.close()
        raise
    return tier
