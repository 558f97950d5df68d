"""Shared test set-up. Hypothesis profiles: ``ci`` (default) and ``nightly``.

Select one with ``HYPOTHESIS_PROFILE=nightly``; ``make test`` uses ``ci``.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", max_examples=50, deadline=None)
settings.register_profile("nightly", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
