"""The connector's settings, read from vLLM's ``kv_connector_extra_config``.

    KVTransferConfig(kv_connector="KvdbConnector", kv_connector_module_path="kvdb.integrations.vllm",
                     kv_role="kv_both", kv_connector_extra_config={"path": "/var/lib/kvdb", ...})

| key | default | meaning |
| --- | --- | --- |
| ``path`` | required | kvdb data directory, owned by the worker process (one Db per path) |
| ``host_bytes`` | ``"4GiB"`` | DRAM tier size (int or ``"4GiB"``-style string) |
| ``disk_bytes`` | ``None`` | disk tier bound; ``None`` unbounded, ``0`` no disk tier |
| ``durability`` | ``"none"`` | ``none`` / ``group`` / ``sync`` for saved blocks (kvdb/db/core.py) |
| ``model_id`` | vLLM's model name | goes into every key's namespace; set it when the same weights are served under two names |
| ``replacer`` | ``"kvdb"`` | any name ``kvdb.open(replacer=)`` takes; ``kvdb`` is the planner's policy |
| ``encryption_key_file`` | ``None`` | AES-256-GCM at rest (kvdb/cold/codec.py) |
| ``codec`` | ``"raw"`` | ``raw`` or ``zstd`` on disk |
| ``session_idle_s`` | ``3600`` | a session idle this long is ended (``None``: never) |
| ``lookup_timeout_s`` | ``2.0`` | scheduler -> worker lookup deadline in vLLM's multi-process mode; past it a lookup is a miss |
| ``shared`` | ``None`` | ``"mooncake://HOST:PORT"``: a Mooncake Store pool shared with other engines (docs/shared.md) |
| ``shared_bytes`` | ``0`` | memory this engine lends the pool (int or size string; 0: a pure client) |
| ``key_secret_file`` | ``None`` | the key secret shared by every engine of a pool (else each directory's own ``KEY_SECRET``) |

``kv_role`` (vLLM's own setting) decides the direction: ``kv_both`` loads and saves,
``kv_producer`` (a prefill engine) saves and never loads, ``kv_consumer`` (a decode engine)
loads and never saves.
| ``pool_demote`` | ``True`` | a waiting agent's blocks go first in vLLM's own pool (kvdb/integrations/vllm/pool.py) |
| ``pool_pin_blocks`` | ``0`` | at most this many blocks of named shared prefixes pinned in vLLM's pool (0: none) |

Unknown keys are refused (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping

from kvdb.errors import InvalidInput
from kvdb.sizes import parse_size
from kvdb.types import DURABILITIES


@dataclass(frozen=True)
class Settings:
    path: str
    host_bytes: int = 4 << 30
    disk_bytes: int | None = None
    durability: str = "none"
    model_id: str | None = None
    replacer: str = "kvdb"
    encryption_key_file: str | None = None
    codec: str = "raw"
    session_idle_s: float | None = 3600.0
    lookup_timeout_s: float = 2.0
    shared: str | None = None
    shared_bytes: int = 0
    key_secret_file: str | None = None
    pool_demote: bool = True
    pool_pin_blocks: int = 0

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> "Settings":
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(KNOWN))
        if unknown:
            raise InvalidInput(f"kv_connector_extra_config: unknown setting(s) {unknown}; known: {list(KNOWN)}")
        path = extra.get("path")
        if not isinstance(path, str) or not path:
            raise InvalidInput("kv_connector_extra_config needs 'path': the kvdb data directory (a non-empty string)")
        durability = extra.get("durability", "none")
        if durability not in DURABILITIES:
            raise InvalidInput(f"kv_connector_extra_config 'durability' must be one of {DURABILITIES}, got {durability!r}")
        for name in ("model_id", "encryption_key_file", "shared", "key_secret_file"):
            v = extra.get(name)
            if v is not None and (not isinstance(v, str) or not v):
                raise InvalidInput(f"kv_connector_extra_config {name!r} must be a non-empty string, got {v!r}")
        for name in ("replacer", "codec"):
            if name in extra and not isinstance(extra[name], str):
                raise InvalidInput(f"kv_connector_extra_config {name!r} must be a string, got {extra[name]!r}")
        idle = extra.get("session_idle_s", 3600.0)
        timeout = extra.get("lookup_timeout_s", 2.0)
        for name, v, nullable in (("session_idle_s", idle, True), ("lookup_timeout_s", timeout, False)):
            if v is None and nullable:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise InvalidInput(f"kv_connector_extra_config {name!r} must be a positive number of seconds, got {v!r}")
        shared, lend = extra.get("shared"), extra.get("shared_bytes", 0)
        if shared is not None or lend not in (0, "0"):
            from kvdb.shared.url import parse_shared  # the URL alone: nothing Mooncake is imported

            if shared is None:
                raise InvalidInput("kv_connector_extra_config 'shared_bytes' needs 'shared': 'mooncake://HOST:PORT'")
            lend = parse_shared(shared, lend).lend_bytes
        else:
            lend = 0
        demote, pins = extra.get("pool_demote", True), extra.get("pool_pin_blocks", 0)
        if not isinstance(demote, bool):
            raise InvalidInput(f"kv_connector_extra_config 'pool_demote' must be true or false, got {demote!r}")
        if isinstance(pins, bool) or not isinstance(pins, int) or pins < 0:
            raise InvalidInput(f"kv_connector_extra_config 'pool_pin_blocks' must be an integer >= 0, got {pins!r}")
        return cls(
            path=path,
            host_bytes=parse_size(extra.get("host_bytes", 4 << 30), "kv_connector_extra_config 'host_bytes'"),
            disk_bytes=parse_size(extra.get("disk_bytes"), "kv_connector_extra_config 'disk_bytes'", allow_none=True),
            durability=durability,
            model_id=extra.get("model_id"),
            replacer=extra.get("replacer", "kvdb"),
            encryption_key_file=extra.get("encryption_key_file"),
            codec=extra.get("codec", "raw"),
            session_idle_s=None if idle is None else float(idle),
            lookup_timeout_s=float(timeout),
            shared=shared,
            shared_bytes=lend,
            key_secret_file=extra.get("key_secret_file"),
            pool_demote=demote,
            pool_pin_blocks=pins,
        )


KNOWN = tuple(f.name for f in fields(Settings))  # the settings kv_connector_extra_config may hold
