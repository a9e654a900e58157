"""Hypothesis profiles: "ci" (default) has no deadline (first calls of torch ops are slow) and is
derandomized when CI=true so that CI runs are reproducible; "dev" explores randomly."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    deadline=None,
    derandomize=os.environ.get("CI", "").lower() == "true",
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", parent=settings.get_profile("ci"), derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
