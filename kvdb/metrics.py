"""Prometheus metrics for a Db: a collector that reads ``db.stats()`` at scrape time.

    from prometheus_client import CollectorRegistry, start_http_server
    registry = CollectorRegistry()
    kvdb.metrics.register(db, registry)
    start_http_server(9400, registry=registry)

Every series carries a ``tier`` label (device, host, disk), but the prompt counters (cache
breaks, kvdb/prompts). Counters are monotone over the Db's life; gauges are resident pages and
bytes. Nothing here is per tenant: metrics never tell one tenant about another's cache.

A Db open with a shared tier (docs/shared.md) adds ``kvdb_shared_events_total{event=...}`` (hits,
misses, puts, put_bytes, get_bytes, dropped_puts, dropped_full, corruptions, deadline_misses,
removes) and ``kvdb_shared_breaker_open`` (1 while the breaker keeps calls off the pool).

``NodeCollector`` adds a replication node's figures (``kvdb replicate serve --metrics-port``):
``kvdb_replication_events_total{event=...}`` (the node's counters: connections, handshakes by
outcome, blocks received and served, ...), ``kvdb_replication_connections{state=serving|handshaking}``
and, on a leader, ``kvdb_replication_follower_lag_records{follower=HOST:PORT}``.

``MetricsServer`` serves a registry over HTTP for ``kvdb replicate serve``, bounded: it binds
127.0.0.1 unless given another host, serves at most ``max_threads`` requests at once (one more
is answered 503 by the accept thread, counted ``refused``), gives each ``read_timeout_s`` to send
its request head of at most 8 KiB (a half-sent one is dropped, ``timeouts``), answers each with
``Connection: close``, and with a token asks for ``Authorization: Bearer TOKEN`` (Prometheus'
``authorization.credentials_file``; else 401). Its own counters are
``kvdb_metrics_requests_total{outcome=...}``.
"""

from __future__ import annotations

import contextlib
import hmac
import socket
import threading
import time

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import REGISTRY, CollectorRegistry

from kvdb.threads import join_all

_GAUGES = {"pages": "resident pages", "bytes": "resident bytes", "capacity_pages": "page capacity",
           "pinned_pages": "pages pinned now"}
_COUNTERS = {"hits": "lookup hits", "misses": "lookup misses", "reads": "blocks read",
             "evictions": "pages evicted for room", "corruptions": "records failing their checksum"}

_SHARED_EVENTS = ("hits", "misses", "puts", "put_bytes", "get_bytes", "dropped_puts", "dropped_full", "corruptions",
                  "deadline_misses", "removes")

_PROMPT_COUNTERS = {"calls": "prompts noted with a session (db.note_prompt)",
                    "breaks": "calls that shared fewer tokens than they could have (same segments, other order)",
                    "tokens_lost": "tokens those breaks could have shared"}


class DbCollector:
    def __init__(self, db, prefix: str = "kvdb") -> None:
        self.db = db
        self.prefix = prefix

    def collect(self):
        s = self.db.stats()
        for field, doc in _GAUGES.items():
            g = GaugeMetricFamily(f"{self.prefix}_{field}", doc, labels=["tier"])
            for tier, ts in s["tiers"].items():
                if isinstance(ts.get(field), (int, float)):
                    g.add_metric([tier], ts[field])
            yield g
        for field, doc in _COUNTERS.items():
            c = CounterMetricFamily(f"{self.prefix}_{field}", doc, labels=["tier"])
            for tier, ts in s["tiers"].items():
                if isinstance(ts.get(field), (int, float)):
                    c.add_metric([tier], ts[field])
            yield c
        yield GaugeMetricFamily(f"{self.prefix}_sessions", "open agent sessions", value=s.get("sessions", 0))
        prompts = s.get("prompts") or {}
        for field, doc in _PROMPT_COUNTERS.items():
            yield CounterMetricFamily(f"{self.prefix}_prompt_{field}", doc, value=prompts.get(field, 0))
        shared = s.get("shared")
        if shared:
            c = CounterMetricFamily(f"{self.prefix}_shared_events", "shared tier (pool) events", labels=["event"])
            for name in _SHARED_EVENTS:
                c.add_metric([name], shared.get(name, 0))
            yield c
            yield GaugeMetricFamily(f"{self.prefix}_shared_breaker_open", "1 while the shared tier's breaker is open",
                                    value=0 if shared.get("breaker") == "closed" else 1)


