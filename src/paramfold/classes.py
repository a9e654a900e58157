"""The classes prepared modules are switched to, shared by every module of one architecture.

Stock ``parametrize`` gives every parametrized module its own class (``ParametrizedLinear``,
one per instance) holding a property per tensor. paramfold swaps each prepared module to a class
*shared* by all modules with the same original class and parametrized names. Sharing matters for
``torch.compile``: dynamo guards on a module's type, so per-instance classes make every layer of a
per-layer-compiled model look different, while shared classes let same-architecture layers (and
same-architecture models) reuse one graph.

Shared classes must never change for one module's sake. torch's ``register_parametrization`` and
``remove_parametrizations`` edit ``module.__class__`` (they expect a class of the module's own);
the :class:`_Sealed` metaclass catches those edits: a property injected for one module becomes a
:class:`~paramfold.site_reads._ForeignSite` that serves only modules parametrized for that name,
and the class leaves the cache so later prepares get a clean one; ``remove_parametrizations``'
deletion of a tensor's descriptor is ignored (each steps aside for a module whose parametrization
is gone). The changed module is refused at its next call, and :func:`paramfold.restore` rebuilds
stock's class for its parametrizations as they are then. Any other write
(``type(module).forward = f``, a property of the user's, ``del type(module).weight`` of the
user's) is refused with a :class:`~paramfold.FoldError` that says where to make it
(:func:`_refuse_class_write`).

While prepared, ``type(m)`` is the shared class (a subclass of the user's class, with the same
name), so ``isinstance`` checks hold; ``torch.nn.utils.parametrize.type_before_parametrizations``
keeps reporting the user's class (see :func:`install_type_before_parametrizations`).

What the descriptors these classes hold for the tensors (stock's properties' stand-ins) do at a
read, inside and outside a call scope, is :mod:`paramfold.site_reads`'s.
"""

from __future__ import annotations

import copy
import copyreg
import functools
import inspect
import os
import sys
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from paramfold.compute import GLOBAL_HOOKS, has_parametrizations
from paramfold.errors import FoldError
from paramfold.frames import run_module_eagerly_as_frames
from paramfold.rebase import rebased
from paramfold.restore import restore_module
from paramfold.site_reads import (LastCallValue, SiteDescriptor, _BetweenCalls, _ForeignSite, _ReadOnce,
                                  _take_last_call_value)
from paramfold.state import STATE_ATTR, installed_keys, orphaned_copy
from paramfold.scope_entry import compiled_call_impl, root_call
from paramfold.scope_midcall import (assigned, copied_between_calls, copied_hook_values,
                                     hook_value_replaced, not_copied, state_read)


