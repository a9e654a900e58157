"""Call scopes: where hoisted and frozen values are computed, outside any compiled code.

A prepared model has *entry* modules: the root passed to :func:`paramfold.prepare` and every
module above a prepared site. Calling an entry eagerly opens a scope: each hoist or freeze site
below it gets its value written into its module's instance ``__dict__`` (where it shadows the
class-level :class:`~paramfold.site_reads.SiteDescriptor`), then the call runs, then the values are
removed again. Compiled code inside the scope therefore reads plain tensors, exactly like an
unparametrized model; outside a scope every read falls back to the descriptor, which computes
the value like stock PyTorch, so a value is never stale whatever way a module is called.

How each entry point's call reaches a scope (the root's ``__call__``, the ``_compiled_call_impl``
every entry class carries), and how a call nested in an open scope is checked, is
:mod:`paramfold.scope_entry`'s: it imports this module, which opens and closes the scopes.

Threads: which entries a scope covers is thread-local; the values themselves live in the modules'
``__dict__``, which every thread sees. So a scope *claims* each holder under one lock: the first
claim installs values, later claims by other threads share them only when both calls run under
``no_grad`` and the same autocast state with no stateful chain training (the values are then the
same either way), and any other overlap — a training call beside another call — is refused with a
:class:`FoldError` instead of letting one thread's values (and autograd graph) leak into the
other's call. A module below an entry called directly from another thread meanwhile claims them the
same way (its ``_compiled_call_impl``); a direct read of a value cannot be seen. In one thread, a
scope opened inside another (model A's forward calls model B) keeps the enclosing scopes' state: a
call of one of A's entries inside it (B's forward calls A) is no other claim but a call nested in
A's scope (:func:`paramfold.scope_entry._reentered`). In a child process made by ``os.fork()`` only
the forking thread's scopes stay open (:func:`_after_fork_in_child`). ``restore`` and ``prepare``
switch a model under the same lock, so a scope opens on the model wholly prepared; a call that
finds it restored meanwhile runs as the restored model's
(:func:`paramfold.scope_entry._as_restored`).
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
import types
import weakref
from collections import Counter
from operator import attrgetter, getitem, is_

import torch
from torch.utils.hooks import RemovableHandle as _Handle
from torch import nn
from torch.nn.utils import parametrize

from paramfold import compile_leaves as leaves
from paramfold import compiled_entry_regions as entry_regions
from paramfold import compile_regions
from paramfold import compile_reads as reads
from paramfold import hooknorms, site_values, unread
from paramfold import scope_nested as nested
from paramfold.compute import any_autocast as _any_autocast
from paramfold.compute import (autocast_state, computed_under, edits_in_place, mode_stack, modes_now,
                               wraps_its_forward)
from paramfold.compute import dispatch_modes as _dispatch_modes
from paramfold.compute import function_modes as _function_modes
from paramfold.errors import FoldError
from paramfold.frames import run_module_eagerly_as_frames
from paramfold.freeze import can_freeze, unchanged
from paramfold.inline import hook_keys, still_exact, sync_refs
from paramfold.rebase import rebased
from paramfold.scope_plan import Plan, holds, sites_as_built
from paramfold.state import (CALLS, MISSING, ONCE_ATTR, STATE_ATTR, ModuleState, SiteState, carries_tangents, distributed,
                             kept_values, syncs_before_forward)
from paramfold.state import functorch_wrapped as _functorch_wrapped

compile_regions.install()  # a nested compile region is reused for a prepared module of the same class only
reads.install()  # a compile that takes a prepared module into a trace waits for other threads' calls of it

_global_forward_pre_hooks = torch.nn.modules.module._global_forward_pre_hooks
_global_forward_hooks = torch.nn.modules.module._global_forward_hooks
_tracing_state = torch._C._get_tracing_state
_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks
# Raised by a non-reentrant torch.utils.checkpoint recomputation at the last tensor its forward
# saved (paramfold.unread.checkpointed).
_STOP_RECOMPUTATION = getattr(torch.utils.checkpoint, "_StopRecomputationError", ())
#: Exceptions a value's computation raises that are not the chain's own error (which the call
#: meets where it reads the value): a refusal, and checkpoint's early stop of its recomputation.
_NOT_THE_CHAINS = (FoldError, *([_STOP_RECOMPUTATION] if _STOP_RECOMPUTATION else []))
_LOCK = threading.RLock()
#: Every entry that opened a scope the general way (by id; every plan is built there): where a
#: child process made by ``os.fork()`` looks for the holders that calls of other threads claimed.
_OPENED: weakref.WeakValueDictionary[int, nn.Module] = weakref.WeakValueDictionary()
_MISSING = MISSING
_COMPILE_STARTS = leaves.START_CALLBACKS
_MARKED, _BARE = reads.MARKED, reads.BARE


class _Local(threading.local):
    covered: frozenset[int] = frozenset()
    #: The entry whose scope was opened last, until its own call reaches ``_compiled_call_impl``.
    opened: nn.Module | None = None
    #: The scopes this thread has open around the current one (another prepared model's: model
    #: A's forward calls model B), innermost first: ``(covered, context, snapshot, enclosing,
    #: hooks_from)`` of each, for a call of one of their entries made inside
    #: (:func:`paramfold.scope_entry._reentered`).
    enclosing: tuple | None = None
    #: torch's next hook handle number when the innermost scope opened: a hook with a key from it
    #: on was registered during the call (:func:`_hooks_since`).
    hooks_from: int = 0
    #: ``(frame of nn.Module._wrapped_call_impl, module, answer)``: what ``_compiled_call_impl``
    #: answered that frame's first read with, for its second (see
    #: :func:`paramfold.scope_entry._answered`).
    answered: tuple | None = None
    #: The modules whose call :func:`paramfold.scope_entry._as_restored` is handing to their class's
    #: ``__call__``, by id, each with that frame of ``_as_restored``.
    handing: dict[int, types.FrameType] = {}
    #: While an entry's scope opens in a checkpointed region's recomputation to replay a call its
    #: forward served (:mod:`paramfold.compiled_entry_regions`): what that call was served.
    replay: dict[tuple[int, str], tuple[bool, bool]] | None = None


_local = _Local()


def _open(entry: nn.Module) -> tuple[tuple, list[nn.Module] | Plan] | None:
    """Open a call scope of ``entry``: what :func:`_close` takes, or None where ``entry`` was
    restored since its call found it prepared (restore holds the lock throughout, so a call waits
    for one under way in another thread and sees the whole model prepared or restored), or a
    falsy :class:`~paramfold.compile_reads.Bare` where another thread compiles code that read its
    modules with no scope of theirs open, or a call of another thread runs with no scope on them
    (:mod:`paramfold.compile_reads`): the call then runs with no scope, each value computed where
    it is read, as stock's, and ends it."""
    grad = torch.is_grad_enabled()
    # What the values are computed under: scope_nested.context(), written out (no Python frame
    # per call while autocast is off).
    context = (grad, autocast_state() if _any_autocast() else None,
               mode_stack() if _function_modes() or _dispatch_modes() else None)
    if _BARE[0] and (state := entry.__dict__.get(STATE_ATTR)) is not None:
        reads.wait_for_bare(state.holders)  # (outside the lock)
    with _LOCK:
        state = entry.__dict__.get(STATE_ATTR)
        if state is None:
            return None
        if (_MARKED or _BARE[0]) and reads.unscoped(state.holders):
            return reads.Bare(state.holders)
        CALLS[0] += 1
        if nested.Installs.partial:  # a nested check built without a value this call puts back
            nested.Installs.count += 1
            nested.Installs.partial = False
        plan = state.plan
        if plan is None or plan.grad is not grad:  # written out: no frame on the steady path
            plan = _plan_of(state, grad)
        usable = (plan is not None and not parametrize._cache_enabled and _tracing_state() is None
                  and _local.replay is None)
        if usable and not holds(plan):
            plan, usable = _after_miss(state, grad, plan)
        if usable:
            try:
                plan.claim()
            except _NOT_THE_CHAINS:
                _release(plan.claimed)
                raise
            except Exception:
                # A chain raised: its state and the values computed before it as they were, and
                # the general path serves the call, that chain computed where it is read.
                _release(plan.claimed)
                claimed = _open_general(entry, state, grad, plan)
            except BaseException:
                _release(plan.claimed)
                raise
            else:
                claimed = plan
        else:
            claimed = _open_general(entry, state, grad, plan)
    # The entry's own call comes next, through the class's __call__ it had before the scope
    # switched it to its read-once class: its forward runs the stand-ins (classes._served_once_call).
    for once in entry.__dict__.get(ONCE_ATTR, ()):
        once.called = True
    claims = leaves.local.claims
    previous = (_local.covered, nested.local.context, claims, _local.enclosing, _local.hooks_from)
    if previous[0]:  # opened inside another scope of this thread
        _local.enclosing = (previous[0], previous[1], nested.local.snapshot, previous[3], previous[4])
    _local.covered = state.covers
    _local.hooks_from = _Handle.next_id
    _local.opened = entry
    nested.local.context = context
    leaves.local.claims = (claimed, claims)
    if leaves.on_compile_start not in _COMPILE_STARTS:
        leaves.ensure_registered()
    return previous, claimed


