"""What a read of a prepared module's tensor (``layer.weight``) does: the stand-ins for stock's properties.

Stock ``parametrize`` gives a parametrized module a class of its own with a property per tensor,
which computes the value at every read. paramfold's shared classes (:mod:`paramfold.classes`) hold
a descriptor per name instead; this module is what each does when a tensor is read:

* :class:`SiteDescriptor`, the prepared class's, a *non-data* descriptor: inside a call scope the
  value the scope put in the module's ``__dict__`` is read without asking it; where none is there
  it computes the value like stock (:func:`read_outside_scope`; traced, stock's computation).
* :class:`_BetweenCalls`, the between-calls class's, a *data* descriptor: a read between calls
  computes the value like stock, whatever the ``__dict__`` holds (a frozen value kept for the next
  call).
* :class:`_ReadOnce`, the read-once class's, for a stateful chain that trains (spectral_norm's
  power iteration): the first read in a call takes the value the scope computed, each later one
  computes afresh, as stock's reads advance the chain's state.
* :class:`LastCallValue`, for a tensor a hook-based norm computes: the value the module's last call
  left, while a call scope has taken it out of ``__dict__``.
* :class:`_ForeignSite`, in place of the property torch injects on a shared class for one module's
  new parametrization: computed for the modules parametrized for that name only.

A read outside a call scope inside a non-reentrant ``torch.utils.checkpoint`` region is noted on
the region's frame, so that its recomputation replays each read as the forward made it
(:func:`read_outside_scope`, :func:`_read_key`).

Which class a module has, and when, is :mod:`paramfold.classes`'s (the classes are shared and
cached there): it imports this module, which imports nothing of it.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn.utils import parametrize

from paramfold import changed_call_regions as changed_regions
from paramfold import scope_nested as nested
from paramfold.compile_reads import RefusedWhileCompiling
from paramfold.compute import (autocast_state, cache_key, checkpoint_frame, compiling_here, compute,
                               computed_for_recomputation, eager_value, inspected_by_dynamo,
                               parametrized_here, read_without_grad)
from paramfold.errors import FoldError
from paramfold.frames import run_module_eagerly_as_frames
from paramfold.freeze import chain_needs_grad
from paramfold.hooknorms import shadowed
from paramfold.state import STATE_ATTR, SiteState, tensor_label


class SiteDescriptor:
    """Class attribute standing in for stock's per-instance property of one tensor name.

    A *non-data* descriptor on purpose: an instance ``__dict__`` entry of the same name takes
    precedence, which is how hoisted and frozen values reach compiled code as plain tensors.
    Outside a call scope it computes the value like stock, so it is never stale.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, module: nn.Module | None, owner: type | None = None):
        if module is None:
            return self
        if torch.compiler.is_compiling() and compiling_here():  # traced (not another thread's compile)
            # In-graph (no value in ``__dict__``: no call scope open, as for a prepared model
            # traced into a bigger compiled function): stock's property, which dynamo traces
            # through ``parametrize.cached()``'s cache as well.
            return eager_value(module, self.name)
        return read_outside_scope(module, self.name)