class _Sealed(type):
    """Metaclass of the shared classes: keeps torch's per-module class edits off them, refuses any
    other class write, and makes instantiating one build the class it was made from."""

    def __call__(cls, *args, **kwargs):
        # ``type(module)(...)`` on a prepared module (PEFT's LoRA for a conv builds its adapters
        # with ``type(base_layer)(...)``): stock builds a module of the module's own class, which
        # has no parametrizations and so behaves as the class it was made from; paramfold's class
        # would make one without paramfold's state, which its calls need (KeyError). Build the
        # class paramfold's was made from (stock's, for a container or an unselected module).
        # A shared class or its between_class (a class that only derives from one, a wrapper's
        # from rebased(), is built as usual).
        if cls.__dict__.get("_paramfold_sealed"):
            return cls._paramfold_base(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    def __setattr__(cls, name: str, value: object) -> None:
        if not cls.__dict__.get("_paramfold_sealed") or name == "__slotnames__" or _dynamos_patch(cls, name, value):
            # __slotnames__: copyreg's cache of the class's slots, the same for every module of it.
            type.__setattr__(cls, name, value)
        elif injected_by_torch(value):
            # register_parametrization on a prepared module (torch's _inject_property): torch's
            # property would serve every module of the class. The first time a name comes, a
            # _ForeignSite computes it for the modules parametrized for it; where the class has a
            # descriptor of its own for the name already (a second registration, on this module
            # after a removal or on another), that one stays.
            if name not in cls.__dict__:
                _evict(cls)
                type.__setattr__(cls, name, _ForeignSite(name))
        else:
            _refuse_class_write(cls, name, value)

    def __delattr__(cls, name: str) -> None:
        if not cls.__dict__.get("_paramfold_sealed"):
            type.__delattr__(cls, name)
        elif name in cls._paramfold_names or isinstance(inspect.getattr_static(cls, name, None), _ForeignSite):
            # remove_parametrizations on a prepared module: other modules still need it, so it
            # stays. The user's ``del type(module).weight`` is refused like any class write.
            if not _torchs_removal(sys._getframe(1)):
                _refuse_class_write(cls, name, _DELETED)
        elif injected_by_torch(vars(cls._paramfold_base).get(name)):
            # remove_parametrizations on a module prepare left parametrized (filter_fn, a
            # submodule selected): its base is stock's class made for this module alone.
            type.__delattr__(cls._paramfold_base, name)
        else:
            _refuse_class_write(cls, name, _DELETED)


def _torchs_removal(caller: types.FrameType) -> bool:
    """Whether ``caller`` (of the class's ``__delattr__``) is torch's ``remove_parametrizations``
    deleting its property, not the user's ``del type(module).name``. Nothing on the module tells
    them apart: torch deletes the property before the parametrization, and with
    ``leave_parametrized=False`` reads nothing through the module first. Its frame has the
    function's globals and name, also where dynamo runs code it made from the function."""
    return caller.f_globals is vars(parametrize) and caller.f_code.co_name == "remove_parametrizations"


def _dynamos_patch(cls: type, name: str, value: object) -> bool:
    """Whether this is ``torch._dynamo.mutation_guard.ensure_patched`` (dynamo's watch of a module,
    in torch versions that use it): its marker, and a ``__setattr__`` wrapping the class's own that
    only records the write, the same for every module of the class."""
    return name == "___needs_mutation_patch" or (
        name == "__setattr__" and getattr(value, "__wrapped__", None) is cls.__setattr__)


def injected_by_torch(value: object) -> bool:
    """Whether ``value`` is the property torch's ``parametrize._inject_property`` makes (its getter
    is that function's nested ``get_parametrized``)."""
    fget = value.fget if isinstance(value, property) else None
    return (getattr(fget, "__module__", None) == parametrize.__name__
            and getattr(fget, "__qualname__", "").startswith("_inject_property.<locals>."))


_DELETED = object()


def _refuse_class_write(cls: type, name: str, value: object) -> None:
    """Refuse ``type(module).name = value`` (or ``del``, ``value`` :data:`_DELETED`) on a prepared
    module, saying where to make it instead.

    A parametrized module's class is its own in stock; paramfold's is shared by every prepared
    module of the architecture and kept for later prepares while one lives. Any other prepared module's stock
    class (a container's, a hook-based norm's layer's: the user's; an unselected module's own) is
    the one paramfold's class derives from, where a write reaches the module as in stock unless
    paramfold's class defines the name itself (a root's ``forward``). Made there *through*
    paramfold's class, the write would not be in ``vars(type(module))``, which tools rely on
    (``mock.patch.object`` would delete the class's own attribute when it unpatches)."""
    prepared = next(c for c in cls.__mro__ if "_paramfold_names" in vars(c))
    base, names = prepared._paramfold_base, prepared._paramfold_names
    deleting = value is _DELETED
    # A descriptor other than a function (a property) works on the class only.
    on_module = not deleting and (isinstance(value, types.FunctionType) or not hasattr(type(value), "__get__"))
    options = [f"set it on the module (module.{name} = ...; a method: module.{name} = "
               "types.MethodType(function, module))"] if on_module else []
    if names:
        where = (f"its class {cls.__name__} is shared by every prepared {base.__name__} whose "
                 f"{', '.join(sorted(names))} {'is' if len(names) == 1 else 'are'} parametrized, in every "
                 "model (and kept for models prepared later), where stock's class is the module's own: the "
                 "change would reach them all")
        options.append("call paramfold.restore(model) first and change the class then (prepare refuses a "
                       "parametrized module whose class was changed: leave it out with filter_fn)")
    elif deleting and name not in vars(base):  # stock's class (the user's) has none of its own: stock's del raises
        raise AttributeError(f"type object '{base.__name__}' has no attribute '{name}'")
    elif name in vars(prepared):
        where = (f"stock makes it on {base.__qualname__}, but paramfold's class {cls.__name__} of the module "
                 f"defines {name} itself, so it would not reach the module")
        options.append("call paramfold.restore(model) first, make the change, and prepare again")
    else:
        mro = f"type(module).__mro__[{cls.__mro__.index(base)}]"
        where = (f"stock makes it on the module's class {base.__qualname__} ({mro}), which paramfold's "
                 f"class {cls.__name__} derives from")
        there = f"delete it there (del {mro}.{name})" if deleting else f"make it there ({mro}.{name} = ...)"
        options.insert(0, f"{there}, which reaches the module as in stock")
    what_to_do = ", or ".join(options)
    raise FoldError(f"{'del ' if deleting else ''}type(module).{name}{'' if deleting else ' = ...'} on a module "
                    f"prepared by paramfold: {where}. Nothing was changed. {what_to_do[0].upper()}{what_to_do[1:]}.")


#: paramfold's classes by what each is made for, each kept while something (a module, a subclass,
#: compiled code) holds it: a process that prepares and drops models whose class is made per model
#: (a ``torch.fx`` ``GraphModule``, a class defined in a factory) keeps neither theirs nor ours.
_classes: weakref.WeakValueDictionary[tuple, type] = weakref.WeakValueDictionary()
_classes_lock = threading.Lock()


def _new_lock_in_child() -> None:
    """After ``os.fork()``: a lock another thread of the parent held would never be released in the child."""
    global _classes_lock
    _classes_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock_in_child)


