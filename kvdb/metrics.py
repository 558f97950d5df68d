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
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import REGISTRY, CollectorRegistry

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
