"""Class rebasing: a class with one of its bases (anywhere up its hierarchy) replaced.

Libraries wrap a module's class in a subclass of their own (FSDP2's ``fully_shard`` makes
``FSDP<cls>(FSDPModule, <cls>)``); when paramfold swaps the class underneath — stock's
per-instance class for its shared one, or back — the wrapper must be kept around the new class.
"""

from __future__ import annotations

import functools


def rebased(cls: type, old: type, new: type) -> type:
    """``cls`` with ``old`` replaced by ``new`` wherever it appears among its bases (recursively).

    ``rebased(C, C, N)`` is ``N``. Classes built here are cached, so modules that differ only by
    their per-instance ``old`` share one rebased class.
    """
    if cls is old:
        return new
    if old not in cls.__mro__:
        return cls
    bases = tuple(rebased(base, old, new) for base in cls.__bases__)
    name = cls.__name__.replace(old.__name__, new.__name__)
    namespace = tuple(
        (k, name if k == "__qualname__" else v) for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")
    )
    try:
        return _derived(name, bases, namespace)
    except TypeError:  # an unhashable class attribute: build it uncached
        return _derived.__wrapped__(name, bases, namespace)


@functools.cache
def _derived(name: str, bases: tuple[type, ...], namespace: tuple[tuple[str, object], ...]) -> type:
    return type(name, bases, dict(namespace))
