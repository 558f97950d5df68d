"""ENOSPC and EIO from the file layer (docs/style.md "Errors"): the failing call raises
StorageIOError, the store is then failed (every call raises DbFailedError until it is closed
and reopened), and nothing acknowledged before the error is lost."""

from __future__ import annotations

import errno

import numpy as np
import pytest

from kvdb.errors import DbFailedError, StorageIOError
from kvdb.fs import FaultFs

from cold_fixtures import TINY, key, pages_for
from test_crash import Model, count_points, observe, open_store, workload


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
def test_io_error_at_every_point_is_typed_sticky_and_loses_nothing(tmp_path, err):
    total = count_points(tmp_path, close=False)  # a failure inside close() raises nothing here
    for point in range(1, total + 1, 2 if err == errno.EIO else 3):
        path = tmp_path / f"p{point}"
        fs = FaultFs(fail_at=point, fail_errno=err)
        model = Model()
        store = None
        with pytest.raises(StorageIOError) as info:
            store = open_store(path, fs)
            workload(store, model)
        assert not isinstance(info.value, DbFailedError)  # the first error says what failed
        assert errno.errorcode[err] in str(info.value)
        if store is not None:
            assert store.failed
            for call in (lambda: store.put([key(50)], pages_for([key(50)]), None, "none"),
                         lambda: store.get_into([key(0)], np.zeros((1, TINY.page_bytes), np.uint8)),
                         lambda: store.read_rows([key(0)], np.zeros((1, TINY.page_bytes), np.uint8), [0]),
                         lambda: store.delete([key(0)]),
                         store.checkpoint, store.flush, store.stats):
                with pytest.raises(DbFailedError):
                    call()
            store.close()
        store = open_store(path)
        try:
            got = observe(store)
            assert any(model.state(n) == got for n in range(model.durable, len(model.records) + 1)), point
            assert store.verify().ok, point
        finally:
            store.close()


def test_a_dead_disk_fails_fsync_and_reopen_keeps_acknowledged_blocks(tmp_path):
    # Scenario: 3 blocks acknowledged under sync; then every I/O fails; the next group put raises.
    fs = FaultFs()
    store = open_store(tmp_path, fs)
    keys = [key(i) for i in range(4)]
    store.put(keys[:3], pages_for(keys[:3]), None, "sync")
    fs.fail_at, fs.fail_repeats = fs.num_points + 1, True
    with pytest.raises(StorageIOError):
        store.put(keys[3:], pages_for(keys[3:]), None, "group")
    with pytest.raises(DbFailedError):
        store.put(keys[3:], pages_for(keys[3:]), None, "group")
    store.close()
    store = open_store(tmp_path)
    try:
        out = np.zeros((4, TINY.page_bytes), np.uint8)
        assert store.get_into(keys, out)[:3] == [True] * 3
        assert (out[:3] == pages_for(keys[:3])).all()
        assert store.verify().ok
    finally:
        store.close()