def _open_general(entry: nn.Module, state: ModuleState, grad: bool, plan: Plan | None) -> list[nn.Module]:
    """Claim the holders below ``entry`` the general way (no steady plan held, or its
    computation raised), and plan the next call; ``plan``: the plan of this grad mode, or None."""
    _OPENED[id(entry)] = entry
    hooked, pre_hooks, reached_from, parametrized = _below_pre_hooks(entry)
    if _left(state, reached_from):
        _forget_left(state, reached_from)
    shared = parametrized == state.parametrized or _share_with_late(entry, state, parametrized)
    claimed, raised = _open_holders(entry, state, grad, hooked)
    if raised:
        _drop_plans(state)
    elif shared and _local.replay is None:
        try:
            _replan(state, grad, pre_hooks, plan, reached_from)
        except BaseException:  # (a KeyboardInterrupt too) the holders are not left claimed for good
            _release(claimed)
            raise
    return claimed


def _drop_plans(state: ModuleState) -> None:
    """After a site's computation raised at a call's start (computed where read in that call
    instead: ``at_read``, which the scope's nested checks and a checkpoint's recomputation read):
    the plans and nested checks of every entry of the model, built while it was served as usual,
    are built again by their next calls, which serve it as usual where it no longer raises."""
    root = state.prepared_model()
    root_state = root.__dict__.get(STATE_ATTR) if root is not None else None
    if root_state is not None:
        _drop_caches_below(root_state)
    _drop_caches_below(state)


def _drop_caches_below(state: ModuleState) -> None:
    """Forget the plans and nested checks of every entry of ``state``'s (itself included)."""
    for below in state.entries:
        bs = below.__dict__.get(STATE_ATTR)
        if bs is not None:
            bs.drop_caches()


#: The most calls opened the general way between two plans that were never used (``_replan``).
_LONGEST_WAIT = 64


#: The most plans an entry keeps besides its current one (``ModuleState.spare_plans``).
_SPARES = 3


def _plan_of(state: ModuleState, grad: bool) -> Plan | None:
    """The entry's last plan of this grad mode, made ``state.plan`` (the one it replaces is kept
    in ``state.spare_plans``: calls alternating grad modes are each served by their own), or None."""
    if state.plan is not None and state.plan.grad is grad:
        return state.plan
    for spare in state.spare_plans:
        if spare.grad is grad:
            _make_current(state, spare)
            return spare
    return None