def prepared_class(
    base: type,
    names: frozenset[str],
    is_root: bool,
    inline_properties: tuple[tuple[str, property], ...] = (),
    hooked: frozenset[str] = frozenset(),
) -> type:
    """The shared class for modules of ``base`` whose ``names`` are parametrized.

    ``inline_properties`` (name, property) pairs read those tensors through generated inline
    getters; every other name gets a :class:`SiteDescriptor` that hoisted or frozen values in the
    instance ``__dict__`` shadow. ``hooked``: the names hook-based norms compute, each given a
    :class:`LastCallValue`.
    """
    key = (base, names, is_root, inline_properties, hooked)
    with _classes_lock:
        cls = _classes.get(key)
        # A class made before ``base`` changed (``nn.Sequential.forward = f``) would keep running
        # what it took from it.
        if cls is None or any(inspect.getattr_static(base, n, None) is not v for n, v in cls._paramfold_taken):
            cls = _classes[key] = _make_class(base, names, is_root, dict(inline_properties), hooked)
    return cls


def class_by_id(cls_id: int) -> tuple[type, str] | None:
    """For one of paramfold's classes, by ``id()`` (as a dynamo ``___check_type_id`` guard names
    it): the class it was made from and what a module has it for: ``"training"`` (its
    :func:`read_once_class`: a stateful chain of it trains), ``"eval"`` (a prepared class that
    has a read-once class: the module has it while its stateful chain does not train), or ``""``.
    None for any other class (and for an evicted one)."""
    with _classes_lock:
        found = next(((key, cls) for key, cls in _classes.items() if id(cls) == cls_id), None)
        if found is None:
            return None
        key, cls = found
        if key[0] == "read_once":
            role = "training"
        elif key[0] != "between" and any(k[0] == "read_once" and k[1] is cls for k in _classes):
            role = "eval"
        else:
            role = ""
    return cls._paramfold_base, role


def _evict(cls: type) -> None:
    with _classes_lock:
        for key, value in list(_classes.items()):
            if value is cls:
                del _classes[key]


def _dir_as_stock(base: type, served: frozenset[str]) -> Callable:
    """``dir(module)`` without what paramfold wrote into the module's ``__dict__`` (its state, values
    between and during calls, read-once hooks, detached parameters): ``nn.Module.__dir__`` lists
    the instance dict's keys beside the class's names, so a value kept there beside its
    descriptor made a site's name appear twice, and code that reads every name ``dir`` gives
    (``torch.jit.trace``'s ``module_has_exports``: ``hasattr``, then ``getattr``) read a training
    spectral_norm twice more than stock, each read a power iteration. A hook-based norm's tensor
    (``served``) is in the instance dict as in stock, and a name of paramfold's class besides."""

    def __dir__(self: nn.Module) -> list[str]:
        names = base.__dir__(self)
        state = self.__dict__.get(STATE_ATTR)
        if state is not None:
            own = self.__dict__
            for key in (STATE_ATTR, *installed_keys(self, state)):
                if key in own and key in names:
                    names.remove(key)  # the instance dict's entry; the class's name stays
            for key in served:
                if names.count(key) > 1:
                    names.remove(key)
        return names

    return __dir__


#: The modules whose classes dynamo takes for torch's own (``UnspecializedBuiltinNNModuleVariable``).
_TORCH_OWN = ("torch.nn.modules", "torch.ao.")


