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
  through ``.data`` (``p.data.mul_()``, init code, EMA loops), ``.detach().numpy()``, DLPack:
  a write mark on each host input nothing else holds, the bytes of the others checked at every
  call (``freeze_check="version"``: the marks only). How those marks and byte checks work,
  and what each check sees and does not, is :mod:`paramfold.write_marks`'s
  (:func:`~paramfold.write_marks.arm`, :func:`~paramfold.write_marks.same_bytes`), which this
  module imports.

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
from collections import OrderedDict
from collections.abc import Iterable
from operator import is_

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from paramfold import hooknorms
from paramfold.compute import GLOBAL_HOOKS, compute, read_without_grad
from paramfold.errors import FoldError, first_few
from paramfold.frames import run_module_eagerly_as_frames
from paramfold.held import ADVICE, held
from paramfold.state import (CALLS, PLAIN_TENSOR_TYPES, FrozenValue, SiteState, carries_tangents,
                             state_for, tensor_label, version_of)
from paramfold.state import functorch_wrapped as _wrapped
from paramfold.state import innermost_transform as _transform
from paramfold.state import tensor_data_ptr as _data_ptr
from paramfold.probe import draws
from paramfold.sites import Site, probed
from paramfold.watch import layout, tag
from paramfold.write_marks import (ARMINGS, arm, is_armed, plain_underneath, rearm_unwritten, release, same_armings,
                                   same_bytes, unshared, unwritten)
from paramfold.write_marks import (_address, _armings, _byte_check, _exported_since, _in_place, _keep_keys,
                                   _storage_key, _storage_of, _unmark)


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
    computed: an input is armed first (:func:`~paramfold.write_marks.arm`), then its version,
    address and bytes are read, so a write at any moment after is seen by one of them."""
    content = site.freeze_check == "content"
    exported = _exported_since(site.frozen) if not content else frozenset()
    prints = _Fingerprint()
    watch, raw, views, marked, fresh, checks = [], [], [], [], [], []
    for d, key, t in _watched(site):
        # With the content check, an input nothing outside torch holds is marked, not read: any
        # later hand-out of a writable pointer to its bytes (numpy, DLPack, data_ptr()) disarms it
        # as a write through torch does. With the version check, every input is marked but one
        # exported after the value before was computed (write_marks._exported_since) that
        # something still holds: its writes stay seen. An inference tensor has no version
        # counter: marked or hashed whatever the check.
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


def same_inputs(watch: tuple[tuple, ...]) -> bool:
    """Whether each ``(dict, key, tensor, version, address, layout)`` still holds."""
    for d, key, t, version, address, described in watch:
        if d.get(key) is not t or version_of(t) != version or layout(t) != described:
            return False
        try:  # inline, not write_marks._address(): this runs for every input at every call
            if (_data_ptr(t) if type(t) in PLAIN_TENSOR_TYPES or plain_underneath(t) else t.data_ptr()) != address:
                return False
        except RuntimeError:  # tensor subclasses without storage (recorded as 0)
            if address:
                return False
    return True


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


# paramfold's own work: dynamo runs it eagerly when it meets it as a frame (paramfold.frames).
run_module_eagerly_as_frames(globals())