def _after_miss(state: ModuleState, grad: bool, failed: Plan) -> tuple[Plan | None, bool]:
    """After ``failed``, the current plan of this grad mode, did not hold: ``(plan, True)`` for a
    spare plan of this grad mode, made under what a value computed now is computed under
    (autocast, numerics, modes), that holds, now current: calls switching autocast, or the
    ``requires_grad`` that decides auto's choice (pix2pix's ``set_requires_grad``), each served
    by their own plan. Spares tried that do not hold are dropped. Else ``(last, False)``:
    ``last`` the plan of this state that did not hold, for :func:`_replan` to replace, or None
    where ``failed`` is another state's (kept as a spare)."""
    under = computed_under()
    for spare in [p for p in state.spare_plans if p.grad is grad and p.under == under]:
        if sites_as_built(spare) and holds(spare):  # (a call since may have changed a site's choice)
            _make_current(state, spare)
            return spare, True
        state.spare_plans = tuple(p for p in state.spare_plans if p is not spare)
    if failed.under == under:
        return failed, False
    state.spare_plans = _kept_spares(failed, state.spare_plans)
    state.plan = None
    return None, False


def _make_current(state: ModuleState, plan: Plan) -> None:
    """``plan``, one of ``state.spare_plans``, made the current plan; the current one a spare."""
    spares = tuple(p for p in state.spare_plans if p is not plan)
    state.spare_plans = _kept_spares(state.plan, spares)
    state.plan = plan


def _kept_spares(plan: Plan | None, spares: tuple) -> tuple:
    """``plan`` put first among ``spares``, at most :data:`_SPARES` of them (the least recently
    current dropped)."""
    return spares if plan is None else (plan, *spares)[:_SPARES]


def _still_served(plan: Plan) -> bool:
    """Whether the values ``plan`` keeps in the modules' ``__dict__`` (frozen ones) and the
    tensors they were computed from are all still where they were (it failed on something
    else, such as the ``requires_grad`` its choice depends on), so it may serve again, and
    keeping it holds no value or original the model no longer has. (A plan that hoists holds
    the dicts its originals are read from, not the tensors.)"""
    if plan.unaddressed:
        return False
    try:
        return (all(map(is_, map(getitem, plan.link_dicts, plan.link_keys), plan.links))
                and all(map(is_, map(getitem, plan.input_dicts, plan.input_keys), plan.inputs)))
    except LookupError:
        return False


def _replan(state: ModuleState, grad: bool, pre_hooks: tuple[dict, ...], last: Plan | None,
            reached_from: dict[int, nn.Module | None]) -> None:
    """The entry's plan for its next call, after this one opened the general way; ``last``: the
    plan of this grad mode that did not hold (:func:`_plan_of`), or None; ``reached_from``: the
    module each module below the entry was reached from (:func:`_below_pre_hooks`).

    It is built from the scope just opened, reusing the guards of ``last`` where they hold.
    The plan it replaces is kept as a spare where it was made for the other grad mode or under
    another autocast or numerics state, or served calls with values still there
    (:func:`_after_miss` tries it again). Where ``last`` never served a call (calls alternate
    no_grad and grad, a rollout and a training step, or something changes between every two
    calls), or where none could be built (a site no plan serves: a hook-based norm's layer with
    another forward pre-hook, FSDP2's sharded originals), building one at every call would cost
    more than it saves: the next is built after 1, then 2, 4, ... up to :data:`_LONGEST_WAIT`
    such calls, and at once after a plan that served one (or after the entry's plans were
    dropped: ``ModuleState.drop_caches``)."""
    if last is None and state.plan is not None:
        state.spare_plans = _kept_spares(state.plan, state.spare_plans)  # another state's, kept aside
    elif last is not None and last.used and _still_served(last) and sites_as_built(last):
        state.spare_plans = _kept_spares(last, state.spare_plans)  # may hold again (a flag switched back)
    if (last is not None and not last.used) or (last is None and state.plan_unbuilt):
        if state.plan_wait:
            state.plan_wait -= 1  # ``last`` stays: its check fails fast, and a plan that holds is exact
            return
        state.plan_backoff = min(2 * state.plan_backoff or 1, _LONGEST_WAIT)
        state.plan_wait = state.plan_backoff
    else:
        state.plan_backoff = state.plan_wait = 0
    if last is None:  # guards to reuse where they hold: another state's plan, kept aside
        last = next((spare for spare in state.spare_plans if spare.grad is grad), None)
    state.plan = Plan.build(state.holders, grad, _shareable, pre_hooks=pre_hooks, previous=last,
                            parents=_parents(state.holders, reached_from))
    state.plan_unbuilt = state.plan is None


def _left(state: ModuleState, reached_from: dict[int, nn.Module | None]) -> bool:
    """Whether a holder or entry of ``state``'s lists is no longer below its entry (model
    surgery: ``model[0] = new_layer``, ``prepare_qat``'s swap, a layer moved to another model)."""
    return not state.covers <= reached_from.keys() or not all(id(h) in reached_from for h in state.holders)


def _forget_left(state: ModuleState, reached_from: dict[int, nn.Module | None]) -> None:
    """Drop from the holders and covers of the entry of ``state``, and of every entry still below
    it, what is no longer below that entry: a scope computes and claims only what its model holds
    now (a layer swapped out may share a stateful member with the one swapped in, whose reads
    alone advance it in stock). A module dropped so stays prepared, alone, until ``restore`` of
    the model (which still lists it), or of itself, or ``prepare`` of a model holding it now
    (``paramfold.restore.drop_detached``); put back, it is computed like stock, at its reads."""
    for below in state.entries:
        bs = below.__dict__.get(STATE_ATTR)
        if bs is None or id(below) not in reached_from:
            continue
        reached = reached_from if bs is state else _below_pre_hooks(below)[2]
        bs.holders = [h for h in bs.holders if id(h) in reached]
        bs.covers = frozenset(i for i in bs.covers if i in reached)
        bs.drop_caches()


