"""The freeze strategy: materialise a parametrized tensor once and reuse it until its inputs change.

A frozen value is keyed on every tensor the chain reads (originals, nested originals, the
parametrization modules' own parameters and buffers, and tensors they hold as plain attributes),
in two ways:

* identity, storage address, version counter (none for an inference tensor: :func:`version_of`)
  and description (type, dtype, device, shape, strides, ``requires_grad``, conjugate and
  negative bits: :func:`~paramfold.watch.layout`) of each. Optimizer steps,
  ``load_state_dict`` (``copy_``), in-place ops, ``torch.nn.init.*`` on the tensor,
  ``lerp_``/``torch._foreach_lerp_``, ``assign=True`` loads, ``.data = ...`` (``p.data.t()`` on
  the same bytes included) and ``.to()`` / ``.half()`` change it. A wrapper subclass
  (``__tensor_flatten__``: torchao's quantized tensors) is keyed so on each of its inner tensors
  too, recursively, which are inputs like the others (:func:`_watched`), and on its
  ``__dict__``'s tag (an inner tensor or metadata reassigned; not what torch's compilers
  write there: :func:`only_bookkeeping`);
* with ``freeze_check="content"`` (the default), writes that bump no version counter —
  through ``.data`` (``p.data.mul_()``, init code, EMA loops), ``.detach().numpy()``, DLPack.
  A host input that is the only tensor on its storage (:func:`unshared`) is watched for writes
  (:func:`arm`): any write through torch and any later hand-out of a pointer to its bytes
  (numpy, DLPack, ``data_ptr()``) is seen, with no byte read per call (a mark cleared with
  nothing written is set again: :func:`rearm_unwritten`). An input something else
  already holds (a numpy array or DLPack capsule made before, a view, memory torch did not
  allocate) has its bytes checked at every call: hashed in place on the host (:data:`digest`,
  16 bytes kept per input), compared with a copy on a device. Not seen: a write through an
  address taken earlier as a bare integer, with nothing holding the memory.
  A subclass that is a plain tensor underneath (:func:`plain_underneath`) is marked or hashed
  as a plain one. ``freeze_check="version"`` reads no bytes: besides identity, address and version it watches
  each host input's storage for writes (:func:`arm`), which sees ``.data`` writes and every
  other write made through torch, but not one through memory exported before (a numpy array,
  DLPack, a raw pointer, another process). An input whose mark is found cleared with no version
  bump while something besides it holds its storage (a numpy array or DLPack export taken
  after the value was computed) is the exception: its bytes are hashed at every call from then
  on, and in the values computed after while that holds (:func:`rearm_unwritten`,
  :func:`_exported_since`).

and on what the chain reads besides tensors (:func:`settings`): its members' plain attributes
(``member.temperature = 0.5``), the ``ParametrizationList``'s own (stock calls it as a module: a
``forward`` set on it, an original shadowed in its ``__dict__``), every module's class, the dicts
and plain objects a custom member holds (:mod:`paramfold.held`; one holding a list, set or array
is not frozen), their submodules and forward hooks, and global forward hooks,
each dict's version tag (:data:`tag`) read when the value was computed; on what it was computed
under (:func:`~paramfold.compute.computed_under`: the autocast state, so that a value computed
outside ``torch.autocast`` does not serve a call inside it; torch's numerics settings, the
default dtype among them; the modes active, under which no frozen value serves); and on its own
version counter and armed storage (a forward may edit the value it reads in place, or through
``.data``).

Every key of an input is read before the value is computed (:func:`_fingerprint`), its write
mark set first: a write that lands meanwhile (another thread's ``load_state_dict``) is a change
at the next call, which computes the value again. A computation that clears a mark itself
(weight_norm's host kernel takes its originals' storages back) has it set again where the
input's version, address and bytes are still those read before (:func:`_freeze`).

Values are computed under ``no_grad`` and outside ``inference_mode``, so a value first needed
inside ``torch.inference_mode()`` also serves later calls that record gradients. One computed
from inputs that carry forward-mode tangents (a dual original, torch.func jvp's wrappers) serves
its own call only, as stock computed it: none of the keys above shows a tangent.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import operator
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from operator import is_

import torch
import xxhash
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from paramfold import hooknorms
from paramfold.compute import GLOBAL_HOOKS, compute, read_without_grad
from paramfold.errors import FoldError, first_few
from paramfold.frames import run_module_eagerly_as_frames
from paramfold.held import ADVICE, held
from paramfold.state import (CALLS, PLAIN_TENSOR_TYPES, STATE_ATTR, FrozenValue, SiteState, carries_tangents,
                             state_for, tensor_label, version_of)
from paramfold.state import functorch_wrapped as _wrapped
from paramfold.state import innermost_transform as _transform
from paramfold.state import tensor_data_ptr as _data_ptr
from paramfold.probe import draws
from paramfold.sites import Site, probed
from paramfold.watch import layout, tag


def frozen_value(module: nn.Module, name: str, site: SiteState, under: tuple) -> torch.Tensor | None:
    """Return the materialised ``module.<name>``, recomputing it if its inputs changed or it was
    computed under other settings than ``under`` (:func:`~paramfold.compute.computed_under`, now);
    None (auto) where the computation would draw random numbers: it is then computed where it is read."""
    frozen = site.frozen
    if frozen is None or not unchanged(site, frozen, under):
        if frozen is not None:
            site.misses += 1
        with torch.inference_mode(False), torch.no_grad(), _outside_transforms(site):
            # Keyed on its inputs as they are before it is computed: a write that lands meanwhile
            # (another thread's load_state_dict or p.copy_ under no_grad) is a change at the next
            # call, where keys read after would match the new weights to the old weights' value.
            prints = _fingerprint(site)
            try:
                with _Unchanging(_storages(prints)):
                    value = compute(module, name) if site.hook is None else hooknorms.compute(module, site.hook, site.hook_kind)
            except Stopped:
                _unmark(prints.fresh)
                # Something its watch does not see (paramfold.randomness) switched it on: a
                # condition on its originals, a write that bumped no version counter.
                site.draws = True
                if site.mode == "freeze":
                    raise random_now(module, name) from None
                return None  # auto: computed where it is read, drawing as stock does
            except BaseException:
                _unmark(prints.fresh)
                raise
            if carries_tangents(value):
                # Computed from inputs with forward-mode tangents (a dual original, a jvp's
                # wrappers): stock's value as read, tangents and view included, for this call
                # only. A frozen value is keyed on its inputs' identity, versions and bytes, none
                # of which shows their tangents (edited in place, gone when the level ends).
                _unmark(prints.fresh)
                release(frozen)
                site.frozen = None
                return value
            if type(value) in PLAIN_TENSOR_TYPES and value._base is not None:
                # A view of an original (a transpose, w[:]): kept as an alias of its storage only,
                # since a view holds its base, which torch.utils.swap_tensors (module.to() with
                # swap_module_params_on_conversion, load_state_dict then) refuses to swap. (Of an
                # original that requires grad, auto's inference: a leaf that requires grad, as
                # stock's view under no_grad is.)
                value = read_without_grad(value)
            new = _freeze(site, value, under, prints)
            if new is None:
                # An input written while it was computed: the value serves this call, as stock's
                # read racing with the write does, and the next call computes it again, frozen
                # (a steady plan would take a value computed for one call for a hoisted one).
                _unmark(prints.marked)
                release(frozen)
                site.frozen = None
                site.hoist_until = CALLS[0] + 1
                return value
            site.frozen = frozen = new
    else:
        site.misses = site.demotions = 0
    return frozen.value


def _outside_transforms(site: SiteState) -> contextlib.AbstractContextManager:
    """Where a value to freeze is computed inside a torch.func transform (``hessian(f)(x)`` of
    a model that needs no grad) from plain tensors only: outside the transforms. Inside them
    torch.func wraps every result for its levels, and a wrapper kept past the transform's end
    reaches the next one with dead levels (torch's INTERNAL ASSERT ``level <= current_level``);
    a plain value is what freezing outside the transform gives, and the transforms lift it as a
    constant, as they do the plain model's parameters. A value computed from the transform's
    own wrappers (vmap's stacked parameters) is computed inside it: its inputs change with
    every transform call, so it is never served to another."""
    if _transform() is None or any(_wrapped(t) for _, _, t in _inputs(site)):
        return contextlib.nullcontext()
    return torch._C._DisableFuncTorch()


class Stopped(Exception):
    """A computation under :class:`_Unchanging` (:func:`unchanging`) was about to draw, or write
    one of its tensors."""


class _Unchanging(TorchDispatchMode):
    """Stops a computation at its first op that would draw random numbers
    (:func:`~paramfold.probe.draws`: dropout, ``randn_like``, a draw from a private generator) or
    write to a tensor of the chain (one of ``storages``: an original, a member's buffer,
    parameter or tensor attribute, a view of one), before it runs: no generator moves, no state
    changes. A chain found not to do either (a freeze or auto site) that does it now was switched
    on since, which stock then does at every read. Per thread, like every dispatch mode."""

    def __init__(self, storages: frozenset[int]) -> None:
        super().__init__()
        self.storages = storages

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Dynamo does not compile a frame it meets under a mode without this, and marks its code
        # to be skipped for good: a member compiled with member.compile() would run eagerly in
        # every model from then on. With it, compiled code is compiled and run as stock runs it;
        # its ops are seen where its backend dispatches them one by one (eager, aot_eager).
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if draws(func, args, kwargs):
            raise Stopped(func.name())
        if func._schema.is_mutable and self.storages and self._writes_held(func, args, kwargs):
            raise Stopped(func.name())
        return func(*args, **kwargs)

    def _writes_held(self, func, args: tuple, kwargs: dict) -> bool:
        for i, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            target = args[i] if i < len(args) else kwargs.get(argument.name)
            for t in target if isinstance(target, (list, tuple)) else (target,):
                if isinstance(t, torch.Tensor) and _storage_of(t) in self.storages:
                    return True
        return False


def unchanging(tensors: Iterable[torch.Tensor]) -> contextlib.AbstractContextManager:
    """A context in which a computation raises :class:`Stopped` before its first op that would
    draw random numbers or write to one of ``tensors``' storages (through ``.data`` too, which no
    version counter shows): what a value is frozen under (:class:`_Unchanging`), for others
    (``paramfold.export``'s folded values)."""
    return _Unchanging(frozenset(k for k in map(_storage_of, tensors) if k is not None))


def _storage_of(t: torch.Tensor) -> int | None:
    try:
        return _storage_key(t)
    except Exception:  # no storage (a wrapper subclass, sparse, meta)
        return None


def _storages(prints: _Fingerprint) -> frozenset[int]:
    """The storages of every tensor a value is computed from, as :func:`_fingerprint` found them
    (:func:`_watched`)."""
    if _storage_key is None:
        return frozenset()
    return frozenset(k for k in (_storage_of(w[2]) for w in prints.watch) if k is not None)


def random_now(module: nn.Module, name: str) -> FoldError:
    return FoldError(
        f"the parametrization of {tensor_label(module, name)} would draw random numbers (or "
        "change its own attributes, buffers or originals, or compute another value with grad "
        "enabled than under no_grad) to compute the value to freeze, which it "
        "did not when paramfold.prepare probed it (a dropout probability or noise scale set above 0 "
        "since, or a flag that switches on an update): stock does that at every read, which a "
        "frozen value cannot. It was stopped before doing so. Call paramfold.restore(model) and "
        "prepare it again (mode='auto' then computes it at every read), or use mode='inline'."
    )


class _Fingerprint:
    """What a value to freeze is keyed on, read from its inputs and settings before it is
    computed (:func:`_fingerprint`); :func:`_freeze` adds the value's own keys."""

    __slots__ = ("watch", "sizes", "raw", "views", "marked", "fresh", "checks", "empty", "full", "then",
                 "members", "member_types", "dicted", "dicted_dicts", "ordered", "order", "wrapped")


def _fingerprint(site: SiteState) -> _Fingerprint:
    """Key every input of ``site`` (see :class:`FrozenValue`) as it is now, before its value is
    computed: an input is armed first (:func:`arm`), then its version, address and bytes are
    read, so a write at any moment after is seen by one of them."""
    content = site.freeze_check == "content"
    exported = _exported_since(site.frozen) if not content else frozenset()
    prints = _Fingerprint()
    watch, raw, views, marked, fresh, checks = [], [], [], [], [], []
    for d, key, t in _watched(site):
        # With the content check, an input nothing outside torch holds is marked, not read: any
        # later hand-out of a writable pointer to its bytes (numpy, DLPack, data_ptr()) disarms it
        # as a write through torch does. With the version check, every input is marked but one
        # exported after the value before was computed (_exported_since) that something still
        # holds: its writes stay seen. An inference tensor has no version counter: marked or
        # hashed whatever the check.
        count = ARMINGS[0]
        armed = (unshared(t) or not (content or _address(t) in exported)) and arm(t)
        version = version_of(t)
        watch.append((d, key, t, version, _address(t), layout(t)))
        if armed:
            marked.append(t)
            if ARMINGS[0] != count:  # armed now, not by another value: cleared if none is frozen
                fresh.append(t)
            # And its bytes as they are now, whatever the check: a computation whose kernel
            # takes the storage back (weight_norm's on the host) clears the mark itself, and a
            # write that lands meanwhile through .data then shows only there (see _freeze).
            checks.append((version, watch[-1][4], _byte_check(t, watch[-1][4])))
            continue
        if not content and version is not None and watch[-1][4] not in exported:
            continue
        check = _byte_check(t, watch[-1][4])
        if check is not None:
            (raw if isinstance(check[0], ctypes.Array) else views).append(check)
    prints.watch, prints.raw, prints.views = tuple(watch), tuple(raw), tuple(views)
    prints.marked, prints.fresh, prints.checks = marked, fresh, checks
    prints.sizes = tuple(map(len, site.tensor_dicts))
    # A wrapper subclass's __dict__ holds its inner tensors and metadata (``w.scale = other``
    # writes it): its tag is what a steady call checks their identity by, as for a member's.
    wrappers = {id(w[2]): vars(w[2]) for w in watch if is_traceable_wrapper_subclass(w[2])}
    live = (*settings(site), *wrappers.values())
    prints.wrapped = tuple((d, _unbookkept(d)) for d in wrappers.values())
    prints.empty = tuple(d for d in live if not d)
    prints.full = tuple(d for d in live if d)
    prints.then = list(map(tag, prints.full))
    members = site.chain if site.hook is None else ()
    objects = tuple(o for m in members if probed(m) for o in held(m).objects)  # objects a custom member holds
    # Every object whose __dict__ is among the settings: ``obj.__dict__ = {...}`` touches no tag.
    # The list's modules, the list itself included: stock calls it as a module; a hook-based
    # norm's hook object, whose attributes (name, dim, eps) and class decide its value.
    modules = tuple(site.plist.modules()) if site.hook is None else (site.hook,)
    prints.dicted = tuple(o for o in (*modules, *objects) if hasattr(o, "__dict__"))
    prints.dicted_dicts = tuple(map(vars, prints.dicted))
    prints.members = (*modules, *objects)
    prints.member_types = tuple(map(type, prints.members))
    prints.ordered = tuple(d for d in prints.full if isinstance(d, OrderedDict))  # move_to_end touches no tag either
    prints.order = list(map(list, prints.ordered))
    return prints


def _byte_check(t: torch.Tensor, address: int) -> tuple | None:
    """``(the bytes in place, their digest)`` of a contiguous host tensor, ``(byte view, copy)``
    of another, None where its bytes cannot be read (see :func:`same_bytes`)."""
    view = bitwise(t)
    if view is None:
        return None
    if address and view.device.type == "cpu" and view.is_contiguous():
        # The tensor's own bytes, read in place (its storage is kept alive by the tensor,
        # and its address is checked before each read).
        memory = (ctypes.c_char * view.nbytes).from_address(address)
        return memory, digest(memory)
    return view, view.clone(memory_format=torch.contiguous_format)


def _same_check(check: tuple) -> bool:
    """Whether the bytes of a :func:`_byte_check` are as they were."""
    return same_bytes((check,), ()) if isinstance(check[0], ctypes.Array) else same_bytes((), (check,))


def unwritten(t: torch.Tensor, armed_check: tuple) -> bool:
    """Whether ``t`` is as it was armed: ``armed_check`` is its ``(version, address, byte check)``
    then (:attr:`FrozenValue.armed_checks`); False where its bytes cannot be read."""
    version, address, check = armed_check
    return check is not None and version_of(t) == version and _address(t) == address and _same_check(check)


def _freeze(site: SiteState, value: torch.Tensor, under: tuple, prints: _Fingerprint) -> FrozenValue | None:
    """``value`` with the fingerprint of every input it was computed from (see :class:`FrozenValue`),
    taken before it was computed (``prints``); None where an input was written meanwhile."""
    for t, (version, address, check) in zip(prints.marked, prints.checks):
        if is_armed(t):
            continue  # unwritten since it was keyed
        # Taken back while the value was computed: by the computation's own kernel, or by a
        # write. Armed again, then found as it was keyed (version, address, bytes), the value is
        # from the bytes the mark watches from now on; the values frozen from it before keep the
        # stamp they were keyed on (not stamped again).
        if not arm(t, again=True) or not unwritten(t, (version, address, check)):
            return None
    armed = list(prints.marked)
    checks = [(version, address, _in_place(check)) for version, address, check in prints.checks]
    if arm(value):
        armed.append(value)
        address = _address(value)
        checks.append((version_of(value), address, _in_place(_byte_check(value, address)) if value.is_contiguous() else None))
    keys = tuple(map(_storage_key, armed)) if armed else ()
    return _keep_keys(FrozenValue(
        value, prints.watch, prints.sizes, prints.raw, prints.views, prints.empty, prints.full, prints.then, under,
        version_of(value), tuple(armed), keys, list(map(_armings.get, keys)), layout(value), prints.members,
        prints.member_types, prints.dicted, prints.dicted_dicts, prints.ordered, prints.order, armed_checks=tuple(checks),
        wrapped=prints.wrapped, value_address=_address(value),
    ))


def _in_place(check: tuple | None) -> tuple | None:
    """A :func:`_byte_check` of bytes hashed in place (16 bytes kept), else None (not a copy)."""
    return check if check is not None and isinstance(check[0], ctypes.Array) else None


def _inputs(site: SiteState):
    """``(dict, key, tensor)`` of every tensor ``site``'s value is computed from: each entry of
    its tensor dicts (originals, the members' parameters and buffers), and each tensor held as a
    plain attribute of a member (``self.scale = torch.tensor(2.0)``), whose in-place edits the
    member's ``__dict__`` tag does not see.

    A chain's dicts are read as they are now, not as ``prepare`` found them: a buffer registered
    on a member since, or a member's submodule replaced, is among the settings (a change
    computes the value again) and its tensors are inputs from then on."""
    if site.hook is not None:
        owners, tensor_dicts = (site.hook,), site.tensor_dicts
    else:
        owners = tuple(site.plist.modules())
        tensor_dicts = [d for m in owners for d in (m._parameters, m._buffers)]
    for d in tensor_dicts:
        for key, t in d.items():
            if t is not None:
                yield d, key, t
    for owner in owners:
        d = vars(owner)
        for key, t in d.items():
            if isinstance(t, torch.Tensor):
                yield d, key, t
        if site.hook is None and probed(owner):
            yield from held(owner).tensors  # in a dict or object a custom member holds


def _watched(site: SiteState):
    """:func:`_inputs`, each followed by the inner tensors of a wrapper subclass
    (``__tensor_flatten__``: torchao's ``Int8Tensor``, ``NF4Tensor``, ``TwoTensor``), recursively,
    as ``(the wrapper's __dict__, attribute, tensor)``: an in-place write, a ``.data`` write or a
    reassignment of one of them (``w.qdata.add_(1)``, ``w.scale = s``) changes what the wrapper
    computes but not its own version, address or description. An inner tensor kept outside the
    wrapper's ``__dict__`` (a slot, a property) is looked up by :class:`_Attributes`."""
    for d, key, t in _inputs(site):
        yield d, key, t
        if is_traceable_wrapper_subclass(t):
            yield from _inner(t)


def _inner(wrapper: torch.Tensor):
    own = vars(wrapper)
    for name in wrapper.__tensor_flatten__()[0]:
        t = getattr(wrapper, name)
        yield own if own.get(name) is t else _Attributes(wrapper), name, t
        if is_traceable_wrapper_subclass(t):
            yield from _inner(t)


class _Attributes:
    """An object's attributes as :func:`same_inputs` reads a tensor dict (``get``)."""

    __slots__ = ("owner",)

    def __init__(self, owner: object) -> None:
        self.owner = owner

    def get(self, name: str) -> object:
        return getattr(self.owner, name, None)


def own_tensors(site: SiteState) -> list[torch.Tensor]:
    """The tensors of :func:`_inputs` that ``site``'s chain holds itself: all but its originals."""
    originals = {id(d.get(k)) for d, k in site.originals}
    return [t for _, _, t in _inputs(site) if id(t) not in originals]


_lazy_clone = getattr(torch, "_lazy_clone", None)
#: Whether a tensor's storage is still armed by :func:`arm` (no write since), where torch has it.
is_armed = getattr(torch._C, "_is_cow_tensor", None)
#: A storage's identity (its StorageImpl's address), read without touching its data.
_storage_key = getattr(torch._C, "_storage_address", None)
#: When :func:`arm` last armed each storage (by :data:`_storage_key`), as :data:`ARMINGS`' count
#: then: unique to that arming. One storage may feed several frozen values (a shared
#: parametrization's buffer, tied weights, views of one flat buffer, two models): the first to
#: see it disarmed arms it again, so each value records the stamp it was computed at, and a later
#: one is a change for the others too. An entry lives while a frozen value records it
#: (:func:`_keep_keys`): a process that prepares and drops models does not grow.
_armings: dict[int, int] = {}
#: How many live frozen values record each entry of :data:`_armings`.
_recorders: dict[int, int] = {}
#: Bumped at every arming anywhere: a steady plan built at one count reads its storages' stamps
#: (:func:`arming_stamps`) only once the count has moved.
ARMINGS = [0]


def _keep_keys(frozen: FrozenValue) -> FrozenValue:
    """Count ``frozen`` among the recorders of its storages' :data:`_armings` entries until it
    is freed; the last one freed drops them (its storage may be freed too, and its address reused)."""
    keys = frozen.armed_keys
    if keys:
        for key in keys:
            _recorders[key] = _recorders.get(key, 0) + 1
        weakref.finalize(frozen, _drop_keys, keys)
    return frozen


def _drop_keys(keys: tuple[int, ...]) -> None:
    for key in keys:
        left = _recorders.get(key, 0) - 1
        if left > 0:
            _recorders[key] = left
        else:  # no value compares this entry now: one armed later is stamped afresh
            _recorders.pop(key, None)
            _armings.pop(key, None)


def plain_underneath(t: torch.Tensor) -> bool:
    """Whether ``t`` is a plain strided tensor, or a subclass of one that changes nothing below
    Python (``t.as_subclass(MyT)``, a subclass of ``nn.Parameter``): its storage is its own and
    can be marked or hashed as a plain tensor's is. Not a wrapper subclass (DTensor, torchao's),
    one that dispatches itself (``__torch_dispatch__``), or one flattened into inner tensors."""
    cls = type(t)
    if cls in PLAIN_TENSOR_TYPES:
        return True
    return (getattr(cls, "__torch_dispatch__", None) is _no_dispatch and not hasattr(cls, "__tensor_flatten__")
            and not _subclass_like(t))


_no_dispatch = torch.Tensor.__torch_dispatch__
#: Whether a tensor dispatches to Python or is a functorch or functional wrapper (a wrapper subclass does).
_subclass_like = getattr(torch._C, "_dispatch_isTensorSubclassLike", lambda t: True)


def _plain(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Where ops on ``t`` (:func:`plain_underneath`) run as on a plain tensor: outside its class's
    ``__torch_function__``, which may log, cast or wrap what they return."""
    return contextlib.nullcontext() if type(t) in PLAIN_TENSOR_TYPES else torch._C.DisableTorchFunctionSubclass()


def release(frozen: FrozenValue | None) -> None:
    """Clear the marks :func:`arm` left on the storages of a frozen value that is dropped (the
    model restored, the site demoted or no longer frozen). A marked storage is copy-on-write: a
    storage resize keeps it so while giving it new memory, and the next write to it then fails
    in torch (``ctx != nullptr INTERNAL ASSERT FAILED at c10/core/impl/COW.cpp``). Handing out a
    writable pointer takes a marked storage back without a copy (nothing else owns it). A storage
    another frozen value still watches is then computed again for it, at worst."""
    if frozen is not None:
        _unmark(frozen.armed)


def _unmark(tensors) -> None:
    """Clear the marks of ``tensors`` (:func:`release`)."""
    if is_armed is None:
        return
    for t in tensors:
        if is_armed(t):
            with _plain(t):
                t.data_ptr()


def mark(t: torch.Tensor) -> int | None:
    """The count ``t``'s storage was last armed at (:data:`_armings`; 0 where not by :func:`arm`)
    while its mark stands, so nothing was written to it since; None where it has no mark."""
    if is_armed is None or _storage_key is None or not is_armed(t):
        return None
    return _armings.get(_storage_key(t), 0)


def arm(t: torch.Tensor, again: bool = False) -> bool:
    """Arm ``t``'s storage so that any later write to it is seen (:data:`is_armed` turns False);
    return whether it could be armed. ``again``: armed again where nothing was written since its
    stamp was taken (a value's own computation took it back: :func:`_freeze`), so the stamp stands.

    It uses torch's copy-on-write storages: lazily cloning a tensor and dropping the clone leaves
    its storage marked copy-on-write with no other owner. Reads leave the mark; the first write
    through torch, by any tensor sharing the storage (``p.data.mul_()``, a view, ``set_``,
    ``untyped_storage()``, an optimizer step), and any hand-out of a writable pointer
    (``data_ptr()``, ``numpy()``, DLPack, ``torch.save``) take the storage back without copying,
    which clears it: at worst a value is computed again for nothing. Only plain, unpinned host
    tensors are armed: memory torch did not allocate (numpy, shared memory) cannot be, and device
    and pinned memory are left alone, since their allocators look blocks up by the storage's
    deleter, which arming changes.

    A storage resize (``untyped_storage().resize_()``, ``t.resize_()`` to a larger size) of an
    armed storage keeps torch's copy-on-write materialiser while giving it memory that is not
    copy-on-write, and the next write to it fails inside torch (``ctx != nullptr INTERNAL
    ASSERT FAILED at c10/core/impl/COW.cpp``), which nothing here can prevent (README, Notes and
    limits: resize after a pointer hand-out, ``t.data_ptr()``, which clears the mark). So no mark
    outlives its value: :func:`release` clears those of a value that is dropped.
    """
    if is_armed is None or _lazy_clone is None or _storage_key is None or not plain_underneath(t) or _wrapped(t):
        return False
    try:
        with _plain(t):
            if t.device.type != "cpu" or t.layout != torch.strided or t.is_pinned():
                return False
            if is_armed(t):  # by another value, and unwritten since: its stamp stands
                return True
            with torch.no_grad():
                _lazy_clone(t.detach())
    except RuntimeError:  # storage not owned the plain way (numpy, shared memory)
        return False
    if not is_armed(t):
        return False
    if again:
        return True
    ARMINGS[0] += 1
    _armings[_storage_key(t)] = ARMINGS[0]
    return True


_use_count = getattr(torch._C, "_storage_Use_Count", None)


def unshared(t: torch.Tensor) -> bool:
    """Whether ``t`` is the only tensor on its storage and nothing but its Python object holds
    it: no view, no ``.data`` alias, and so no numpy array or DLPack capsule made from it or
    from an alias before now (one made of ``t`` itself holds ``t``, one of an alias a tensor on
    the storage).

    With ``freeze_check="content"``, an input that is unshared and :func:`arm`-ed needs no byte
    check: every later way to write its bytes goes through torch or a pointer handed out after
    now, and either disarms it. Only an address taken earlier as a bare integer (``data_ptr()``
    kept, then written through ``ctypes``) is not seen; a shared input's bytes are hashed."""
    if _use_count is None or not plain_underneath(t):
        return False
    try:
        with _plain(t):
            # ``t``'s and the storage object's own; ``t`` held by its Python object alone.
            return _use_count(t.untyped_storage()._cdata) <= 2 and t._use_count() <= 1
    except Exception:  # no storage (meta, sparse), or a torch whose storages do not say
        return False


def settings(site: SiteState) -> tuple[dict, ...]:
    """Every dict besides the tensor dicts that ``site``'s value depends on (see
    :class:`~paramfold.state.FrozenValue`), read from the chain as it is now."""
    if site.hook is not None:
        found = [vars(site.hook)]  # name, dim, eps, n_power_iterations
    else:
        # The list itself as its members: stock calls it as a module, so a ``forward`` or
        # ``_call_impl`` set on it (Accelerate's per-module wrapping), its class or a class
        # attribute replaced, or an original shadowed in its ``__dict__`` (which its forward's
        # ``self.original`` finds first) is a write to one of these.
        found = []
        for m in site.plist.modules():
            # Its parameter and buffer dicts too, empty or not: a tensor entry set where
            # there was none (``register_buffer("mask", None)``, then ``member.mask = t``)
            # is a write there, which the inputs' own checks cannot see.
            found += [m.__dict__, m._modules, m._forward_hooks, m._forward_pre_hooks, m._parameters, m._buffers]
            found += class_dicts(type(m))
            if probed(m):
                found += held(m).dicts  # a config dict or object it holds (paramfold.held)
    return (*found, *GLOBAL_HOOKS[:2])  # the forward ones: a frozen value is computed without autograd


#: Classes whose attributes a chain member's computation does not read.
_NOT_READ = frozenset({nn.Module, object})


def class_dicts(cls: type) -> list[dict]:
    """The dicts behind the ``__dict__`` of ``cls`` and its bases up to ``nn.Module``: a class
    attribute set (``Scale.k = 3.0``) or a method replaced (``Scale.forward = ...``) there is a
    write to one of them."""
    return [gc.get_referents(c.__dict__)[0] for c in cls.__mro__ if c not in _NOT_READ]


def same_settings(empty: tuple[dict, ...], full: tuple[dict, ...], then: list) -> bool:
    """Whether the dicts of :func:`settings` are as they were: the ``empty`` ones still empty,
    the ``full`` ones with the tags ``then`` (one C-level pass each)."""
    try:
        return not any(empty) and list(map(tag, full)) == then
    except Exception:  # a copy's entry replaced by a tensor or an array, whose == is elementwise
        return False


def unchanged(site: SiteState, frozen: FrozenValue, under: tuple) -> bool:
    """Whether every input of ``frozen`` is as it was: same tensor, version, storage address and
    description (:func:`~paramfold.watch.layout`), each armed storage unwritten (and, with
    ``freeze_check="content"``, the same bytes), and ``under`` what it was computed under; and
    the value itself: its version, description and storage address (a forward hands it out, and
    the caller's ``w.data = other`` bumps no version and leaves the mark of ``other``'s storage)."""
    # Runs for every frozen site at every call: flat loops, cheapest tests first.
    if (tuple(map(len, site.tensor_dicts)) != frozen.sizes or under != frozen.under
            or not all(map(is_, map(type, frozen.members), frozen.member_types))
            or (frozen.held and not all(map(is_, map(vars, frozen.held), frozen.held_dicts)))
            or (frozen.ordered and list(map(list, frozen.ordered)) != frozen.order)
            or version_of(frozen.value) != frozen.value_version or layout(frozen.value) != frozen.value_layout
            or _address(frozen.value) != frozen.value_address
            or not same_armings(frozen)  # first: a mark is set again only at the count keyed on
            or not (all(map(is_armed, frozen.armed)) or rearm_unwritten(site, frozen))):
        return False
    # The addresses same_bytes reads are the ones same_inputs just checked; each input's storage
    # is held alive by its tensor.
    return (same_inputs(frozen.watch)
            and (same_settings(frozen.settings_empty, frozen.settings, frozen.settings_then)
                 or (bool(frozen.wrapped) and only_bookkeeping(frozen)))
            and same_bytes(frozen.raw, frozen.views))


def _bookkeeping(key: str) -> bool:
    """Whether ``key`` is an attribute torch's compilers set on a tensor they compile with
    (``_dynamo_static_input_type``, ``mark_dynamic``'s ``_dynamo_dynamic_indices``, inductor's
    ``_is_frozen_param``): what a tensor holds, not what it computes."""
    return key.startswith("_dynamo_") or key == "_is_frozen_param"


def _unbookkept(d: dict) -> dict:
    return {k: v for k, v in d.items() if not _bookkeeping(k)}


def only_bookkeeping(frozen: FrozenValue) -> bool:
    """Whether the settings of ``frozen`` that were written since are wrapper subclasses'
    ``__dict__``s (see :func:`_fingerprint`), written only where :func:`_bookkeeping` says
    (dynamo marks an original it meets so while it compiles), every other entry the same object
    as when the value was computed; their tags are then taken as they are now."""
    wrapped = {id(d) for d, _ in frozen.wrapped}
    try:
        if any(frozen.settings_empty):
            return False
        now = list(map(tag, frozen.settings))
        if any(id(d) not in wrapped for d, n, t in zip(frozen.settings, now, frozen.settings_then) if n != t):
            return False
    except Exception:  # a copy's entry replaced by a tensor or an array, whose == is elementwise
        return False
    for d, then in frozen.wrapped:
        own = _unbookkept(d)
        if own.keys() != then.keys() or not all(own[k] is v for k, v in then.items()):
            return False
    frozen.settings_then = now
    return True


def same_armings(frozen: FrozenValue) -> bool:
    """Whether no storage ``frozen`` watches was armed afresh since (written, then armed for another value)."""
    return arming_stamps(frozen.armed_keys) == frozen.armed_counts


def arming_stamps(keys: Iterable[int]) -> list[int | None]:
    """The :data:`ARMINGS` count at which each storage (by :data:`_storage_key`) was last armed."""
    return list(map(_armings.get, keys))


def rearm_unwritten(site: SiteState, frozen: FrozenValue) -> bool:
    """Whether each of ``frozen``'s storages whose mark was cleared is unwritten: its version,
    address and bytes are those it was armed with. A kernel that takes a writable pointer and
    writes nothing clears a mark (inductor's ``freezing`` packs a frozen weight for MKL so while
    it compiles); computing the value again for that would give it a new identity, which
    compiled code guards on. Each is then watched as :func:`_fingerprint` watches an input:
    armed again where nothing else holds its storage, its count standing, as that of an input
    armed again in :func:`_freeze` (the caller checked it is the count the value was keyed on);
    its bytes checked at every call otherwise, since a numpy array or DLPack capsule on it
    writes unseen. So with ``freeze_check="version"`` too, the value's own storage included: a
    forward may return the value, and an array taken of it then writes what later calls read
    (stock's next read is a fresh tensor). A mark that a compile cleared (inductor's freezing
    packs a frozen weight, and keeps a view of it) is set again as that compile ends
    (:func:`rearm_compiled`), before anything else can hold the storage."""
    hashed = []
    for i, (t, armed_check) in enumerate(zip(frozen.armed, frozen.armed_checks, strict=True)):
        if is_armed(t):
            continue
        if not unwritten(t, armed_check):
            return False
        if not unshared(t) or not arm(t, again=True):
            hashed.append(i)
    if hashed:
        keep = [i for i in range(len(frozen.armed)) if i not in hashed]
        frozen.raw += tuple(frozen.armed_checks[i][2] for i in hashed)
        frozen.armed, frozen.armed_keys, frozen.armed_checks = (
            tuple(frozen.armed[i] for i in keep), tuple(frozen.armed_keys[i] for i in keep),
            tuple(frozen.armed_checks[i] for i in keep))
        frozen.armed_counts = [frozen.armed_counts[i] for i in keep]
    return True


def standing_marks(holders: Iterable[nn.Module]) -> list[tuple[torch.Tensor, tuple]]:
    """The frozen values of ``holders``' sites whose marks stand now, each with what it was armed
    with: the marks a compile beginning now may clear (:func:`rearm_compiled`). With
    ``freeze_check="version"`` only: another thread may take a pointer to a value while this one
    compiles, which the compiler's own view cannot be told from; the content check hashes what
    something else holds, whoever it is."""
    found = []
    if is_armed is None:
        return found
    for holder in holders:
        hs = holder.__dict__.get(STATE_ATTR)
        for site in (hs.sites.values() if hs is not None else ()):
            frozen = site.frozen
            if frozen is not None and site.freeze_check == "version":
                found += [(t, check) for t, check in zip(frozen.armed, frozen.armed_checks)
                          if t is frozen.value and is_armed(t)]
    return found


def rearm_compiled(marks: list[tuple[torch.Tensor, tuple]]) -> None:
    """Set again each mark of :func:`standing_marks` that the compile now ending cleared with
    nothing written (its version, address and bytes those it was armed with): a compiler that
    packs a weight takes a writable pointer to it (inductor's ``freezing``) and keeps a view of
    it, which :func:`rearm_unwritten` would take for an array a caller made, and hash at every
    call. Only this thread's compile ran since it began, where no other thread took a pointer to
    the value meanwhile (which the version check does not see: README). The caller holds the scope lock."""
    for t, armed_check in marks:
        if not is_armed(t) and unwritten(t, armed_check):
            arm(t, again=True)


def _exported_since(frozen: FrozenValue | None) -> frozenset[int]:
    """With the version check, the addresses of ``frozen``'s inputs that something took a
    pointer to after it was computed and holds (a numpy array, DLPack): hashed since
    (:func:`rearm_unwritten`), or found with their mark cleared, no version bump and their
    storage shared (the write through the array is what computes the value again). They stay
    hashed, not armed, in the value computed next: a write through the array is seen at every
    call, not at the first only."""
    if frozen is None:
        return frozenset()
    found = {*(ctypes.addressof(memory) for memory, _ in frozen.raw), *(view.data_ptr() for view, _ in frozen.views)}
    for t, (version, address, _) in zip(frozen.armed, frozen.armed_checks, strict=True):
        if t is not frozen.value and not is_armed(t) and version_of(t) == version and not unshared(t):
            found.add(address)
    return frozenset(found)


def same_inputs(watch: tuple[tuple, ...]) -> bool:
    """Whether each ``(dict, key, tensor, version, address, layout)`` still holds."""
    for d, key, t, version, address, described in watch:
        if d.get(key) is not t or version_of(t) != version or layout(t) != described:
            return False
        try:  # inline, not _address(): this runs for every input at every call
            if (_data_ptr(t) if type(t) in PLAIN_TENSOR_TYPES or plain_underneath(t) else t.data_ptr()) != address:
                return False
        except RuntimeError:  # tensor subclasses without storage (recorded as 0)
            if address:
                return False
    return True


def same_bytes(raw: tuple[tuple[object, int], ...], views: tuple[tuple[torch.Tensor, torch.Tensor], ...]) -> bool:
    """Whether each input's bytes are as they were (see :class:`FrozenValue`)."""
    for memory, expected in raw:
        if digest(memory) != expected:
            return False
    for view, copy in views:
        if not torch.equal(view, copy):
            return False
    return True


#: The content check's hash of a host buffer: XXH3's 128 bits (a change kept undetected needs a
#: collision, about 3e-39 for a random change), read at memory speed in one pass, where a
#: comparison with a copy reads twice the bytes and keeps the copy in memory.
digest = xxhash.xxh3_128_intdigest


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bitwise(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` viewed as integers of its element size (bitwise comparable: NaN and -0.0 included),
    or None where there are no bytes to read (wrapper subclasses, sparse and meta tensors)."""
    if not plain_underneath(t):
        return None
    with _plain(t):
        if t.layout != torch.strided or t.is_meta:
            return None
        t = t.detach()
        if t.is_complex():  # as (real, imaginary) pairs: complex128 has no integer of its size
            t = torch.view_as_real(t.conj() if t.is_conj() else t)  # the bytes in memory, not their conjugate
        if t.is_neg():
            t = torch._neg_view(t)
        as_int = _SAME_SIZE_INT.get(t.element_size())
        if as_int is not None:
            return t.view(as_int)
        return t.contiguous().view(torch.uint8) if t.is_contiguous() else None


def can_freeze(site: SiteState, grad: bool = True) -> bool:
    """A site may be frozen when no stateful chain is training and, for calls that record
    autograd (``grad``), nothing in its chain needs grad: under ``no_grad`` stock's value has no
    history either, so a trainable chain's frozen value is stock's value there."""
    if grad and chain_needs_grad(site):
        return False
    return not site.training_stateful and not unwatched(site)


def unwatched(site: SiteState) -> list[str]:
    """Where ``site``'s custom chain members hold something a frozen value cannot be keyed on (a
    list, a set, an array, a tensor in a tuple: :mod:`paramfold.held`), as ``"Member.attribute"``.
    torch's and torchao's own parametrizations are trusted: what they hold (torchao's
    ``rebuild_stack`` list) is only ever replaced, which their ``__dict__`` tag sees."""
    if site.hook is not None:
        return []
    return [f"{type(m).__name__}.{where} ({'a slot' if obj is m else 'a ' + type(obj).__name__})"
            for m in site.plist.modules() if probed(m) for where, obj in held(m).unwatched]


def chain_needs_grad(site: SiteState) -> bool:
    """Whether any tensor the value is computed from requires grad: an original, a parameter a
    parametrization owns, and also a buffer or a plain tensor attribute of a member (a learnable
    scale kept as ``self.s = torch.tensor(1.5, requires_grad=True)``), which stock's read gives a
    gradient as well."""
    # Inside a torch.func transform (vmap), its wrappers hide requires_grad: look through them.
    requires_grad = _attr_requires_grad if _transform() is None else _requires_grad
    for d, key in site.originals:
        if requires_grad(d[key]):
            return True
    if site.hook is not None:  # a hook-based norm: its module's other tensors (bias) are not inputs
        return False
    return any(requires_grad(t) for _, _, t in _inputs(site))


_attr_requires_grad = operator.attrgetter("requires_grad")
_unwrap = getattr(torch._C._functorch, "get_unwrapped", None)


def _requires_grad(t: torch.Tensor) -> bool:
    """Whether ``t`` or a tensor it wraps requires grad: a vmap ``BatchedTensor`` reports
    ``requires_grad=False`` over one that requires it (``vmap(functional_call(model, stacked
    params))``), yet autograd records what is computed from it, as stock's read of the value does."""
    while not t.requires_grad:
        if _unwrap is None or not _wrapped(t):
            return False
        t = _unwrap(t)
    return True


def refuse_unfreezable(sites: list[Site], when: str) -> None:
    """Raise :class:`FoldError` naming every site in ``sites`` that cannot be frozen."""
    states = [(s, state_for(s, "freeze")) for s in sites]
    bad = [(s, st) for s, st in states if not can_freeze(st)]
    if not bad:
        return
    reasons = []
    fixes = set()  # what the user can do about each reason, for advice that fits them all
    for s, st in bad:
        if chain_needs_grad(st):
            why, fix = "a tensor of the chain requires grad", "inference"
        elif st.stateful_in_eval:
            why, fix = "its chain changes its own buffers at every computation, in eval mode too", "none"
        elif st.training_stateful:
            why, fix = "stateful chain in training mode", "inference"
        else:
            why, fix = f"its chain holds {first_few(unwatched(st), 2)}, whose changes a frozen value cannot watch", "held"
        fixes.add(fix)
        reasons.append(f"{s.fqn} ({s.kind}: {why})")
    steps = ["Freeze is for inference: call model.eval() and model.requires_grad_(False) first"] if "inference" in fixes else []
    if "held" in fixes:
        steps.append(f"{ADVICE[0].upper()}{ADVICE[1:]}")
    alternatives = "mode='auto' (freezes what it can, computes the rest at every call) or mode='hoist'"
    never = "a chain that changes its buffers in eval mode too can never be frozen"
    if not steps:
        advice = f"{never[0].upper()}{never[1:]}: use {alternatives}."
    else:
        advice = f"{'; '.join(steps)}, or use {alternatives}{f' ({never})' if 'none' in fixes else ''}."
    raise FoldError(f"cannot freeze {len(bad)} site(s) {when}: {first_few(reasons, 4)}. {advice}")


def _address(t: torch.Tensor) -> int:
    try:
        # Not data_ptr() for a subclass that is a plain tensor underneath: it would clear its mark.
        return _data_ptr(t) if plain_underneath(t) else t.data_ptr()
    except RuntimeError:  # tensor subclasses without storage
        return 0


# paramfold's own work: dynamo runs it eagerly when it meets it as a frame (paramfold.frames).
run_module_eagerly_as_frames(globals())