def _make_class(base: type, names: frozenset[str], is_root: bool, inline: dict[str, property],
                hooked: frozenset[str] = frozenset()) -> type:
    namespace: dict[str, object] = {
        # A class with tensors computed in compiled code (inline's) is a user module to dynamo, as
        # stock's Parametrized* class is: a guard filter that drops the guards of torch's own
        # modules (torch.compiler.skip_guard_on_inbuilt_nn_modules_unsafe) keeps its chain's (a
        # spectral_norm member's training flag). Hoisted and frozen values are plain inputs, as
        # the plain model's parameters are: their classes stay torch's own to dynamo.
        "__module__": parametrize.__name__ if inline and base.__module__.startswith(_TORCH_OWN) else base.__module__,
        "__qualname__": base.__qualname__,
        "_paramfold_names": names,
        "_paramfold_base": base,
        "_compiled_call_impl": compiled_call_impl,
    }
    served = frozenset(n for n in hooked if not any(n in vars(c) for c in base.__mro__))  # (not over the class's own)
    namespace.update((name, LastCallValue(name)) for name in served)
    for name in names:
        namespace[name] = inline.get(name) or SiteDescriptor(name)
    if names or served:
        namespace["__setattr__"] = _make_setattr(base, served)
    if names or served:
        namespace["__delattr__"] = _make_delattr(base, served)
    # Pickling refused with a message that says what to do (these classes are not importable,
    # so pickle would otherwise fail with a confusing lookup error); deepcopy supported, as on
    # stock's per-instance classes.
    namespace["__reduce_ex__"] = _refuse_pickle
    namespace["__prepare_scriptable__"] = _refuse_script
    taken = ["register_forward_pre_hook", "__deepcopy__"]  # what the class took from base
    namespace["register_forward_pre_hook"] = _recording_prepends(base.register_forward_pre_hook)
    if names:
        taken += ["register_parameter", "register_buffer"]
        namespace["register_parameter"] = _registering(base.register_parameter, names)
        namespace["register_buffer"] = _registering(base.register_buffer, names)
    namespace["__deepcopy__"] = _deepcopy_with(getattr(base, "__deepcopy__", _default_deepcopy))
    namespace["__dir__"] = _dir_as_stock(base, served)
    if is_root:
        namespace["__call__"] = root_call
        taken.append("__call__")
        if base.__call__ is not nn.Module.__call__:  # the model's own __call__ (it calls super's)
            namespace["_paramfold_call"] = base.__call__
        if _forward_is_torchs(base):
            namespace["forward"] = _root_forward_for(base.forward)
            namespace["_paramfold_forward"] = base.forward
        taken.append("forward")
    namespace["_paramfold_taken"] = tuple((n, inspect.getattr_static(base, n, None)) for n in taken)
    prefix = "Parametrized" if names else ""
    meta = _Sealed if type(base) is type else type(f"_Sealed{type(base).__name__}", (_Sealed, type(base)), {})
    try:
        cls = meta(f"{prefix}{base.__name__}", (base,), namespace)
    except Exception as exc:  # the model's __init_subclass__ or metaclass refuses a subclass
        raise FoldError(
            f"making paramfold's subclass of {base.__qualname__} raised {type(exc).__name__}: {exc} "
            f"(a __init_subclass__ or metaclass of {base.__qualname__}'s refuses it; paramfold gives "
            "each prepared module and the model's root a class of its own over the module's): exclude "
            "this module with filter_fn, or let that hook accept subclasses; the model was not changed."
        ) from exc
    type.__setattr__(cls, "_paramfold_sealed", True)
    return cls



def between_class(cls: type) -> type:
    """The class a prepared module whose values a call scope puts in its ``__dict__`` (hoisted or
    frozen) has *between* calls, from ``prepare`` on.

    Inside a call scope a module has ``cls``, whose non-data :class:`SiteDescriptor` lets the
    values in its ``__dict__`` reach compiled code as plain tensors. Frozen values stay there after
    the call, so the next call finds every module dict unchanged: nothing to write, and dynamo's
    guards skip the tensors of dicts whose version tag did not move. Between calls the module
    has this subclass instead, whose data descriptors compute each read like stock whatever its
    ``__dict__`` holds (a kept value, or a tensor the user put there under the name, which
    stock's property hides too); compiled code guards on the module's class, so code compiled
    outside a scope never reads a kept value.
    """
    key = ("between", cls)
    with _classes_lock:
        sub = _classes.get(key)
        if sub is None:
            names = [n for n in cls._paramfold_names if isinstance(vars(cls).get(n), SiteDescriptor)]
            namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "_paramfold_between": True}
            namespace.update((n, _BetweenCalls(n)) for n in names)
            sub = _classes[key] = type(cls)(cls.__name__, (cls,), namespace)
            type.__setattr__(sub, "_paramfold_sealed", True)
    return sub



def read_once_class(cls: type, names: frozenset[str], hooked: bool = False) -> type:
    """The class a prepared module has inside a call scope while a *stateful* chain of ``names``
    trains (spectral_norm's power iteration): ``cls`` with a :class:`_ReadOnce` for each, and
    with ``hooked`` (a hook-based spectral_norm) a ``__call__`` and a ``forward`` that first run
    the module's ``hooknorms.ServedOnce`` stand-ins at a call of the module (not at a ``forward``
    called directly, which skips stock's hooks).

    Stock computes such a tensor at every read (a hook-based norm: at every call of the module),
    and each advances the chain's state. The scope computes it once, before the call; the first
    read (call) in the call is served that value and each later one (a discriminator scoring the
    real and the fake batch in one ``forward``, a tied weight) computes afresh, so the state
    advances as in stock, and a compiled graph traces the chain only for the reads after the
    first. The price is one traced function per read or call, and none while nothing trains:
    other modules, and these in eval, keep ``cls``, whose values are plain ``__dict__`` reads.
    """
    key = ("read_once", cls, names, hooked)
    with _classes_lock:
        sub = _classes.get(key)
        if sub is None:
            namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
            namespace.update((n, _ReadOnce(n)) for n in sorted(names))
            if hooked:
                namespace["__call__"] = _served_once_call(cls)
                namespace["_call_impl"] = _served_once_call_impl(cls)
                namespace["forward"] = _served_once_forward(cls)
            namespace["state_dict"] = _state_dict_as_stock(cls)
            sub = _classes[key] = type(cls)(cls.__name__, (cls,), namespace)
            type.__setattr__(sub, "_paramfold_sealed", True)
    return sub


