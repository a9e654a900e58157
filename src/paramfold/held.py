"""What a parametrization module holds besides its tensors, submodules and hooks.

A chain may read more than its members' own attributes: a config dict (``self.cfg["scale"]``),
an object it was given (``self.schedule.temperature``), a list of scales. Stock reads them at
every computation, so a frozen value must be computed again when any of them changes, and
``find``'s probe must see a member that changes them itself (a count kept in a list).

Dicts, and the ``__dict__`` of plain objects, have a version tag that any write changes: freeze
watches them as it watches the members' own attributes, and tensors found in them are inputs like
any other; a tuple's items and a frozen dataclass's fields are followed the same way. Other
mutable holders (a list, a set, a numpy array, an object with ``__slots__`` or a base implemented
in C, a tensor inside a tuple) have no tag, and comparing their contents at every call would
cost every call: a chain holding one is not frozen (``"auto"`` computes it at each call,
``"freeze"`` refuses it). So is one whose member keeps a value in ``__slots__`` of its own, or
holds dicts and objects nested deeper than :data:`_DEPTH` or more than :data:`_MOST` of them.
A prepared module's paramfold state and installed values are not its holdings. Not followed:
state reached through a function (its closure, defaults or globals), a bound method's object, a
class's attributes other than the members' own classes' (and of those, only which object each
is: not a dict it holds, changed in place), or a module referenced as a plain attribute.

The random generators a member holds (a ``random.Random``, a NumPy ``Generator``) are listed here
too (:func:`generators`, compared by :func:`generator_state`); the process's global ones, which a
chain may hold or draw from: :mod:`paramfold.global_generators`.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import pickle
import random
import re
import sys
import types

import torch
from torch import nn

from paramfold.frames import run_module_eagerly_as_frames
from paramfold.state import ONCE_ATTR, STATE_ATTR, installed_keys

#: ``nn.Module``'s own bookkeeping (hook dicts, ``_parameters``, ``_buffers``, ``_modules``, ...):
#: watched apart where a value depends on it.
_STANDARD = frozenset(nn.Module().__dict__)

#: Values nothing can change in place, or whose state is not followed (see the module docstring).
_ATOMS = (
    type(None), bool, int, float, complex, str, bytes, range, slice, type(Ellipsis), type(NotImplemented),
    torch.dtype, torch.device, torch.layout, torch.memory_format, torch.qscheme, torch.Generator, enum.Enum, type,
    types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType, re.Pattern,
    torch.Tensor, nn.Module,
)

#: How deep and how many held objects are followed; past either, what is left counts as unwatched.
_DEPTH, _MOST = 4, 256

#: What a refusal for an unwatched holder advises.
ADVICE = (f"keep such settings in dicts, tuples or plain objects, which are followed up to {_DEPTH} levels "
          f"deep and {_MOST} objects per member")


class Held:
    """What one module holds: ``dicts``, watched by their version tags (held dicts and plain
    objects' ``__dict__``, besides the module's own); ``tensors``, ``(dict, key, tensor)`` of each
    tensor entry of those; ``objects``, each object whose ``__dict__`` is among ``dicts`` (its
    ``__class__`` set, or its ``__dict__`` replaced, touches no tag); ``unwatched``,
    ``(where, object)`` of each holder no tag watches (``(slot name, the module)`` for each of
    the module's own slots)."""

    __slots__ = ("dicts", "tensors", "objects", "unwatched")

    def __init__(self) -> None:
        self.dicts: list[dict] = []
        self.tensors: list[tuple[dict, object, torch.Tensor]] = []
        self.objects: list[object] = []
        self.unwatched: list[tuple[str, object]] = []


def held(module: nn.Module) -> Held:
    """What ``module``'s plain attributes hold (see :class:`Held`).

    >>> from torch import nn
    >>> m = nn.Module()
    >>> m.cfg = {"scale": 2.0}
    >>> m.scales = [1.0, 2.0]
    >>> found = held(m)
    >>> found.dicts == [m.cfg], [where for where, _ in found.unwatched]
    (True, ['scales'])
    """
    found = Held()
    seen = {id(module.__dict__)}
    skipped = _STANDARD
    state = module.__dict__.get(STATE_ATTR)
    if state is not None:  # a prepared module: paramfold's own state and the values it installs
        skipped = skipped | {STATE_ATTR, ONCE_ATTR, *installed_keys(module, state)}
    for key, value in vars(module).items():
        if key not in skipped:
            _visit(found, seen, value, key, 0)
    # Its own slots, outside its __dict__: each is recorded with the module as its holder.
    found.unwatched += [(name, module) for name in _all_slots(type(module)) if hasattr(module, name)]
    return found


def _visit(found: Held, seen: set[int], value: object, where: str, depth: int) -> None:
    if isinstance(value, _ATOMS) or _numpy_scalar(value) or id(value) in seen:
        return
    seen.add(id(value))
    if depth >= _DEPTH or len(seen) > _MOST:
        found.unwatched.append((where, value))
        return
    if isinstance(value, (tuple, frozenset)):
        _visit_items(found, seen, ((f"{where}[{i}]", item) for i, item in enumerate(value)), depth)
        return
    if isinstance(value, dict):
        _visit_dict(found, seen, value, where, depth, "[{!r}]")
        if type(value) is not dict:  # a subclass's own attributes too (``cfg.scale`` of a dict subclass)
            _visit_attributes(found, seen, value, where, depth)
        return
    if _frozen_dataclass(type(value)) and not hasattr(value, "__dict__"):
        # Fields that cannot be set (a frozen dataclass with slots): followed as a tuple's items.
        fields = dataclasses.fields(value)
        _visit_items(found, seen, ((f"{where}.{f.name}", getattr(value, f.name)) for f in fields), depth)
        return
    if isinstance(value, functools.partial):  # its arguments, which no __dict__ holds
        _visit(found, seen, value.args, where + ".args", depth + 1)
        _visit(found, seen, value.keywords, where + ".keywords", depth + 1)
        _visit_attributes(found, seen, value, where, depth)
        return
    if not isinstance(value, (list, set, bytearray)) and _state_in_dict(type(value)):
        attributes = getattr(value, "__dict__", None)
        if type(attributes) is dict:
            found.objects.append(value)
            _visit_dict(found, seen, attributes, where, depth, ".{}")
            return
    found.unwatched.append((where, value))


def _visit_items(found: Held, seen: set[int], items, depth: int) -> None:
    """The ``(where, item)`` of something that cannot change itself (a tuple, a frozen dataclass)."""
    for where, item in items:
        if isinstance(item, torch.Tensor):  # edited in place, no tag sees it
            found.unwatched.append((where, item))
        else:
            _visit(found, seen, item, where, depth + 1)


def _visit_attributes(found: Held, seen: set[int], value: object, where: str, depth: int) -> None:
    """The ``__dict__`` of a container (a dict subclass, a ``functools.partial``), if any."""
    attributes = getattr(value, "__dict__", None)
    if type(attributes) is dict and attributes is not value and id(attributes) not in seen:
        seen.add(id(attributes))
        found.objects.append(value)
        _visit_dict(found, seen, attributes, where, depth, ".{}")


def _visit_dict(found: Held, seen: set[int], d: dict, where: str, depth: int, step: str) -> None:
    found.dicts.append(d)
    for key, item in d.items():
        if isinstance(item, torch.Tensor):
            found.tensors.append((d, key, item))
        else:
            _visit(found, seen, item, where + step.format(key), depth + 1)


def _frozen_dataclass(cls: type) -> bool:
    params = getattr(cls, "__dataclass_params__", None)
    return params is not None and params.frozen


def _numpy_scalar(value: object) -> bool:
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.generic)


