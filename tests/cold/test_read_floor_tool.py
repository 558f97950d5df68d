"""tools/read_floor.py, the floor of a batch read (issue 12): every variant reads the real store's
segments back, the floor's checks are the store's (a damaged page fails them), and the figures
come out for every variant with their ratio to the raw reads of the same run."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
from helpers import load_tool


def test_every_variant_reads_the_stored_pages_and_the_floor_checks_them(tmp_path, capsys):
    tool = load_tool("read_floor")
    st = tool.Store(str(tmp_path), 16)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        for check, copy, sliced in tool.FLOORS.values():
            st.out[:] = 0
            st.host[:] = 1
            assert st.floor(check, copy, sliced, pool) > 0
            assert np.array_equal(st.out, st.expect)
            assert np.array_equal(st.host[: tool.BATCH], st.expect) == copy  # 16 MiB: one batch, frames 0..255
        st.out[:] = 0
        assert st.store() > 0 and np.array_equal(st.out, st.expect)
        st.raw_buf[:] = 0
        assert st.lookup_read(pool) > 0  # whole records, back to back: each page after its head
        recs = st.raw_buf[: tool.BATCH * st.want].reshape(tool.BATCH, st.want)
        assert np.array_equal(recs[:, st.want - st.page :], st.expect)
        # one byte of one stored page flipped on disk: the floor's checks catch it, as the store's do
        seg, off, _nbytes, _recs = st.batches[0][0]
        with open(st.segs[seg], "r+b") as f:
            f.seek(off + st.want * 3 + 1000)
            b = f.read(1)
            f.seek(off + st.want * 3 + 1000)
            f.write(bytes([b[0] ^ 0xFF]))
        with pytest.raises(AssertionError, match="failed its checks"):
            st.floor(True, True, True, pool)
    finally:
        pool.shutdown()
    assert tool.main(["--mib", "16", "--rounds", "1"]) == 0
    rows = {ln.split()[0]: ln.split()[1:] for ln in capsys.readouterr().out.splitlines()[1:]}
    assert set(rows) == {"raw", "store", "lookup_read", *tool.FLOORS}
    assert float(rows["raw"][1]) == 1.0 and all(float(g) > 0 for g, _r in rows.values())
    assert tool.main(["--mib", "1"]) == 2