def _served_once_call(cls: type) -> Callable:
    """``cls.__call__`` run after the module's ``hooknorms.ServedOnce`` stand-ins, where torch's
    hooks ran in stock: at the module's calls only, not at a ``forward`` called directly, which
    skips stock's hooks (``layer.forward(x)`` reads the value its hook set at the last call, or
    one assigned since). Eagerly the stand-ins run in ``forward`` (:func:`_served_once_forward`),
    after the nested check of ``_compiled_call_impl`` (a call with changed originals marks the
    value served there, and the hook then runs); this marks the call for it (an entry's call
    that opens its scope reached the class's ``__call__`` before: ``scope._open`` marks it). Traced, where
    nothing is checked at nested calls, they run here, and ``cls.forward`` straight after, as
    dynamo's own call of a module without hooks does (no frame more than stock's)."""
    stocks_call = cls.__call__ is nn.Module.__call__  # not a root's call (scope_entry.root_call)

    def served_once_call(self: nn.Module, *args, **kwargs):
        onces = self._paramfold_once  # state.ONCE_ATTR
        if torch.compiler.is_compiling() and stocks_call and not (
                self._forward_pre_hooks or self._forward_hooks or self._backward_hooks
                or self._backward_pre_hooks or any(GLOBAL_HOOKS)):
            for once in onces:  # hooknorms.ServedOnce's protocol, written out: a frame less to trace
                if once.served:
                    once.hook(self, args)
                else:
                    once.served = True
            return cls.forward(self, *args, **kwargs)
        for once in onces:
            once.called = True
        try:
            return cls.__call__(self, *args, **kwargs)
        finally:
            for once in onces:
                once.called = False

    return served_once_call


def _served_once_call_impl(cls: type) -> Callable:
    """``cls._call_impl`` that marks the call for the stand-ins as :func:`_served_once_call` does:
    a call that does not go through the class's ``__call__`` (``nn.Module.__call__(layer, x)``,
    ``layer._call_impl(x)``, ``layer._wrapped_call_impl(x)``) runs torch's hooks in stock too,
    where the stand-ins must run (not as for a ``forward`` called directly)."""

    def served_once_call_impl(self: nn.Module, *args, **kwargs):
        onces = self._paramfold_once  # state.ONCE_ATTR
        for once in onces:
            once.called = True
        try:
            return cls._call_impl(self, *args, **kwargs)
        finally:
            for once in onces:
                once.called = False

    return served_once_call_impl


def _served_once_forward(cls: type) -> Callable:
    """``cls.forward`` run after the module's ``hooknorms.ServedOnce`` stand-ins where the module
    was called (:func:`_served_once_call`), not where its ``forward`` is called directly. Looked
    up at the call: a forward written to the class ``cls`` derives from (the user's class of a
    hook-based norm's layer) is run in training calls too."""

    def served_once_forward(self: nn.Module, *args, **kwargs):
        # state.ONCE_ATTR, as an attribute: dynamo traces that for less than a read of __dict__;
        # hooknorms.ServedOnce's protocol is written out here, a frame less to trace.
        for once in self._paramfold_once:
            if not once.called:
                continue
            once.called = False  # (a forward of the module's called directly inside this one)
            if once.served:
                once.hook(self, args)
                if not torch.compiler.is_compiling():
                    once.after()
            else:
                once.served = True
        return cls.forward(self, *args, **kwargs)

    functools.update_wrapper(served_once_forward, cls.forward, assigned=("__name__", "__qualname__", "__doc__"),
                             updated=())
    return served_once_forward


def _state_dict_as_stock(cls: type) -> Callable:
    """``cls.state_dict`` (looked up at the call, as ``forward`` in :func:`_served_once_forward`)
    that first gives each stateful chain whose value the open call has not read yet its state
    from before the call (``scope_midcall.state_read``): the read-once class's only, so no state_dict
    outside a training call runs it."""

    def state_dict_as_stock(self: nn.Module, *args, **kwargs):
        state_read(self)
        return cls.state_dict(self, *args, **kwargs)

    functools.update_wrapper(state_dict_as_stock, cls.state_dict, assigned=("__name__", "__qualname__", "__doc__"),
                             updated=())
    return state_dict_as_stock



def _forward_is_torchs(base: type) -> bool:
    """Whether dynamo skips ``base.forward`` as torch's own code (``nn.Sequential`` and friends).

    ``torch.compile`` of such a module wraps it in an extra frame (``external_utils.wrap_inline``)
    that *inlines* the module's ``__call__``, so the root's eager call scope never opens.
    """
    try:
        from torch._dynamo import trace_rules

        return bool(trace_rules.check(base.forward))
    except Exception:  # an older dynamo without this rule: no wrapper frame either
        return False


