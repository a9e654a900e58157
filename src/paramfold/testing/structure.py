"""Snapshots of a model's object structure, to check that ``prepare`` + ``restore`` (or a refused
``prepare``) leaves a model exactly as it was: :func:`structure` and :func:`assert_same_structure`.

Why a module of its own: a test suite uses the snapshots on their own, around any transform, and
the checker (:mod:`~paramfold.testing.check`) uses them after each restore.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from paramfold.testing.compare import BITWISE, compare_dicts

__all__ = ["Structure", "assert_same_structure", "structure"]


@dataclasses.dataclass(frozen=True, eq=False)
class Structure:
    """A snapshot of a model's object structure (and, optionally, its state dict values).

    ``modules`` lists, for every module reached by ``named_modules(remove_duplicate=False)``
    (parametrization modules included): its path, object id, class object, ``__dict__`` keys,
    and the ids and ``requires_grad`` of its own parameters and buffers.
    """

    modules: tuple[tuple[Any, ...], ...]
    state: dict[str, torch.Tensor] | None


#: ``__dict__`` entries that are not paramfold's business: ``torch.compile(module)`` marks the
#: module it wraps.
_IGNORED_KEYS = frozenset({"_is_torch_compile"})


def structure(model: nn.Module, *, values: bool = True) -> Structure:
    """Snapshot ``model`` for :func:`assert_same_structure`; ``values`` also copies its state dict.

    Example::

        >>> import torch, paramfold
        >>> from paramfold.testing import structure, assert_same_structure
        >>> from torch.nn.utils.parametrizations import weight_norm
        >>> model = weight_norm(torch.nn.Linear(2, 2))
        >>> before = structure(model)
        >>> _ = paramfold.restore(paramfold.prepare(model, "hoist"))
        >>> assert_same_structure(before, structure(model))
    """
    rows = []
    for path, module in model.named_modules(remove_duplicate=False):
        params = tuple((n, id(p), p is not None and p.requires_grad) for n, p in module._parameters.items())
        buffers = tuple((n, id(b)) for n, b in module._buffers.items())
        keys = tuple(sorted(k for k in module.__dict__ if k not in _IGNORED_KEYS))
        rows.append((path, id(module), type(module), keys, params, buffers))
    state = None
    if values:
        state = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
    return Structure(tuple(rows), state)


def assert_same_structure(before: Structure, after: Structure) -> None:
    """Fail with a readable message unless two :func:`structure` snapshots agree.

    State values are compared (bitwise) only when both snapshots carry them.
    """
    if len(before.modules) != len(after.modules):
        raise AssertionError(f"module count changed: {len(before.modules)} -> {len(after.modules)}")
    fields = ("path", "module object", "class", "__dict__ keys", "parameters", "buffers")
    for old, new in zip(before.modules, after.modules):
        for field, a, b in zip(fields, old, new):
            if a == b:
                continue
            where = old[0] or "<root>"
            if field == "class":
                change = f"{a.__module__}.{a.__qualname__} (id {id(a)}) -> {b.__module__}.{b.__qualname__} (id {id(b)})"
            elif field == "__dict__ keys":
                change = f"added {sorted(set(b) - set(a))}, removed {sorted(set(a) - set(b))}"
            else:
                change = f"{a!r} -> {b!r}"
            raise AssertionError(f"module {where!r}: {field} changed: {change}")
    if before.state is not None and after.state is not None:
        compare_dicts("", "state_dict", before.state, after.state, BITWISE)
