"""Property checks for parametrized models: run them in your own test suite.

Three layers, usable separately:

* :func:`assert_equivalent` runs a model stock and prepared by :func:`paramfold.prepare`
  side by side (forward, backward, several steps, optionally compiled) and fails with a message
  naming the first tensor that differs; then it restores the prepared copy and checks that its
  structure is exactly what it was (:func:`structure`, :func:`assert_same_structure`).
* :data:`PARAMETRIZATIONS`, a registry of real parametrizations by name (torch's
  ``weight_norm``, ``spectral_norm``, ``orthogonal``; the ``unsafe`` dtype cast; a custom
  ``right_inverse`` returning a tuple; a custom buffer scale; torchao's ``FakeSparsity`` mask and
  ``Int8WeightOnlyConfig`` + ``unwrap_tensor_subclass``), each applied by
  ``PARAMETRIZATIONS[name].apply(module, tensor_name, **options)``.
* Hypothesis strategies: :func:`chains` (1-3 compatible parametrizations for one tensor),
  :func:`models` (small random models as a printable :class:`NetSpec`) and :func:`cases`
  (a model factory, its inputs and the case's flags).

Example::

    >>> import torch, paramfold.testing as pt
    >>> from torch.nn.utils.parametrizations import weight_norm
    >>> model = torch.nn.Sequential(weight_norm(torch.nn.Linear(4, 4)), torch.nn.Tanh())
    >>> pt.assert_equivalent(model, torch.randn(2, 4), "hoist", steps=2)

and with Hypothesis::

    from hypothesis import given, settings
    import paramfold.testing as pt

    @settings(deadline=None)  # a first call of a torch op can take longer than Hypothesis' 200 ms
    @given(pt.cases())
    def test_hoist_is_exact(case):
        factory, inputs, flags = case
        pt.assert_equivalent(factory(), inputs, "hoist", steps=2)

The layout says what needs what: :mod:`~paramfold.testing.registry` (the parametrizations),
:mod:`~paramfold.testing.nets` (the models, as data), :mod:`~paramfold.testing.check` (the
checker; its module docstring states the tolerances), its parts
:mod:`~paramfold.testing.resummed` (gradients paramfold sums in another order, and their
reference), :mod:`~paramfold.testing.between_steps` (the change between steps),
:mod:`~paramfold.testing.left_as_stock` (what a prepared model must leave as stock leaves it:
process-wide settings, global hooks, tensors' memory, the modules ``filter_fn`` leaves out),
:mod:`~paramfold.testing.walks` and :mod:`~paramfold.testing.generators` (what they share),
:mod:`~paramfold.testing.compare` (how results are compared),
:mod:`~paramfold.testing.structure` (snapshots of a model's objects) and
:mod:`~paramfold.testing.strategies` (Hypothesis, drawing from the registry and the nets). Everything is importable from here. Only the
strategies need Hypothesis (``pip install "paramfold[testing]"``): they are imported on first
use, so the checker and the registry work without it, and ``pt.cases`` without it raises an
ImportError that says what to install.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from paramfold.testing.check import COMPILE_TOLERANCES, assert_equivalent, grad_mode
from paramfold.testing.nets import BufferMix, Conv1dBlock, Conv2dBlock, LayerSpec, NetSpec, ResidualNet, WithUnused
from paramfold.testing.registry import PARAMETRIZATIONS, Cast, HalfSum, Recipe, Scale, Step, TensorSpec, apply_chain
from paramfold.testing.structure import Structure, assert_same_structure, structure

if TYPE_CHECKING:  # for type checkers and IDEs; at run time they are resolved by __getattr__
    from paramfold.testing.strategies import Case, cases, chains, models

#: The names :mod:`paramfold.testing.strategies` defines: importing it needs Hypothesis.
_STRATEGIES = frozenset({"Case", "cases", "chains", "models"})

__all__ = [
    "COMPILE_TOLERANCES",
    "PARAMETRIZATIONS",
    "BufferMix",
    "Case",
    "Cast",
    "Conv1dBlock",
    "Conv2dBlock",
    "HalfSum",
    "LayerSpec",
    "NetSpec",
    "Recipe",
    "ResidualNet",
    "Scale",
    "Step",
    "Structure",
    "TensorSpec",
    "WithUnused",
    "apply_chain",
    "assert_equivalent",
    "assert_same_structure",
    "cases",
    "chains",
    "grad_mode",
    "models",
    "structure",
]


def __getattr__(name: str) -> Any:
    if name == "ModelSpec":  # its name until it met paramfold.bench.ModelSpec, a different thing
        warnings.warn(
            "paramfold.testing.ModelSpec is deprecated: use paramfold.testing.NetSpec (same class)",
            DeprecationWarning,
            stacklevel=2,
        )
        return NetSpec
    if name in _STRATEGIES:
        value = getattr(importlib.import_module("paramfold.testing.strategies"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _STRATEGIES)