def _share_with_late(entry: nn.Module, state: ModuleState, parametrized: tuple[nn.Module, ...]) -> bool:
    """Take into account, for state sharing, the parametrized modules now below the entry of
    ``state`` (``parametrized``) that were not when ``prepare`` or an earlier call worked it out:
    a layer added after ``prepare`` (or put back after a call dropped it) is computed where it is
    read, as stock's, so a prepared site sharing a stateful member or a state tensor with it is
    computed at every read too while that state changes (``SiteState.shares_changing_state``),
    as ``prepare`` has it for the sharers it found. Sharers are only added: a site computed at
    every read is exact whoever else reads its state. False where it cannot be worked out now
    (a chain that cannot be probed inside a ``torch.func`` transform): the next call tries again."""
    known = set(map(id, state.parametrized))
    if all(id(m) in known for m in parametrized):
        state.parametrized = parametrized
        return True
    from paramfold.prepare import state_sharers  # prepare imports this module
    from paramfold.probe import CannotProbeNow
    from paramfold.sites import find
    try:
        found = {id(site): site for site in find(entry)}
    except CannotProbeNow:
        state.plan, state.spare_plans = None, ()
        return False
    state.parametrized = parametrized
    changed = False
    for site_id, (modules, in_eval) in state_sharers(entry, list(found.values())).items():
        site = found[site_id]
        hs = site.module.__dict__.get(STATE_ATTR)
        ss = hs.sites.get(site.tensor_name) if hs is not None else None
        if ss is None or ss.mode == "inline":
            continue
        sharers = tuple(dict.fromkeys((*ss.state_sharers, *modules)))
        if sharers != ss.state_sharers or (in_eval and not ss.sharers_in_eval):
            ss.state_sharers, ss.sharers_in_eval = sharers, ss.sharers_in_eval or in_eval
            changed = True
    if changed:  # plans built on the old sharers
        _drop_caches_below(state)
    return True


def _parents(holders: list[nn.Module], reached_from: dict[int, nn.Module | None]) -> tuple[nn.Module, ...]:
    """The modules on one path from the entry down to each of ``holders`` (the entry included,
    the holder not): a write to one's ``_modules`` may take the holder out of the model."""
    found: dict[int, nn.Module] = {}
    for holder in holders:
        module = reached_from[id(holder)]
        while module is not None and id(module) not in found:
            found[id(module)] = module
            module = reached_from[id(module)]
    return tuple(found.values())


def _open_holders(entry: nn.Module, state: ModuleState, grad: bool, hooked: set[int]) -> tuple[list[nn.Module], bool]:
    """The holders below ``entry``, claimed with their values installed, and whether computing
    one of those raised (:func:`_install`)."""
    # Everything that refuses a call is checked before any value is computed, so a refused call
    # leaves the model as it was (no power iteration of an earlier holder has run).
    for holder in state.holders:
        hs = holder.__dict__[STATE_ATTR]
        if hs.sites:
            _check_unchanged(entry, holder, hs)
        if hs.users:
            if hs.shareable is None or hs.shareable != _shareable(hs, grad):
                raise _concurrent(entry)
        else:
            for name, site in hs.sites.items():
                if site.mode == "freeze" and not distributed(site) and not can_freeze(site):
                    raise site_values.unfreezable(holder, name, site, _path_below(entry, holder))
    claimed: list[nn.Module] = []
    raised = False
    under = computed_under()  # what frozen values must have been computed under to serve this call
    try:
        for holder in state.holders:
            hs = holder.__dict__[STATE_ATTR]
            if hs.users:
                _renew_shared(entry, holder, hs, grad, under)
                hs.users += 1
            else:
                raised = _install(holder, hs, grad, under, id(holder) in hooked) or raised
            claimed.append(holder)
    except BaseException:
        _release(claimed)
        raise
    return claimed, raised


_at_read = attrgetter("at_read")