def _root_forward(self: nn.Module, *args, **kwargs):
    # A frame of paramfold's own for a torch-defined root forward: torch.compile(model) then calls
    # the root's __call__ eagerly (opening the scope) and compiles this frame, as for user modules.
    forward = getattr(type(self), "_paramfold_forward", None)
    if forward is None:  # restored since this was bound (f = model.forward, Accelerate's wrapper of it)
        forward = type(self).forward
    return forward(self, *args, **kwargs)


# id(code) -> (code, forward): the code object of _root_forward made for each torch forward.
# By id: copies of one code object compare (and hash) equal.
_root_codes: dict[int, tuple[types.CodeType, Callable]] = {}


def _root_forward_for(forward: Callable) -> types.FunctionType:
    """:func:`_root_forward` (its code, so dynamo compiles it as that frame) presented as
    ``forward``: ``__wrapped__`` gives ``inspect.signature`` and ``fx.symbolic_trace`` (which read
    the unwrapped code for their placeholders) the model's own parameters, as on stock.

    Each torch forward gets a copy of the code object of its own: dynamo keeps its graphs and
    counts the recompile limit per code object, so prepared roots of one class share them (as
    instances of any class share their forward's), not every prepared torch-defined root
    (``nn.Sequential``, ``nn.Linear``, ...) with every other. Called under ``_classes_lock``.
    """
    code = next((c for c, f in _root_codes.values() if f is forward), None)
    if code is None:
        code = _root_forward.__code__.replace()
        _root_codes[id(code)] = (code, forward)
    fn = types.FunctionType(code, _root_forward.__globals__, "forward")
    functools.update_wrapper(fn, forward, assigned=("__name__", "__qualname__", "__doc__"), updated=())
    return fn


def root_forward_of(code: types.CodeType) -> Callable | None:
    """The torch forward (``nn.Sequential.forward``) that ``code``, paramfold's frame for a
    prepared root whose forward is torch's own, runs; None for any other code object."""
    entry = _root_codes.get(id(code))
    return entry[1] if entry is not None and entry[0] is code else None


def _refuse_pickle(self: nn.Module, protocol: int = 2) -> None:
    raise FoldError(
        "A model prepared by paramfold cannot be pickled or shallow-copied (copy.copy), not even "
        "its modules that stock does not parametrize (a container, a hook-based norm's layer): "
        "copy.deepcopy works (the copy is prepared too); to save, save its state_dict() "
        "(unchanged by paramfold), or call paramfold.restore(model) first. Serialization of "
        "parametrized modules is only supported through state_dict(). See:\n"
        "https://pytorch.org/tutorials/beginner/saving_loading_models.html"
        "#saving-loading-a-general-checkpoint-for-inference-and-or-resuming-training"
    )


def _recording_prepends(register: Callable) -> Callable:
    """``register_forward_pre_hook`` that tells :mod:`paramfold.hooknorms` of a ``prepend=True``
    registration made while a call has the module's norm hooks out (its place is then before
    them, which the dict without them cannot show)."""

    @functools.wraps(register)
    def register_forward_pre_hook(self: nn.Module, hook: Callable, *args: Any, **kwargs: Any) -> Any:
        handle = register(self, hook, *args, **kwargs)
        state = self.__dict__.get(STATE_ATTR)
        if kwargs.get("prepend") and state is not None and state.hooks_out:
            state.hooks_out[2].append(handle.id)
        return handle

    return register_forward_pre_hook


def _refuse_script(self: nn.Module) -> None:
    """What ``torch.jit.script`` asks every module for first: a prepared one refuses (its class's
    descriptors and call scope are not TorchScript; TorchScript's error named a try block)."""
    raise FoldError(
        f"torch.jit.script cannot compile a model prepared by paramfold (met {type(self).__name__}): its "
        "classes serve torch.compile, and TorchScript does not run parametrizations (a scripted stock "
        "model raises 'Parametrization is not working with scripting' when called, unless the model "
        "removes them itself in __prepare_scriptable__, as torchaudio's wav2vec2 does). For inference, "
        "script a plain copy holding each tensor's value: from paramfold.export import folded_copy; "
        "torch.jit.script(folded_copy(model)); or script the model as stock does after "
        "paramfold.restore(model); or use torch.jit.trace / paramfold.export."
    )