class _Plain:
    pass


_MISSING = object()


#: The instance size of a class defined in Python with no slots: a larger one has fields that a
#: base implemented in C keeps outside the ``__dict__`` (an exception's ``args``, a
#: ``threading.local``'s per-thread dicts, a ``functools.partial``'s arguments).
_PLAIN_SIZE = _Plain.__basicsize__


def _state_in_dict(cls: type) -> bool:
    """Whether an instance of ``cls`` keeps all its state in its ``__dict__``, so that the
    dict's tag sees every change: no slots, and no fields of a base implemented in C."""
    return cls.__basicsize__ <= _PLAIN_SIZE and not _has_slots(cls)


def _has_slots(cls: type) -> bool:
    """Whether instances of ``cls`` keep some state in slots, which no dict tag sees."""
    return bool(_all_slots(cls))


@functools.cache
def _all_slots(cls: type) -> tuple[str, ...]:
    return tuple(s for c in cls.__mro__ for s in _slot_names(c) if s != "__dict__" and s != "__weakref__")


def _slot_names(cls: type) -> tuple[str, ...]:
    slots = vars(cls).get("__slots__", ())
    return (slots,) if isinstance(slots, str) else tuple(slots)


def generators(module: nn.Module) -> list[object]:
    """The Python and NumPy random generators ``module`` holds (a ``random.Random``, a NumPy
    ``Generator``, ``RandomState`` or bit generator), directly or as an item of a held list, tuple
    or dict: no version tag sees a draw from one, :func:`generator_state` does."""
    found = []
    for _, obj in held(module).unwatched:
        items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple, set)) else (obj,)
        found += [item for item in items if generator_state(item) is not None]
    return found


