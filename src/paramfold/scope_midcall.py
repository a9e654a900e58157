"""What a call scope does when the call itself touches the values it installed.

A call scope (:mod:`paramfold.scope`) computes each value once, at the call's start, and every
read of the call shares it; stock computes it at each read. Where the forward does something
between two reads that stock's next read would see, the shared value must give way:

* ``layer.weight = t`` or ``del layer.weight`` (:func:`assigned`, :func:`hook_value_replaced`):
  the reads, or a hook-based norm's next call, compute it from the new originals;
* ``copy.deepcopy`` of a module during the call (:func:`copied_between_calls`,
  :func:`copied_hook_values`, :func:`not_copied`): the copy is an ordinary model, as stock's is,
  holding what stock's would hold;
* ``state_dict()`` taken during the call (:func:`state_read`): a training stateful chain's
  buffers hold stock's state there;
* a backward that frees the graphs it runs through (:func:`watch_backward`): the values lose
  their graph, and each read computes afresh.

Each gives the affected values up, and where a training stateful chain's value is unread yet,
puts back the state from before the scope computed it (:func:`paramfold.unread.drop`).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from paramfold import compile_leaves as leaves
from paramfold import unread
from paramfold import scope_nested as nested
from paramfold.compute import compiling
from paramfold.errors import FoldError
from paramfold.frames import run_module_eagerly_as_frames
from paramfold.scope import _MISSING, _unclaimed, calls_lock
from paramfold.scope_entry import _enclosing, _in_scope
from paramfold.state import ONCE_ATTR, PLAIN_TENSOR_TYPES, STATE_ATTR, kept_values, tensor_label


def not_copied(module: nn.Module) -> tuple[str, ...]:
    """The names in ``module.__dict__`` whose values paramfold put there, not stock's attributes,
    which a copy of the module leaves out: those an open call scope installed (see
    :func:`copied_between_calls`), and the frozen values kept for the next call (the copy freezes
    its own: a kept one, keyed on this module's tensors, would be taken for the user's there)."""
    hs = module.__dict__.get(STATE_ATTR)
    if hs is None:
        return ()
    return (*(hs.installed if hs.users else ()), *kept_values(module, hs))


def copied_hook_values(module: nn.Module) -> list[tuple[object, object]]:
    """For a copy of ``module`` made now: ``(value, last)`` for each hook-based norm's value in
    ``module.__dict__`` that the copy holds ``last`` for instead. An open call computed and stored
    this call's value up front, where stock's ``__dict__`` holds the last call's until the
    module's call in this one runs the norm's hook: a copy made before that (from a forward hook
    of an earlier layer) holds the last call's, as stock's does (and copies where stock's does: a
    value of a grad call is no graph leaf, which ``copy.deepcopy`` refuses). A training
    spectral_norm's read-once class tells whether the module was called yet; where nothing does
    (weight_norm, an eval spectral_norm) the two values must be one: refused where they differ
    (the originals changed since the last call, a spectral_norm's first call, which replaces
    the weight its registration left) or only the last call's copies (a value of a grad call)."""
    hs = module.__dict__.get(STATE_ATTR)
    if hs is None or not hs.users or not hs.replaced:
        return []
    values, substitutes = module.__dict__, []
    for name, last in hs.replaced:
        value = values.get(name, _MISSING)
        if value is last or value is _MISSING or last is _MISSING:
            continue
        once = hs.sites[name].once_hook
        if once is not None and once in values.get(ONCE_ATTR, ()) and hs.reads_once(module):
            if not once.served:  # (served: the module was called, and its value is stock's)
                substitutes.append((value, last))
        elif (_copyable(last) and not _copyable(value)) or not _same_numbers(value, last):
            # (else: both copy, with the same numbers; or only this call's value does, where the
            # last is a grad value, which stock's copy refuses before the module's call, but not
            # after; or neither does, and the copy raises as stock's)
            raise FoldError(
                f"copy.deepcopy of {tensor_label(module, name)}, computed by a hook-based "
                f"torch.nn.utils.{hs.sites[name].hook_kind}, during a call that computed it: stock's copy "
                "holds the module's value of the last call before the module's call in this one, and this "
                "call's after, which paramfold cannot tell apart here, and they differ (other numbers: the "
                "originals changed since the last call; or this call's, computed with grad, is no graph leaf "
                "and cannot be copied). Copy between calls, or prepare this module with mode='inline' (filter_fn).")
    return substitutes