def _install(holder: nn.Module, hs: ModuleState, grad: bool, under: tuple, at_read: bool = False) -> bool:
    """Install ``holder``'s values for a call; whether computing one of them raised (that one is
    then computed where it is read)."""
    values = holder.__dict__
    raised = False
    kept_before = hs.kept
    hs.kept = ()
    unserved = not _enter_scope_class(holder, hs, not at_read)
    installed: list[str] = []
    kept: list[str] = []
    hook_keys: list[int] = []
    onces: list[hooknorms.ServedOnce] = []
    left: list[tuple[str, object]] = []
    replaced: list[tuple[str, object]] = []
    renewed = False
    wrapped = wraps_its_forward(holder)
    replay = _local.replay
    at_read_before = list(map(_at_read, hs.sites.values()))
    try:
        for name, site in hs.sites.items():
            mode = site.mode
            if mode == "inline":
                # Nothing to compute here: the getter reads each original from its dict when the
                # tensor is read, so under FSDP2 after the layer's pre-forward gather, like stock.
                sync_refs(holder, site)
                continue
            site.raised = False
            if site.hook is None:
                _set_aside_foreign(values, name, site, hs, kept_before)
            # A stateful chain training where the class cannot serve only the first read its
            # value (a class of someone else's now), one sharing changing state with another
            # site's (the scope would compute both in module order, not the forward's, and
            # whether or not the call reads them), a tensor its module's call edits in place
            # (an embedding's max_norm, a training BatchNorm's num_batches_tracked), and a tensor
            # of a module whose forward is wrapped (a decorated one, Accelerate's autocast
            # wrapper on the instance: the region it enters starts after any check of a call; a
            # hook-based norm's hook runs before it): computed at every read, as stock does.
            site.at_read = (at_read or (unserved and site.training_stateful) or site.shares_changing_state
                            or edits_in_place(holder, name)
                            or (wrapped and site.hook is None))
            if replay is not None:  # as in the forward this recomputation replays
                site.at_read = (id(holder), name) not in replay
            if site.at_read:
                # A forward pre-hook may change the originals before the forward reads the
                # tensor: it is computed where it is read, as stock does (the descriptor, in-graph
                # when compiled; a hook-based norm's own hook stays in and runs as in stock, and
                # sets the value again). The value of the last call is taken out meanwhile:
                # compiled code traced while the hook was out reads it, and would read it stale
                # (dynamo does not guard on hooks); missing, it is traced again, with the hooks.
                _set_aside(values, name, site, left)
                continue
            frozen = site.frozen
            if replay is not None:
                value = entry_regions.replayed_value(holder, name, site, replay[(id(holder), name)])
            elif (frozen is not None and (mode != "hoist" or (not grad and site_values.freezing_now()))
                    and site_values.freezable(site, grad) and not parametrize._cache_enabled
                    and unchanged(site, frozen, under)):
                value = frozen.value  # the fast path: nothing changed since the last call
                site.misses = site.demotions = 0
            else:
                # A training stateful chain's value is served once (read-once class): its state is
                # put back where the call does not read it (paramfold.unread).
                keep = site.training_stateful
                if keep:
                    unread.take(holder, name, site)
                failed = False
                try:
                    value = site_values.for_call(holder, name, site, grad, under)
                except _NOT_THE_CHAINS:
                    raise
                except Exception:
                    # The chain (a hook-based norm's hook) raised: stock raises at the read, after
                    # the forward's earlier reads, which advance their states. Computed there, as
                    # stock does, for this call, from its state as before (put back just below).
                    value, failed = None, True
                if keep:
                    unread.computed(site, value)
                if failed:
                    raised = site.raised = site.at_read = True
                    _set_aside(values, name, site, left)
                    continue
                if value is None:
                    site.at_read = True
                    values.pop(name, None)
                    continue
            nested.record(site)
            if site.hook is not None:  # hook-based norm: like stock, the value stays; its hook is out meanwhile
                replaced.append((name, values.get(name, _MISSING)))
                values[name] = value
                hook_keys.append(site.hook_key)
                if site.stateful:  # its hook runs at the module's later calls in this one (read-once class)
                    once = site.once_hook
                    if once is None:
                        once = site.once_hook = hooknorms.ServedOnce(site.hook, functools.partial(nested.refresh, site))
                    once.served = once.called = False
                    onces.append(once)
            elif site.frozen is not None and value is site.frozen.value and not _functorch_wrapped(value):
                # (A value computed inside a torch.func transform from its wrappers serves that
                # call only: installed, so it is taken out when the call ends.)
                if values.get(name) is not value:  # an unchanged dict keeps dynamo's guards cheap
                    values[name] = value
                    renewed = True
                kept.append(name)
            else:
                values[name] = value
                installed.append(name)
        if hs.detach_params:
            installed += _detach_params(holder, hs, grad)
        for name in kept_before:
            if name not in kept and name not in installed:
                values.pop(name, None)
    except BaseException:
        for name in (*installed, *kept, *kept_before):
            values.pop(name, None)
        for site in hs.sites.values():
            unread.put_back(site)
        values.update(left)
        raise
    hs.installed = tuple(installed)
    if list(map(_at_read, hs.sites.values())) != at_read_before:
        # Values served from __dict__ now that the last call computed where read, or the other way
        # round: the nested checks and the plans built on the sites served then are built again
        # (a plan's claim serves the values it was built for, and keeps the sites' flags as they are).
        nested.Installs.count += 1
        _drop_plans(hs)
    # The same kept tuple while the same values stay kept: a plan checks it by identity, so the
    # other grad mode's plan still holds after a call that kept the same values (each builds its own).
    hs.kept = kept_before if not renewed and tuple(kept) == kept_before else tuple(kept)
    hs.hooks_out = hooknorms.detach(holder, hook_keys) if hook_keys else ()
    # What the read-once class's forward runs: none where each value is computed at every read
    # (its hook in), so also no stand-in left from an earlier call.
    runs_onces = hs.reads_once(holder) and "forward" in vars(hs.read_once_class)
    if (onces or runs_onces or ONCE_ATTR in values) and values.get(ONCE_ATTR) != tuple(onces):
        values[ONCE_ATTR] = tuple(onces)
    hs.left = tuple(left)
    hs.replaced = tuple(replaced)
    hs.users = 1
    hs.shareable = _shareable(hs, grad)
    return raised


def _set_aside_foreign(values: dict, name: str, site: SiteState, hs: ModuleState, kept: tuple[str, ...]) -> None:
    """Keep aside what the user put in a holder's ``__dict__`` (``values``) under the name of a
    site served from there (``vars(layer)[name] = t`` between calls): stock's class's property
    hides it from every read, and its ``__dict__`` keeps it, which ``restore`` gives back
    (``ModuleState.foreign``). Anything there but this site's kept frozen value is the user's."""
    value = values.get(name, _MISSING)
    if value is not _MISSING and not (name in kept and site.frozen is not None and value is site.frozen.value):
        hs.foreign[name] = values.pop(name)


def _set_aside(values: dict, name: str, site: SiteState, left: list) -> None:
    """Take the last call's value of a site computed where it is read in this call out of its
    module's ``__dict__`` (``values``); a hook-based norm's goes to ``left``, put back when the
    call ends if the norm's hook did not set it again (``_unclaimed``)."""
    value = values.pop(name, _MISSING)
    if site.hook is not None and value is not _MISSING:
        left.append((name, value))


def _renew_shared(entry: nn.Module, holder: nn.Module, hs: ModuleState, grad: bool, under: tuple) -> None:
    """Make the values another thread's open scope installed in ``holder`` those a call beginning
    now reads, before this call shares them (the caller holds the scope lock and has checked that
    both calls may share: ``no_grad``, one autocast state, no stateful chain training).

    Their inputs may have been written since they were computed (a writer thread's ``p.copy_()``
    under ``no_grad``, an optimizer or EMA thread between the calls): each value is computed again
    where that is so (a frozen value where its inputs changed, a hoisted one always) and put in
    place of the old one. Under ``no_grad`` and one autocast state that is the value every read
    computes from now on, in stock, for both calls; the other call's nested module calls see the
    write themselves (``scope_nested``). Categories stay as they are (``installed`` names are
    removed when the last call ends, ``kept`` ones stay hidden between calls); the kept tuple is
    made anew where a value changed, so no plan built on the old ones holds."""
    values = holder.__dict__
    renewed = False
    for name, site in hs.sites.items():
        if site.mode == "inline" or site.at_read or name not in values:
            continue
        value = site_values.for_call(holder, name, site, grad, under)
        if value is None:  # now to be computed where read (sharded originals): not shareable
            raise _concurrent(entry)
        if value is not values[name]:
            values[name] = value
            nested.record(site)
            renewed = True
    if hs.detach_params and not grad:
        # a parameter replaced since (assign=True, p.data = t); not one a nested call took out
        _detach_params(holder, hs, grad, {name for name, _ in hs.detached})
    if renewed and hs.kept:
        hs.kept = tuple(list(hs.kept))  # the same names in a new tuple: plans check it by identity


