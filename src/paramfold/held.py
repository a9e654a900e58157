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
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import pickle
import random
import re
import sys
import types
from collections.abc import Iterable

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


def holds_global_generator(module: nn.Module) -> bool:
    """Whether a module of ``module`` holds one of torch's default generators, or Python's or
    NumPy's global one, or a method bound to one (``random.seed``), anywhere its plain attributes
    reach through dicts, lists, tuples, sets, ``functools.partial`` arguments and plain objects'
    attributes (up to :data:`_DEPTH` levels, and :data:`_LOOKED_AT` items per module: a held
    vocabulary of a million entries is not walked): a probe runs a deep copy, whose generator is
    a copy, so a seed or a draw the chain makes through it would go unseen. No user code runs: an
    object that cannot be looked into without it (a ``__dict__`` property, a dead weak proxy) is
    not followed."""
    shared = {id(g) for g in (*_torch_default_generators(), random._inst,
                              getattr(sys.modules.get("numpy.random.mtrand"), "_rand", None)) if g is not None}
    for m in module.modules():
        state = m.__dict__.get(STATE_ATTR)
        skipped = _STANDARD if state is None else _STANDARD | {STATE_ATTR, ONCE_ATTR, *installed_keys(m, state)}
        if _reaches(shared, [v for k, v in vars(m).items() if k not in skipped]):
            return True
    return False


#: How many held items :func:`holds_global_generator` looks at per module.
_LOOKED_AT = 10_000


def _reaches(shared: set[int], values: list) -> bool:
    """Whether any of ``values``, or what they hold, is one of the objects ``shared`` (by id)."""
    seen: set[int] = set()
    stack = [(v, 0) for v in values]
    budget = _LOOKED_AT
    while stack and budget > 0:
        value, depth = stack.pop()
        budget -= 1
        if id(value) in shared:
            return True
        cls = type(value)  # not isinstance: a weak proxy's __class__ raises once its object is gone
        if cls in _SCALARS or id(value) in seen or depth >= _DEPTH:
            continue
        seen.add(id(value))
        try:
            items = _held_items(value, cls)
        except Exception:  # nothing to look into without running its code
            continue
        stack.extend((item, depth + 1) for item in itertools.islice(items, budget))
    return False


#: Types that hold nothing: skipped without a look.
_SCALARS = frozenset({type(None), bool, int, float, complex, str, bytes, torch.Tensor, nn.Parameter, torch.dtype,
                      torch.device, type})


def _held_items(value: object, cls: type) -> Iterable:
    """What ``value`` holds, read through the base types' own methods (a subclass's are not run)."""
    if issubclass(cls, types.MethodType):  # a deep copy binds its copy to a copy of the object
        return (value.__self__,)
    if issubclass(cls, (torch.Tensor, nn.Module, types.FunctionType, types.ModuleType, type, torch.Generator)):
        return ()
    if issubclass(cls, dict):
        items = dict.values(value)
    elif issubclass(cls, list):
        items = list.__iter__(value)
    elif issubclass(cls, tuple):
        items = tuple.__iter__(value)
    elif issubclass(cls, (set, frozenset)):
        items = (set.__iter__ if issubclass(cls, set) else frozenset.__iter__)(value)
    elif issubclass(cls, functools.partial):
        items = (value.func, *value.args, *dict.values(value.keywords))
    else:
        items = ()
    attributes = _own_dict(value, cls)
    if type(attributes) is dict:
        return itertools.chain(items, dict.values(attributes))
    return items


#: How Python keeps an instance's ``__dict__`` (a class's own, or a C type's member): read without user code.
_PLAIN_DICT_SLOTS = (types.GetSetDescriptorType, types.MemberDescriptorType)


def _own_dict(value: object, cls: type) -> object:
    """``value.__dict__`` where Python keeps it (not a ``__dict__`` a class computes), else None."""
    for c in cls.__mro__:
        slot = c.__dict__.get("__dict__")
        if slot is not None:
            return slot.__get__(value, cls) if type(slot) in _PLAIN_DICT_SLOTS else None
    return None


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


def global_generator_states() -> tuple[tuple, NumpyState | None]:
    """The states of Python's global generator (``random.*``) and NumPy's (``np.random.*``; None
    where NumPy is not imported), comparable with ``==``: the generators a chain or a forward draws
    from without holding one, which no dispatch mode sees. Read at each probe of a chain
    (:mod:`paramfold.sites`), so as they come (``random.getstate()``'s tuple), not pickled: a
    third of the time (until 2026-12-07 both were pickled, 0.2 ms a read)."""
    numpy = sys.modules.get("numpy")
    return random.getstate(), None if numpy is None else NumpyState(numpy.random.get_state(legacy=False))


def set_global_generator_states(states: tuple[tuple, NumpyState | None]) -> None:
    """Put back what :func:`global_generator_states` returned."""
    python, numpy = states
    random.setstate(python)
    if numpy is not None:
        sys.modules["numpy"].random.set_state(numpy.state)


