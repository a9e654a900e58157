"""Whether dicts were written, tensors re-described or objects replaced since a moment, in one pass.

Freshness checks key on every dict a value is found through (a module's ``__dict__``, its
``_modules``, ``_parameters``, a chain member's attributes): any write to a dict gives it a new
version tag (CPython's ``ma_version_tag``; torch reads it, or a dict watcher's count from Python
3.12). They also key on how each input tensor is described — its type, dtype, device, shape,
strides, ``requires_grad``, conjugate and negative bits — which ``p.data = p.data.t()``,
``p.data = p.data[:3]`` or ``p.data = p.data.conj()`` changes without touching its version
counter, storage or bytes.

They also key on identities no tag shows: an object's class (``m.__class__ = C``), its
``__dict__`` (``m.__dict__ = {...}``), and, in a dict that is written for other reasons (a
module's ``__dict__``, where a call puts its values), one entry's object or one key's presence.

A steady call checks a few hundred dicts and tensors and as many identities. Read one by one from
Python, each costs one or more calls; dynamo's guard manager, which checks the same things before
every compiled call (``DICT_VERSION``, ``TENSOR_MATCH``, ``TYPE_MATCH``, ``ID_MATCH``,
``DICT_CONTAINS``), reads a whole tuple of them in one C++ pass, two to eight times faster.
:class:`Watch` uses it where this torch's guard manager behaves as relied on (tried once, on
probes, at import), and compares from Python otherwise: the answer is the same either way.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import repeat
from operator import contains, getitem, is_
from typing import Any

import torch
from torch import nn

from paramfold.frames import run_module_eagerly_as_frames
from paramfold.state import PLAIN_TENSOR_TYPES


def _load_dict_version():
    """torch's reader of a dict's version tag, where it behaves as this module relies on, else None."""
    try:
        from torch._C._dynamo.guards import dict_version
    except Exception:  # a torch without dynamo's C guards
        return None
    try:
        probe = nn.Module()
        tags = [dict_version(probe.__dict__)]
        for change in _DICT_CHANGES:
            change(probe)
            tags.append(dict_version(probe.__dict__))
        if len(set(tags)) != len(tags) or dict_version(probe.__dict__) != tags[-1]:
            return None
    except Exception:
        return None
    return dict_version


#: Writes a tag must see: an entry added, replaced, removed.
_DICT_CHANGES = (lambda m: setattr(m, "alpha", 1.0), lambda m: setattr(m, "alpha", 2.0),
                 lambda m: delattr(m, "alpha"))

_dict_version = _load_dict_version()
#: What a dict is compared by: its version tag, or, where torch cannot read one, a copy (entries
#: compared by identity, then ``==``).
tag = _dict_version if _dict_version is not None else dict


def layout(t: torch.Tensor) -> tuple:
    """How ``t`` is described, besides its storage and bytes: what a ``.data`` assignment can
    change without a version bump (the storage offset is in its address, checked apart), the lazy
    conjugate and negative bits included (``p.data = p.data.conj()``)."""
    try:
        stride = t.stride()
    except RuntimeError:  # tensor subclasses and layouts without strides
        stride = None
    return type(t), t.dtype, t.device, t.shape, stride, t.requires_grad, t.is_conj(), t.is_neg()


#: How many objects one guard manager of :func:`_guard_manager` checks: dynamo looks a child up
#: by a scan of its siblings as it adds one, so a flat manager of n objects takes O(n²) to build
#: (about 0.3 s for the 7,700 dicts and tensors of a 1,024-site model); in chunks, O(n).
_CHUNK = 64


def chunked(items: tuple) -> tuple[tuple, ...]:
    """``items`` as the tuple of tuples of at most :data:`_CHUNK` that :func:`_guard_manager`'s
    ``check`` takes."""
    return tuple(items[i:i + _CHUNK] for i in range(0, len(items), _CHUNK))


def _guard_manager(dicts: tuple[dict, ...], tensors: tuple[torch.Tensor, ...], ids: Identities = None) -> Any:
    """A dynamo ``RootGuardManager`` whose ``check(chunked((*dicts, *tensors, *ids.objects())))``
    is True while no dict was written, no tensor re-described (:func:`layout`) and none of
    ``ids`` replaced since now."""
    from torch._C._dynamo.guards import RootGuardManager
    from torch._dynamo.guards import GuardManagerType

    ids = ids if ids is not None else Identities()
    manager = GuardManagerType.GUARD_MANAGER
    root = RootGuardManager()
    chunks = [root.tuple_getitem_manager(c, f"watched[{c}]", chunk, manager)
              for c, chunk in enumerate(chunked((*dicts, *tensors, *ids.objects())))]

    def item(i: int, obj: object) -> Any:
        c, j = divmod(i, _CHUNK)
        return chunks[c].tuple_getitem_manager(j, f"watched[{c}][{j}]", obj, manager)

    for i, d in enumerate(dicts):
        item(i, d).add_dict_version_guard(d, [f"watched item {i} unwritten"], None)
    i = len(dicts)
    for t in tensors:
        item(i, t).add_tensor_match_guard(t, list(t.size()), list(t.stride()), f"watched item {i}",
                                          [f"watched item {i} as described"], None, type(t), torch._C._dispatch_keys(t))
        i += 1
    for obj, cls in zip(ids.typed, ids.types):
        item(i, obj).add_type_match_guard(id(cls), [f"watched item {i} of its class"], None)
        i += 1
    for obj, d in zip(ids.dicted, ids.dicts):
        own = item(i, obj).get_generic_dict_manager(f"watched item {i}.__dict__", d, manager)
        own.add_id_match_guard(id(d), [f"watched item {i} with its __dict__"], None)
        i += 1
    for d, key, value in zip(ids.entry_dicts, ids.entry_keys, ids.entry_values):
        entry = item(i, d).dict_getitem_manager(key, f"watched item {i}[{key!r}]", value, manager)
        entry.add_id_match_guard(id(value), [f"watched item {i}[{key!r}] the same object"], None)
        i += 1
    for d, key, present in zip(ids.key_dicts, ids.key_names, ids.key_present):
        item(i, d).add_dict_contains_guard(present, key, [f"watched item {i} with {key!r} or without"], None)
        i += 1
    return root


class Identities:
    """Identities a :class:`Watch` checks besides tags and descriptions, as parallel columns:
    ``types``, (object, its class); ``dicts``, (object, its ``__dict__``); ``entries``, (dict,
    key, the object at that key); ``keys``, (dict, key, whether the dict has it). Each object
    named is held, so no check compares the address of one freed since."""

    __slots__ = ("typed", "types", "dicted", "dicts", "entry_dicts", "entry_keys", "entry_values",
                 "key_dicts", "key_names", "key_present")

    def __init__(self, types: Iterable[tuple[object, type]] = (), dicts: Iterable[tuple[object, dict]] = (),
                 entries: Iterable[tuple[dict, object, object]] = (),
                 keys: Iterable[tuple[dict, object, bool]] = ()) -> None:
        self.typed, self.types = columns(types, 2)
        self.dicted, self.dicts = columns(dicts, 2)
        self.entry_dicts, self.entry_keys, self.entry_values = columns(entries, 3)
        self.key_dicts, self.key_names, present = columns(keys, 3)
        self.key_present = list(present)

    def objects(self) -> tuple:
        """The objects a guard manager looks each identity up from, in its order."""
        return (*self.typed, *self.dicted, *self.entry_dicts, *self.key_dicts)

    def shape(self) -> tuple:
        """What decides which guards check which identity: a guard manager built for identities
        of another shape checks other things."""
        return len(self.typed), len(self.dicted), self.entry_keys, self.key_names, tuple(self.key_present)

    def same(self) -> bool:
        """From Python: whether every identity is as it was."""
        try:
            return (all(map(is_, map(type, self.typed), self.types))
                    and all(map(is_, map(vars, self.dicted), self.dicts))
                    and all(map(is_, map(getitem, self.entry_dicts, self.entry_keys), self.entry_values))
                    and list(map(contains, self.key_dicts, self.key_names)) == self.key_present)
        except (LookupError, TypeError):  # a key gone; an object without a __dict__ now
            return False


def columns(rows: Iterable[tuple], width: int) -> tuple[tuple, ...]:
    """``rows`` of ``width`` items as ``width`` parallel tuples (empty ones where there is no row)."""
    rows = tuple(rows)
    return tuple(zip(*rows)) if rows else ((),) * width


def _tensor_changes() -> tuple:
    """Re-descriptions :class:`Watch` must see, each as (make a tensor, change it)."""
    def data(make):
        return lambda t: setattr(t, "data", make(t.data))
    square = lambda: nn.Parameter(torch.zeros(4, 4), requires_grad=False)
    complex_square = lambda: nn.Parameter(torch.zeros(4, 4, dtype=torch.cfloat), requires_grad=False)
    return (
        (square, data(lambda d: d.t())),
        (square, data(lambda d: d[:2])),
        (square, data(lambda d: d.view(torch.int32))),
        (square, data(lambda d: d.as_strided((4, 4), (1, 4)))),
        (square, lambda t: t.requires_grad_(True)),
        (complex_square, data(lambda d: d.conj())),
        (complex_square, data(torch._neg_view)),
    )


def _guard_manager_works() -> bool:
    """Whether :func:`_guard_manager` builds and sees each change :data:`_DICT_CHANGES` and
    :func:`_tensor_changes` make, and nothing else, on probes (torch's private API: checked,
    not assumed)."""
    if _dict_version is None:
        return False
    try:
        for change in _DICT_CHANGES:
            probes = tuple(nn.Module() for _ in range(_CHUNK + 1))  # a change in the second chunk
            for probe in probes:
                probe.alpha = 0.0
            watched = tuple(m.__dict__ for m in probes)
            root = _guard_manager(watched, ())
            watched = chunked(watched)
            if root.check(watched) is not True:
                return False
            change(probes[-1])
            if root.check(watched) is not False or root.check(watched) is not False:
                return False
        for make, change in _tensor_changes():
            tensors = tuple(make() for _ in range(_CHUNK + 1))
            root = _guard_manager((), tensors)
            if root.check(chunked(tensors)) is not True:
                return False
            change(tensors[-1])
            if root.check(chunked(tensors)) is not False:
                return False
        for identities, change in _identity_changes():
            probes = tuple(nn.Module() for _ in range(_CHUNK + 1))
            for probe in probes:
                probe.alpha = 0.0
            ids = Identities(**identities(probes))
            root = _guard_manager((), (), ids)
            watched = chunked(ids.objects())
            if root.check(watched) is not True or not ids.same():
                return False
            change(probes[-1])
            if root.check(watched) is not False or ids.same():
                return False
        return True
    except Exception:
        return False


class _Probe(nn.Module):
    pass


def _identity_changes() -> tuple:
    """Replacements :class:`Identities` must see, each as (its columns for probe modules, change
    the last probe)."""
    types = lambda probes: {"types": [(m, type(m)) for m in probes]}
    dicts = lambda probes: {"dicts": [(m, vars(m)) for m in probes]}
    entries = lambda probes: {"entries": [(vars(m), "_modules", m._modules) for m in probes]}
    keys = lambda probes: {"keys": [(vars(m), key, key in vars(m)) for m in probes for key in ("alpha", "forward")]}
    return (
        (types, lambda m: setattr(m, "__class__", _Probe)),
        (dicts, lambda m: object.__setattr__(m, "__dict__", dict(vars(m)))),
        (entries, lambda m: vars(m).__setitem__("_modules", dict(m._modules))),
        (entries, lambda m: vars(m).pop("_modules")),
        (keys, lambda m: vars(m).pop("alpha")),
        (keys, lambda m: vars(m).__setitem__("forward", m.forward)),
    )


_USE_GUARD_MANAGER = _guard_manager_works()


class _TensorAt(int):
    """A tensor's ``id`` in a dict's snapshot: a watch keeps no tensor alive of its own (a tensor
    ``functional_call`` put in for one call is let go when the call ends; a weak reference would
    stop ``torch.utils.swap_tensors``). It stands for that tensor only where the watch holds it."""


def _snapshot(d: dict) -> dict:
    """``d``'s entries as they are now, a tensor's as a :class:`_TensorAt`."""
    try:
        plain = not any(map(isinstance, d.values(), repeat(torch.Tensor)))
    except Exception:  # a dead weak proxy's __class__ raises: by type, which runs no code of its own
        plain = not any(issubclass(type(value), torch.Tensor) for value in d.values())
    if plain:  # most: a copy in C, no frame
        return d.copy()
    return {key: _TensorAt(id(value)) if issubclass(type(value), torch.Tensor) else value for key, value in d.items()}


#: How many checks in a row a watch that took a written-back dict or a ``training`` switch
#: makes from Python before it builds its guard manager again (:meth:`Watch.same_but_training`).
_REROOT_AFTER = 64


class Watch:
    """``dicts``' version tags and ``tensors``' descriptions (:func:`layout`) now; :meth:`same`
    says whether all are as they were.

    >>> import torch
    >>> from torch import nn
    >>> layer = nn.Linear(2, 2)
    >>> watch = Watch([layer.__dict__, layer._parameters], [layer.weight])
    >>> watch.same()
    True
    >>> layer.weight.data = layer.weight.data.t()
    >>> watch.same()
    False

    ``ids``: the :class:`Identities` checked as well (an object's class, its ``__dict__``, one
    entry or key of a dict that is written for other reasons).

    >>> ids = Identities(types=[(layer, nn.Linear)], keys=[(vars(layer), "forward", False)])
    >>> watch = Watch([], [], ids=ids)
    >>> layer.forward = print
    >>> watch.same()
    False

    ``previous``: a watch whose guards are reused where they hold for these dicts, tensors and
    identities (the same dicts, unwritten since it was made; tensors described alike; the same
    objects), instead of built again. ``rooted_after``: how many checks :meth:`same` makes from
    Python before it builds the guard manager (which costs milliseconds for a few hundred objects,
    and pays only where it is checked again and again); 0 builds it at once.
    """

    __slots__ = ("dicts", "tensors", "ids", "tags", "layouts", "others", "other_layouts", "watched", "_root",
                 "_unrooted", "copies", "flags_free")

    def __init__(self, dicts: Iterable[dict] = (), tensors: Iterable[torch.Tensor] = (),
                 previous: Watch | None = None, ids: Identities | None = None, rooted_after: int = 0,
                 flags_free: int = -1) -> None:
        tensors = tuple(tensors)
        self.dicts = tuple(dicts)
        # The dicts as they are now, for :meth:`same_but_training` (where ``flags_free`` >= 0), and
        # how many of them, first, may have their ``training`` entry switched.
        self.copies = list(map(_snapshot, self.dicts)) if flags_free >= 0 else None
        self.flags_free = flags_free
        # Tensor subclasses are described from Python: the probes tried plain tensors only.
        self.tensors = tuple(t for t in tensors if type(t) in PLAIN_TENSOR_TYPES)
        self.others = tuple(t for t in tensors if type(t) not in PLAIN_TENSOR_TYPES)
        self.ids = ids if ids is not None else Identities()
        self.watched = chunked((*self.dicts, *self.tensors, *self.ids.objects()))
        self.other_layouts = list(map(layout, self.others))
        self._root = None
        self._unrooted = rooted_after if _USE_GUARD_MANAGER and self.watched else -1
        if previous is not None and previous._fits(self):
            # The same dicts, unwritten since ``previous`` was made, tensors described as its
            # were and the same identities: its guards hold for these, and building them again
            # would cost more than a call (dynamo's guard manager is built through Python, one
            # accessor per object).
            self._root, self.tags, self.layouts = previous._root, previous.tags, previous.layouts
            return
        self.tags = list(map(tag, self.dicts))
        self.layouts = list(map(layout, self.tensors))
        if self._unrooted == 0:
            self._build()

    def _build(self) -> None:
        """Build the guard manager, now that everything is as it was (else compare from Python)."""
        self._unrooted = -1
        try:
            self._root = _guard_manager(self.dicts, self.tensors, self.ids)
        except Exception:  # something the guards do not take: compare from Python
            self._root = None

    def _fits(self, other: Watch) -> bool:
        """Whether this watch's guards check what ``other``'s would, and hold for its dicts,
        tensors and identities as they are now."""
        if (self._root is None or len(self.dicts) != len(other.dicts) or len(self.tensors) != len(other.tensors)
                or self.ids.shape() != other.ids.shape()):
            return False
        try:
            return self._root.check(other.watched) is True
        except Exception:
            return False

    def same_but_training(self) -> bool:
        """After :meth:`same` said False: whether every dict written since holds the same keys and
        objects as then (written and written back: ``model.train()`` then ``model.eval()``), but
        for the ``training`` entry of the first ``flags_free`` dicts, which may differ, with the
        tensors described and the identities as then; if so, the watch takes the dicts as they are
        now and checks from Python until it has held for :data:`_REROOT_AFTER` checks in a row (its
        guards would cost more to build again at every switch than they save), then builds its
        guard manager again."""
        copies = self.copies
        if copies is None or (self.others and list(map(layout, self.others)) != self.other_layouts):
            return False
        try:
            if list(map(layout, self.tensors)) != self.layouts or not self.ids.same():
                return False
            tags = list(map(tag, self.dicts))
        except Exception:
            return False
        flags_free = self.flags_free
        held = set(map(id, (*self.tensors, *self.others)))
        for i, (d, then) in enumerate(zip(self.dicts, copies)):
            if tags[i] == self.tags[i]:
                continue
            if len(d) != len(then):
                return False
            for (key, value), (key_then, value_then) in zip(d.items(), then.items()):
                if key is not key_then and key != key_then:
                    return False
                if type(value_then) is _TensorAt:  # the same tensor, one this watch holds
                    if id(value) == value_then and value_then in held:
                        continue
                    return False
                if value is not value_then and (key != "training" or i >= flags_free):
                    return False
            copies[i] = _snapshot(d)
        self.tags, self._root, self._unrooted = tags, None, _REROOT_AFTER
        return True

    def same(self) -> bool:
        """Whether no dict was written and no tensor re-described since (a dict copy compared by
        ``==`` where torch reads no tags)."""
        if self.others and list(map(layout, self.others)) != self.other_layouts:
            return False
        root = self._root
        if root is not None:
            return root.check(self.watched)
        if not (list(map(tag, self.dicts)) == self.tags and list(map(layout, self.tensors)) == self.layouts
                and self.ids.same()):
            return False
        if self._unrooted > 0:
            self._unrooted -= 1
            if self._unrooted == 0:  # everything as it was, just checked: the guards take it as it is now
                self._build()
        return True


# paramfold's own work: dynamo runs it eagerly when it meets it as a frame (paramfold.frames).
run_module_eagerly_as_frames(globals())
