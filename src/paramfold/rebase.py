"""Class rebasing: a class with one of its bases (anywhere up its hierarchy) replaced.

Libraries wrap a module's class in a subclass of their own (FSDP2's ``fully_shard`` makes
``FSDP<cls>(FSDPModule, <cls>)``); when paramfold swaps the class underneath — stock's
per-instance class for its shared one, or back — the wrapper must be kept around the new class.
"""

from __future__ import annotations

import functools
import types


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
        derived = _derived(name, bases, namespace)
    except TypeError:  # an unhashable class attribute: build it uncached
        derived = _derived.__wrapped__(name, bases, namespace)
    for key, value in namespace:  # (once: a cached class has its own already)
        if vars(derived).get(key) is value and (own := _in_class(value, cls, derived)) is not value:
            setattr(derived, key, own)
    return derived


@functools.cache
def _derived(name: str, bases: tuple[type, ...], namespace: tuple[tuple[str, object], ...]) -> type:
    return type(name, bases, dict(namespace))


def _in_class(value: object, old: type, new: type) -> object:
    """``value``, an attribute of class ``old``, as one of ``new``: a function whose zero-argument
    ``super()`` (its ``__class__`` cell) names ``old`` copied with a cell naming ``new`` (else
    ``super()`` raises TypeError in ``new``'s instances), through classmethod, staticmethod and
    property; anything else as it is."""
    if isinstance(value, (classmethod, staticmethod)):
        inner = _in_class(value.__func__, old, new)
        return value if inner is value.__func__ else type(value)(inner)
    if isinstance(value, property):
        parts = (value.fget, value.fset, value.fdel)
        moved = tuple(_in_class(f, old, new) for f in parts)
        return value if moved == parts else property(*moved, value.__doc__)
    if not isinstance(value, types.FunctionType) or "__class__" not in value.__code__.co_freevars:
        return value
    i = value.__code__.co_freevars.index("__class__")
    closure = value.__closure__
    try:
        if closure[i].cell_contents is not old:
            return value
    except ValueError:  # an empty cell
        return value
    copied = types.FunctionType(value.__code__, value.__globals__, value.__name__, value.__defaults__,
                                (*closure[:i], types.CellType(new), *closure[i + 1:]))
    copied.__kwdefaults__ = value.__kwdefaults__
    copied.__dict__.update(value.__dict__)
    copied.__qualname__, copied.__doc__, copied.__module__ = value.__qualname__, value.__doc__, value.__module__
    copied.__annotations__ = value.__annotations__
    return copied
