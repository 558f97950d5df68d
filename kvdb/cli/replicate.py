"""``kvdb replicate serve|status`` and ``kvdb bench replication`` (docs/replication.md)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

import click

from kvdb.cli.output import BYTE_SIZE, emit, json_option


@click.group("replicate")
def replicate() -> None:
    """Run a replication node, or ask one for its status."""


def _parse_layout(text: str | None):
    if text is None:
        return None
    from kvdb.format.layout import BlockLayout
    from kvdb.errors import InvalidInput

    try:
        return BlockLayout.from_dict(json.loads(text))
    except json.JSONDecodeError as e:
        raise InvalidInput(f"--layout is not JSON: {e}") from None


def _check_listen(listen: str) -> None:
    """Bind --listen once, before the data directory is touched: an address this host does not
    have is a usage error (exit 2); one in use or not allowed, a runtime error (exit 1)."""
    import errno
    import socket

    from kvdb.errors import InvalidInput, KvdbError
    from kvdb.replication.channel import parse_addr

    try:
        host, port = parse_addr(listen)
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (InvalidInput, socket.gaierror) as e:
        raise click.BadParameter(f"{listen!r}: {getattr(e, 'strerror', None) or e}", param_hint="--listen") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                raise click.BadParameter(f"{host} is not an address of this host", param_hint="--listen") from None
            raise KvdbError(f"cannot listen on {listen}: {e.strerror or e}") from None


def _positive_seconds(v: float) -> float:
    if not 0 < v < float("inf"):  # also refuses nan
        raise click.BadParameter(f"{v} is not a positive number of seconds")
    return v


@replicate.command("serve")
@click.option("--db", "db_path", required=True, type=click.Path(file_okay=False), help="data directory this node owns")
@click.option("--listen", required=True, help="HOST:PORT for peers (port 0 picks a free one)")
@click.option("--secret-file", required=True, type=click.Path(dir_okay=False), help="shared secret of the cluster")
@click.option("--transport", type=click.Choice(["auto", "mooncake", "tcp"]), default="auto", show_default=True)
@click.option("--node", default=None, help="this node's name (default: its address)")
@click.option("--host-bytes", type=BYTE_SIZE, default="1GiB", show_default=True,
              help="host tier capacity in bytes (an int or a size like 4GiB)")
@click.option("--disk-bytes", default=None, type=BYTE_SIZE,
              help="disk tier capacity in bytes, or a size like 100GiB (0: memory only; default: the Db's)")
@click.option("--encryption-key-file", default=None, type=click.Path(exists=True, dir_okay=False),
              help="AES-256 key of the disk tier (a follower of an encrypted leader needs the leader's key)")
@click.option("--key-secret-file", default=None, type=click.Path(dir_okay=False),
              help="the cluster's key secret (at least 16 bytes, e.g. head -c 32 /dev/urandom): give every node "
                   "the same file so a follower computes its leader's keys (default: the Db's own KEY_SECRET)")
@click.option("--allow-foreign-keys", is_flag=True, default=False,
              help="as a follower, also take the log of a leader of another key secret (a raw byte mirror, "
                   "looked up only by its leader's keys); default: refuse it, naming both fingerprints")
@click.option("--layout", "layout_json", default=None, help="layout JSON for a new data directory")
@click.option("--model-id", default=None, help="model id for a new data directory")
@click.option("--replica", "replicas", multiple=True, help="HOST:PORT of a follower to ship this node's log to")
@click.option("--max-connections", type=click.IntRange(min=1), default=256, show_default=True,
              help="open connections (handshaking or serving, one thread each); more are refused")
@click.option("--max-handshakes", type=click.IntRange(min=1), default=16, show_default=True,
              help="connections not yet authenticated at once; more are refused")
@click.option("--handshake-timeout", "handshake_timeout_s", type=float, default=10.0, show_default=True,
              callback=lambda ctx, param, v: _positive_seconds(v),
              help="seconds an unauthenticated peer has for the whole handshake")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None,
              help="serve Prometheus metrics (kvdb/metrics.py: the Db's tiers and this node's counters, "
                   "followers' addresses included) at http://127.0.0.1:PORT/metrics (0 picks a free port); "
                   "default: none")
@click.option("--metrics-listen", default=None,
              help="HOST:PORT for the metrics instead (e.g. 0.0.0.0:9400 for a scraper on another host: then "
                   "also give --metrics-token-file)")
@click.option("--metrics-token-file", default=None, type=click.Path(exists=True, dir_okay=False),
              help="ask scrapes for 'Authorization: Bearer TOKEN', TOKEN this file's contents (Prometheus' "
                   "authorization.credentials_file)")
@json_option
def serve_cmd(db_path, listen, secret_file, transport, node, host_bytes, disk_bytes, encryption_key_file,
              key_secret_file, allow_foreign_keys, layout_json, model_id, replicas, max_connections, max_handshakes,
              handshake_timeout_s, metrics_port, metrics_listen, metrics_token_file, as_json) -> None:
    """Own the Db at --db and serve pushes, lookups and log streams until SIGTERM / SIGINT;
    with --replica, also ship this node's log to those followers. A follower behind its
    leader's log is re-seeded from a copy (not a node that is itself a leader). A follower
    refuses a leader of another namespace, key secret included: give every node the same
    --key-secret-file (or --allow-foreign-keys for a raw byte mirror). Unauthenticated
    peers are bounded by the connection caps, the handshake deadline and a 64 KiB read cap."""
    import kvdb
    from kvdb.replication.channel import load_secret
    from kvdb.replication.node import NodeServer
    from kvdb.replication.reseed import finish_swap
    from kvdb.replication.sink import LogSink

    secret = load_secret(secret_file)
    kw = {}
    if disk_bytes is not None:
        kw["disk_bytes"] = disk_bytes
    if encryption_key_file is not None:
        kw["encryption_key_file"] = encryption_key_file
    if key_secret_file is not None:  # one key namespace per cluster (docs/replication.md)
        from kvdb.db.open import read_key_secret_file

        kw["key_secret"] = read_key_secret_file(key_secret_file)

    def reopen(path=db_path, host_bytes=host_bytes):  # the Db, or a re-seed's staging copy of it
        return kvdb.open(path, host_bytes=host_bytes, **kw)

    _check_listen(listen)  # before anything touches the data directory
    metrics = _start_metrics(metrics_port, metrics_listen, metrics_token_file)  # likewise: a port in use fails here
    finish_swap(db_path)  # a re-seed interrupted by a crash: roll it forward or drop it
    db = kvdb.open(db_path, layout=_parse_layout(layout_json), model_id=model_id, host_bytes=host_bytes, **kw)
    done = threading.Event()
    server = None
    try:
        sink = LogSink.for_db(db, reopen=None if replicas else reopen, allow_foreign_keys=allow_foreign_keys)
        server = NodeServer(db, listen, secret, node=node, transport=transport, sink=sink,
                            max_connections=max_connections, max_handshakes=max_handshakes,
                            handshake_timeout_s=handshake_timeout_s)
        rep = None
        if replicas:
            from kvdb.replication.replicator import Replicator

            rep = Replicator(db, replicas=list(replicas), secret=secret, transport=transport, node=server.node)
            server.leader_status = lambda: rep.status()["followers"]
            server.replicator = rep
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: done.set())
        server.start()
        info = {"event": "listening", "address": server.address, "node": server.node,
                "transport": server.transport.descriptor(), "db": str(db_path)}
        if metrics is not None:
            info["metrics"] = _serve_metrics(metrics, server)
        if as_json:
            click.echo(json.dumps(info), nl=True)
        else:
            click.echo(f"kvdb: node {server.node} serving {db_path} on {server.address} "
                       f"({info['transport']['kind']})"
                       + (f"; metrics at {info['metrics']}" if metrics is not None else ""), err=True)
        sys.stdout.flush()
        while not done.wait(0.5):
            pass
        server.stop()
        if rep is not None:
            rep.close()
    finally:
        if metrics is not None:
            metrics.close()
        db.close()
        if server is not None and server.db is not db:  # re-seeded meanwhile
            server.db.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # the Transfer Engine's destructor may block for a second; the Db is closed, nothing is pending
    os._exit(0)


def _start_metrics(port: int | None, listen: str | None, token_file: str | None):
    """The Prometheus endpoint (kvdb/metrics.py ``MetricsServer``, its registry still empty) on
    127.0.0.1:--metrics-port or on --metrics-listen, or None without either."""
    if port is None and listen is None:
        if token_file is not None:
            raise click.BadParameter("needs --metrics-port or --metrics-listen", param_hint="--metrics-token-file")
        return None
    if port is not None and listen is not None:
        raise click.BadParameter("give --metrics-port (127.0.0.1) or --metrics-listen HOST:PORT, not both",
                                 param_hint="--metrics-listen")
    from prometheus_client import CollectorRegistry

    from kvdb.errors import InvalidInput, KvdbError
    from kvdb.metrics import MetricsServer
    from kvdb.replication.channel import parse_addr

    host = "127.0.0.1"
    if listen is not None:
        try:
            host, port = parse_addr(listen)
        except InvalidInput as e:
            raise click.BadParameter(str(e), param_hint="--metrics-listen") from None
    token = None
    if token_file is not None:
        with open(token_file, "rb") as f:
            token = f.read().strip()
        if len(token) < 16 or any(b < 0x21 or b > 0x7E for b in token):
            raise click.BadParameter(f"{token_file} must hold a token of at least 16 printable characters",
                                     param_hint="--metrics-token-file")
    try:
        return MetricsServer(CollectorRegistry(), host, port, token=token)
    except OSError as e:
        raise KvdbError(f"cannot serve metrics on {host}:{port}: {e.strerror or e}") from None


def _serve_metrics(metrics, server) -> str:
    """Register the Db's and the node's collectors; the URL to scrape. The Db is looked up at
    each scrape (a re-seed swaps it)."""
    import types

    from kvdb.metrics import NodeCollector, register

    register(types.SimpleNamespace(stats=lambda: server.db.stats()), metrics.registry)
    metrics.registry.register(NodeCollector(server))
    return metrics.url


@replicate.command("status")
@click.option("--peer", required=True, help="HOST:PORT of a node")
@click.option("--secret-file", required=True, type=click.Path(dir_okay=False))
@json_option
def status_cmd(peer: str, secret_file: str, as_json: bool) -> None:
    """A node's counters (refused connections, auth failures, handshake timeouts, oversize
    frames, ...), its limits, its follower position and, for a leader, each follower's lag."""
    from kvdb.replication.peer import Peer

    with Peer(peer, secret_file=secret_file, transport="tcp") as p:
        s = p.status()
    emit(s, as_json, _render_status)