class GlobalGenerators:
    """Whether a chain's probe used a global generator, one it draws from or seeds without
    holding it (:mod:`paramfold.probe`): Python's ``random``, NumPy's ``np.random``, torch's
    default CPU (and initialised device) generators. Create it before the probe, call
    :meth:`moved` after: it says whether the probe used one, and puts back those it did.

    Python's and torch's are watched on the probe's own thread (``sys.setprofile``, which is per
    thread): every call of a method of Python's global generator but a state read (a draw,
    ``seed``, ``setstate``), and every seed or state set on torch's (``manual_seed``,
    ``set_rng_state``; torch's draws are ops, which the probe serves from a generator of its
    own). So another thread's seeds of torch's meanwhile are neither taken for the chain's nor
    undone, and a seed or state set to the one a generator is in already shows; a generator is
    put back to its state just before the probe first used it. A method called by C code (``map``
    over ``random.getrandbits``) makes no profile event: Python's state is compared too, and put
    back to where it was before the probe (another thread's draws meanwhile are then taken for the
    chain's, and drawn again). ``torch.random.fork_rng`` putting torch's state back is no use of
    it. NumPy's functions are Cython, which no profiler sees: its state is compared
    (:class:`_NumpyCompared`).

    Where the thread has a profiler already (``cProfile``), which ``sys.setprofile`` would
    replace, all three are compared instead (:class:`_Compared`). Where the chain itself stops
    or replaces the watch (a profiler it starts and stops: ``sys.setprofile(None)``), what it did
    after is unknown: the probe is taken as having used them, each put back to its state before
    the probe, and whatever profiler the chain left is left in place; so where it sets a profile
    function or starts a profiler at all (``sys.setprofile``, ``cProfile``'s ``enable``, torch's
    profiler), even one that puts the watch back after."""

    __slots__ = ("used", "saved", "outer", "compared", "numpy", "python", "torch", "paused")

    def __init__(self) -> None:
        self.used = False
        self.paused = False  # the chain set a profile function (the watch off, maybe put back later)
        self.python = random.getstate()  # a draw no call shows: a C function calling its method (map)
        self.torch: tuple | None = None  # torch's generators' states, where the watch was stopped
        self.saved: dict[object, tuple] = {}  # generator -> (its state then, how to put it back)
        profile = sys.getprofile()
        ours = getattr(profile, "__func__", None) is GlobalGenerators._seen
        self.outer = profile.__self__ if ours else None  # a probe inside a probe: both see its calls
        self.compared = _Compared() if profile is not None and not ours else None
        self.numpy = _NumpyCompared() if self.compared is None else None
        if self.compared is None:
            # put back only where the chain stopped the watch: another thread's seed meanwhile is undone then
            self.torch = tuple((g, g.get_state()) for g in _torch_default_generators())
            sys.setprofile(self._seen)

    def _seen(self, frame: types.FrameType, event: str, arg: object) -> None:
        if event != "c_call" or (arg is sys.setprofile and frame.f_code in _WATCHES_OWN):  # not the chain's
            return
        if self.outer is not None:
            self.outer._seen(frame, event, arg)
        if arg is sys.setprofile or _starts_a_profiler(arg):  # what it does until it puts the watch back is unseen
            self.paused = True
            return
        owner = getattr(arg, "__self__", None)
        kind = None if owner is None else _global_generator(owner, arg.__name__)
        if kind is None or (kind == "torch" and _putting_back(frame)):
            return
        self.used = True
        if owner not in self.saved:
            self.saved[owner] = (random.getstate(), random.setstate) if kind == "python" else (
                owner.get_state(), owner.set_state)

    def moved(self) -> bool:
        """Whether the probe drew from or seeded a global generator (each put back as it was just
        before the probe first used it)."""
        if self.compared is not None:
            return self.compared.moved()
        profile = sys.getprofile()
        ours = getattr(profile, "__func__", None) is GlobalGenerators._seen and profile.__self__ is self
        if ours:
            sys.setprofile(self.outer._seen if self.outer is not None else None)
        if self.paused or not ours:  # the chain stopped or replaced the watch (an outer probe's too, which sees that)
            self.used = True
            for g, state in self.torch:
                g.set_state(state)
        for state, put_back in self.saved.values():
            put_back(state)
        if random.getstate() != self.python:
            self.used = True
            random.setstate(self.python)
        return self.numpy.moved() or self.used


#: The code that sets and removes the probe's watch (an inner probe's too, seen by an outer one).
_WATCHES_OWN = frozenset({GlobalGenerators.__init__.__code__, GlobalGenerators.moved.__code__})