def _detach_params(holder: nn.Module, hs: ModuleState, grad: bool, names: set[str] | None = None) -> list[str]:
    """``detach_params_under_no_grad``: under ``no_grad``, put each plain parameter of ``holder``
    (of ``names``) in its ``__dict__`` detached for the call, and return their names. Not one that
    carries forward-mode tangents (a dual tensor, a torch.func jvp's wrapper, swapped in by
    ``functional_call``), which ``detach()`` drops: the call reads that one itself."""
    values = holder.__dict__
    detached = []
    for name, param in holder._parameters.items() if not grad else ():
        if param is not None and (names is None or name in names) and not carries_tangents(param):
            alias = param.detach()
            if type(alias) is torch.Tensor:
                # The Parameter's own attributes (a quantizer's ``weight.qscale``), read and written
                # through the alias as on the Parameter; its data and metadata follow when it
                # leaves (nested.settle_detached). (A wrapper subclass's __dict__ holds its inner
                # tensors, detached in its alias: not shared.)
                alias.__dict__ = param.__dict__
            values[name] = alias
            layout = nested.layout_of(alias)
            if layout is not None:
                hs.aliases[name] = (param, alias, layout)
            detached.append((name, param))
    last = hs.detached
    if len(detached) != len(last) or not all(a[0] == b[0] and a[1] is b[1] for a, b in zip(detached, last)):
        hs.detached = tuple(detached)
        nested.Installs.count += 1  # the nested checks built on the last ones (scope_nested.check_of)
    return [name for name, _ in detached]


def _changes_originals(module: nn.Module | None) -> bool:
    """Whether calling ``module`` (``None``: any module, through the global hooks) runs a forward
    pre-hook that may change originals before a parametrized tensor below it is read: any but
    the hook-based norms that the scope serves itself. FSDP2's counts: it swaps in the gathered
    parameters, and a layer left gathered between calls (``reshard_after_forward=False``,
    ``set_reshard_after_backward(False)``) has plain tensors there, not DTensors, whose value
    computed at the root's call would be backpropagated after FSDP2's reduce-scatter. So does a
    DDP or FSDP1 wrapper's forward (:func:`~paramfold.state.syncs_before_forward`) below the entry."""
    if module is not None and syncs_before_forward(module):
        return True
    hooks = _global_forward_pre_hooks if module is None else module._forward_pre_hooks
    if not hooks:
        return False
    state = None if module is None else module.__dict__.get(STATE_ATTR)
    served = {site.hook_key for site in state.sites.values() if site.hook is not None} if state is not None else ()
    return any(key not in served for key in hooks)


def _hooks_since(module: nn.Module, state: ModuleState) -> None:
    """At a call of ``module`` nested in an open scope, after a hook was registered somewhere
    since its last check, or where that was made in another call (torch numbers every hook's
    handle from one counter; the scopes of other threads may have checked since): where one that may
    change what its values are was registered during the call (its key is at least
    ``_local.hooks_from``), the values below ``module`` are served as stock's from now on in the
    call (``scope_nested.computed_at_read``): a forward pre-hook on ``module`` or a global one
    (registered from a forward hook of an earlier layer: a monitor, a clipping or pruning tool)
    runs after this check and may change the originals, which the scope computed them from
    before; a global forward hook, or one on a chain's own modules, runs at each of stock's reads.
    One there when the call began left them so already (:func:`_below_pre_hooks`,
    ``site_values.for_call``, the chain's probe)."""
    state.hooks_checked, state.hooks_checked_from = _Handle.next_id, _local.hooks_from
    check = state.nested_check
    if check is None or check[0] != nested.Installs.count:  # (check_of's own test, written out)
        check = nested.check_of(module)
    keys = itertools.chain(module._forward_pre_hooks, _global_forward_pre_hooks, _global_forward_hooks, *check[15])
    if max(keys, default=-1) >= _local.hooks_from:
        with _LOCK:
            if nested.computed_at_read(module, _concurrent):
                _drop_plans(state)  # built on the sites' choices this call changed (at_read)


def _below_pre_hooks(entry: nn.Module) -> tuple[set[int], tuple[dict, ...], dict[int, nn.Module | None],
                                                  tuple[nn.Module, ...]]:
    """The ids of the modules at or below a module with a forward pre-hook that may change
    originals (:func:`_changes_originals`; all of them for a global one), in ``entry``'s tree,
    every forward pre-hook dict read to find them (a steady plan holds while their keys do),
    the module each module in the tree (by id) was first reached from (``entry``: None), and
    the parametrized modules in the tree (:func:`_share_with_late`)."""
    hooked: set[int] = set()
    parametrized: list[nn.Module] = []
    dicts = [_global_forward_pre_hooks]
    reached_from: dict[int, nn.Module | None] = {id(entry): None}
    stack = [(entry, _changes_originals(None))]
    while stack:
        module, below = stack.pop()
        dicts.append(module._forward_pre_hooks)
        below = below or _changes_originals(module)
        if below:
            hooked.add(id(module))
        if isinstance(module._modules.get("parametrizations"), nn.ModuleDict):
            parametrized.append(module)
        for name, child in module._modules.items():
            if child is not None and name != "parametrizations":  # the chains: computed by the scope
                reached_from.setdefault(id(child), module)
                stack.append((child, below))
    return hooked, tuple(dicts), reached_from, tuple(parametrized)


def parametrized_below(entry: nn.Module) -> tuple[nn.Module, ...]:
    """The parametrized modules at or below ``entry`` (as a call's general path finds them)."""
    return _below_pre_hooks(entry)[3]


