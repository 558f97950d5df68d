"""The ``shared=`` option: ``mooncake://HOST:PORT[?option=value&...]`` (docs/shared.md).

Options: ``protocol`` (``tcp``, the default, or ``rdma``), ``device`` (RDMA devices, e.g.
``mlx5_0``; comma-separated), ``local`` (the address this process's transfer engine advertises;
default 127.0.0.1 for a master on loopback, else this host's name), ``deadline_ms`` (kvdb's own
limit on every pool call, default 500), ``workers`` (threads that make pool calls, default 4),
``staging`` (memory for objects on their way to or from the pool, default 64MiB, and
at least two batches of 32 objects each way; plain pages fetched need only their headers there). Anything else
is InvalidInput naming it, before anything is opened.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlsplit

from kvdb.errors import InvalidInput
from kvdb.sizes import parse_size

DEFAULT_DEADLINE_S = 0.5
DEFAULT_WORKERS = 4
DEFAULT_STAGING = 64 << 20
PROTOCOLS = ("tcp", "rdma")
OPTIONS = ("protocol", "device", "local", "deadline_ms", "workers", "staging")


@dataclass(frozen=True)
class SharedConfig:
    master: str  # host:port of mooncake_master
    protocol: str = "tcp"
    device: str = ""
    local: str = "127.0.0.1"
    deadline_s: float = DEFAULT_DEADLINE_S
    workers: int = DEFAULT_WORKERS
    staging_bytes: int = DEFAULT_STAGING
    lend_bytes: int = 0  # shared_bytes: memory this process lends the pool (0: a pure client)


def parse_shared(url, shared_bytes=0) -> SharedConfig:
    """The checked ``shared=`` URL and ``shared_bytes=`` size; InvalidInput on anything wrong."""
    lend = parse_size(shared_bytes, "shared_bytes")
    if not isinstance(url, str):
        raise InvalidInput(f"shared must be a 'mooncake://HOST:PORT' URL, got {type(url).__name__}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise InvalidInput(f"shared={url!r}: {e}") from None
    if parts.scheme != "mooncake":
        raise InvalidInput(f"shared={url!r}: the scheme must be mooncake:// (the only pool kvdb speaks)")
    if not parts.hostname or port is None or parts.path not in ("", "/") or parts.fragment:
        raise InvalidInput(f"shared={url!r}: write mooncake://HOST:PORT of the mooncake_master")
    opts: dict[str, str] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True, strict_parsing=False):
        if name not in OPTIONS:
            raise InvalidInput(f"shared={url!r}: unknown option {name!r}; one of {', '.join(OPTIONS)}")
        if name in opts:
            raise InvalidInput(f"shared={url!r}: option {name!r} given twice")
        opts[name] = value
    protocol = opts.get("protocol", "tcp")
    if protocol not in PROTOCOLS:
        raise InvalidInput(f"shared={url!r}: protocol must be one of {PROTOCOLS}, got {protocol!r}")
    if protocol == "rdma" and not opts.get("device"):
        raise InvalidInput(f"shared={url!r}: protocol=rdma needs device= (e.g. mlx5_0)")
    host = parts.hostname
    loopback = host in ("127.0.0.1", "localhost", "::1")
    local = opts.get("local") or ("127.0.0.1" if loopback else socket.gethostname())
    deadline_s = DEFAULT_DEADLINE_S
    if "deadline_ms" in opts:
        try:
            ms = float(opts["deadline_ms"])
        except ValueError:
            ms = -1.0
        if not 1 <= ms <= 60_000:
            raise InvalidInput(f"shared={url!r}: deadline_ms must be a number of milliseconds in [1, 60000]")
        deadline_s = ms / 1000
    workers = DEFAULT_WORKERS
    if "workers" in opts:
        if not opts["workers"].isdigit() or not 1 <= int(opts["workers"]) <= 64:
            raise InvalidInput(f"shared={url!r}: workers must be an int in [1, 64]")
        workers = int(opts["workers"])
    staging = parse_size(opts.get("staging", DEFAULT_STAGING), "shared staging")
    host_port = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return SharedConfig(master=host_port, protocol=protocol, device=opts.get("device", ""), local=local,
                        deadline_s=deadline_s, workers=workers, staging_bytes=staging, lend_bytes=lend)
