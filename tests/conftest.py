"""Shared test set-up. Hypothesis profiles: ``ci`` (default) and ``nightly``.

Select one with ``HYPOTHESIS_PROFILE=nightly``; ``make test`` uses ``ci``.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", max_examples=50, deadline=None)
settings.register_profile("nightly", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.gpu`` tests skip, with the reason, where CUDA is absent."""
    import pytest
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run tools/gpu_check.py on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ---------------------------------------------------------------- a real Mooncake Store pool
# (kvdb/shared/localpool.py; used by tests/shared/ and tests/integrations/test_vllm_shared.py)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def shared_netns():
    """One private network namespace for every pool of the session, entered by the test thread:
    the Store client keeps process-wide connections and threads, made in the namespace they were
    first needed in, so each pool gets its own ports instead of its own namespace."""
    from helpers import need_pool
    from kvdb.netns import private_netns

    need_pool()
    with private_netns():
        yield


@pytest.fixture
def pool_factory(shared_netns):
    """``make(storage_bytes=[...], lease_ms=...)``: a fresh pool (master and storage processes)
    for this test, stopped by pid after it."""
    from contextlib import ExitStack

    from kvdb.shared.localpool import LocalPool as Pool

    with ExitStack() as stack:
        def make(storage_bytes=(64 << 20,), **kw) -> Pool:
            p = Pool(list(storage_bytes), **kw)
            stack.callback(p.stop)
            return p

        yield make


@pytest.fixture
def pool(pool_factory):
    return pool_factory()
