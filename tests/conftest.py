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