class NodeCollector:
    """A replication node's counters, read from ``node.endpoint_status()`` and, on a leader,
    ``node.leader_status()`` at scrape time (kvdb/replication/node.py ``NodeServer``)."""

    def __init__(self, node, prefix: str = "kvdb") -> None:
        self.node = node
        self.prefix = prefix

    def collect(self):
        st = self.node.endpoint_status()
        c = CounterMetricFamily(f"{self.prefix}_replication_events", "replication node events since it started",
                                labels=["event"])
        for name, n in sorted(st["counters"].items()):
            c.add_metric([name], n)
        yield c
        g = GaugeMetricFamily(f"{self.prefix}_replication_connections", "open peer connections", labels=["state"])
        for state, n in st["connections_open"].items():
            g.add_metric([state], n)
        yield g
        leader = getattr(self.node, "leader_status", None)
        if leader is not None:
            lag = GaugeMetricFamily(f"{self.prefix}_replication_follower_lag_records",
                                    "log records a follower has not confirmed", labels=["follower"])
            for f in leader():
                if isinstance(f.get("lag_records"), (int, float)):
                    lag.add_metric([str(f.get("addr"))], f["lag_records"])
            yield lag


def register(db, registry: CollectorRegistry | None = None, prefix: str = "kvdb") -> DbCollector:
    """Register a collector for ``db`` (the default registry unless one is given)."""
    collector = DbCollector(db, prefix)
    (registry or REGISTRY).register(collector)
    return collector


_HEAD_MAX = 8192
_OUTCOMES = ("served", "refused", "timeouts", "bad_requests", "unauthorized")


def _response(status: str, body: bytes = b"", ctype: str = "text/plain; charset=utf-8", extra: str = "") -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n{extra}"
            "Connection: close\r\n\r\n").encode() + body


class MetricsServer:
    """``registry`` as Prometheus text at ``http://HOST:PORT/metrics``, bounded (module docstring).
    Raises ``OSError`` when the address cannot be bound; ``close`` stops it."""

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0, *,
                 token: bytes | None = None, max_threads: int = 4, read_timeout_s: float = 5.0) -> None:
        self.registry = registry
        self.token = token
        self.read_timeout_s = float(read_timeout_s)
        self.counters = dict.fromkeys(_OUTCOMES, 0)
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_threads)
        self._threads: set[threading.Thread] = set()
        self._closed = False
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.create_server((host, port), family=family)
        self.host, self.port = host, self.sock.getsockname()[1]
        registry.register(_ServerCollector(self))
        self._thread = threading.Thread(target=self._accept, name="kvdb-metrics", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        shown = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{shown}:{self.port}/metrics"

    def _count(self, outcome: str) -> None:
        with self._lock:
            self.counters[outcome] += 1

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                self._count("refused")
                with contextlib.suppress(OSError):
                    conn.setblocking(False)
                    conn.send(_response("503 Service Unavailable", b"busy\n"))
                conn.close()
                continue
            t = threading.Thread(target=self._serve, args=(conn,), name="kvdb-metrics-request", daemon=True)
            with self._lock:
                self._threads.add(t)
            try:
                t.start()
            except RuntimeError:  # no thread to be had: give the slot back, refuse it
                with self._lock:
                    self._threads.discard(t)
                self._slots.release()
                conn.close()
                self._count("refused")

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.sendall(self._answer(conn))
        except TimeoutError:
            self._count("timeouts")
        except OSError:
            pass
        finally:
            conn.close()
            with self._lock:
                self._threads.discard(threading.current_thread())
            self._slots.release()

    def _answer(self, conn: socket.socket) -> bytes:
        deadline = time.monotonic() + self.read_timeout_s
        buf = b""
        while b"\r\n\r\n" not in buf:
            if len(buf) > _HEAD_MAX:
                self._count("bad_requests")
                return _response("431 Request Header Fields Too Large")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("request head not received in time")
            conn.settimeout(left)
            chunk = conn.recv(4096)
            if not chunk:
                raise ConnectionError("peer closed")
            buf += chunk
        conn.settimeout(self.read_timeout_s)  # for the answer too
        lines = buf.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or parts[0] != "GET":
            self._count("bad_requests")
            return _response("405 Method Not Allowed", extra="Allow: GET\r\n")
        if self.token is not None:
            auth = next((v.strip() for k, _, v in (h.partition(":") for h in lines[1:]) if k.strip().lower()
                         == "authorization"), "")
            if not hmac.compare_digest(auth.encode("latin-1"), b"Bearer " + self.token):
                self._count("unauthorized")
                return _response("401 Unauthorized", extra='WWW-Authenticate: Bearer realm="kvdb"\r\n')
        if parts[1].split("?", 1)[0] not in ("/", "/metrics"):
            self._count("bad_requests")
            return _response("404 Not Found")
        self._count("served")
        return _response("200 OK", generate_latest(self.registry), CONTENT_TYPE_LATEST)

    def status(self) -> dict:
        with self._lock:
            return {"counters": dict(self.counters), "threads": len(self._threads)}

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(5)
        with self._lock:
            threads = list(self._threads)
        join_all(threads, self.read_timeout_s + 1)  # one deadline for all of them


class _ServerCollector:
    def __init__(self, server: MetricsServer) -> None:
        self.server = server

    def collect(self):
        c = CounterMetricFamily("kvdb_metrics_requests", "requests to this metrics endpoint, by outcome",
                                labels=["outcome"])
        for name, n in sorted(self.server.status()["counters"].items()):
            c.add_metric([name], n)
        yield c
