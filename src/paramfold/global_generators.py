"""The process's global random generators: whether a chain draws from or seeds one, or holds one.

torch's default CPU (and initialised device) generators, Python's ``random`` and NumPy's
``np.random`` belong to the whole process, not to a chain. ``find``'s probe serves torch's draws
from a generator of its own (:mod:`paramfold.probe`), but a draw from Python's or NumPy's is a
call no dispatch mode sees, and a seed or a state set on any of them is no op: a chain that uses
one draws random numbers (stock's read moves or reseeds it at every computation), and the probe
must see that and put back what it moved (:class:`GlobalGenerators`). A chain holding one of them
itself (``self.g = torch.default_generator``, ``self.reseed = random.seed``) is probed on a deep
copy, which would use a copy (:func:`holds_global_generator`). Python's and NumPy's states are
read and set back here for :mod:`paramfold.testing` too (:func:`global_generator_states`).

The generators a member holds of its own (a ``random.Random``, a NumPy ``Generator``) are among
what it holds, compared on the probe's copy: :func:`paramfold.held.generators`.
"""

from __future__ import annotations

import collections
import functools
import itertools
import random
import sys
import types
from collections.abc import Iterable

import torch
from torch import nn

from paramfold.frames import run_module_eagerly_as_frames
from paramfold.held import _DEPTH, _STANDARD, own_dict, slot_values
from paramfold.state import ONCE_ATTR, STATE_ATTR, installed_keys


def holds_global_generator(module: nn.Module) -> bool:
    """Whether a module of ``module`` holds one of torch's default generators, or Python's or
    NumPy's global one, or a method bound to one (``random.seed``), anywhere its plain attributes
    reach (:func:`_held_items`: dicts' keys and values, lists, tuples, sets, deques, ``functools.partial``
    arguments, objects' attributes and slots, modules held in a list; up to :data:`_DEPTH` levels, and
    :data:`_LOOKED_AT` items per module: a held vocabulary of more is not read, and the smaller
    holders beside it are read first): a probe runs a deep copy, whose generator is
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
    """Whether any of ``values``, or what they hold, is one of the objects ``shared`` (by id).

    Level by level, each item compared as it is read, and at each level the smaller holders read
    first; a holder of more items than the budget has left (a vocabulary) is not read, and what the
    others hold, at every level, still is, whatever order the attributes were set in."""
    if any(id(v) in shared for v in values):
        return True
    seen: set[int] = set()
    budget = _LOOKED_AT
    level = values
    for _ in range(_DEPTH):
        holders = []
        for value in level:
            cls = type(value)  # not isinstance: a weak proxy's __class__ raises once its object is gone
            if id(cls) in _HOLDS_NOTHING or id(value) in seen:
                continue
            seen.add(id(value))
            try:
                holders.append(_held_items(value, cls))
            except Exception:  # nothing to look into without running its code
                continue
        level = []
        for count, items in sorted(holders, key=lambda sized: sized[0]):
            if count > budget:  # too large to read (a vocabulary): what the others hold is read still
                continue
            budget -= count
            for item in items:
                if id(item) in shared:
                    return True
                level.append(item)
    return False


#: Types that hold nothing, by id (a class whose metaclass defines ``__eq__`` alone cannot be hashed).
_HOLDS_NOTHING = frozenset(map(id, (type(None), bool, int, float, complex, str, bytes, torch.Tensor, nn.Parameter,
                                    torch.dtype, torch.device, type, types.FunctionType, types.BuiltinFunctionType,
                                    types.ModuleType, torch.Generator)))


def _held_items(value: object, cls: type) -> tuple[int, Iterable]:
    """How many items ``value`` holds, and an iterator over them, read through the base types' own
    methods and slots' own descriptors (no code of a subclass's or the holder's runs): a dict's keys
    and values, a list's, tuple's, set's or deque's items, a ``functools.partial``'s function and
    arguments, a bound method's object, the instance ``__dict__`` and slots, and of a module held
    as a plain value (one in a list), its own attributes and submodules."""
    if issubclass(cls, types.MethodType):  # a deep copy binds its copy to a copy of the object
        return 1, (value.__self__,)
    if issubclass(cls, (torch.Tensor, types.FunctionType, types.ModuleType, type, torch.Generator)):
        return 0, ()
    parts: list[Iterable] = []
    count = 0
    if issubclass(cls, dict):
        count += 2 * dict.__len__(value)
        parts.append(itertools.chain.from_iterable(dict.items(value)))
    elif issubclass(cls, (list, tuple, set, frozenset, collections.deque)):
        base = next(b for b in (list, tuple, set, frozenset, collections.deque) if issubclass(cls, b))
        count += base.__len__(value)
        parts.append(base.__iter__(value))
    elif issubclass(cls, functools.partial):
        args, keywords = vars(functools.partial)["args"], vars(functools.partial)["keywords"]
        count += 1 + len(args.__get__(value, cls)) + len(keywords.__get__(value, cls))
        parts.append((vars(functools.partial)["func"].__get__(value, cls), *args.__get__(value, cls),
                      *dict.values(keywords.__get__(value, cls))))
    attributes = own_dict(value, cls)
    if type(attributes) is dict:
        if issubclass(cls, nn.Module):  # its submodules, not its parameters' and hooks' bookkeeping
            modules = attributes.get("_modules")
            own = [v for k, v in attributes.items() if k not in _STANDARD and k != STATE_ATTR and k != ONCE_ATTR]
            own += list(dict.values(modules)) if type(modules) is dict else []
            count += len(own)
            parts.append(own)
        else:
            count += len(attributes)
            parts.append(dict.values(attributes))
    slots = slot_values(value, cls)
    if slots:
        count += len(slots)
        parts.append(v for _, v in slots)
    return count, itertools.chain.from_iterable(parts)


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


# paramfold's own work: dynamo runs it eagerly when it meets it as a frame (paramfold.frames).
run_module_eagerly_as_frames(globals())