class LastCallValue:
    """Class attribute for a tensor a hook-based norm computes (``module.weight``): a *non-data*
    descriptor, so it is asked only where the instance ``__dict__`` has no value. That is while a
    call scope has taken out the value the module's last call left, until the norm's own hook,
    running in the call as in stock, sets it again (``scope._install``: compiled code traced while
    the hook was out would read it stale). A read before that hook — a global forward pre-hook
    (a weight monitor), a pre-hook registered with ``prepend=True`` or before the norm, the
    parent's forward — gets that value, as in stock, whose ``__dict__`` still holds it."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, module: nn.Module | None, owner: type | None = None):
        if module is None:
            return self
        state = module.__dict__.get(STATE_ATTR)
        if state is not None and not shadowed(module, self.name):  # (a parameter registered over it is read)
            for name, value in state.left:
                if name == self.name:
                    return value
        raise AttributeError(self.name)  # nn.Module.__getattr__ finds what stock finds


def _take_last_call_value(module: nn.Module, name: str) -> bool:
    """Drop the value :class:`LastCallValue` serves for ``name``, as an assignment or ``del`` of the
    attribute replaces or removes stock's in its ``__dict__`` (``module.weight = p`` removes it
    before registering ``p``, which it refuses while the attribute is there); whether there was one."""
    state = module.__dict__.get(STATE_ATTR)
    if state is None or all(n != name for n, _ in state.left):
        return False
    state.left = tuple(pair for pair in state.left if pair[0] != name)
    return True


class _BetweenCalls(SiteDescriptor):
    """The descriptor of :func:`~paramfold.classes.between_class`: a *data* descriptor, so a frozen
    value left in the instance ``__dict__`` for the next call is never what a read between calls
    returns."""

    def __get__(self, module: nn.Module | None, owner: type | None = None):
        if module is None:
            return self
        if torch.compiler.is_compiling() and compiling_here():  # traced (not another thread's compile)
            return eager_value(module, self.name)
        if parametrized_here(module, self.name):
            return read_outside_scope(module, self.name)
        # The parametrization is gone (torch's remove_parametrizations): a kept value is stale.
        _drop_kept(module, self.name)
        values = module.__dict__
        if self.name in values:
            return values[self.name]
        raise AttributeError(self.name)  # nn.Module.__getattr__ finds the plain tensor

    def __set__(self, module: nn.Module, value: object) -> None:
        _drop_kept(module, self.name)
        module.__dict__[self.name] = value

    def __delete__(self, module: nn.Module) -> None:
        _drop_kept(module, self.name)
        if module.__dict__.pop(self.name, _MISSING) is _MISSING:
            raise AttributeError(self.name)


_MISSING = object()


def _drop_kept(module: nn.Module, name: str) -> None:
    state = module.__dict__.get(STATE_ATTR)
    if state is not None and state.drop_kept(name):
        module.__dict__.pop(name, None)

class _ReadOnce(SiteDescriptor):
    """The descriptor of :func:`~paramfold.classes.read_once_class`: a *data* descriptor whose first
    read in a call scope takes the value the scope computed out of the instance ``__dict__``; later
    reads find none there and compute it like stock, each its own power iteration (in-graph when
    compiled)."""

    def __get__(self, module: nn.Module | None, owner: type | None = None):
        if module is None:
            return self
        # Traced, each torch.compiler call and inlined frame costs dynamo at every read: asked once.
        traced = torch.compiler.is_dynamo_compiling()
        if not traced and inspected_by_dynamo():
            return self._as_dynamo_sees_it(module)
        values = module.__dict__
        value = values.pop(self.name, None)
        if value is not None:
            # Traced, the value's own guard needs it in ``__dict__``: code traced here serves no call
            # where an earlier read took it.
            if not (traced or torch.compiler.is_compiling()):
                _note_served(module, self.name)
            if parametrize._cache_enabled:
                # Inside parametrize.cached() (opened inside the forward too): stock's first read
                # in the block caches what it computes (under no_grad, without a history), and
                # every later read gets that.
                value = parametrize._cache.setdefault(
                    cache_key(module, self.name),
                    read_without_grad(value) if value.requires_grad and not torch.is_grad_enabled() else value)
            return value
        if traced or torch.compiler.is_compiling():
            # Dynamo guards nothing about a key's absence from ``module.__dict__``; asked of the same
            # dict reached as a plain one (the state's ``own_dict``), it guards the dict's keys, so
            # code traced after the value was taken (a frame re-entered or resumed inside the call)
            # serves no later call where the value is there, unread. Asked only here: the check
            # costs dynamo a wrap of the whole dict (0.5x the plain model's compile, 16 layers).
            self.name in values[STATE_ATTR].own_dict
        return SiteDescriptor.__get__(self, module, owner)

    def _as_dynamo_sees_it(self, module: nn.Module) -> torch.Tensor:
        """A read made for real by dynamo while it compiles: the guards of a traced
        ``hasattr(module, name)`` or ``getattr(module, name, default)`` evaluate both on the
        module as they are built. The traced code took the value or computed it afresh, and
        runs later: this read takes nothing and computes nothing (taking it emptied the dict
        dynamo was building a guard on, a ``KeyError``; computing it advanced the chain's state).

        Where the value is there, dynamo's guard reads it from ``__dict__`` at later calls too;
        where a frame of this call took it already (across a graph break, a module compiled on
        its own), the guard would get it through this descriptor, for real, before every run of
        the code, each advancing the chain's state, which stock's eager call does not. Refused."""
        value = module.__dict__.get(self.name)
        if value is not None:
            return value
        raise RefusedWhileCompiling(
            f"{tensor_label(module, self.name)}: compiled code asks hasattr() or getattr(..., default) of "
            "this stateful parametrization in training after an earlier compiled frame of the call read "
            "it (across a graph break, or from a module compiled on its own): torch.compile's guards "
            "would read it for real before every later run of that code, each read advancing its state "
            "(spectral_norm's power iteration), which stock's eager call does not. Read it there as "
            f"module.{self.name} (without hasattr or a getattr default), remove the graph break, prepare "
            "this module with mode='inline' (filter_fn; it compiles as stock does, those guard reads "
            "included), or call model.eval()."
        )

    def __set__(self, module: nn.Module, value: object) -> None:
        module.__dict__[self.name] = value  # as the non-data descriptor lets it be set; read once

    def __delete__(self, module: nn.Module) -> None:
        if module.__dict__.pop(self.name, _MISSING) is _MISSING:
            raise AttributeError(self.name)

class _ForeignSite:
    """Put on a shared class in place of the property torch injected for one module's new site."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, module: nn.Module | None, owner: type | None = None):
        if module is None:
            return self
        if not parametrized_here(module, self.name):
            raise AttributeError(self.name)  # nn.Module.__getattr__ finds the plain tensor
        return eager_value(module, self.name)


def read_outside_scope(module: nn.Module, name: str) -> torch.Tensor:
    """The value of a hoist or freeze site read eagerly where no value is in ``__dict__``: stock's.

    Inside a non-reentrant ``torch.utils.checkpoint`` region, the recomputation (during
    backward) must do for each read exactly what the forward did, or the region saves other
    tensors (a ``CheckpointError``, or ``Linear`` saving what its gradients need, which depends on
    whether the weight requires grad), runs ops the forward never ran (selective checkpointing's
    cache refuses them), or computes other gradients. A read that reaches this descriptor in the
    forward computes its value here, with autograd, inside the region (no call scope over the
    module: a submodule or ``forward`` checkpointed directly; a tensor left to be computed where
    read; a nested call under another autocast state, grad mode or with swapped originals,
    ``scope_nested.call_changed``); it is noted on the region's frame (:func:`_read_key`). In the
    recomputation a read with such a note is computed again the same way; any other read was
    served, in the forward, a value the call scope computed *before* the region (a plain
    ``__dict__`` read, its gradient flowing through the graph that value recorded then), so it is
    computed again without autograd and outside the region's dispatch modes, as a leaf that
    requires grad where that value did; except a training stateful chain's, refused: stock runs
    its power iteration again here. Its read-once class serves the first read the scope's value
    and computes the later ones here under the same key, so that first read is noted on the
    frame too (:func:`_note_served`), and any read of such a chain is refused.
    """
    if not parametrized_here(module, name):
        raise AttributeError(name)
    region = checkpoint_frame()
    if region is not None:
        frame, recomputing = region
        site = module.__dict__[STATE_ATTR].sites.get(name)
        if not recomputing:
            if frame is not None:
                frame.__dict__.setdefault(_READS, set()).add(_read_key(module, name, site))
            return eager_value(module, name)
        key = _read_key(module, name, site)
        noted = frame.__dict__ if frame is not None else {}
        read_here = key in noted.get(_READS, ())
        in_graph = read_here or site is None or site.mode == "inline" or site.at_read or (
            site.subclass and chain_needs_grad(site))
        # A read-once chain's first read was served the scope's value, its later ones computed
        # here under the same key: which of them this read replays cannot be told, and the
        # served one cannot be replayed (below).
        if site is not None and site.training_stateful and (not in_graph or key in noted.get(_SERVED, ())):
            raise FoldError(
                f"{tensor_label(module, name)}: a stateful parametrization (spectral_norm) in "
                "training mode is read again while torch.utils.checkpoint(use_reentrant=False) "
                "recomputes its forward; stock would run the power iteration inside the "
                "checkpointed region, which a value computed once per call cannot reproduce. "
                "Prepare this module with mode='inline' (filter_fn), or call model.eval()."
            )
        if not in_graph:
            return computed_for_recomputation(functools.partial(compute, module, name), chain_needs_grad(site))
    return eager_value(module, name)


#: The attribute of a ``torch.utils.checkpoint`` frame that holds the :func:`_read_key` of every
#: read its forward computed where it was read.
_READS = "_paramfold_computed_at_read"
#: ... and of every read of a read-once chain its forward served the call scope's value.
_SERVED = "_paramfold_served"


def _note_served(module: nn.Module, name: str) -> None:
    """Note on the non-reentrant checkpoint region this forward runs in, if any, that the read of
    ``name`` was served the value the call scope computed before the region (:class:`_ReadOnce`)."""
    region = checkpoint_frame()
    if region is not None and region[0] is not None and not region[1]:
        site = module.__dict__[STATE_ATTR].sites.get(name)
        region[0].__dict__.setdefault(_SERVED, set()).add(_read_key(module, name, site))


def _read_key(module: nn.Module, name: str, site: SiteState | None) -> tuple:
    """What tells a read in a checkpointed region's recomputation which read of its forward it
    replays: the tensor, the grad mode and autocast state, and whether the originals and the
    chain are those the call scope's value was computed from. A read served that value in the
    forward differs from one computed there (``scope_nested.call_changed`` computes where one of
    those differs), and the recomputation reads under the same ones as its forward; and whether
    it is made inside a call changed in the region (:mod:`paramfold.changed_call_regions`): a
    read outside it was served the scope's value."""
    if site is None:
        return (id(module), name, changed_regions.inside())
    chain = site.plist is None or tuple(site.plist._modules.values()) == (site.read_chain or site.modules)
    return (id(module), name, torch.is_grad_enabled(), autocast_state(),
            nested.same(nested.inputs(site), site.read_from), chain, changed_regions.inside())


# Run eagerly when dynamo meets them as frames of their own (a frame it falls back on calls
# them); inlined into traced code they are traced as usual, as stock's properties are.
run_module_eagerly_as_frames(globals())