def _starts_a_profiler(fn: object) -> bool:
    """Whether ``fn``, a C function the probe's chain calls, sets the thread's profile function:
    a ``cProfile.Profile``'s ``enable``, torch's profiler starting (its Python tracer)."""
    name = getattr(fn, "__name__", "")
    if name == "enable":
        owner = getattr(fn, "__self__", None)
        return owner is not None and any(c.__module__ == "_lsprof" for c in type(owner).__mro__)
    return name in ("_enable_profiler", "_prepare_profiler")


#: The methods of torch's generators that set their state (a draw is an op, served by the probe).
_TORCH_SETTERS = frozenset({"manual_seed", "seed", "set_state", "set_offset", "graphsafe_set_state"})


def _global_generator(owner: object, name: str) -> str | None:
    """Which global generator a C method bound to ``owner`` uses (``"python"``, ``"torch"``), or
    None: none, or only reads it."""
    if owner is random._inst:
        return None if name == "getstate" else "python"
    if type(owner) is torch._C.Generator and name in _TORCH_SETTERS:
        if any(owner is g for g in _torch_default_generators()):
            return "torch"
    return None


def _torch_default_generators() -> tuple:
    """torch's default CPU generator and the default generators of the CUDA devices initialised."""
    cuda = sys.modules["torch.cuda"].default_generators if "torch.cuda" in sys.modules else ()
    return (torch.default_generator, *cuda)


def _putting_back(frame: types.FrameType | None) -> bool:
    """Whether a call from ``frame`` is ``torch.random.fork_rng`` putting a state back."""
    code = getattr(getattr(torch.random.fork_rng, "__wrapped__", None), "__code__", None)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


class _NumpyCompared:
    """Whether NumPy's global generator moved between this object's creation and :meth:`moved`
    (put back where it did). Where it is freshly seeded it is moved by one draw first, so that a
    chain seeding it to the state it is in shows too (about 40 us a read: only then). Another
    thread's draws meanwhile are taken for the chain's, and drawn again after."""

    __slots__ = ("state", "start")

    def __init__(self) -> None:
        numpy = sys.modules.get("numpy")
        self.state = self.start = None if numpy is None else NumpyState(numpy.random.get_state(legacy=False))
        if self.state is not None and self.state.state.get("state", {}).get("pos") == _FRESH_INDEX:
            numpy.random.random_sample()
            self.start = NumpyState(numpy.random.get_state(legacy=False))

    def moved(self) -> bool:
        if self.state is None:
            return False
        numpy = sys.modules["numpy"]
        drew = NumpyState(numpy.random.get_state(legacy=False)) != self.start
        if drew or self.start is not self.state:
            numpy.random.set_state(self.state.state)
        return drew


class _Compared:
    """:class:`GlobalGenerators` where the thread has a profiler already: the generators' states
    compared around the probe. Python's is moved by one draw first, so that a chain that sets it
    to the state it was in shows too; NumPy's as :class:`_NumpyCompared`. Of torch's only a seed
    set shows: its initial seed changed, or its state freshly seeded where it was not. Another
    thread's draws from Python's generator meanwhile are taken for the chain's and drawn again;
    another thread's torch seed is undone."""

    __slots__ = ("python", "numpy", "seed", "torch", "start")

    def __init__(self) -> None:
        self.python = random.getstate()
        self.numpy = _NumpyCompared()
        self.seed = torch.initial_seed()
        self.torch = torch.default_generator.get_state()
        random.getrandbits(32)
        self.start = random.getstate()

    def moved(self) -> bool:
        drew = random.getstate() != self.start
        random.setstate(self.python)
        drew = self.numpy.moved() or drew
        now, seed = torch.default_generator.get_state(), torch.initial_seed()
        seeded = seed != self.seed or (torch.equal(now, _fresh_torch_state(seed)) and not torch.equal(now, self.torch))
        if seeded:
            torch.default_generator.set_state(self.torch)
        return drew or seeded


#: The position of a Mersenne Twister (Python's, NumPy's legacy) right after it was seeded.
_FRESH_INDEX = 624


@functools.lru_cache(maxsize=4)
def _fresh_torch_state(seed: int) -> torch.Tensor:
    """torch's CPU generator state right after ``manual_seed(seed)``."""
    return torch.Generator().manual_seed(seed).get_state()


class NumpyState:
    """NumPy's ``get_state(legacy=False)`` (a dict holding an array, whose ``==`` is elementwise),
    compared with ``==`` by its entries, the arrays by dtype, shape and bytes."""

    __slots__ = ("state", "key")

    def __init__(self, state: dict) -> None:
        self.state = state
        self.key = _comparable(state)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NumpyState) and self.key == other.key

    __hash__ = None  # type: ignore[assignment]


def _comparable(obj: object) -> object:
    if isinstance(obj, dict):
        return tuple((k, _comparable(v)) for k, v in obj.items())
    if type(obj).__name__ == "ndarray":
        return obj.dtype.str, obj.shape, obj.tobytes()
    return obj


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
