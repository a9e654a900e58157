"""Calls nested in an open call scope, after the forward changed what the scope's values were computed from.

A scope (:mod:`paramfold.scope`) computes its hoisted and frozen values when the prepared model's
call begins. A forward may then change their inputs before it calls a submodule:

* swap them: ``torch.func.functional_call(self.inner, params, x)`` puts other tensors in the
  ``ParametrizationList``'s dicts for the call of ``self.inner``, then puts the originals back;
* change them in place: MoCo's momentum update, ``param_k.data = m * param_k.data + (1 - m) *
  param_q.data``, inside ``forward``, before ``self.key_encoder(x)``;
* or change what they are computed under: a ``torch.autocast`` region (Accelerate wraps
  ``forward`` in one; stock's reads inside it compute the chain's matmuls in lower precision), or
  a ``torch.enable_grad()`` region in a ``no_grad`` call (stock's reads there record gradients).

Every eager call of an entry reads its ``_compiled_call_impl`` (``scope._get_compiled_call_impl``),
which checks the entry's :func:`check_of` columns: the tensors below it are the ones its values
were computed from (always), and, where the scope was opened eagerly, their version counters and
storage addresses are those of when it opened (:func:`snapshot`); and that the grad mode and
autocast state are those the values were computed under (``local.context``). Where something
differs, :func:`call_changed` runs the call with those values computed afresh, as stock computes
each read: a swapped value, or one computed for another grad mode or autocast state, is put back
after (the originals come back, the region ends), a value changed in place stays (it is the
current one for the rest of the call).

Not seen: reads that are not inside a nested module call (a forward reading ``self.k.weight``
after changing it); in-place edits through ``.data`` (they bump no version counter); and
anything inside compiled code, where nested calls are traced, not called (README, Notes and
limits).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from operator import getitem, is_
from typing import Any

import torch
from torch import nn

from paramfold import hooknorms, unread
from paramfold.compute import any_autocast, autocast_state, checkpoint_frame, compute
from paramfold.errors import FoldError
from paramfold.frames import run_module_eagerly_as_frames
from paramfold.freeze import chain_needs_grad
from paramfold.state import PLAIN_TENSOR_TYPES, STATE_ATTR, SiteState
from paramfold.state import tensor_data_ptr as _data_ptr
from paramfold.state import tensor_version as _version

_grad_enabled = torch.is_grad_enabled



class _Local(threading.local):
    #: ``({id: version}, {id: storage address})`` of the plain tensors below the entry whose
    #: scope this thread opened eagerly, taken when it opened; None otherwise.
    snapshot: tuple[dict, dict] | None = None
    #: ``(grad enabled, compute.autocast_state())`` the values of this thread's open scope were
    #: computed under (:func:`context`); None where no scope is open.
    context: tuple | None = None


local = _Local()


class Installs:
    """Counts changes of any site's ``read_from`` (under the scope lock): an entry's
    :func:`check_of` stays valid until the next one. Shared by all models, so one model's change
    only makes another's check be rebuilt, never trusted wrongly."""

    count = 0


def inputs(site: SiteState) -> tuple:
    return tuple(itertools.chain.from_iterable(map(dict.values, site.tensor_dicts)))


def same(now: tuple, then: tuple) -> bool:
    return len(now) == len(then) and all(map(is_, now, then))


def record(site: SiteState) -> None:
    """Note what a value just put in ``__dict__`` by the scope was computed from."""
    read_from = inputs(site)
    if not same(read_from, site.read_from) or site.read_chain:
        site.read_from = read_from
        site.read_chain = ()
        Installs.count += 1


def check_of(entry: nn.Module) -> tuple:
    """``(count, dicts, keys, tensors, sized dicts, sizes, swapped, plain tensors, their ids)``
    for the sites below ``entry`` whose values are in ``__dict__``: ``dicts[i][keys[i]] is
    tensors[i]`` and the dicts' sizes hold while nothing was swapped since the values were put
    there."""
    state = entry.__dict__[STATE_ATTR]
    check = state.nested_check
    if check is not None and check[0] == Installs.count:
        return check
    dicts, keys, tensors, sized, swapped = [], [], [], [], []
    for holder, name, site in _valued(entry):
        if not same(inputs(site), site.read_from) or (
                site.plist is not None and tuple(site.plist._modules.values()) != (site.read_chain or site.modules)):
            swapped.append((holder, name))
            continue
        for d in site.tensor_dicts:
            sized.append(d)
            for key in d:
                dicts.append(d)
                keys.append(key)
        tensors.extend(site.read_from)
        if site.plist is not None:  # its chain: a member appended, removed or replaced for a call
            members = site.plist._modules
            sized.append(members)
            dicts.extend(members for _ in members)
            keys.extend(members)
            tensors.extend(members.values())
    plain = [t for t in tensors if type(t) in PLAIN_TENSOR_TYPES]
    check = (Installs.count, dicts, keys, tensors, sized, list(map(len, sized)), swapped, plain, list(map(id, plain)))
    state.nested_check = check
    return check