def _deepcopy_with(copier: Callable[[nn.Module, dict], nn.Module]) -> Callable[[nn.Module, dict], nn.Module]:
    """``copy.deepcopy`` of a prepared module by ``copier`` (the base class's own, else
    :func:`_default_deepcopy`). A copy of part of a prepared model made without that model
    (``copy.deepcopy(model.layer)``: a cloned layer, one layer's EMA) is part of no prepared model,
    so it is made a stock module, as :func:`paramfold.restore` would leave it: stock's class (the
    original's, which stock's copy shares too) and no paramfold state. Prepare it on its own if
    you want it compiled as a plain model."""

    def __deepcopy__(self: nn.Module, memo: dict) -> nn.Module:
        found = memo.get(id(self))
        if found is not None:
            return found
        asked = _asked_through(self)
        if asked is not None and getattr(_stock_class(self), "__deepcopy__", None) is None:
            # copy.deepcopy(wrapper) found this method through the wrapper's forwarding
            # __getattr__ (torch.compile's OptimizedModule, PEFT's ModulesToSaveWrapper). Stock's
            # class has none to find, so stock copies the wrapper itself: so do we.
            return copy._reconstruct(asked, memo, *asked.__reduce_ex__(4))  # type: ignore[attr-defined]
        orphan = orphaned_copy(self, memo)
        left_out = not_copied(self) if copier is not _default_deepcopy else ()
        replica = copier(self, memo)
        if copier is not _default_deepcopy:
            for name in left_out:  # (the class's own copier copied them)
                replica.__dict__.pop(name, None)
            copied_between_calls(self, replica)
        if orphan:
            restore_module(replica)
        return replica

    return __deepcopy__


def _asked_through(module: nn.Module) -> object | None:
    """The object ``copy.deepcopy`` was given, when it is not ``module`` but found ``module``'s
    ``__deepcopy__`` through its own ``__getattr__`` (``copy.deepcopy`` looks the method up on the
    instance); None when called otherwise."""
    caller = sys._getframe(2)  # __deepcopy__'s caller: this function is called by __deepcopy__
    if caller.f_code is not copy.deepcopy.__code__:
        return None
    given = caller.f_locals.get("x")
    return None if given is None or given is module else given


def _stock_class(module: nn.Module) -> type:
    """The class ``module`` has without paramfold."""
    state = module.__dict__.get(STATE_ATTR)
    return state.original_class if state is not None else type(module)


def _default_deepcopy(self: nn.Module, memo: dict) -> nn.Module:
    """``copy.deepcopy`` of a prepared module, as stock copies the module.

    A module stock parametrizes has a class of torch's with parametrize's ``default_deepcopy``,
    which copies the instance ``__dict__`` as it is (this function's second half). Any other module
    (a container, a hook-based norm's layer) stock copies through its class's ``__reduce_ex__``:
    ``__getstate__``, which drops ``_compiled_call_impl`` (the compiled *bound* ``_call_impl`` that
    ``module.compile()`` left: kept, the copy's calls would run the original module), and
    ``__setstate__``. Our class refuses ``__reduce_ex__`` (pickling), so that path is taken here
    with the object protocol that stock's copy would have used.
    """
    found = memo.get(id(self))
    if found is not None:
        return found
    left_out = not_copied(self)  # values paramfold put there: not the module's own
    for now, then in copied_hook_values(self):  # (wherever the copy meets it: a dict holding it too)
        memo[id(now)] = copy.deepcopy(then, memo)
        copy._keep_alive(now, memo)  # type: ignore[attr-defined]
    if not has_parametrizations(self):
        rv = object.__reduce_ex__(self, 4)
        if left_out and isinstance(rv[2], dict):
            rv = (rv[0], rv[1], {k: v for k, v in rv[2].items() if k not in left_out}, *rv[3:])
        replica = copy._reconstruct(self, memo, *rv)  # type: ignore[attr-defined]
    else:
        replica = self.__new__(type(self))
        memo[id(self)] = replica
        own = {k: v for k, v in self.__dict__.items() if k not in left_out} if left_out else self.__dict__
        object.__setattr__(replica, "__dict__", copy.deepcopy(own, memo))
        for slot in copyreg._slotnames(type(self)):  # type: ignore[attr-defined]
            if hasattr(self, slot):
                setattr(replica, slot, copy.deepcopy(getattr(self, slot), memo))
    state, copied = self.__dict__.get(STATE_ATTR), replica.__dict__.get(STATE_ATTR)
    if state is not None and copied is not None and copied is not state:
        copied.keep_copied(state, memo)
    copied_between_calls(self, replica)
    return replica


def _registering(register: Callable, names: frozenset[str]) -> Callable:
    """``register_parameter`` / ``register_buffer`` of a prepared class: torch's
    ``remove_parametrizations`` registers the original under the name it took the parametrization
    off; where a call scope put that name's value in the module's ``__dict__`` (the call is open:
    a hook baking the weight in), stock's module has none there, and torch's check of the name
    would refuse it ("attribute ... already exists") after the parametrization is gone. The value
    leaves first, as after an assignment (:func:`~paramfold.scope_midcall.assigned`)."""

    def method(self: nn.Module, name: str, *args: Any, **kwargs: Any) -> None:
        if name in names and name in self.__dict__:
            plists = self.__dict__.get("_modules", {}).get("parametrizations")
            if plists is None or name not in plists._modules:
                assigned(self, name)
        return register(self, name, *args, **kwargs)

    return method