def _enter_scope_class(holder: nn.Module, hs: ModuleState, read_once: bool = True) -> bool:
    """Give ``holder`` its class for the call scope: its prepared class (from the between-calls
    class its kept frozen values had, also inside a wrapper a library made of it meanwhile,
    FSDP2's ``fully_shard``), or, with ``read_once`` while a stateful chain of its trains, its
    :func:`~paramfold.classes.read_once_class` (the first read of such a value takes it, each
    later read computes afresh, as stock's every read does). False where a stateful chain trains
    but the module has a class of someone else's (a wrapper), which no read-once class serves,
    or its read-once class serves a hook-based norm through its ``forward`` and the module's call
    does not reach that (:func:`~paramfold.hooknorms.calls_class_forward`): the prepared class then."""
    cls, prepared, between, once = type(holder), hs.prepared_class, hs.between_class, hs.read_once_class
    training = read_once and once is not None and any(site.training_stateful for site in hs.sites.values())
    served = not training or "forward" not in vars(once) or hooknorms.calls_class_forward(holder)
    wanted = once if training and served else prepared
    if wanted is once:
        hs.own_dict = holder.__dict__
    if cls is wanted:
        return served
    if cls is prepared or cls is between or (cls is once and once is not None):
        object.__setattr__(holder, "__class__", wanted)
        return served
    if between is not None and between in cls.__mro__:
        object.__setattr__(holder, "__class__", rebased(cls, between, prepared))
    return not training


def _shareable(hs: ModuleState, grad: bool) -> tuple | None:
    """What the values installed now must have been computed under for another thread's call to
    share them: None where none may (a call recording autograd, or a stateful chain training),
    else the autocast state and the modes active (thread-local: one thread's region must not
    serve another's call; under a mode other than a ``torch.device`` context, none is shared)."""
    if grad or any(site.training_stateful for site in hs.sites.values()):
        return None
    modes = modes_now()
    if modes is None:
        return autocast_state() if _any_autocast() else ()
    return autocast_state(), modes


def _release(claimed: list[nn.Module] | Plan) -> None:
    with _LOCK:
        if type(claimed) is Plan:
            if claimed.release():
                return
            claimed = claimed.claimed
        for holder in claimed:
            hs = holder.__dict__[STATE_ATTR]
            hs.users -= 1
            if not hs.users:
                _unclaimed(holder, hs)


def _unclaimed(holder: nn.Module, hs: ModuleState) -> None:
    """``holder`` as between calls, once no call scope uses its values: they leave its
    ``__dict__`` (kept frozen values stay, hidden by its between-calls class), hook-based norms'
    hooks go back."""
    values = holder.__dict__
    for name, site in hs.sites.items():
        unread.release(holder, name, site)
        if site.read_for_one_call and nested.let_go(site) and hs.drop_kept(name):
            values.pop(name, None)
    if hs.aliases:
        nested.settle_detached(hs)
    for name in hs.installed:
        values.pop(name, None)
    hs.installed = hs.replaced = ()
    if hs.reads_once(holder):
        object.__setattr__(holder, "__class__", hs.prepared_class)
    if type(holder) is hs.prepared_class and hs.between_class is not None:
        object.__setattr__(holder, "__class__", hs.between_class)
    elif hs.kept:  # a class of someone else's now: nothing would hide kept values
        for name in hs.kept:
            values.pop(name, None)
        hs.kept = ()
    if hs.hooks_out:
        hooknorms.attach(holder, *hs.hooks_out)
        hs.hooks_out = ()
    for name, value in hs.left:  # the call ended before the norm's hook set it again
        if not hooknorms.shadowed(holder, name):  # (not over a parameter registered meanwhile)
            values.setdefault(name, value)
    hs.left = ()


def _after_fork_in_child() -> None:
    """In a child process made by ``os.fork()`` (a DataLoader worker, multiprocessing's fork start
    method), where only the forking thread lives on: the calls other threads of the parent had
    open never end here, so their claims go, as their ends would release them, and the child's
    calls are served as if no other call were open, as stock's are. The forking thread's own open
    calls (a fork inside a forward) keep theirs. A scope lock held by another thread, which would
    never be released here, is replaced; that thread may have been halfway through installing or
    releasing values, so every holder no call claims now is also cleared of what a call put in."""
    global _LOCK
    if _LOCK._is_owned():
        # Forked from code this thread runs under the lock (a chain computing a value): its own
        # claim is half made. The bookkeeping stays as it is.
        return
    halfway = not _LOCK.acquire(blocking=False)
    if halfway:
        _LOCK = threading.RLock()
        _LOCK.acquire()
    try:
        own = Counter(map(id, leaves.claimed_holders(leaves.local.claims)))
        done: set[int] = set()
        for entry in list(_OPENED.values()):
            state = entry.__dict__.get(STATE_ATTR)
            if state is None:  # restored
                continue
            state.drop_caches()  # plans of claims that are gone: the next call builds them again
            for holder in state.holders:
                hs = holder.__dict__.get(STATE_ATTR)
                if hs is None or id(holder) in done:
                    continue
                done.add(id(holder))
                users = own[id(holder)]
                if hs.users != users or (halfway and not users):
                    hs.users = users
                    if not users:
                        hs.shareable = None
                        _unclaimed(holder, hs)
                        _drop_call_values(holder, hs)
        nested.Installs.count += 1  # the nested checks built on those values
    finally:
        _LOCK.release()


def _drop_call_values(holder: nn.Module, hs: ModuleState) -> None:
    """Take out of ``holder``'s ``__dict__`` what a call that will never end put there and had not
    listed yet (a child of ``os.fork()``): every site's value but a kept frozen one and a
    hook-based norm's (which stays between calls, as stock's), and parameters put in detached."""
    values, kept = holder.__dict__, kept_values(holder, hs)
    for name, site in hs.sites.items():
        if site.hook is None and name in values and name not in kept:
            del values[name]
    if any(name not in values for name in hs.kept):
        hs.kept = tuple(name for name in hs.kept if name in values)
    if hs.detach_params:
        for name in holder._parameters:
            values.pop(name, None)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def calls_lock() -> threading.RLock:
    """The lock every call of a prepared model computes, checks and marks its values under.

    Hold it while another thread writes weights that calls read (an EMA or weight-sync thread,
    hot-swapped weights): torch leaves concurrent reads and writes of one tensor to its users
    (stock's model then reads torn values), and ``freeze``/``auto`` mark the storages their
    values are keyed on copy-on-write, whose bookkeeping an unserialized write can corrupt
    (torch's internal asserts, a crash or a hang). Writes made under it are seen by the next
    call, or by the next module call of one that is open; the forward's own reads run outside it
    (inline's originals, plain parameters: torn by a write as stock's are). Do not call the model
    holding it where its forward waits on other threads that call its modules. Read it at each
    use: a child of ``os.fork()`` has a new one.

    >>> import torch, paramfold
    >>> from torch.nn.utils.parametrizations import weight_norm
    >>> model = torch.nn.Sequential(weight_norm(torch.nn.Linear(2, 2))).eval()
    >>> model = paramfold.prepare(model.requires_grad_(False), "freeze")
    >>> x, bias = torch.ones(1, 2), model[0].bias
    >>> before = model(x)
    >>> with paramfold.calls_lock(), torch.no_grad():  # in the writer thread: weight_norm's g doubled
    ...     _ = model[0].parametrizations.weight.original0.mul_(2.0)
    >>> torch.allclose(model(x) - bias, 2 * (before - bias))  # the next call computes it again
    True
    """
    return _LOCK


