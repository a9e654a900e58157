"""Deprecated: the bench figures moved to :mod:`paramfold.bench.plot`.

``from paramfold.plot import plot_ratios`` still works and warns once (``DeprecationWarning``).
"""

from __future__ import annotations

import warnings

from paramfold.bench.plot import plot_ratios

__all__ = ["plot_ratios"]

warnings.warn(
    "paramfold.plot is deprecated: import plot_ratios from paramfold.bench.plot",
    DeprecationWarning,
    stacklevel=2,
)
