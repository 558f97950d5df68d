"""Index.write: one batch of puts and deletes lands as if applied one by one, in the order
given, whether it goes to RocksDB in arrival order or, from SORTED_WRITE_MIN ops up, in key
order (kvdb/cold/index.py)."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from kvdb.cold import index as index_module
from kvdb.cold.index import Index

_keys = st.sampled_from([bytes([0x42, i, 255 - i]) for i in range(12)])  # few keys: many repeats
_op = st.tuples(_keys, st.one_of(st.none(), st.binary(min_size=1, max_size=6)))

_dirs = itertools.count()


@settings(max_examples=40, deadline=None)
@given(batches=st.lists(st.one_of(st.lists(_op, max_size=8),
                                   st.lists(_op, min_size=index_module.SORTED_WRITE_MIN - 1,
                                            max_size=2 * index_module.SORTED_WRITE_MIN)),
                         min_size=1, max_size=3))
def test_a_batch_applies_each_keys_ops_in_the_order_given(tmp_path_factory, batches):
    idx = Index(str(tmp_path_factory.mktemp(f"ix{next(_dirs)}") / "index"))
    model: dict[bytes, bytes] = {}
    try:
        for ops in batches:
            idx.write(ops)
            for k, v in ops:
                if v is None:
                    model.pop(k, None)
                else:
                    model[k] = v
            for k in {k for k, _v in ops}:
                assert idx.get(k) == model.get(k)
    finally:
        idx.close()


def test_a_large_batch_with_a_key_put_then_deleted_then_put_again(tmp_path):
    """Past the sort threshold, one key's three ops among many keep their order."""
    n = index_module.SORTED_WRITE_MIN * 2
    others = [(bytes([0x42]) + i.to_bytes(4, "big"), b"v%d" % i) for i in range(n)][::-1]  # descending
    k = bytes([0x42]) + (n // 2).to_bytes(4, "big") + b"x"
    ops = others[: n // 3] + [(k, b"first")] + others[n // 3 : n // 2] + [(k, None)] + others[n // 2 :] + [(k, b"last")]
    idx = Index(str(tmp_path / "index"))
    try:
        idx.write(ops)
        assert idx.get(k) == b"last"
        idx.write(sorted(others) + [(k, None)] + [(b"\x42", b"a")] * 70)
        assert idx.get(k) is None and idx.get(b"\x42") == b"a"
        assert all(idx.get(key) == v for key, v in others)
    finally:
        idx.close()