def _render_status(s: dict, console) -> None:
    from rich.table import Table

    console.print(f"node [bold]{s.get('node')}[/] at {s.get('address')}  transport {s.get('transport')}")
    t = Table("counter", "value")
    for k, v in sorted(s.get("counters", {}).items()):
        t.add_row(k, str(v))
    console.print(t)
    lim, now = s.get("limits"), s.get("connections_open")
    if lim:
        console.print(f"connections: {now.get('serving')} serving, {now.get('handshaking')} handshaking; limits "
                      f"{lim.get('max_connections')} connections, {lim.get('max_handshakes')} handshakes, "
                      f"{lim.get('handshake_timeout_s')} s per handshake, {lim.get('preauth_max_bytes')} bytes "
                      "before authentication")
    rc = s.get("replicator")
    if rc:
        console.print("as a leader: " + ", ".join(f"{k} {v}" for k, v in sorted(rc.items())))
    fol = s.get("follower")
    if fol:
        rs = fol.get("reseed")
        console.print(f"follower: {({k: v for k, v in fol.items() if k != 'reseed'})}")
        if rs:
            console.print(f"re-seeding: {rs['records_received']} of {rs['records_total']} records "
                          f"({rs['bytes_received']} bytes) as of lsn {rs['snapshot_lsn']}, {rs['state']}")
    followers = s.get("followers") or []
    if followers:
        ft = Table("follower", "confirmed_lsn", "lag_records", "state", "key_namespace", "reseed")
        for f in followers:
            rs = f.get("reseed")
            prog = f"{rs['records_sent']}/{rs['records_total']} sent, {rs['records_confirmed']} applied" if rs else ""
            ft.add_row(str(f.get("addr")), str(f.get("confirmed_lsn")), str(f.get("lag_records")), str(f.get("state")),
                       str(f.get("key_namespace", "unknown")), prog)
        console.print(ft)
        for f in followers:  # why a follower refused this leader (or why its stream dropped), in full
            if f.get("error"):
                console.print(f"follower {f.get('addr')} ({f.get('state')}): {f.get('error')}", soft_wrap=True)


@click.command("replication")
@click.option("--blocks", type=click.IntRange(min=1), default=64, show_default=True, help="2 MiB blocks per round")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--transport", type=click.Choice(["auto", "mooncake", "tcp"]), default="auto", show_default=True)
@click.option("--chunk-mib", type=click.IntRange(min=1), default=32, show_default=True, help="MiB per push chunk")
@click.option("--window", type=click.IntRange(min=1), default=4, show_default=True, help="push chunks sent and not yet acknowledged")
@json_option
def bench_replication_cmd(blocks: int, repeats: int, transport: str, chunk_mib: int, window: int,
                          as_json: bool) -> None:
    """Push and log shipping of 2 MiB blocks over loopback vs the engine's own batch write."""
    from kvdb.bench.replication import bench_replication

    emit(bench_replication(num_blocks=blocks, repeats=repeats, transport=transport, chunk_bytes=chunk_mib << 20,
                           window=window), as_json)


def register(cli: click.Group) -> None:
    cli.add_command(replicate)
    bench = cli.commands.get("bench")
    if bench is not None:
        bench.add_command(bench_replication_cmd)
