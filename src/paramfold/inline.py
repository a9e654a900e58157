"""The inline strategy: compute a parametrized tensor where it is read, through the leanest path.

Stock ``parametrize`` reads a tensor through a per-instance property, the
``ParametrizationList`` module call, ``ModuleList.__getitem__`` and a ``hasattr`` loop; dynamo
inlines all of it for every read. :func:`compute` goes straight from the ``_modules`` and
``_parameters`` dicts to the parametrization modules, which is the same sequence of module
calls (so the same ops, bitwise) with far less Python for dynamo to trace.

:func:`inline_property` goes further for inline sites: a property whose getter is generated
per chain shape, with the chain unrolled into one expression.

:class:`SiteDescriptor` serves hoist and freeze sites whenever they are read outside a call
scope (see :mod:`paramfold.scope`). It is a *non-data* descriptor on purpose: an instance
``__dict__`` entry of the same name takes precedence, which is how hoisted and frozen values
reach compiled code as plain tensors.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn.utils import parametrize


def compute(module: nn.Module, name: str) -> torch.Tensor:
    """Evaluate the parametrization chain of ``module.<name>`` like stock, minus the plumbing."""
    plist = module._modules["parametrizations"]._modules[name]
    chain = iter(plist._modules.values())
    first = next(chain)
    if plist.is_tensor:
        value = first(plist.original)
    else:
        value = first(*[getattr(plist, f"original{i}") for i in range(plist.ntensors)])
    for parametrization in chain:
        value = parametrization(value)
    return value


class SiteDescriptor:
    """Class attribute standing in for stock's per-instance property of one tensor name."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, module: nn.Module | None, owner: type | None = None):
        if module is None:
            return self
        if parametrize._cache_enabled and not torch.compiler.is_compiling():
            # Honour `with parametrize.cached():` exactly like the stock property does.
            return _cached(module, self.name)
        return compute(module, self.name)


def chain_signature(module: nn.Module, name: str) -> tuple[int | None, str, int]:
    """What the generated getter of ``module.<name>`` is specialised on.

    ``(number of originals or None for a single ``original``, the dict holding them, chain
    length)``. Modules with equal signatures share one getter, and so one class.
    """
    plist = module._modules["parametrizations"]._modules[name]
    ntensors = None if plist.is_tensor else plist.ntensors
    first = "original" if plist.is_tensor else "original0"
    where = "_parameters" if first in plist._parameters else "_buffers"
    return ntensors, where, len(plist._modules)


@functools.cache
def inline_property(name: str, signature: tuple[int | None, str, int]) -> property:
    """A property computing ``module.<name>`` with the chain unrolled into straight-line code.

    Dynamo traces a handful of bytecodes per read instead of stock's ``ParametrizationList``
    machinery; the module calls are the same, so the ops (and results) are the same.
    """
    ntensors, where, length = signature
    if ntensors is None:
        args = f'o["original"]'
    else:
        args = ", ".join(f'o["original{i}"]' for i in range(ntensors))
    expr = f'm["0"]({args})'
    for i in range(1, length):
        expr = f'm["{i}"]({expr})'
    source = (
        "def get(self):\n"
        "    if parametrize._cache_enabled:\n"
        f"        return _cached(self, {name!r})\n"
        f"    p = self._modules['parametrizations']._modules[{name!r}]\n"
        "    m = p._modules\n"
        f"    o = p.{where}\n"
        f"    return {expr}\n"
        "def set(self, value):\n"
        f"    self._modules['parametrizations']._modules[{name!r}].right_inverse(value)\n"
    )
    namespace = {"parametrize": parametrize, "_cached": _cached}
    exec(compile(source, f"<paramfold inline getter {name}{signature}>", "exec"), namespace)
    return property(namespace["get"], namespace["set"])


def _cached(module: nn.Module, name: str) -> torch.Tensor:
    key = (id(module), name)
    value = parametrize._cache.get(key)
    if value is None:
        value = parametrize._cache[key] = compute(module, name)
    return value
