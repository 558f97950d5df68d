"""The ``shared`` tier: a cache of blocks in a Mooncake Store pool shared by engines (docs/shared.md).

Attached to a Db from above (``kvdb.open(..., shared="mooncake://HOST:PORT")``); the Db imports
nothing from here. ``url`` parses the option, ``calls`` bounds every pool call (deadline, fixed
workers, circuit breaker), ``client`` wraps the Store's Python client, ``tier`` publishes and
fetches blocks, ``attach`` wires it to a Db.
"""
