"""Byte sizes as operators write them: ``4GiB``, ``512 MiB``, ``1.5GB``, ``65536``.

    parse_size("4GiB", "host_bytes") == 4 << 30
    parse_size(None, "disk_bytes", allow_none=True) is None

Binary units (KiB, MiB, GiB, TiB) are powers of 1024; decimal ones (KB, MB, GB, TB) powers of
1000; a bare number or ``B`` is bytes. Fractions are allowed when the result is a whole number
of bytes. Anything else is an InvalidInput naming the setting.
"""

from __future__ import annotations

import math
import re

from kvdb.errors import InvalidInput

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
MAX_BYTES = 1 << 62  # more than any machine has; keeps sizes inside int64 everywhere below


def parse_size(value, name: str, *, allow_none: bool = False) -> int | None:
    """``value`` (int or str) as a byte count >= 0; InvalidInput naming ``name`` otherwise."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool):
        raise InvalidInput(f"{name} must be a size in bytes (an int or a string like '4GiB'), got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        m = _SIZE.match(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in UNITS:
            raise InvalidInput(f"{name}: cannot read {value!r} as a size; write an int or a number with one "
                               f"of the units {', '.join(u for u in ('KiB', 'MiB', 'GiB', 'TiB', 'KB', 'MB', 'GB', 'TB', 'B'))}")
        x = float(m.group(1)) * UNITS[unit]
        if not math.isfinite(x) or x != int(x):
            raise InvalidInput(f"{name}: {value!r} is not a whole number of bytes")
        n = int(x)
    else:
        raise InvalidInput(f"{name} must be a size in bytes (an int or a string like '4GiB'), got {type(value).__name__}")
    if n < 0 or n > MAX_BYTES:
        raise InvalidInput(f"{name} must be between 0 and 2**62 bytes, got {value!r}")
    return n