def snapshot(entry: nn.Module) -> tuple[dict, dict] | None:
    """Version counters and storage addresses of the plain tensors below ``entry``, now."""
    check = check_of(entry)
    plain, ids = check[7], check[8]
    try:
        return dict(zip(ids, map(_version, plain))), dict(zip(ids, map(_data_ptr, plain)))
    except RuntimeError:  # a tensor without storage: only swaps are seen
        return None


def context() -> tuple:
    """What a value computed now is computed under, besides its inputs."""
    return _grad_enabled(), autocast_state()


def same_context(then: tuple | None) -> bool:
    """Whether values computed under ``then`` (``local.context``) serve a call made now:
    :func:`context` equal, tested cheaply (autocast's details only where it is on)."""
    return then is None or (
        then[0] is _grad_enabled() and (then[1] is None) is not any_autocast()
        and (then[1] is None or autocast_state() == then[1])
    )


def unchanged(check: tuple) -> bool:
    """Nothing below the entry of ``check`` changed: what ``scope._get_compiled_call_impl``
    tests inline (without a frame of its own), for the other callers."""
    if not same_context(local.context):
        return False
    try:
        if check[6] or not all(map(is_, map(getitem, check[1], check[2]), check[3])):
            return False
        if list(map(len, check[4])) != check[5]:
            return False
        snap = local.snapshot
        if snap is not None and check[7]:
            plain, ids = check[7], check[8]
            if list(map(snap[0].__getitem__, ids)) != list(map(_version, plain)):
                return False
            if list(map(snap[1].__getitem__, ids)) != list(map(_data_ptr, plain)):
                return False
    except (LookupError, RuntimeError):  # a key gone, a tensor the snapshot lacks
        return False
    return True


def changed(entry: nn.Module) -> list[tuple[nn.Module, str, bool, tuple | None]]:
    """``(holder, name, put back, appended members)`` of every site below ``entry`` whose value
    differs from what stock would compute now: from other tensors (swapped: put back after the
    call), under another grad mode or autocast state or with another chain (put back too), or from
    the same ones changed in place. ``appended members`` (else None): the chain only grew, so the
    value is the one there with them applied."""
    entry.__dict__[STATE_ATTR].nested_check = None
    snap = local.snapshot
    then, now_context = local.context, context()
    autocast_moved = then is not None and then[1] != now_context[1]
    grad_on = then is not None and now_context[0] and not then[0]
    found = []
    for holder, name, site in _valued(entry):
        now = inputs(site)
        served = site.read_chain or site.modules
        chain = served if site.plist is None else tuple(site.plist._modules.values())
        swapped = not same(now, site.read_from)
        context_moved = not swapped and (autocast_moved or (grad_on and chain_needs_grad(site)))
        moved = not swapped and not context_moved and snap is not None and _moved(now, snap)
        if chain == served and not (swapped or context_moved or moved):
            continue
        if context_moved and site.training_stateful:
            raise FoldError(
                f"{type(holder).__name__}.{name}: a stateful parametrization (spectral_norm) in training "
                "is read under another grad mode or autocast state than the prepared model's call "
                "(a torch.autocast or torch.enable_grad region inside its forward); stock runs the "
                "power iteration at that read, a value computed at the call's start already ran it. "
                "Enter the region around the model's call, or prepare this module with mode='inline' "
                "(filter_fn)."
            )
        if not (swapped or context_moved or moved) and chain[:len(served)] == served:
            # Only members appended (PEFT's ParamWrapper, for this call): applied to the value
            # there, which is what stock's read computes first.
            found.append((holder, name, True, chain[len(served):]))
        else:
            # Computed again from the chain and tensors there now. A change in place stays after
            # the call, so its value does too; calls nested later compare with what it came from.
            found.append((holder, name, not moved, None))
    return found


