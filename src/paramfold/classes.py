"""The classes prepared modules are switched to.

Stock ``parametrize`` gives every parametrized module its own class (``ParametrizedLinear``,
one per instance) holding a property per tensor. paramfold swaps each prepared module to a class
*shared* by all modules with the same original class and parametrized names. Sharing matters for
``torch.compile``: dynamo guards on a module's type, so per-instance classes make every layer of a
per-layer-compiled model look different, while shared classes let same-architecture layers (and
same-architecture models) reuse one graph.
"""

from __future__ import annotations

import copy
import copyreg
import functools

from torch import nn
from torch.nn.utils import parametrize

from paramfold.inline import SiteDescriptor, inline_property
from paramfold.scope import compiled_call_impl, root_call


@functools.cache
def prepared_class(
    base: type,
    names: frozenset[str],
    is_root: bool,
    inline_signatures: tuple[tuple[str, tuple], ...] | None = None,
) -> type:
    """The shared class for modules of ``base`` whose ``names`` are parametrized.

    ``inline_signatures`` (name, chain signature) pairs make the class read those tensors
    through generated inline properties; otherwise each name gets a :class:`SiteDescriptor`
    that hoisted or frozen values in the instance ``__dict__`` shadow.
    """
    namespace: dict[str, object] = {
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
        "_paramfold_names": names,
        "_compiled_call_impl": compiled_call_impl,
    }
    inline = dict(inline_signatures or ())
    for name in names:
        namespace[name] = inline_property(name, inline[name]) if name in inline else SiteDescriptor(name)
    if names - inline.keys():
        namespace["__setattr__"] = _make_setattr(base)
    # Pickling refused with a message that says what to do (these classes are not importable,
    # so pickle would otherwise fail with a confusing lookup error); deepcopy supported, as on
    # stock's per-instance classes.
    namespace["__reduce_ex__"] = _refuse_pickle
    if not hasattr(base, "__deepcopy__"):
        namespace["__deepcopy__"] = _default_deepcopy
    if is_root:
        namespace["__call__"] = root_call
    prefix = "Parametrized" if names else ""
    return type(f"{prefix}{base.__name__}", (base,), namespace)


def _refuse_pickle(self: nn.Module, protocol: int = 2) -> None:
    raise RuntimeError(
        "A model prepared by paramfold cannot be pickled: save its state_dict() (unchanged by "
        "paramfold), or call paramfold.restore(model) first. Serialization of parametrized "
        "modules is only supported through state_dict(). See:\n"
        "https://pytorch.org/tutorials/beginner/saving_loading_models.html"
        "#saving-loading-a-general-checkpoint-for-inference-and-or-resuming-training"
    )


def _default_deepcopy(self: nn.Module, memo: dict) -> nn.Module:
    found = memo.get(id(self))
    if found is not None:
        return found
    replica = self.__new__(self.__class__)
    memo[id(self)] = replica
    replica.__dict__ = copy.deepcopy(self.__dict__, memo)
    for slot in copyreg._slotnames(self.__class__):  # type: ignore[attr-defined]
        if hasattr(self, slot):
            setattr(replica, slot, copy.deepcopy(getattr(self, slot), memo))
    return replica


def _make_setattr(base: type):
    base_setattr = base.__setattr__

    def __setattr__(self: nn.Module, name: str, value: object) -> None:
        # Stock's property setter: assigning to a parametrized tensor goes through right_inverse.
        if name in type(self)._paramfold_names:
            self.parametrizations[name].right_inverse(value)
        else:
            base_setattr(self, name, value)

    return __setattr__


def plain_base(module: nn.Module) -> type:
    """The class ``module`` would have without parametrizations, keeping any wrapper around it.

    Stock ``parametrize`` puts ``module`` in a per-instance ``Parametrized<Name>`` class whose
    first base is the original class; ``type_before_parametrizations`` relies on that. Libraries
    that later swap the class to a subclass of their own — FSDP2's ``fully_shard`` makes
    ``FSDPParametrizedLinear(FSDPModule, ParametrizedLinear)`` — break it (its first base is the
    ``FSDPModule`` mixin), so here the stock class is found in the MRO and replaced there:
    ``FSDPLinear(FSDPModule, Linear)``, one class shared by all such modules.
    """
    cls = type(module)
    names = set(module._modules["parametrizations"]._modules) if "parametrizations" in module._modules else set()
    stock = next((c for c in cls.__mro__ if names and all(type(vars(c).get(n)) is property for n in names)), None)
    if stock is None or stock is cls:
        return parametrize.type_before_parametrizations(module)
    return rebased(cls, stock, stock.__bases__[0])


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
