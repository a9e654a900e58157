"""The sites the checker walks in a model: its parametrized modules (:func:`parametrized`) and
its hook-based norms (:func:`hook_norms`).

Why a module of its own: the checker (:mod:`~paramfold.testing.check`), the reference that sums
gradients as paramfold does (:mod:`~paramfold.testing.resummed`), the change between steps
(:mod:`~paramfold.testing.between_steps`) and the checks of what a prepared model leaves as stock
(:mod:`~paramfold.testing.left_as_stock`) all walk a model's sites the same way, and each of them
is imported by the checker, so the walk cannot live in the checker. (Not paramfold's own site
finder, :mod:`paramfold.sites`: only its ``parametrization_paths``, the modules inside a
``ParametrizationList``, which are no sites of their own.) Its names are the testing package's
internals, shared across its modules, not part of :mod:`paramfold.testing`'s API.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from paramfold import hooknorms
from paramfold.compute import has_parametrizations
from paramfold.sites import parametrization_paths

__all__ = ["hook_norms", "parametrized"]


def parametrized(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(path, module)`` of every module of ``model`` with parametrizations, bar those inside a
    ``ParametrizationList`` (a chain's members)."""
    inside = parametrization_paths(model)
    return [
        (path, m)
        for path, m in model.named_modules()
        if has_parametrizations(m) and path not in inside
    ]


def hook_norms(model: nn.Module) -> list[tuple[str, nn.Module, Any, str]]:
    """``(path, module, hook, kind)`` of every hook-based norm paramfold serves in ``model``."""
    inside = parametrization_paths(model)
    return [(path, module, hook, kind) for path, module in model.named_modules() if path not in inside
            for _, hook, kind in hooknorms.hook_norms(module)]
