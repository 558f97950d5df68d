"""Prometheus exposition of a Db's stats."""

from __future__ import annotations

import torch
from prometheus_client import CollectorRegistry, generate_latest

import kvdb
import kvdb.metrics

LAYOUT = kvdb.BlockLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_tokens=2, dtype=torch.float32)


def test_metrics_follow_stats(tmp_path):
    with kvdb.open(tmp_path, layout=LAYOUT, model_id="m", host_bytes=2 * LAYOUT.page_bytes, disk_bytes=0) as db:
        reg = CollectorRegistry()
        kvdb.metrics.register(db, reg)
        keys = db.block_keys(list(range(6)))
        for k in keys:  # 3 puts into 2 frames: the third evicts the least recent (key 0)
            db.put_blocks([k], torch.zeros((1, *LAYOUT.block_shape)))
        assert db.match_prefix(keys) == 0
        text = generate_latest(reg).decode()
        assert 'kvdb_pages{tier="host"} 2.0' in text
        assert 'kvdb_evictions_total{tier="host"} 1.0' in text
        assert 'kvdb_hits_total{tier="host"} 0.0' in text  # key 0 is gone: the prefix is empty
        assert 'kvdb_misses_total{tier="host"} 1.0' in text
        assert "kvdb_sessions 0.0" in text
