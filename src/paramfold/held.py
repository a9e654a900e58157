"""What a parametrization module holds besides its tensors, submodules and hooks.

A chain may read more than its members' own attributes: a config dict (``self.cfg["scale"]``),
an object it was given (``self.schedule.temperature``), a list of scales. Stock reads them at
every computation, so a frozen value must be computed again when any of them changes, and
``find``'s probe must see a member that changes them itself (a count kept in a list).

Dicts, and the ``__dict__`` of plain objects, have a version tag that any write changes: freeze
watches them as it watches the members' own attributes, and tensors found in them are inputs like
any other; a tuple's items and a frozen dataclass's fields are followed the same way. Other
mutable holders (a list, a set, a numpy array, an object with ``__slots__`` or a base implemented
in C, a tensor inside a tuple, a dict subclass whose ``items`` or ``__getitem__`` is its own code)
have no tag, and comparing their contents at every call would cost every call: a chain holding
one is not frozen (``"auto"`` computes it at each call,
``"freeze"`` refuses it). So is one whose member keeps a value in ``__slots__`` of its own, or
holds dicts and objects nested deeper than :data:`_DEPTH` or more than :data:`_MOST` of them.
A prepared module's paramfold state and installed values are not its holdings. Not followed:
state reached through a function (its closure, defaults or globals), a bound method's object, a
class's attributes other than the members' own classes' (and of those, only which object each
is: not a dict it holds, changed in place), or a module referenced as a plain attribute. Held
objects are read through types and the base types' own methods: no code of the holder's runs (an
object that cannot be looked into without it, a ``__dict__`` property or a dead weak proxy, is
unwatched).

The random generators a member holds (a ``random.Random``, a NumPy ``Generator``) are listed here
too (:func:`generators`, compared by :func:`generator_state`); the process's global ones, which a
chain may hold or draw from: :mod:`paramfold.global_generators`.
"""

from __future__ import annotations

import array
import collections
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
    # Read through types and the base types' own methods, never the holder's code (``isinstance``
    # reads ``__class__``, which a dead weak proxy raises for; a class may compute ``__dict__``).
    cls = type(value)
    if issubclass(cls, _ATOMS) or _numpy_scalar(cls) or id(value) in seen:
        return
    seen.add(id(value))
    if depth >= _DEPTH or len(seen) > _MOST:
        found.unwatched.append((where, value))
        return
    try:
        _visit_holder(found, seen, value, cls, where, depth)
    except Exception:  # nothing to look into without running its code: no tag watches it
        found.unwatched.append((where, value))


def _visit_holder(found: Held, seen: set[int], value: object, cls: type, where: str, depth: int) -> None:
    if issubclass(cls, (tuple, frozenset)):
        items = tuple.__iter__(value) if issubclass(cls, tuple) else frozenset.__iter__(value)
        _visit_items(found, seen, ((f"{where}[{i}]", item) for i, item in enumerate(items)), depth)
        if cls is not tuple and cls is not frozenset:  # a subclass's own attributes too (a namedtuple has none)
            _visit_attributes(found, seen, value, cls, where, depth)
        return
    if issubclass(cls, dict):
        if _reads_in_python(cls):  # what its reads return is its code's, not what a version tag watches
            found.unwatched.append((where, value))
            return
        _visit_dict(found, seen, value, where, depth, "[{!r}]")
        if cls is not dict:  # a subclass's own attributes too (``cfg.scale`` of a dict subclass)
            _visit_attributes(found, seen, value, cls, where, depth)
        return
    if _frozen_dataclass(cls) and own_dict(value, cls) is None:
        # Fields that cannot be set (a frozen dataclass with slots): followed as a tuple's items.
        fields = {f.name for f in dataclasses.fields(cls)}
        _visit_items(found, seen, ((f"{where}.{name}", v) for name, v in slot_values(value, cls) if name in fields),
                     depth)
        return
    if issubclass(cls, functools.partial):  # its arguments, which no __dict__ holds
        _visit(found, seen, _PARTIAL_ARGS.__get__(value, cls), where + ".args", depth + 1)
        _visit(found, seen, _PARTIAL_KEYWORDS.__get__(value, cls), where + ".keywords", depth + 1)
        _visit_attributes(found, seen, value, cls, where, depth)
        return
    if not issubclass(cls, (list, set, bytearray)) and _state_in_dict(cls):
        attributes = own_dict(value, cls)
        if type(attributes) is dict:
            found.objects.append(value)
            _visit_dict(found, seen, attributes, where, depth, ".{}")
            return
    found.unwatched.append((where, value))


