"""Cross-node sharing: push blocks to a peer, look blocks up on a peer, ship the log.

    server = NodeServer(db, "127.0.0.1:7070", load_secret("secret")).start()   # on the decode node
    push(keys, pages, "decode-host:7070", secret_file="secret")                # on the prefill node

Modules: protocol (frame layout), channel (authenticated control channel), transport (Mooncake
Transfer Engine data plane; inline TCP fallback), peer (push / lookup client), node (the
server's connections) and requests (what it serves), shipping (log shipping, leader side;
sendbuf, slots), sink (follower side), reseed, replicator and attach (a Db's replication),
namespace, netns (private network namespaces for tests and benchmarks).
See docs/replication.md.
"""

from kvdb.replication.channel import load_secret
from kvdb.replication.node import NodeServer
from kvdb.replication.peer import Peer, PushResult, push

__all__ = ["NodeServer", "Peer", "PushResult", "load_secret", "push"]