def _make_setattr(base: type, last_call_values: frozenset[str] = frozenset()):
    base_setattr = base.__setattr__

    def __setattr__(self: nn.Module, name: str, value: object) -> None:
        if name == "__class__" and value is type(self).__bases__[0] and vars(type(self)).get("_paramfold_between"):
            # torch's remove_parametrizations of the last one takes the class one level down,
            # from the between-calls class to the prepared one: stock's is the class below that.
            value = value.__bases__[0]
        if name in last_call_values:
            _take_last_call_value(self, name)
            hook_value_replaced(self, name)
        # Stock's property setter: assigning to a parametrized tensor goes through right_inverse,
        # where nn.Module.__setattr__ would reach it: not for a Parameter (register_parameter
        # refuses the taken name) or a module (registered as a submodule), which it handles first.
        plists = self.__dict__.get("_modules", {}).get("parametrizations")
        if plists is not None and name in plists._modules and not isinstance(value, (nn.Parameter, nn.Module)):
            try:
                plists._modules[name].right_inverse(value)
            finally:  # (also where it raised: it may have written some originals)
                assigned(self, name)
        else:
            base_setattr(self, name, value)

    return __setattr__


def _make_delattr(base: type, last_call_values: frozenset[str]):
    base_delattr = base.__delattr__

    def __delattr__(self: nn.Module, name: str) -> None:
        if name in last_call_values:
            hook_value_replaced(self, name)
            if name not in self.__dict__ and _take_last_call_value(self, name):
                return
        plists = self.__dict__.get("_modules", {}).get("parametrizations")
        if plists is not None and name in plists._modules:
            # Stock's property has no deleter; object.__delattr__ would delete the value a call
            # scope put in __dict__ (the non-data SiteDescriptor lets it) instead of refusing.
            raise AttributeError(f"property of {type(self).__name__!r} object has no deleter")
        base_delattr(self, name)

    return __delattr__


# --- type_before_parametrizations -----------------------------------------------------------

_stock_type_before = parametrize.type_before_parametrizations


def _type_before_parametrizations(module: nn.Module) -> type:
    state = module.__dict__.get(STATE_ATTR)
    if state is None:
        return _stock_type_before(module)
    cls = state.original_class
    return cls.__bases__[0] if state.stock_names else cls


_type_before_parametrizations.__doc__ = _stock_type_before.__doc__
_type_before_parametrizations.__wrapped__ = _stock_type_before  # type: ignore[attr-defined]


def install_type_before_parametrizations() -> None:
    """Make ``parametrize.type_before_parametrizations`` see through paramfold's classes.

    It answers ``type(module)`` for an unparametrized module and the first base of the class
    otherwise; for a prepared module both would name paramfold's shared class. The replacement
    answers, for prepared modules only, what stock answers for the module as it was before
    ``prepare``, and defers to stock for every other module. Modules that imported the function
    by name (``torch.ao``) get it too. Installed by the first ``prepare``; it stays (it changes
    nothing for unprepared modules).
    """
    if parametrize.type_before_parametrizations is _type_before_parametrizations:
        return
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if namespace is not None and namespace.get("type_before_parametrizations") is _stock_type_before:
            namespace["type_before_parametrizations"] = _type_before_parametrizations


def plain_base(module: nn.Module) -> type:
    """The class ``module`` would have without parametrizations, keeping any wrapper around it.

    Stock ``parametrize`` puts ``module`` in a per-instance ``Parametrized<Name>`` class whose
    first base is the original class; ``type_before_parametrizations`` relies on that. Libraries
    that later swap the class to a subclass of their own — FSDP2's ``fully_shard`` makes
    ``FSDPParametrizedLinear(FSDPModule, ParametrizedLinear)`` — break it (its first base is the
    ``FSDPModule`` mixin), so here the stock class is found in the MRO and replaced there:
    ``FSDPLinear(FSDPModule, Linear)``, one class shared by all such modules.
    """
    cls, stock = type(module), parametrized_class(module)
    if stock is None or stock is cls:
        return parametrize.type_before_parametrizations(module)
    return rebased(cls, stock, stock.__bases__[0])


def parametrized_class(module: nn.Module) -> type | None:
    """The per-instance class stock ``parametrize`` made for ``module`` (with a property for each
    parametrized tensor): its class, or the base of a wrapper a library made of it since (FSDP2's
    ``FSDPParametrizedLinear(FSDPModule, ParametrizedLinear)``); None where it has none."""
    names = set(module._modules["parametrizations"]._modules) if "parametrizations" in module._modules else set()
    return next((c for c in type(module).__mro__ if names and all(type(vars(c).get(n)) is property for n in names)),
                None)


# Run eagerly when dynamo meets them as frames of their own (a frame it falls back on calls
# them); inlined into traced code they are traced as usual. torch's own parametrize code is
# skipped the same way, as a file of torch. _root_forward stands in for a torch-defined root's
# forward, which dynamo is to compile as a frame.
run_module_eagerly_as_frames(globals(), keep=(_root_forward,))
