"""What makes one node's blocks usable by another: the namespace a Db's keys and pages belong to.

Two Dbs may exchange blocks (a log stream, a push, a lookup) only when they hold KV of the same
model, revision, layout (dtype included), key algorithm and tensor / pipeline rank: otherwise a
follower would store pages its engine would misread, under keys its own lookups never compute.
Every node describes its Db with ``namespace_of(db)``: the fields below, from the Db and its
MANIFEST.json, and ``digest``, the Db's public key namespace (kvdb/keys.py, the same 16 bytes
every key chain starts from, for tenants before their salt). ``mismatch(ours, theirs)`` names
the fields that differ, or None.

A leader sends its namespace in SHIP_HELLO and a follower of another namespace refuses the
stream with ERROR{NAMESPACE} naming the fields (sink.py); a node sends its own in WELCOME, so a Db
pushing to or looking up on a peer of another namespace refuses before a block moves
(replicator.py).

The key *secret* (the tenant salts, kvdb/keys.py) is described by ``key_secret_id``, a keyed
fingerprint (an HMAC of a constant under the secret: MANIFEST.json's, kvdb/db/open.py): two nodes
compare fingerprints, never the secret, which no message carries. ``key_namespace`` says "same",
"differs" or "unknown". A follower of another secret would hold its leader's blocks bit-exact,
but its own lookups by tokens compute other keys and miss every one (a failover to it is a cold
cache), so it refuses the stream too (``key_refusal``: ERROR{NAMESPACE} before any record, like
a model or layout mismatch). One key namespace per cluster is the operator's: every node is given
the same key secret file (docs/replication.md, "One key namespace per cluster"). The one use of
a follower of another secret, a raw byte mirror looked up only by its leader's keys (``peers=``,
pushes), is an explicit opt-in (``LogSink(allow_foreign_keys=True)``, ``kvdb replicate serve
--allow-foreign-keys``); it is reported ``differs`` in both nodes' status and warned about once.
A node that sends no fingerprint (a bare log directory) is "unknown" and not judged.
"""

from __future__ import annotations

from pathlib import Path

from kvdb.errors import KvdbError
from kvdb.format.manifest import read_manifest



#: compared in this order; each is named in a refusal
FIELDS = ("model_id", "model_revision", "layout", "key_algo", "tp_rank", "tp_size", "pp_rank", "pp_size")


def namespace_of(db) -> dict:
    """The namespace of ``db``'s blocks (see the module doc); plain JSON values."""
    try:
        manifest = read_manifest(Path(db.path)) or {}
    except KvdbError:
        manifest = {}
    keyspace = getattr(db, "keyspace", None)
    ns = {name: manifest.get(name) for name in FIELDS}
    ns["model_id"] = db.model_id
    ns["layout"] = db.layout.to_dict()
    ns["key_algo"] = getattr(keyspace, "algo", None) or manifest.get("key_algo") or "sha256"
    public = getattr(keyspace, "public_namespace", None)
    ns["digest"] = public.hex() if isinstance(public, bytes) else None
    ns["key_secret_id"] = manifest.get("key_secret_id")
    return ns


def key_namespace(ours: dict, theirs) -> str:
    """"same" when both nodes compute the same keys for the same tokens and tenant (the same key
    secret), "differs" when not, "unknown" when either did not say (a bare log, an older node)."""
    a = ours.get("key_secret_id")
    b = theirs.get("key_secret_id") if isinstance(theirs, dict) else None
    if not a or not b:
        return "unknown"
    return "same" if a == b else "differs"


def key_refusal(ours: dict, theirs, *, us: str = "this follower", them: str = "the leader") -> str | None:
    """Why a follower (``ours``) refuses the records of a leader (``theirs``) of another key secret,
    or None (the same secret, or either did not say). Names the two fingerprints' first 8 hex
    digits (MANIFEST.json's ``key_secret_id``), never the secret."""
    if key_namespace(ours, theirs) != "differs":
        return None
    a, b = str(ours["key_secret_id"])[:8], str(theirs["key_secret_id"])[:8]
    return (f"{them} holds another namespace than {us}: another key secret (key_secret_id {b}... vs {a}..., {them} "
            f"vs {us}); {us} would hold its blocks under keys its own lookups by tokens never compute; give every "
            f"node the same key secret file "
            f"(kvdb replicate serve --key-secret-file, kvdb.open(key_secret=); docs/replication.md, 'One key "
            f"namespace per cluster'), or start {us} with --allow-foreign-keys for a raw byte mirror")


def mismatch(ours: dict, theirs, *, us: str = "this node", them: str = "the peer") -> str | None:
    """None when ``theirs`` describes the same namespace as ``ours``; else which fields differ,
    in words. A peer that sent no namespace (``theirs`` None) is not judged here."""
    if theirs is None:
        return None
    if not isinstance(theirs, dict):
        return f"{them} sent a malformed namespace"
    diffs = []
    for name in FIELDS:
        a, b = ours.get(name), theirs.get(name)
        if name == "layout" and isinstance(a, dict) and isinstance(b, dict):
            sub = [f"{k} {b.get(k)!r} vs {a.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
            if sub:
                diffs.append("layout (" + ", ".join(sub) + ")")
        elif a != b:
            diffs.append(f"{name} {b!r} vs {a!r}")
    if not diffs and ours.get("digest") and theirs.get("digest") and ours["digest"] != theirs["digest"]:
        diffs.append(f"key namespace {theirs['digest']} vs {ours['digest']}")
    if not diffs:
        return None
    return f"{them} holds another namespace than {us}: " + "; ".join(diffs) + f" ({them} vs {us})"