def call_changed(
    entry: nn.Module,
    found: list[tuple[nn.Module, str, bool, tuple | None]],
    lock: Any,
    busy: Callable[[nn.Module], Exception],
    call: Callable,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """``call`` with the values of ``found`` computed from the tensors there now, under the grad
    mode and autocast state now (calls nested in it compare with those); the ones found to be put
    back are put back after. ``busy(entry)`` is raised where another thread shares a value."""
    put_back = []
    outer = local.context
    if outer is not None:
        local.context = context()
    if not found:  # the state changed and nothing needs computing again
        try:
            return call(*args, **kwargs)
        finally:
            local.context = outer
    # Inside a non-reentrant torch.utils.checkpoint region, a value computed once here would be
    # computed with autograd inside the region and served to every read of the call, which the
    # region's recomputation (no scope open, or one opened inside the region) cannot tell apart
    # from reads served a value computed before the region. There the value to be put back is
    # taken out for the call instead: each read computes it like stock, through the descriptor,
    # which notes it for the recomputation (classes.read_outside_scope).
    in_region = checkpoint_frame() is not None
    try:
        with lock:
            for holder, name, swapped, appended in found:
                hs = holder.__dict__[STATE_ATTR]
                if hs.users > 1:
                    raise busy(entry)
                site = hs.sites[name]
                read_once = site.stateful and type(holder) is hs.read_once_class  # training
                if read_once and site.hook is not None:
                    # The module's calls from now on run its hook, as stock's every call does,
                    # from the state before the call's unread computation (paramfold.unread).
                    if not site.once_hook.served:
                        unread.put_back(site)
                    site.once_hook.served = True
                    continue
                if read_once and appended is None:
                    # The reads from now on compute it afresh, from the tensors there at each, as
                    # stock's do; nothing to put back but the state, where no read took the value.
                    if holder.__dict__.pop(name, None) is not None:
                        unread.put_back(site)
                    continue
                if in_region and swapped and site.hook is None:
                    put_back.append((holder.__dict__, name, holder.__dict__.pop(name), site, site.read_from,
                                     site.read_chain, None))
                    continue
                if appended is not None:
                    value = holder.__dict__[name]
                    for member in appended:
                        value = member(value)
                elif site.hook is None:
                    value = compute(holder, name)
                else:
                    value = hooknorms.compute(holder, site.hook, site.hook_kind)
                if swapped:
                    # read once: put back only where no read took it (a later read computes afresh)
                    put_back.append((holder.__dict__, name, holder.__dict__[name], site, site.read_from,
                                     site.read_chain, value if read_once else None))
                holder.__dict__[name] = value
                site.read_from = inputs(site)  # calls nested in this one use the new value
                if site.plist is not None:
                    chain = tuple(site.plist._modules.values())
                    site.read_chain = () if chain == site.modules else chain
                refresh(site)
            Installs.count += 1
        return call(*args, **kwargs)
    finally:
        local.context = outer
        if put_back:
            with lock:
                for values, name, value, site, read_from, read_chain, not_read in reversed(put_back):
                    if not_read is None or values.get(name) is not_read:
                        values[name] = value
                    site.read_from = read_from
                    site.read_chain = read_chain
                    refresh(site)
                Installs.count += 1


def _valued(entry: nn.Module):
    for holder in entry.__dict__[STATE_ATTR].holders:
        values = holder.__dict__
        hs = values[STATE_ATTR]
        for name, site in hs.sites.items():
            # inline computes where it reads, and so does a site the scope left to be computed
            # where read (below a forward pre-hook: a hook-based norm's hook then stays in and
            # puts stock's own value in __dict__), and a hook-based spectral_norm training whose
            # value served the module's first call (its later calls run the hook)
            if site.mode != "inline" and not site.at_read and name in values and not (
                    site.once_hook is not None and site.once_hook.served and type(holder) is hs.read_once_class):
                yield holder, name, site


def _moved(tensors: tuple, snap: tuple[dict, dict]) -> bool:
    versions, addresses = snap
    for t in tensors:
        if type(t) not in PLAIN_TENSOR_TYPES:
            continue
        try:
            if versions[id(t)] != _version(t) or addresses[id(t)] != _data_ptr(t):
                return True
        except (LookupError, RuntimeError):
            return True
    return False


def refresh(site: SiteState) -> None:
    """The snapshot takes this site's tensors as they are now (its value was just computed from
    them; a stateful chain's own buffer updates must not count as a change)."""
    snap = local.snapshot
    if snap is None:
        return
    for t in site.read_from:
        if type(t) in PLAIN_TENSOR_TYPES:
            try:
                snap[0][id(t)], snap[1][id(t)] = _version(t), _data_ptr(t)
            except RuntimeError:
                pass


# paramfold's own work: dynamo runs it eagerly when it meets it as a frame (paramfold.frames).
run_module_eagerly_as_frames(globals())