def _same_numbers(value: object, last: object) -> bool:
    """Whether a copy holding ``value`` or ``last`` holds the same tensor, but for its history
    (plain tensors only: a subclass's comparison may be more than a read, a DTensor's a collective)."""
    if type(value) not in PLAIN_TENSOR_TYPES or type(last) not in PLAIN_TENSOR_TYPES:
        return False
    with torch.no_grad():
        return (value.dtype == last.dtype and value.device == last.device and value.shape == last.shape
                and value.stride() == last.stride() and bool(torch.equal(value, last)))


def _copyable(value: object) -> bool:
    """Whether ``copy.deepcopy`` copies ``value`` as a tensor would: a non-leaf tensor refuses."""
    return not isinstance(value, torch.Tensor) or value.is_leaf


def copied_between_calls(module: nn.Module, replica: nn.Module) -> None:
    """Give ``replica``, a copy of ``module`` made while a call scope held it (``copy.deepcopy``
    inside its forward, or in another thread during a call), the state a copy made between calls
    has, as stock's copy is an ordinary model wherever it is made: unclaimed (its calls and
    ``restore`` are not refused as concurrent), its hooks back, its between-calls class, without
    the call's values, and a training stateful chain whose value is unread yet with its state
    from before the scope computed that value (stock has run no power iteration for it yet)."""
    hs = replica.__dict__.get(STATE_ATTR)
    if hs is None or not hs.users:
        return
    with calls_lock():
        for name, site in module.__dict__[STATE_ATTR].sites.items():
            state = unread.as_before(module, name, site)
            if state is not None:
                with torch.no_grad():
                    for t, then in zip(unread.state_tensors(replica, hs.sites[name]), state):
                        if then is not None:
                            t.copy_(then)
        hs.users = 0
        hs.shareable = None
        _unclaimed(replica, hs)


def state_read(holder: nn.Module) -> None:
    """Before a ``state_dict()`` of ``holder`` taken inside a call this thread has open (a
    checkpoint or EMA snapshot saved from a forward hook of an earlier layer): each training
    stateful chain whose value the call has not read yet gets its state from before the scope
    computed that value, and its reads from now on compute it (:func:`unread.drop`). The
    state_dict then holds, as stock's does, the buffers themselves with stock's state there, and
    the rest of the call advances them as stock's does. From another thread (whose state_dict
    races with the call's power iteration in stock too), the buffers as they are."""
    hs = holder.__dict__.get(STATE_ATTR)
    if hs is None or not hs.users or not (_in_scope(holder) or _enclosing(holder) is not None):
        return
    with calls_lock():
        for name, site in hs.sites.items():
            unread.drop(holder, name, site)


def assigned(holder: nn.Module, name: str) -> None:
    """After ``holder.<name> = value`` ran stock's property setter (``right_inverse``, which writes
    the originals): the value a call scope put in ``holder``'s ``__dict__`` for ``name`` (or a
    frozen value kept there) was computed from the originals before, and leaves it, so the reads
    from now on compute it from the new ones, as stock's do. A training stateful chain's value no
    read took yet gets its state from before the scope computed it (:func:`unread.drop`): stock
    runs the power iteration at the read after the assignment, not at the call's start."""
    hs = holder.__dict__.get(STATE_ATTR)
    site = hs.sites.get(name) if hs is not None else None
    if site is None or name not in holder.__dict__:
        return
    with calls_lock():
        unread.drop(holder, name, site)
        holder.__dict__.pop(name, None)
        hs.drop_kept(name)
        nested.Installs.count += 1  # the nested checks built with that value