def generator_state(obj: object) -> bytes | None:
    """The state of a Python or NumPy random generator, comparable with ``==``; None for anything
    else."""
    if isinstance(obj, random.Random):
        return pickle.dumps(obj.getstate())
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return None
    if isinstance(obj, numpy.random.Generator):
        obj = obj.bit_generator
    if isinstance(obj, numpy.random.RandomState):
        return pickle.dumps(obj.get_state(legacy=False))
    if isinstance(obj, numpy.random.BitGenerator):
        return pickle.dumps(obj.state)
    return None


def snapshot(module: nn.Module) -> tuple[list, list, list]:
    """What ``module`` holds, for :func:`same` to compare later: each held dict's entries, in
    order; each held tensor's version counter; each unwatched holder's items where they can be
    listed (a list's, a set's, a dict's, a slotted object's, an array's bytes)."""
    found = held(module)
    return ([(d, tuple(d.items())) for d in found.dicts], [(t, t._version) for _, _, t in found.tensors],
            [(obj, _contents(obj)) for _, obj in found.unwatched])


def same(snap: tuple[list, list, list]) -> bool:
    """Whether everything :func:`snapshot` recorded is as it was (entries by identity)."""
    dicts, tensors, others = snap
    for d, then in dicts:
        if (len(d) != len(then) or tuple(d) != tuple(k for k, _ in then)  # keys in order: move_to_end
                or not all(v is v0 for v, (_, v0) in zip(d.values(), then))):
            return False
    for t, version in tensors:
        if t._version != version:
            return False
    for obj, then in others:
        if _contents(obj)[1] != then[1]:
            return False
    return True


def _contents(obj: object) -> tuple[object, object]:
    """``(what is kept alive, what is compared)`` of an unwatched holder: items are compared by
    identity, and kept, so that no new item can be given a freed one's id."""
    if isinstance(obj, (list, tuple)) or type(obj).__name__ == "deque":
        items = tuple(obj)
        return items, tuple(map(id, items))
    if isinstance(obj, (set, frozenset)):
        items = tuple(obj)
        return items, frozenset(map(id, items))
    if isinstance(obj, dict):  # past the depth or count followed: its own entries, in order
        items = tuple(obj.items())
        return items, tuple(id(x) for item in items for x in item)
    if isinstance(obj, bytearray):
        return None, bytes(obj)
    if isinstance(obj, torch.Tensor):
        return None, obj._version
    slots = _all_slots(type(obj))
    if slots:  # a slotted object, or a module with slots of its own
        values = tuple(getattr(obj, name, _MISSING) for name in slots)
        return values, tuple(map(id, values))
    tobytes = getattr(obj, "tobytes", None)  # a numpy or array.array array
    if callable(tobytes):
        try:
            return None, tobytes()
        except Exception:
            pass
    return obj, id(obj)  # nothing to list: a change inside is not seen


# paramfold's own work: dynamo runs it eagerly when it meets it as a frame (paramfold.frames).
run_module_eagerly_as_frames(globals())