leaves.scope_lock = calls_lock


def busy(state: ModuleState) -> bool:
    """Whether a call scope (of any thread) holds values in the modules below an entry."""
    with _LOCK:
        return any(holder.__dict__[STATE_ATTR].users for holder in state.holders)


def _concurrent(entry: nn.Module) -> FoldError:
    return FoldError(
        f"this prepared {type(entry).__name__} is already being called from another thread; "
        "concurrent calls share one model's values, which is "
        "only exact when every overlapping call runs under torch.no_grad() with no stateful chain "
        "training. Give each thread its own copy (copy.deepcopy(model)), or serialise the calls."
    )


def _check_unchanged(entry: nn.Module, holder: nn.Module, hs: ModuleState) -> None:
    changed = not issubclass(type(holder), hs.prepared_class)  # a wrapper class (fully_shard) is fine
    hooks = holder._forward_pre_hooks
    taken = dict(hs.hooks_out[0]) if hs.hooks_out else {}  # by a scope open in another thread
    names = []
    for name, site in hs.sites.items():
        if site.hook is None:
            names.append(name)
        elif taken.get(site.hook_key, hooks.get(site.hook_key)) is not site.hook:
            changed = True
        elif hooknorms.shadowed(holder, name):
            raise _shadowed(entry, holder, name, site)
        for owner, key, value in site.dict_pins:  # the tensor dicts every mode reads as captured
            if vars(owner).get(key) is not value:  # its __dict__ as it is now: one replaced holds another
                changed = True
        for d, key in site.originals:  # an original taken out of its dict (prune's reparametrization)
            if key not in d:
                changed = True
    if names and not changed:
        plists = holder._modules.get("parametrizations")
        changed = plists is None or plists._modules.keys() != set(names)
        for name in names if not changed else ():
            site = hs.sites[name]
            plist = plists._modules[name]
            if plist is not site.plist or tuple(plist._modules.values()) != site.modules:
                changed = True
                break
            if site.signature is not None and not still_exact(holder, name, site.signature):
                changed = True
                break
            if site.hook_keys is not None and hook_keys(plist) != site.hook_keys:
                changed = True
                break
    if changed:
        path = _path_below(entry, holder)
        where = "the model" if path == "" else repr(path) if path is not None else "a module"
        raise FoldError(
            f"parametrizations of {where} ({type(holder).__name__}, prepared as a "
            f"{hs.original_class.__name__}) changed after paramfold.prepare "
            "(registered, removed or replaced, a hook-based norm removed, a _parameters/_buffers "
            "dict under them replaced (or a whole __dict__ holding one), an original pruned "
            "(torch.nn.utils.prune takes it out of its dict), their originals taken out "
            "by a wrapper that flattens parameters such as FSDP1 with use_orig_params=False, or, "
            "with mode='inline', a hook added to one): call paramfold.restore(model), change or "
            "wrap it, then prepare again (the wrapper, for FSDP1)."
        )


def _shadowed(entry: nn.Module, holder: nn.Module, name: str, site: SiteState) -> FoldError:
    path = _path_below(entry, holder)
    where = "the model" if path == "" else repr(path) if path is not None else "a module"
    what = ("parameter" if name in holder._parameters else "buffer" if name in holder._buffers
            else "parametrized tensor")
    how = ("register_parametrization, as torchao's unwrap_tensor_subclass does" if what == "parametrized tensor"
           else f"module.{name} = p, as transformers' tie_weights() does on a normed lm_head")
    remove = "remove_weight_norm" if site.hook_kind == "weight_norm" else "remove_spectral_norm"
    return FoldError(
        f"{name!r} of {where} ({type(holder).__name__}), which its hook-based torch.nn.utils.{site.hook_kind} "
        f"computes, was made a {what} after paramfold.prepare ({how}). Stock PyTorch cannot call it "
        f"either: the norm's hook cannot assign its value over a {what} (it raises at every call). Call "
        f"paramfold.restore(model), remove the norm first (torch.nn.utils.{remove}(module)), then make "
        f"the {what}, and prepare again."
    )


def _path_below(entry: nn.Module, module: nn.Module) -> str | None:
    """``module``'s path below ``entry`` (its first, if it has several), for an error message."""
    return next((p for p, m in entry.named_modules(remove_duplicate=False) if m is module), None)


def _close(previous: tuple, claimed: list[nn.Module] | Plan, stopped: bool = False) -> None:
    _local.covered, nested.local.context, leaves.local.claims, _local.enclosing, _local.hooks_from = previous
    _local.opened = None
    stranded = (leaves.local.swapped or leaves.local.stranded) and leaves.restore_stranded()
    refused = None
    if _saved_tensors_hooks(True) is not None:  # maybe a torch.utils.checkpoint region
        refused = unread.checkpointed(claimed.claimed if type(claimed) is Plan else claimed, stopped)
    _release(claimed)
    if stranded:
        raise leaves.stranded_error()
    if refused is not None:
        raise refused


# When one of these runs as a frame of its own under an active torch.compile (called from an entry
# point's call, paramfold.scope_entry), dynamo runs it eagerly instead of trying to compile it, and
# still compiles the frames it calls.
run_module_eagerly_as_frames(globals())