def hook_value_replaced(holder: nn.Module, name: str) -> None:
    """Before ``holder.<name> = value`` or ``del holder.<name>`` of a tensor a hook-based norm
    computes (``layer.weight``), inside a call: stock's hook sets it again at the module's next
    call, from the originals. Where the module's next call in this one would be served the value
    the scope computed instead (the hook is out, and no :class:`hooknorms.ServedOnce` stand-in
    of a training spectral_norm has served it yet), the hook comes back for the rest of the call;
    where no call took that value yet, the power iteration the scope ran for it is undone
    (:func:`unread.drop`): the hook runs it at the next call, as stock's does.

    Where the module's next call runs the hook anyway, nothing is to be done: that is also where
    the hook itself runs and sets the value (kept in, or run by its stand-in at a later call),
    so its own write returns here before anything else, traced without a graph break."""
    hs = holder.__dict__.get(STATE_ATTR)
    site = hs.sites.get(name) if hs is not None else None
    if site is None or site.hook is None:
        return
    if hs.served_once(holder, site):
        return  # its stand-in runs the hook at each later call of the module
    if nested.hook_in(hs, site):
        return  # it runs at the module's next call
    with calls_lock():
        unread.drop(holder, name, site)
        if not (site.once_hook is not None and hs.reads_once(holder)):
            nested.hooks_back(holder, hs, [site.hook_key])


def watch_backward() -> None:
    """Have every backward (``Tensor.backward``, ``torch.autograd.backward``/``grad``: torch's
    ``_engine_run_backward``) that frees the graphs it runs through (no ``retain_graph``) tell
    the call scopes this thread has open (:func:`_graphs_freed`). Nothing is added to a call; a
    backward outside any call checks one thread-local attribute. Installed by the first
    ``prepare``; where the function is not there (another torch), the values stay shared."""
    run = getattr(torch.autograd, "_engine_run_backward", None)
    if run is None or getattr(run, "_paramfold_watch", False):
        return

    @functools.wraps(run)
    def engine_run_backward(t_outputs, *args, **kwargs):
        try:
            return run(t_outputs, *args, **kwargs)
        finally:
            # (outputs, grad_tensors, keep_graph, create_graph, inputs, ...), as torch calls it;
            # not a compiler's own (aot_autograd tracing the joint graph of a frame in the call)
            if (leaves.local.claims and not (args[1] if len(args) > 1 else kwargs.get("keep_graph", True))
                    and not compiling()):
                _graphs_freed(leaves.local.claims)

    engine_run_backward._paramfold_watch = True  # type: ignore[attr-defined]
    # Both names, as torch's own patch of it (torch.compiler's make_fx tracing) sets and restores both.
    torch.autograd._engine_run_backward = engine_run_backward
    torch.autograd.graph._engine_run_backward = engine_run_backward


def _graphs_freed(claims: tuple) -> None:
    """After a backward inside the forward that may have freed the graph of a value the open scopes
    computed for the call (gradient accumulation over micro-batches in one forward, an inner
    gradient step): the value, which every read of the call shares, goes, and each read from now on
    computes it afresh, with a graph of its own, as stock's every read does (a hook-based norm: its
    hook is back, and runs at the module's later calls). A training stateful chain whose value is
    unread yet gets its state from before (:func:`unread.drop`); one read already computes afresh."""
    with calls_lock():
        for holder in leaves.claimed_holders(claims):
            values = holder.__dict__
            hs = values[STATE_ATTR]
            hooks = []
            for name, site in hs.sites.items():
                if site.before is not None:
                    unread.drop(holder, name, site)
                    continue
                value = values.get(name)
                if not isinstance(value, torch.Tensor) or value.grad_fn is None:
                    continue
                if site.hook is None:
                    if name in hs.installed:
                        del values[name]
                elif not (site.once_hook is not None and hs.reads_once(holder)):
                    hooks.append(site.hook_key)
            nested.hooks_back(holder, hs, hooks)


# paramfold's own work: dynamo runs it eagerly when it meets it as a frame (paramfold.frames).
run_module_eagerly_as_frames(globals())