_PARTIAL_ARGS, _PARTIAL_KEYWORDS = vars(functools.partial)["args"], vars(functools.partial)["keywords"]


def _visit_items(found: Held, seen: set[int], items, depth: int) -> None:
    """The ``(where, item)`` of something that cannot change itself (a tuple, a frozen dataclass)."""
    for where, item in items:
        if issubclass(type(item), torch.Tensor):  # edited in place, no tag sees it
            found.unwatched.append((where, item))
        else:
            _visit(found, seen, item, where, depth + 1)


def _visit_attributes(found: Held, seen: set[int], value: object, cls: type, where: str, depth: int) -> None:
    """The ``__dict__`` of a container (a dict subclass, a ``functools.partial``), if any."""
    attributes = own_dict(value, cls)
    if type(attributes) is dict and attributes is not value and id(attributes) not in seen:
        seen.add(id(attributes))
        found.objects.append(value)
        _visit_dict(found, seen, attributes, where, depth, ".{}")


def _visit_dict(found: Held, seen: set[int], d: dict, where: str, depth: int, step: str) -> None:
    found.dicts.append(d)
    for key, item in dict.items(d):
        if issubclass(type(item), torch.Tensor):
            found.tensors.append((d, key, item))
        else:
            _visit(found, seen, item, where + step.format(key), depth + 1)


#: How a dict is read (by a chain, and by the watches of its entries).
_DICT_READS = ("__getitem__", "__iter__", "keys", "values", "items")


def _reads_in_python(cls: type) -> bool:
    """Whether a dict subclass reads its entries with code of its own (``__getitem__``,
    ``__iter__``, ``keys``, ``values`` or ``items`` defined in Python), which no version tag sees
    and a watch's reads would run: not followed. ``OrderedDict``'s, ``defaultdict``'s and
    ``Counter``'s reads are the base types' own, and so are an addict-style ``Dict``'s (its
    ``copy``, ``__missing__`` and ``__getattr__`` are its own)."""
    for c in cls.__mro__:
        if c is dict:
            return False
        own = vars(c)
        if any(name in own and not isinstance(own[name], _C_METHODS) for name in _DICT_READS):
            return True
    return False


_C_METHODS = (types.MethodDescriptorType, types.WrapperDescriptorType, types.BuiltinFunctionType,
              types.ClassMethodDescriptorType)


def _frozen_dataclass(cls: type) -> bool:
    params = getattr(cls, "__dataclass_params__", None)
    return params is not None and params.frozen


def _numpy_scalar(cls: type) -> bool:
    numpy = sys.modules.get("numpy")
    return numpy is not None and issubclass(cls, numpy.generic)


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


def _all_slots(cls: type) -> tuple[str, ...]:
    try:
        return _all_slots_cached(cls)
    except TypeError:  # a class that cannot be hashed (its metaclass defines __eq__ alone)
        return _all_slots_cached.__wrapped__(cls)


@functools.cache
def _all_slots_cached(cls: type) -> tuple[str, ...]:
    return tuple(s for c in cls.__mro__ for s in _slot_names(c) if s != "__dict__" and s != "__weakref__")


def slot_values(value: object, cls: type) -> list[tuple[str, object]]:
    """``(name, value)`` of each slot of ``value`` (of class ``cls``) that is set, read through
    the slot's own descriptor: no ``__getattribute__`` or property of the class's runs."""
    found = []
    for c in cls.__mro__:
        for name in _slot_names(c):
            if name in ("__dict__", "__weakref__"):
                continue
            key = f"_{c.__name__.lstrip('_')}{name}" if name.startswith("__") and not name.endswith("__") else name
            slot = vars(c).get(key)
            if type(slot) is types.MemberDescriptorType:
                try:
                    found.append((name, slot.__get__(value, cls)))
                except AttributeError:  # not set
                    pass
    return found


#: How Python keeps an instance's ``__dict__`` (a class's own, or a C type's member): read without user code.
_PLAIN_DICT_SLOTS = (types.GetSetDescriptorType, types.MemberDescriptorType)


def own_dict(value: object, cls: type) -> object:
    """``value.__dict__`` where Python keeps it (not a ``__dict__`` a class computes), else None."""
    for c in cls.__mro__:
        slot = vars(c).get("__dict__")
        if slot is not None:
            return slot.__get__(value, cls) if type(slot) in _PLAIN_DICT_SLOTS else None
    return None


def _slot_names(cls: type) -> tuple[str, ...]:
    slots = vars(cls).get("__slots__", ())
    return (slots,) if isinstance(slots, str) else tuple(slots)


