"""Calls nested in an open call scope, after the forward changed what the scope's values were computed from.

A scope (:mod:`paramfold.scope`) computes its hoisted and frozen values when the prepared model's
call begins. A forward may then change their inputs before it calls a submodule:

* swap them: ``torch.func.functional_call(self.inner, params, x)`` puts other tensors in the
  ``ParametrizationList``'s dicts for the call of ``self.inner``, then puts the originals back;
* change them in place: MoCo's momentum update, ``param_k.data = m * param_k.data + (1 - m) *
  param_q.data``, inside ``forward``, before ``self.key_encoder(x)``;
* or change what they are computed under: a ``torch.autocast`` region (Accelerate wraps
  ``forward`` in one; stock's reads inside it compute the chain's matmuls in lower precision), a
  ``torch.enable_grad()`` region in a ``no_grad`` call (stock's reads there record gradients), or
  the submodule's settings: ``self.D.eval()``, ``self.D.requires_grad_(False)`` around the call
  that scores a generator's output, a custom member's attribute set for one call;
* or register a forward pre-hook on the submodule, or a global one (from a forward hook of an
  earlier layer), which runs at the submodule's call after its check and may change them before
  its forward reads them, or a hook that stock's reads run (a global forward hook, one on a
  chain's own modules): :func:`computed_at_read` serves them as stock does from then on.

Every eager call of an entry reads its ``_compiled_call_impl`` (``scope_entry._get_compiled_call_impl``),
which checks the entry's :func:`check_of` columns: the tensors below it are the ones its values
were computed from (always), and, where the scope was opened eagerly, their version counters (an
inference tensor, which has none: :class:`Unversioned`) and storage addresses are those of when
it opened (:func:`snapshot`), as are, for the entry's own
values (read inside its calls), the originals' ``requires_grad``, the chain members' training
modes and the custom members' attributes; and that the grad mode and autocast state are those
the values were computed under (``local.context``). Where something differs, :func:`call_changed`
runs the call with those values computed afresh, as stock computes each read: a swapped value, or
one computed for another grad mode, autocast state or settings, is put back after (the originals
come back, the region ends), a value changed in place stays (it is the current one for the rest
of the call), and a stateful chain whose settings changed is computed at each read from then on.
The plain parameters ``detach_params_under_no_grad`` presents detached are checked alike: one
swapped, or any under a call made with grad on again, is taken out for the rest of the call
(:func:`undetach`), so the module reads the parameter itself, as stock does.

Not seen: reads that are not inside a nested module call (a forward reading ``self.k.weight``
after changing its originals; an assignment ``self.k.weight = w`` is seen where it is made, by the
prepared class's ``__setattr__``: ``scope_midcall.assigned``); in-place edits through ``.data`` (they bump no version counter); and
anything inside compiled code, where nested calls are traced, not called (README, Notes and
limits).
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Callable
from operator import getitem, is_
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from paramfold import changed_call_regions as changed_regions
from paramfold import hooknorms, unread
from paramfold.compute import (any_autocast, autocast_state, compute, computed_in_region, dispatch_modes, function_modes, mode_stack,
                               read_without_grad)
from paramfold.errors import FoldError
from paramfold.frames import run_module_eagerly_as_frames
from paramfold.held import held
from paramfold.freeze import chain_needs_grad
from paramfold.sites import probed
from paramfold.state import ONCE_ATTR, PLAIN_TENSOR_TYPES, STATE_ATTR, ModuleState, SiteState, for_one_call, tensor_label, version_of
from paramfold.state import tensor_data_ptr as _data_ptr
from paramfold.state import tensor_version as _version
from paramfold.watch import tag
from paramfold.write_marks import _storage_key, digest, mark, release

_grad_enabled = torch.is_grad_enabled

#: ``changed``'s verdict for a value that from now on is computed at every read, as stock's:
#: a stateful chain whose mode or settings changed inside the forward.
AT_READ = "at read"
#: :func:`changed`'s "put back" for a value the open ``parametrize.cached()`` block holds apart
#: from the module's: served the call, the module's own put back after it.
BLOCK = "block"


class _Local(threading.local):
    #: What the values below the entry whose scope this thread opened eagerly were computed
    #: from, taken when it opened (None otherwise): ``(values, {id: storage address}, {id:
    #: version tag})``, ``values`` holding each plain tensor's version counter (by ``id``; an
    #: inference tensor's :attr:`Unversioned.version`) and
    #: ``requires_grad`` (by :func:`_flag`), and each chain member's training mode (by ``id``; a
    #: hook-based norm: its module's), the addresses the plain tensors', the tags the custom
    #: members' ``__dict__``'s.
    snapshot: tuple[dict, dict, dict] | None = None
    #: ``(grad enabled, compute.autocast_state(), compute.mode_stack())`` the values of this
    #: thread's open scope were computed under (:func:`context`); None where no scope is open.
    context: tuple | None = None


local = _Local()


class Installs:
    """Counts changes of any site's ``read_from`` (under the scope lock): an entry's
    :func:`check_of` stays valid until the next one. Shared by all models, so one model's change
    only makes another's check be rebuilt, never trusted wrongly. ``partial``: a check was built
    while some value was out of its module's ``__dict__`` for the rest of a call; it must not
    serve a later call scope, which puts the value back (the next scope counts one more)."""

    count = 0
    partial = False


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
        site.read_for_one_call = any(map(for_one_call, read_from))
        Installs.count += 1


def let_go(site: SiteState) -> bool:
    """Forget what ``site`` recorded of tensors put in for the call that just ended (the caller
    holds the scope lock): stock keeps none of them once the call returns. The next call records
    what it reads; until then a nested call takes the site's inputs for swapped and computes its
    value afresh. True where its frozen value was computed from them, and is dropped too."""
    site.read_from = ()
    site.read_for_one_call = False
    Installs.count += 1
    frozen = site.frozen
    if frozen is None or not any(for_one_call(w[2]) for w in frozen.watch):
        return False
    release(frozen)
    site.frozen = None
    return True


def check_of(entry: nn.Module) -> tuple:
    """``(count, dicts, keys, tensors, sized dicts, sizes, swapped, plain tensors, their ids,
    objects, attributes, their snapshot keys, custom members' dicts, their ids, the same five for
    every site below, the forward hook dicts of their chains' modules)`` for the sites below
    ``entry`` whose values are in ``__dict__``:
    ``dicts[i][keys[i]] is tensors[i]`` and the dicts' sizes hold while nothing was swapped
    since the values were put there; ``getattr(
    objects[i], attributes[i])`` (the plain tensors' version counters; for ``entry``'s own
    sites, read only inside its calls, also their ``requires_grad`` and the chain members'
    training modes) is what the snapshot holds under ``keys[i]``."""
    state = entry.__dict__[STATE_ATTR]
    check = state.nested_check
    if check is not None and check[0] == Installs.count:
        return check
    dicts, keys, tensors, sized, swapped, missing, chain_hooks = [], [], [], [], [], [], []
    # Modules whose training mode counts, custom members' dicts, plain tensors whose
    # requires_grad counts: of entry's own sites, of every site below.
    own: tuple[list, list, list] = ([], [], [])
    below: tuple[list, list, list] = ([], [], [])
    one_call = False
    for holder, name, site in _valued(entry, missing):
        one_call = one_call or site.read_for_one_call
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
            for module in site.plist.modules():  # (and the hooks stock's reads run: scope._hooks_since)
                chain_hooks += (module._forward_pre_hooks, module._forward_hooks)
            members = site.plist._modules
            sized.append(members)
            dicts.extend(members for _ in members)
            keys.extend(members)
            tensors.extend(members.values())
        watched = (_moded(holder, site), _settings(site), [t for t in site.read_from if type(t) in PLAIN_TENSOR_TYPES])
        # Read inside a call of their module only: checked at its calls (the snapshot takes all).
        for into in (below, own) if holder is entry else (below,):
            for column, more in zip(into, watched):
                column.extend(more)
    plain = [t for t in tensors if type(t) in PLAIN_TENSOR_TYPES]
    ids = list(map(id, plain))
    for holder in state.holders:  # a detached plain parameter swapped (functional_call): see undetach
        for name, param in holder.__dict__[STATE_ATTR].detached:
            dicts.append(holder._parameters)
            keys.append(name)
            tensors.append(param)
    check = (Installs.count, dicts, keys, tensors, sized, list(map(len, sized)), swapped, plain, ids,
             *_watched(plain, *own), _watched(plain, *below), chain_hooks)
    # Not kept where it holds tensors put in for one call (let_go): it would keep them past it.
    state.nested_check = None if one_call else check
    if missing:
        Installs.partial = True
    return check


def _watched(plain: list, modes: list, settings: list, flagged: list) -> tuple:
    """``(objects, attributes, keys, dicts, their ids)``: see :func:`check_of`."""
    modes, settings = list(dict.fromkeys(modes)), list({id(d): d for d in settings}.values())
    flagged = list({id(t): t for t in flagged}.values())
    versioned = plain
    try:
        list(map(_version, plain))
    except RuntimeError:  # an inference tensor has no version counter: its Unversioned stands in
        versioned = [t if version_of(t) is not None else Unversioned(t) for t in plain]
    objects = [*versioned, *flagged, *modes]
    attributes = (["_version" if o is t else "version" for o, t in zip(versioned, plain)]
                  + ["requires_grad"] * len(flagged) + ["training"] * len(modes))
    return objects, attributes, [*map(id, plain), *map(_flag, flagged), *map(id, modes)], settings, list(map(id, settings))


def _moded(holder: nn.Module, site: SiteState) -> tuple[nn.Module, ...]:
    """The modules whose training mode ``site``'s value depends on: its chain's members (a
    hook-based norm's: its module)."""
    return site.chain if site.hook is None else (holder,)


def _settings(site: SiteState) -> list[dict]:
    """The ``__dict__`` of each custom member of ``site``'s chain (a temperature, a scale), and the
    dicts it holds (:mod:`paramfold.held`): torch's and torchao's parametrizations keep no setting a
    forward changes but ``training``."""
    return [d for m in site.chain if probed(m) for d in (vars(m), *held(m).dicts)] if site.hook is None else []


def _flag(t: torch.Tensor) -> int:
    """The snapshot's key of ``t.requires_grad`` (its version counter's is ``id(t)``)."""
    return ~id(t)


def snapshot(entry: nn.Module) -> tuple[dict, dict, dict] | None:
    """What the values below ``entry`` are computed from, now (:attr:`_Local.snapshot`)."""
    check = check_of(entry)
    objects, attributes, keys, settings, ids = check[14]  # every site's below, not only entry's own
    try:
        return (dict(zip(keys, map(getattr, objects, attributes))), dict(zip(check[8], map(_data_ptr, check[7]))),
                dict(zip(ids, map(tag, settings))))
    except RuntimeError:  # a tensor without storage: only swaps are seen
        return None


def context() -> tuple:
    """What a value computed now is computed under, besides its inputs (torch's numerics
    settings are not compared at nested calls: set one inside a forward and the values were
    computed under the call's)."""
    return _grad_enabled(), autocast_state(), mode_stack()


def same_context(then: tuple | None) -> bool:
    """Whether values computed under ``then`` (``local.context``) serve a call made now:
    :func:`context` equal, tested cheaply (autocast's details only where it is on)."""
    return then is None or (
        then[0] is _grad_enabled() and (then[1] is None) is not any_autocast()
        and (then[1] is None or autocast_state() == then[1])
        and (not function_modes() and not dispatch_modes() if then[2] is None else mode_stack() == then[2])
    )


def unchanged(check: tuple) -> bool:
    """Nothing below the entry of ``check`` changed: what ``scope_entry._get_compiled_call_impl``
    tests inline (without a frame of its own), for the other callers."""
    if not same_context(local.context):
        return False
    try:
        if check[6] or not all(map(is_, map(getitem, check[1], check[2]), check[3])):
            return False
        if list(map(len, check[4])) != check[5]:
            return False
        snap = local.snapshot
        if snap is not None:
            if list(map(snap[0].__getitem__, check[11])) != list(map(getattr, check[9], check[10])):
                return False
            if list(map(snap[1].__getitem__, check[8])) != list(map(_data_ptr, check[7])):
                return False
            if check[12] and list(map(snap[2].__getitem__, check[13])) != list(map(tag, check[12])):
                return False
    except (LookupError, RuntimeError):  # a key gone, a tensor the snapshot lacks
        return False
    return True


def undetach(entry: nn.Module) -> None:
    """Take out of ``__dict__``, for the rest of the call, each detached plain parameter below
    ``entry`` that no longer stands for stock's read: where grad mode is on now (a
    ``torch.enable_grad()`` region of a ``no_grad`` call: stock's read records gradients) or its
    parameter was swapped (``functional_call``). Reads then get the parameter in
    ``_parameters``, which under ``no_grad`` computes what its detached alias does. (The caller
    holds the scope lock.)"""
    grad = _grad_enabled()
    for holder in entry.__dict__[STATE_ATTR].holders:
        hs = holder.__dict__[STATE_ATTR]
        if not hs.detached:
            continue
        params = holder._parameters
        gone = {name for name, param in hs.detached if grad or params.get(name) is not param}
        if gone:
            settle_detached(hs, gone)
            for name in gone:
                holder.__dict__.pop(name, None)
            hs.detached = tuple(d for d in hs.detached if d[0] not in gone)
            Installs.count += 1


def settle_detached(hs: ModuleState, names=None) -> None:
    """Give each parameter presented detached in this call (``hs.aliases``, those of ``names``)
    what the call did to its alias and stock's call would have done to the parameter:
    ``alias.data = t`` or ``alias.set_(t)`` (a pre-hook masking or requantizing the weight under
    ``no_grad``) gave the alias other data or layout, which the parameter then takes
    (``param.data = alias``, as stock's ``.data`` write leaves it; values written in place are in
    their shared storage already). A parameter written itself meanwhile (through
    ``_parameters``, or another module sharing it) keeps its own write; an alias replaced in the
    module since (``module.weight = nn.Parameter(...)``) still gives its parameter what was done
    to it before."""
    aliases = hs.aliases
    for name in list(aliases) if names is None else [n for n in names if n in aliases]:
        param, alias, then = aliases.pop(name)
        now = layout_of(alias) if type(alias) is torch.Tensor else then
        if now is not None and now != then and layout_of(param) == then:
            param.data = alias


def layout_of(t: torch.Tensor) -> tuple | None:
    """What ``.data =``, ``set_`` or ``resize_`` change of a tensor: its storage, data address,
    shape, strides and dtype; None where it has no storage (a torch.func transform's wrapper)."""
    try:
        storage = _storage_key(t) if _storage_key is not None else t.untyped_storage()._cdata
        return storage, _data_ptr(t), t.shape, t.stride(), t.dtype
    except (RuntimeError, NotImplementedError):
        return None


def changed(entry: nn.Module) -> list[tuple[nn.Module, str, bool, tuple | None]]:
    """``(holder, name, put back, appended members)`` of every site below ``entry`` whose value
    differs from what stock would compute now: from other tensors (swapped: put back after the
    call), under another grad mode, autocast state, training mode, ``requires_grad`` or custom
    member's settings, or with another chain (put back too), or from the same ones changed in
    place. ``appended members`` (else None): the chain only grew, so the value is the one there
    with them applied. ``put back`` is :data:`AT_READ` for a value to be computed at each read
    from now on."""
    entry.__dict__[STATE_ATTR].nested_check = None
    snap = local.snapshot
    then, now_context = local.context, context()
    # Another autocast state, or another mode (a TorchDispatchMode entered inside the forward).
    autocast_moved = then is not None and (then[1] != now_context[1] or then[2] != now_context[2])
    grad_on = then is not None and now_context[0] and not then[0]
    found = []
    cache = parametrize._cache_enabled
    for holder, name, site in _valued(entry):
        if cache and in_block(holder, name, site):
            # Inside parametrize.cached(), a value an earlier read or call of the block cached:
            # stock's reads return it, whatever the forward swapped, edited or switched since
            # (served for this call where the module holds another: :func:`_commit`).
            if _block_differs(holder, name, site):
                found.append((holder, name, BLOCK, None))
            continue
        now = inputs(site)
        served = site.read_chain or site.modules
        chain = served if site.plist is None else tuple(site.plist._modules.values())
        swapped = not same(now, site.read_from)
        # A module's training mode, a custom member's attribute or an original's requires_grad
        # changed inside the forward (``D.eval()``, ``requires_grad_(False)`` around a call of
        # ``D``): stock's reads compute under the new ones.
        settings_moved = not swapped and snap is not None and not _same_settings_of(holder, site, snap)
        if (settings_moved and site.stateful and not _read_once(holder, site)
                and (site.stateful_in_eval or any(m.training for m in _moded(holder, site)))):
            # A value computed once would run its state updates once (or not at all) for reads
            # that each run them in stock: computed at each read from now on. (Still in eval,
            # where only a requires_grad flag or an attribute changed: computed again below,
            # which updates no state, as stock's reads do not.) (Read once: the
            # state as before the call's unread computation, then the same, in call_changed.)
            if site.hook is not None:
                raise FoldError(
                    f"{tensor_label(holder, name)}: a hook-based stateful norm "
                    "(torch.nn.utils.spectral_norm) whose module was switched to training, or "
                    "whose settings changed, inside the prepared model's forward; stock's hook "
                    "then runs its power iteration at each call of the module, which a value "
                    "computed at the call's start cannot. Switch modes around the model's call, "
                    "or prepare this module with mode='inline' (filter_fn)."
                )
            found.append((holder, name, AT_READ, None))
            continue
        region_moved = not swapped and (autocast_moved or (grad_on and chain_needs_grad(site)))
        context_moved = region_moved or settings_moved
        moved = not swapped and not context_moved and snap is not None and _moved(now, snap)
        if chain == served and not (swapped or context_moved or moved):
            if cache and holder is entry:
                _commit(holder, name, site)
            continue
        if region_moved and site.training_stateful:
            raise FoldError(
                f"{tensor_label(holder, name)}: a stateful parametrization (spectral_norm) in training "
                "is read under another grad mode, autocast state or torch mode than the prepared model's "
                "call (a torch.autocast, torch.enable_grad or mode region inside its forward); stock runs the "
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
    put_back, block_back = [], []
    # (Inside a non-reentrant checkpoint region, the reads in the call are told from those outside it.)
    marked = changed_regions.marking(entry, call)
    in_region, call = marked is not call, marked
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
    # which notes it for the recomputation (site_reads.read_outside_scope).
    try:
        with lock:
            for holder, name, swapped, appended in found:
                hs = holder.__dict__[STATE_ATTR]
                # Another thread's call shares the value: computed again only where both calls
                # may share it (under no_grad, one autocast state: ``hs.shareable``) and from the
                # same tensors changed in place (a writer thread's p.copy_()), which is what
                # every read of either computes from now on, as stock's do.
                if hs.users > 1 and (swapped is not False or hs.shareable is None):
                    raise busy(entry)
                site = hs.sites[name]
                if swapped is BLOCK:
                    # The block's value for this call; the module's own is back after it (what it
                    # was computed from is as it was).
                    block_back.append((holder, name, holder.__dict__[name]))
                    holder.__dict__[name] = parametrize._cache[(id(holder), name)]
                    continue
                if swapped is AT_READ:
                    _uncache(holder, name, site, holder.__dict__.pop(name, None))
                    hs.drop_kept(name)  # not to be served by the next call either without a check
                    continue
                read_once = _read_once(holder, site)  # training
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
                    put_back.append((holder, name, holder.__dict__.pop(name), site, site.read_from,
                                     site.read_chain, None, [], None))
                    continue
                if appended is not None:
                    value = holder.__dict__[name]
                    for member in appended:
                        value = member(value)
                elif site.hook is None:
                    # Under no_grad in a call whose value has a history (an edit, then a call, in
                    # a no_grad region of a grad-mode forward): kept for the call's later reads,
                    # it keeps one too (the same bits; read here, none).
                    keeps_history = _grad_enabled() or (
                        not site.stateful and holder.__dict__[name].requires_grad and chain_needs_grad(site))
                    with torch.set_grad_enabled(keeps_history):
                        value = compute(holder, name)
                else:
                    value = hooknorms.compute(holder, site.hook, site.hook_kind)
                # calls nested in this one compare with these: the flags of the tensors the value
                # was just computed from (swapped ones, where the forward swapped them)
                settings = _note_settings(holder, site, inputs(site))
                if parametrize._cache_enabled and holder is entry and site.hook is None and not in_block(holder, name, site):
                    # Inside parametrize.cached(), the module's call is the block's first read of
                    # the tensor: its value is the block's from now on, as stock's cache keeps it.
                    _commit(holder, name, site, value)
                elif swapped:
                    # read once: put back only where no read took it (a later read computes afresh)
                    put_back.append((holder, name, holder.__dict__[name], site, site.read_from,
                                     site.read_chain, value if read_once else None, settings, value))
                if not swapped and hs.drop_kept(name):
                    # A kept frozen value replaced for the rest of the call (its inputs changed in
                    # place): this one leaves when the call ends, as any value installed for it.
                    hs.installed = (*hs.installed, name)
                holder.__dict__[name] = value
                if in_region:
                    computed_in_region[value] = True
                site.read_from = inputs(site)  # calls nested in this one use the new value
                if site.plist is not None:
                    chain = tuple(site.plist._modules.values())
                    site.read_chain = () if chain == site.modules else chain
                refresh(site)
            Installs.count += 1
        return call(*args, **kwargs)
    finally:
        local.context = outer
        if put_back or block_back:
            with lock:
                for holder, name, value in block_back:
                    holder.__dict__[name] = value
                for holder, name, value, site, read_from, read_chain, not_read, settings, installed in reversed(put_back):
                    if in_block(holder, name, site):
                        continue  # made the block's value by a call nested in this one (_commit)
                    values = holder.__dict__
                    if (values[STATE_ATTR].users > 1 and installed is not None
                            and values.get(name, installed) is not installed):
                        # Another thread's call, sharing the values, renewed this one since ours
                        # computed it (a write between: scope._renew_shared): what every read
                        # computes from now on, where the one ours would put back is from before.
                        continue
                    if not_read is None or values.get(name) is not_read:
                        values[name] = value
                    site.read_from = read_from
                    site.read_chain = read_chain
                    refresh(site)
                    _put_settings(settings)
                Installs.count += 1


def commit(entry: nn.Module) -> bool:
    """Called inside ``parametrize.cached()`` only: a call of ``entry`` reads its tensors as they
    are (nothing changed since the values were computed), so each value it holds is the block's
    from now on, as stock's cache keeps the value of the block's first read. A later call of
    ``entry``, after the forward changed its settings or tensors, still reads that one
    (:func:`changed`). Whether a module below holds another value than the block's, which
    :func:`changed` then serves the call (a first read under ``no_grad``: :func:`_commit`)."""
    differs = False
    for holder, name, site in _valued(entry):
        if holder is entry:
            _commit(holder, name, site)
        if not differs and in_block(holder, name, site):
            differs = _block_differs(holder, name, site)
    return differs


def _read_once(holder: nn.Module, site: SiteState) -> bool:
    """Whether ``site``'s value is served through the read-once class now (a stateful chain
    training: ``classes.read_once_class``)."""
    return site.stateful and holder.__dict__[STATE_ATTR].reads_once(holder)


def _block_differs(holder: nn.Module, name: str, site: SiteState) -> bool:
    """Whether the open block's value of ``holder.<name>`` is not the one the module holds. A
    training stateful chain's (read once) is not served through the module: its first read takes
    the module's value, and its read-once descriptor returns the block's instead
    (``site_reads._ReadOnce``), once, where putting the module's back would serve it again."""
    if _read_once(holder, site):
        return False
    return parametrize._cache[(id(holder), name)] is not holder.__dict__[name]


def _commit(holder: nn.Module, name: str, site: SiteState, value: torch.Tensor | None = None) -> None:
    """Make ``holder.<name>``'s value (``value``, else the one there) the block's cached value.
    Made under ``no_grad`` in a call that records autograd, stock's read computes it without a
    history, and the block's later reads, under grad too, get that: the value detached (the same
    bits; the module's own, with its history, is read again after the block)."""
    if site.hook is not None or in_block(holder, name, site):  # hook-based norms compute at each call, cached() or not
        return
    if value is None:
        value = holder.__dict__[name]
    if value.requires_grad and not torch.is_grad_enabled():
        value = read_without_grad(value)
    parametrize._cache[(id(holder), name)] = value
    site.from_cache = True


def _uncache(holder: nn.Module, name: str, site: SiteState, value: object) -> None:
    """Inside ``parametrize.cached()``: where the scope put ``value``, computed when the call
    began, in the block's cache and no read took it yet (``site.from_cache``: one did, or an
    earlier call of the block), it leaves: the value is computed where it is read from now on,
    and stock's first read in the block computes the one every later read gets."""
    key = (id(holder), name)
    if (value is not None and parametrize._cache_enabled and not in_block(holder, name, site)
            and parametrize._cache.get(key) is value):
        del parametrize._cache[key]


def in_block(holder: nn.Module, name: str, site: SiteState) -> bool:
    """Whether ``holder.<name>``'s value is the open ``parametrize.cached()`` block's, put in its
    cache by a read or call of the block (``site.from_cache``). The flag alone outlives the block:
    a call of a later block, or one that opens a block inside its forward, finds it set by an
    earlier one, and torch's new block starts with an empty cache."""
    return site.from_cache and parametrize._cache_enabled and (id(holder), name) in parametrize._cache


def _valued(entry: nn.Module, missing: list | None = None):
    """The sites below ``entry`` whose values are in their modules' ``__dict__``; ``missing``
    gets those whose value is not there now but may be in a later call scope (a read-once value
    taken, a hook-based norm's value served, one :func:`call_changed` set aside): a check built
    without them must not serve that scope (``Installs.partial``)."""
    for holder in entry.__dict__[STATE_ATTR].holders:
        values = holder.__dict__
        hs = values[STATE_ATTR]
        for name, site in hs.sites.items():
            # inline computes where it reads, and so does a site the scope left to be computed
            # where read (below a forward pre-hook: a hook-based norm's hook then stays in and
            # puts stock's own value in __dict__), and a hook-based spectral_norm training whose
            # value served the module's first call (its later calls run the hook), and a hook-based
            # norm whose hook the call put back in (scope_midcall: its module's later calls run it)
            served = hs.served_once(holder, site) or hook_in(hs, site)
            if site.mode != "inline" and not site.at_read and not served:
                if name in values:
                    yield holder, name, site
                elif missing is not None:
                    missing.append(site)
            elif (site.raised or served) and missing is not None:  # valued again from the next call (scope._install)
                missing.append(site)


def hook_in(hs: ModuleState, site: SiteState) -> bool:
    """Whether ``site`` is a hook-based norm's whose hook is in its module's pre-hooks, not taken
    out by the open scope (never taken out, or put back for the rest of the call): the module's
    calls run it, and it sets the value, as stock's does."""
    if site.hook is None:
        return False
    for key, _ in hs.hooks_out[0] if hs.hooks_out else ():
        if key == site.hook_key:
            return False
    return True


def hooks_back(holder: nn.Module, hs: ModuleState, keys: list[int]) -> None:
    """Put the hook-based norms' hooks at ``keys`` that the open scope took out back in their
    places, for the rest of the call: they run at the module's later calls, as stock's do."""
    if keys and hs.hooks_out:
        taken, order, prepended = hs.hooks_out
        hooknorms.attach(holder, [(k, h) for k, h in taken if k in keys], order, prepended)
        rest = [(k, h) for k, h in taken if k not in keys]
        hs.hooks_out = (rest, order, prepended) if rest else ()


def computed_at_read(entry: nn.Module, busy: Callable[[nn.Module], Exception]) -> bool:
    """Serve every value below ``entry`` as stock does for the rest of the call: a forward
    pre-hook registered during the call, on ``entry`` or a global one, runs at ``entry``'s call
    after its nested check and before its forward reads the tensors, and may change their
    originals; a global forward hook, or one on a chain's own modules, runs at each call of
    them, so at each of stock's reads (``scope._hooks_since``). As where it was there when the
    call began (``scope._below_pre_hooks``): each read computes afresh, a hook-based norm's hook is back in
    its place among the pre-hooks (a training spectral_norm's stand-in out), and a training
    stateful chain's value no read took yet gives its state back (:func:`unread.drop`), so the
    reads (the module's calls) advance it from there, in stock's order. ``busy(entry)`` is raised
    where another thread's call shares a value; returns whether any value was served otherwise.
    The caller holds the scope lock."""
    found = False
    for holder in entry.__dict__[STATE_ATTR].holders:
        values = holder.__dict__
        hs = values[STATE_ATTR]
        served = [(name, site) for name, site in hs.sites.items()
                  if site.mode != "inline" and not site.at_read and not hook_in(hs, site)]
        if served and hs.users > 1:
            raise busy(entry)
        found = found or bool(served)
        hooks = []
        for name, site in served:
            value = values.get(name)
            unread.drop(holder, name, site)
            if site.hook is None:
                site.at_read = True
                _uncache(holder, name, site, value)
                if values.pop(name, None) is not None:
                    hs.drop_kept(name)
                continue
            hooks.append(site.hook_key)
            once = site.once_hook
            if once is not None and once in values.get(ONCE_ATTR, ()):
                values[ONCE_ATTR] = tuple(o for o in values[ONCE_ATTR] if o is not once)
        hooks_back(holder, hs, hooks)
    if found:
        Installs.count += 1
        # A check built from now on leaves out the sites given up here, which the next call's
        # scope serves again: none of this call's checks may serve that one.
        Installs.partial = True
    return found


def _same_settings_of(holder: nn.Module, site: SiteState, snap: tuple) -> bool:
    """Whether ``site``'s originals' ``requires_grad``, its modules' training modes and its custom
    members' attributes are as ``snap`` holds them (:attr:`_Local.snapshot`)."""
    try:
        return (all(snap[0][_flag(t)] is t.requires_grad for t in site.read_from if type(t) in PLAIN_TENSOR_TYPES)
                and all(snap[0][id(m)] is m.training for m in _moded(holder, site))
                and all(snap[2][id(d)] == tag(d) for d in _settings(site)))
    except LookupError:
        return False


def _note_settings(holder: nn.Module, site: SiteState, read_from: tuple) -> list[tuple[dict, int, object]]:
    """Take ``site``'s settings as they are now into the snapshot (its value was just computed
    under them, from ``read_from``); return what was there, for :func:`_put_settings` to put back."""
    snap = local.snapshot
    if snap is None:
        return []
    entries = [(snap[0], _flag(t), t.requires_grad) for t in read_from if type(t) in PLAIN_TENSOR_TYPES]
    entries += [(snap[0], id(m), m.training) for m in _moded(holder, site)]
    entries += [(snap[2], id(d), tag(d)) for d in _settings(site)]
    then = [(d, key, d.get(key)) for d, key, _ in entries]
    for d, key, now in entries:
        d[key] = now
    return then


def _put_settings(then: list[tuple[dict, int, object]]) -> None:
    for d, key, value in then:
        if value is None:  # not in the snapshot before
            d.pop(key, None)
        else:
            d[key] = value


class Unversioned:
    """Stands in for an inference tensor's version counter (made inside
    ``torch.inference_mode()``, it has none, and a write to it there moves nothing) in the
    checks and the snapshot: :attr:`version` changes where the tensor may have been written. It
    is what freeze watches such an input by between calls: its write mark, where it has one
    (armed by a frozen value: any write through torch, ``.data`` included, clears it), read
    for free; else a hash of its bytes on the host, read at each check (the nested calls' cost
    grows with the bytes of such inputs, not with their computation); else (device memory,
    never marked, or bytes not contiguous) a fresh object at each read: the value is computed
    again at every nested call, as stock's read computes it."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    @property
    def version(self) -> object:
        t = self.tensor
        count = mark(t)
        if count is not None:  # armed afresh since is a change too
            return count
        if t.device.type == "cpu" and t.layout is torch.strided and t.is_contiguous():
            # Its bytes in place (a plain tensor: PLAIN_TENSOR_TYPES), at its address now.
            return ~digest((ctypes.c_char * t.nbytes).from_address(_data_ptr(t)))
        return object()


def _version_of(t: torch.Tensor) -> object:
    """What the snapshot holds for ``t``'s version counter (:func:`_watched`)."""
    version = version_of(t)
    return version if version is not None else Unversioned(t).version


def _moved(tensors: tuple, snap: tuple) -> bool:
    versions, addresses = snap[0], snap[1]
    for t in tensors:
        if type(t) not in PLAIN_TENSOR_TYPES:
            continue
        try:
            if versions[id(t)] != _version_of(t) or addresses[id(t)] != _data_ptr(t):
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
                snap[0][id(t)], snap[1][id(t)] = _version_of(t), _data_ptr(t)
            except RuntimeError:
                pass


# paramfold's own work: dynamo runs it eagerly when it meets it as a frame (paramfold.frames).
run_module_eagerly_as_frames(globals())
