"""Operating a replication node (issue 15): ``kvdb replicate serve --metrics-port`` serves
Prometheus text (kvdb/metrics.py ``NodeCollector``), and the Mooncake Transfer Engine's C++ log
stays off stderr unless the user asks for it through its own variables
(kvdb/replication/transport.py ``engine_log_quiet``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvdb.replication import Peer

from .conftest import LAYOUT, NodeProc, make_blocks, make_keys, needs_te

pytestmark = pytest.mark.slow


class MetricsNode(NodeProc):
    """``kvdb replicate serve`` with ``--metrics-port 0``; ``metrics_url`` from its listening line."""

    def spawn(self) -> None:
        cmd = [sys.executable, "-c", "from kvdb.cli.main import cli; cli()", "replicate", "serve",
               "--db", str(self.db_path), "--listen", "127.0.0.1:0", "--secret-file", str(self.secret_file),
               "--transport", "tcp", "--json", "--layout", json.dumps(LAYOUT.to_dict()), "--model-id", "test-model",
               "--host-bytes", "4MiB", "--disk-bytes", "64MiB", "--metrics-port", "0"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def wait_ready(self) -> "MetricsNode":
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"node exited with {self.proc.wait()}: {self.proc.stderr.read()}")
        info = json.loads(line)
        self.address, self.metrics_url = info["address"], info["metrics"]
        return self


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_serve_metrics_port_serves_prometheus_text(netns, tmp_path, secret_file):
    # Scenario: a node with --metrics-port 0; one client pushes 5 blocks; a scrape shows the 5
    # host pages and the node's counters (1 connection, 5 blocks received).
    node = MetricsNode(tmp_path / "db", secret_file)
    try:
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", node.metrics_url)
        before = scrape(node.metrics_url)
        assert before[("kvdb_pages", (("tier", "host"),))] == 0
        with Peer(node.address, secret_file=secret_file, transport="tcp") as p:
            p.push(make_keys(5, tag=1), make_blocks(5, seed=1), durability="none")
            after = scrape(node.metrics_url)
        assert after[("kvdb_pages", (("tier", "host"),))] == 5
        assert after[("kvdb_replication_events_total", (("event", "connections"),))] == 1
        assert after[("kvdb_replication_events_total", (("event", "blocks_received"),))] == 5
        assert after[("kvdb_replication_connections", (("state", "serving"),))] == 1
    finally:
        assert node.stop() == 0
    assert "Traceback" not in node.proc.stderr.read()


def test_serve_metrics_port_in_use_is_an_error_before_the_data_directory(netns, tmp_path, secret_file):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-c", "from kvdb.cli.main import cli; cli()", "replicate", "serve",
                            "--db", str(tmp_path / "db"), "--listen", "127.0.0.1:0", "--secret-file",
                            str(secret_file), "--transport", "tcp", "--metrics-port", str(port)],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.startswith("kvdb: error: cannot serve metrics"), r.stderr
    assert not (tmp_path / "db").exists()


_REPLICATE = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[2])
    import torch
    import kvdb
    from kvdb.replication import NodeServer, Peer
    from kvdb.netns import private_netns
    from replication.conftest import LAYOUT, SECRET, make_blocks, make_keys

    with private_netns():
        db = kvdb.open(sys.argv[1], layout=LAYOUT, model_id="m", host_bytes=64 * LAYOUT.page_bytes, disk_bytes=0)
        srv = NodeServer(db, "127.0.0.1:0", SECRET, node="n0", transport="mooncake").start()
        with Peer(srv.address, secret=SECRET, transport="mooncake") as p:
            assert p.uses_engine
            p.push(make_keys(8, tag=1), make_blocks(8, seed=1), durability="none")
            hits, _ = p.lookup(make_keys(8, tag=1))
            assert hits == 8, hits
        srv.stop()
        db.close()
    print("replicated", flush=True)
""")


def _replicate(tmp_path, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("MC_LOG_LEVEL", "GLOG_minloglevel",
                                                              "KVDB_QUIET_MC_LOG")}
    r = subprocess.run([sys.executable, "-c", _REPLICATE, str(tmp_path / "db"), str(Path(__file__).parents[1])],
                       capture_output=True, text=True, timeout=300, env={**clean, **env})
    assert r.returncode == 0 and r.stdout.strip() == "replicated", r.stderr
    return r


@needs_te
def test_transfer_engine_is_quiet_unless_asked(tmp_path):
    # Scenario: one process starts two engines (a node and a client), pushes 8 blocks through
    # the engine and reads them back. Old code: ~20 glog lines (I/W/E) on stderr.
    r = _replicate(tmp_path / "quiet")
    assert r.stderr == "", r.stderr
    # asked for, through the engine's own variable: its lines are back
    r = _replicate(tmp_path / "loud", MC_LOG_LEVEL="INFO")
    assert "transfer_engine" in r.stderr and re.search(r"^I\d{4} ", r.stderr, re.M), r.stderr