def generators(module: nn.Module) -> list[object]:
    """The Python and NumPy random generators ``module`` holds (a ``random.Random``, a NumPy
    ``Generator``, ``RandomState`` or bit generator), directly or as an item of a held list, tuple
    or dict: no version tag sees a draw from one, :func:`generator_state` does."""
    found = []
    for _, obj in held(module).unwatched:
        cls = type(obj)
        items = (dict.values(obj) if issubclass(cls, dict) else list.__iter__(obj) if issubclass(cls, list)
                 else tuple.__iter__(obj) if issubclass(cls, tuple) else set.__iter__(obj) if issubclass(cls, set)
                 else (obj,))
        found += [item for item in items if generator_state(item) is not None]
    return found


def generator_state(obj: object) -> bytes | None:
    """The state of a Python or NumPy random generator, comparable with ``==``; None for anything
    else."""
    cls = type(obj)  # not isinstance: a dead weak proxy's __class__ raises
    if issubclass(cls, random.Random):
        return pickle.dumps(obj.getstate())
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return None
    if issubclass(cls, numpy.random.Generator):
        obj, cls = obj.bit_generator, type(obj.bit_generator)
    if issubclass(cls, numpy.random.RandomState):
        return pickle.dumps(obj.get_state(legacy=False))
    if issubclass(cls, numpy.random.BitGenerator):
        return pickle.dumps(obj.state)
    return None


def snapshot(module: nn.Module) -> tuple[list, list, list]:
    """What ``module`` holds, for :func:`same` to compare later: each held dict's entries, in
    order; each held tensor's version counter; each unwatched holder's items where they can be
    listed (a list's, a set's, a dict's, a slotted object's, an array's bytes)."""
    found = held(module)
    return ([(d, tuple(_entries(d))) for d in found.dicts], [(t, t._version) for _, _, t in found.tensors],
            [(obj, _contents(obj)) for _, obj in found.unwatched])


def same(snap: tuple[list, list, list]) -> bool:
    """Whether everything :func:`snapshot` recorded is as it was (entries by identity)."""
    dicts, tensors, others = snap
    for d, then in dicts:
        now = tuple(_entries(d))
        if (len(now) != len(then) or tuple(k for k, _ in now) != tuple(k for k, _ in then)  # keys in order
                or not all(v is v0 for (_, v), (_, v0) in zip(now, then))):
            return False
    for t, version in tensors:
        if t._version != version:
            return False
    for obj, then in others:
        if _contents(obj)[1] != then[1]:
            return False
    return True


def _entries(d: dict):
    """``d``'s entries in its order, through the base type's own method: an ``OrderedDict``'s
    (``move_to_end`` changes it, not the underlying dict's), else the dict's."""
    return (collections.OrderedDict.items if issubclass(type(d), collections.OrderedDict) else dict.items)(d)


def _contents(obj: object) -> tuple[object, object]:
    """``(what is kept alive, what is compared)`` of an unwatched holder: items are compared by
    identity, and kept, so that no new item can be given a freed one's id. Read through the base
    types' own methods, as :func:`held` reads."""
    cls = type(obj)
    try:
        if issubclass(cls, (list, tuple, collections.deque)):
            items = tuple((list.__iter__ if issubclass(cls, list) else tuple.__iter__ if issubclass(cls, tuple)
                           else collections.deque.__iter__)(obj))
            return items, tuple(map(id, items))
        if issubclass(cls, (set, frozenset)):
            items = tuple((set.__iter__ if issubclass(cls, set) else frozenset.__iter__)(obj))
            return items, frozenset(map(id, items))
        if issubclass(cls, dict):  # past the depth or count followed: its own entries, in order
            items = tuple(_entries(obj))
            return items, tuple(id(x) for item in items for x in item)
        if issubclass(cls, bytearray):
            return None, bytes(obj)
        if issubclass(cls, torch.Tensor):
            return None, obj._version
        if _all_slots(cls):  # a slotted object, or a module with slots of its own
            values = tuple(v for _, v in slot_values(obj, cls))
            return values, tuple(map(id, values))
        numpy = sys.modules.get("numpy")
        if (numpy is not None and issubclass(cls, numpy.ndarray)) or issubclass(cls, array.array):
            return None, obj.tobytes()
    except Exception:  # nothing to list without running its code
        pass
    return obj, id(obj)  # nothing to list: a change inside is not seen


# paramfold's own work: dynamo runs it eagerly when it meets it as a frame (paramfold.frames).
run_module_eagerly_as_frames(globals())
