"""A call scope's steady state, checked and entered with a constant amount of Python per call.

Opening a scope the general way (:mod:`paramfold.scope`) walks every holder and site: it checks
that nothing changed, then installs or reuses each value. Once a model is in its steady state —
every site served from a frozen value kept in its module's ``__dict__``, or hoisted — an entry
keeps a :class:`Plan`: everything those choices depend on, flattened into parallel tuples.
:func:`holds` checks all of it — most in one C++ pass of dynamo's guard manager
(:class:`~paramfold.watch.Watch`), the rest with ``map`` over C-level callables
(``operator.is_``, ``attrgetter``, a hash) — and :meth:`Plan.claim` / :meth:`Plan.release` do
the scope's bookkeeping the same way, so the interpreter runs the same bytecode whether a model
has 4 sites or 4,000; only the hoisted
sites' own parametrization calls run per site. Hook-based ``weight_norm`` and ``spectral_norm``
are served too: the value frozen or computed by the hook's ``compute_weight`` (a training
spectral_norm's state copied first, and put back where no call of its layer took the value), the
hook taken out for the call and put back after it, as the general path does. A failed check
sends the call down the general path, which rebuilds the plan: the plan makes a call cheaper,
never different.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from itertools import repeat
from operator import attrgetter, contains, getitem, is_

import torch
from torch import nn

from paramfold import hooknorms
from paramfold.compute import (GLOBAL_HOOKS, IN_PLACE_EDITS, OWN_FORWARD_KEYS, call_path, calls_its_forward, class_forward,
                               compute, computed_under, hook_dicts, overrides_its_call, wraps_its_forward)
from paramfold.frames import run_module_eagerly_as_frames
from paramfold.freeze import class_dicts, same_inputs
from paramfold.scope_nested import Installs
from paramfold.site_values import freezing_now
from paramfold.state import CALLS, MISSING, ONCE_ATTR, PLAIN_TENSOR_TYPES, STATE_ATTR, ModuleState
from paramfold.state import tensor_data_ptr as _data_ptr
from paramfold.state import tensor_version as _version
from paramfold.unread import Copies, fusable, give_back, put_back, state_entries
from paramfold.watch import Identities, Watch, columns, layout, tag
from paramfold.write_marks import ARMINGS, arm, arming_stamps, digest, is_armed, same_armings, unshared, unwritten
from paramfold.write_marks import _address

_users = attrgetter("users")
_kept = attrgetter("kept")
_training = attrgetter("training")
_requires_grad = attrgetter("requires_grad")
_set_class = object.__setattr__
#: The hook dicts ``nn.Module._call_impl`` reads from a module's ``__dict__``: all empty (and no
#: ``_compiled_call_impl`` set there by ``module.compile()``) means a call is a call of ``forward``.
_hooks = hook_dicts
_call_path = call_path
_tracing_state = torch._C._get_tracing_state
_inference_mode = torch.is_inference_mode_enabled


#: Exhausts an iterator in C (itertools' ``consume`` recipe): ``_run(map(setattr, ...))`` is a
#: bulk update with no Python loop or frame.
_run = deque(maxlen=0).extend


class Plan:
    """The steady state of one entry's call scope (see the module docstring).

    ``claimed`` is the holders a scope opened through the plan claims, for the general release.
    """

    __slots__ = (
        "grad", "claimed", "states", "types", "kepts", "installing", "installed", "shareable", "ones",
        "switched", "inside", "outside",
        "link_dicts", "link_keys", "links", "ordered", "order",
        "stateful", "mode_modules", "modes", "flag_tensors", "flags",
        "input_dicts", "input_keys", "inputs", "versioned", "versions", "addresses", "watch",
        "unaddressed", "raw_memory", "raw_digests", "views", "values", "versioned_values", "value_versions",
        "addressed_values", "value_addresses", "other_values", "other_value_addresses",
        "armed", "armings", "armed_checks", "armed_keys", "armed_counts", "value_ids",
        "settings_empty",
        "hoisted", "hoisted_dicts", "copied_sites", "copied_dicts", "copied_names", "copied_tensors", "copied_dtypes",
        "copied_from", "copied_to", "copied_state_dicts", "copied_state_keys", "copied_onces",
        "hoisted_names", "callees", "callee_types", "callee_classes", "callee_paths", "direct", "under",
        "pre_hooks_empty", "pre_hooks", "pre_hook_keys", "until", "demoted", "missed", "used", "count", "freezing",
        "site_states",
        "hooked", "hook_dicts", "hook_dict_keys", "onces",
    )

    @classmethod
    def build(cls, holders: list[nn.Module], grad: bool, shareable: Callable[[ModuleState, bool], tuple | None],
              pre_hooks: tuple[dict, ...] = (), previous: Plan | None = None,
              parents: tuple[nn.Module, ...] = ()) -> Plan | None:
        """The plan of a scope just opened over ``holders`` the general way, or None where some
        site is not in a steady state (a stateful hook-based norm, DTensors, anything recomputed).
        ``pre_hooks``: the forward pre-hook dicts whose hooks decided that values are installed;
        ``previous``: the plan this one replaces, whose watch it reuses where that still holds;
        ``parents``: the modules between the entry and ``holders``, whose ``_modules`` hold them
        in the model (a layer replaced or moved out writes one)."""
        plan = cls()
        plan.grad = grad
        plan.used = False
        plan.pre_hooks_empty = tuple(d for d in pre_hooks if not d)  # the usual case: a truth test each
        plan.pre_hooks = tuple(d for d in pre_hooks if d)
        plan.pre_hook_keys = list(map(list, plan.pre_hooks))
        plan.under = computed_under()  # the frozen values were just checked against it
        # Whether inductor's freezing was on, where it decides how hoist sites are served (in
        # no_grad calls: site_values.freezing_now), else None. Not read at each call: a compile
        # under it ends a plan that hoists them (compile_leaves.on_compile_start); one that
        # freezes them serves exact values with it off as well.
        plan.freezing = None
        if not grad and any(s.mode == "hoist" for h in holders for s in h.__dict__[STATE_ATTR].sites.values()):
            plan.freezing = freezing_now()
        claimed, states, types, kepts, installed, shares = [], [], [], [], [], []
        switched, inside, outside = [], [], []
        links, value_links, ordered, stateful, modes, typed = [], [], [], [], [], []
        flags, watch, raw, views, hoisted, callees, kept, armed = [], [], [], [], [], [], [], []
        armed_checks: list[tuple] = []
        armed_keys: list[int] = []
        armed_counts: list[int] = []
        switches: list[tuple[torch.Tensor, int]] = []  # hoisted chains' tensors, as last probed
        copied: list[tuple] = []
        forward_keys: list[tuple[dict, str, bool]] = []
        copied_list: list[torch.Tensor] = []
        copied_entries: list[tuple[dict, str]] = []
        until: list[int] = []
        missed: list = []
        site_states: list[tuple] = []
        # Hook-based norms, per holder: (holder, its state, its __dict__, ((name, hook, key, frozen
        # value or None, compute_weight's keyword arguments), ...)), and the key list its
        # _forward_pre_hooks dict has between calls (the norms' hooks only).
        hooked: list[tuple] = []
        hook_dicts: list[dict] = []
        hook_dict_keys: list[list] = []
        onces: list = []  # spectral_norms' hooknorms.ServedOnce stand-ins
        structure: dict[int, dict] = {}
        empty: dict[int, dict] = {}  # by id: the global hook dicts are in every site's
        settings: dict[int, tuple[dict, object]] = {}
        # Each module (and object a frozen chain holds) whose __dict__'s tag or entries are
        # checked, with that __dict__ by identity: ``obj.__dict__ = {...}`` leaves the old one
        # unwritten.
        dicted: dict[int, tuple[object, dict]] = {}

        def pin_dicts(pairs) -> bool:
            for obj, d in pairs:
                if dicted.setdefault(id(obj), (obj, d))[1] is not d:  # pinned as another dict
                    return False
            return True

        def frozen_checks(site, frozen) -> bool:
            """What keeps a site's frozen value fresh, collected; False where a plan cannot."""
            # Armed again since it was frozen (written, then armed for another value frozen
            # later in the call): no plan. A plan takes ARMINGS as it is now, and reads its
            # storages' stamps only once that has moved.
            if not same_armings(frozen) or not pin_dicts(zip(frozen.held, frozen.held_dicts)):
                return False
            if site.misses or site.demotions:
                missed.append(site)
            watch.extend(frozen.watch)
            kept.append((frozen.value, frozen.value_version, frozen.value_layout, frozen.value_address))
            armed.extend(frozen.armed)
            armed_checks.extend(frozen.armed_checks)
            armed_keys.extend(frozen.armed_keys)
            armed_counts.extend(frozen.armed_counts)
            raw.extend(frozen.raw)
            views.extend(frozen.views)
            empty.update((id(d), d) for d in frozen.settings_empty)
            typed.extend(zip(frozen.members, frozen.member_types))
            ordered.extend(frozen.ordered)
            settings.update((id(d), (d, then)) for d, then in zip(frozen.settings, frozen.settings_then))
            return True

        def hoisted_checks(site) -> bool:
            """What keeps a hoisted site's choice (freeze and auto: nothing that decides it changed,
            nor a computed-at-every-call period ended), collected; whether it is made as auto's."""
            if site.hoist_until > CALLS[0]:  # freeze and auto: computed at every call for now
                until.append(site.hoist_until)
            as_auto = site.mode != "hoist" or plan.freezing
            if as_auto:  # what decides freeze's refusal and auto's choice
                flags.extend((t, t.requires_grad) for d in site.tensor_dicts for t in d.values() if t is not None)
            draw_checks(site)
            return as_auto

        def copy_state(holder, site, values, name, once) -> None:
            """A training stateful chain's state, copied at each claim (to put back where the call
            does not read its value: a parametrization's is read where it left ``values``, a
            hook-based norm's where its module's call was served it, ``once``)."""
            entries = state_entries(holder, site)
            copied.append((site, values, name, len(copied_list), len(copied_list) + len(entries), once))
            copied_list.extend(d[k] for d, k in entries)
            copied_entries.extend(entries)

        def draw_checks(site) -> None:
            if site.draw_watch is not None:  # a change has the chain probed for draws again
                empty.update((id(d), d) for d in site.draw_watch.empty)
                settings.update((id(d), (d, then)) for d, then in zip(site.draw_watch.full, site.draw_watch.tags))
                switches.extend(zip(site.draw_watch.tensors, site.draw_watch.versions))

        for parent in parents:
            structure[id(parent._modules)] = parent._modules
            links.append((vars(parent), "_modules", parent._modules))
            if not pin_dicts([(parent, vars(parent))]):
                return None
        for holder in holders:
            hs = holder.__dict__[STATE_ATTR]
            values = holder.__dict__
            scope_class = type(holder)  # its prepared class, or the read-once one (scope._enter_scope_class)
            if hs.users != 1 or hs.detach_params or (hs.hooks_out and not _hooks_servable(holder, hs)) or (
                    scope_class is not hs.prepared_class and scope_class is not hs.read_once_class):
                return None
            if hs.kept and hs.between_class is None:
                return None
            plists = holder._modules.get("parametrizations")
            if plists is None and not hs.hooks_out:
                return None
            # Every dict a site's value is found through, down to its tensors, is checked by its
            # tag (any write changes it): the holder's own __dict__, which the scope writes
            # values to, and the chain members' (hoist reads their attributes live) by the key.
            links.append((values, "_modules", holder._modules))
            if not pin_dicts([(holder, values), *([(plists, vars(plists))] if plists is not None else [])]):
                return None
            # Whether its forward is wrapped (decides which of its values are computed where read):
            # the keys of its own __dict__ that set one, and its classes' dicts.
            wrapped = wraps_its_forward(holder)
            forward_keys.extend((values, key, key in values) for key in OWN_FORWARD_KEYS)
            structure.update((id(d), d) for d in class_dicts(type(holder)))
            for edit in IN_PLACE_EDITS:
                # Which tensors its call edits in place (computed where read) holds while the
                # attributes that decide it stay the same objects (an embedding's max_norm, training).
                if isinstance(holder, edit.classes) and not edit.names.isdisjoint(hs.sites):
                    if not all(key in values for key in edit.reads):
                        return None
                    links.extend((values, key, values[key]) for key in edit.reads)
            structure[id(holder._modules)] = holder._modules
            if plists is not None:
                structure.update((id(d), d) for d in (plists.__dict__, plists._modules))
            hooks_here = []
            onces_here = False
            for name, site in hs.sites.items():
                # (read_for_one_call: it would keep tensors put in for this call alone, and never hold.)
                if site.read_for_one_call:
                    return None
                frozen = site.frozen
                site_states.append((site, site.at_read, site.raised, site.draws, site.draw_watch, site.state_sharers,
                                    site.hoist_until, frozen))
                if site.hook is not None:
                    # A hook-based norm (weight_norm, spectral_norm), frozen or computed by its
                    # hook's own compute_weight at each call, its hook out meanwhile, as the
                    # general path does (scope._install), while nothing that decides that changes:
                    # the hook object at its key, alone in the dict; its settings; the tensors'
                    # dicts; a spectral_norm's module's training flag (its power iteration runs
                    # while it trains: its state copied first, put back where no call of the
                    # module was served the value, paramfold.unread, as the general path does).
                    if (site.at_read or site.raised or site.subclass or name in hs.installed
                            or name in hs.kept or (frozen is not None and values.get(name) is not frozen.value)):
                        return None
                    if frozen is None:
                        hoisted_checks(site)
                    elif not site.training_stateful and frozen_checks(site, frozen):
                        draw_checks(site)
                    else:
                        return None
                    structure.update((id(d), d) for d in (vars(site.hook), *site.tensor_dicts))
                    links.extend((vars(owner), key, d) for owner, key, d in site.dict_pins)
                    value_links.append((holder._forward_pre_hooks, site.hook_key, site.hook))
                    arguments = _NO_ARGS
                    if site.stateful:  # its stand-in for training calls, reset as the general path does
                        modes.append((holder, holder.training))
                        onces.append(site.once_hook)
                        onces_here = True
                        arguments = _TRAINING_NORM if holder.training else _EVAL_NORM
                    if site.training_stateful:
                        copy_state(holder, site, values, name, site.once_hook)
                    hooks_here.append((name, site.hook, site.hook_key, None if frozen is None else frozen.value,
                                       arguments))
                    continue
                plist_dict = site.plist.__dict__
                structure.update((id(d), d) for d in (plist_dict, site.plist._modules, *site.tensor_dicts))
                links.extend((vars(owner), key, d) for owner, key, d in site.dict_pins if owner is not site.plist)
                if not pin_dicts((m, vars(m)) for m in site.plist.modules()):  # the list's and members'
                    return None
                if len(site.modules) > 1:
                    ordered.append(site.plist._modules)
                if site.mode == "inline":
                    # Computed where it is read, from the dicts its getter keeps in the holder's
                    # __dict__ (pinned by key, as scope's sync_refs puts them); the getter calls
                    # the forwards of members that had no hooks, which must stay so.
                    links.extend((values, key, ref) for key, ref, _ in site.original_refs)
                    if site.signature is not None:
                        for member, forward in zip(site.chain, site.signature[2]):
                            if forward is not None:
                                typed.append((member, type(member)))  # nor its __class__ set
                                empty.update((id(d), d) for d in _hooks(vars(member)))
                                # and no forward of its own set on it since, nor on its class
                                structure[id(vars(member))] = vars(member)
                                structure.update((id(d), d) for d in class_dicts(type(member)))
                        if not site.signature[3]:  # nor the list's call made more than its forward
                            empty.update((id(d), d) for d in _hooks(vars(site.plist)))
                            typed.append((site.plist, type(site.plist)))
                            structure.update((id(d), d) for d in class_dicts(type(site.plist)))
                    elif site.hook_keys is not None:  # nested: no hook on its modules, as at prepare
                        if any(site.hook_keys):
                            return None
                        empty.update((id(d), d) for m in site.plist.modules() for d in _hooks(vars(m)))
                    continue
                # Served so while no chain sharing its state changes it (scope's at_read).
                modes.extend((m, m.training) for m in site.state_sharers)
                if name in hs.kept:
                    if frozen is None or values.get(name) is not frozen.value:
                        return None
                    # Still there: a tensor put in its place (``vars(layer)[name] = t``) is ignored
                    # by stock, whose class's property wins, and set aside by the general path.
                    # (Checked apart from the watch, whose guards a value frozen again still fits.)
                    value_links.append((values, name, frozen.value))
                    if not frozen_checks(site, frozen):
                        return None
                    if site.stateful:
                        stateful.extend(site.chain)
                elif name in hs.installed and frozen is None and site.subclass == "":
                    # Hoisted: the same choice next call as long as the originals are the same
                    # tensors (so not DTensors: the tensor dicts' tags) and, for freeze and auto,
                    # nothing that decides it changed, nor a computed-at-every-call period ended.
                    if hoisted_checks(site) or site.stateful:  # training decides them too, and sharing
                        modes.extend((m, m.training) for m in site.chain)
                    # A global forward hook registered: computed where read from then on (site_values).
                    empty.update((id(d), d) for d in GLOBAL_HOOKS[:2])
                    # compute()'s steps for a flat chain, without its lookups (the structure tags
                    # pin the modules), and each member's forward where a call of it would be just that.
                    chain = None if site.nested or not calls_its_forward(site.plist) else site.chain
                    forwards = None
                    if chain is not None and all(map(_plain_call, chain)):
                        forwards = tuple(type(m).forward for m in chain)
                        callees.extend(chain)
                        callees.append(site.plist)  # its call still just its forward, checked live
                    hoisted.append((values, name, holder, site.originals, chain, forwards, site.hoist_until > CALLS[0]))
                    if site.training_stateful:  # its state is copied, to put back if unread (paramfold.unread)
                        copy_state(holder, site, values, name, None)
                elif wrapped and site.at_read and name not in values:
                    forward_keys.append((values, name, False))  # computed where read: nothing put there
                else:
                    return None
            if hooks_here:
                if onces_here:  # the stand-ins its read-once class runs (another call may have left none)
                    value_links.append((values, ONCE_ATTR, values[ONCE_ATTR]))
                hooked.append((holder, hs, values, tuple(hooks_here)))
                hook_dicts.append(holder._forward_pre_hooks)
                hook_dict_keys.append(list(hs.hooks_out[1]))
            claimed.append(holder)
            states.append(hs)
            between_calls = hs.between_class or hs.prepared_class
            types.append(between_calls)
            kepts.append(hs.kept)
            installed.append(hs.installed)
            shares.append(shareable(hs, grad))
            if scope_class is not between_calls:
                switched.append(holder)
                inside.append(scope_class)
                outside.append(between_calls)
        plan.claimed, plan.states, plan.types, plan.kepts = claimed, tuple(states), tuple(types), tuple(kepts)
        # Released, a holder has nothing installed: only the holders that install values (hoisted
        # or detached ones, not kept ones) have their names written at each claim.
        plan.installing, plan.installed = columns([(hs, names) for hs, names in zip(states, installed) if names], 2)
        plan.shareable, plan.ones = tuple(shares), [1] * len(states)
        plan.switched, plan.inside, plan.outside = tuple(switched), tuple(inside), tuple(outside)
        plan.callees = tuple(callees)
        plan.callee_types = tuple(map(type, callees))
        plan.callee_classes = tuple(dict.fromkeys(plan.callee_types))
        plan.callee_paths = list(map(_call_path, plan.callee_classes))
        # What makes a callee's call more than its forward on the instance (a hook, a forward or
        # compiled call set on it, its __class__ set) is decided now and kept by the checks every
        # call makes anyway: its __dict__'s tag, its hook dicts empty, its type. Only what is
        # read from the class or process (call paths, global hooks, JIT tracing) is read live.
        plan.direct = bool(callees) and not any(map(overrides_its_call, plan.callees))
        if plan.direct:
            for callee in plan.callees:
                own = vars(callee)
                if id(own) not in settings:
                    structure[id(own)] = own
                empty.update((id(d), d) for d in _hooks(own))
            typed.extend(zip(plan.callees, plan.callee_types))
        plan.link_dicts, plan.link_keys, plan.links = columns(value_links, 3)
        # The key lists of chains longer than one, their order (a copy's equality would not see
        # it where tags cannot be read).
        plan.ordered, plan.order = ordered, list(map(list, ordered))
        plan.stateful = tuple(stateful)
        plan.mode_modules, plan.modes = columns(modes, 2)
        plan.flag_tensors, plan.flags = columns(flags, 2)
        # Inputs without a storage address (tensor subclasses), and a wrapper subclass's inner
        # tensors found outside a dict whose tag is checked (freeze._Attributes), keep
        # same_inputs' own handling.
        addressed, unaddressed = [], []
        for w in watch:
            (addressed if w[4] and type(w[2]) in PLAIN_TENSOR_TYPES and isinstance(w[0], dict) else unaddressed).append(w)
        plan.unaddressed = tuple(unaddressed)
        plan.input_dicts, plan.input_keys, plan.inputs, versions, addresses, layouts = columns(addressed, 6)
        plan.addresses = list(addresses)
        # A write-marked tensor's version counter needs no reading: whatever bumps it (an in-place
        # op, copy_, an optimizer step) writes its storage, which clears the mark checked below.
        # An inference tensor has none (None): it is marked or its bytes are checked.
        marked = set(map(id, armed))
        plan.versioned, versions = columns(
            [(t, v) for t, v in zip(plan.inputs, versions) if id(t) not in marked and v is not None] + switches, 2)
        plan.versions = list(versions)
        plan.raw_memory, digests = columns(raw, 2)
        plan.raw_digests = list(digests)
        plan.views = tuple(views)
        plan.values, versions, value_layouts, value_addresses = columns(kept, 4)
        plan.versioned_values, versions = columns(
            [(t, v) for t, v in zip(plan.values, versions) if id(t) not in marked and v is not None], 2)
        plan.value_versions = list(versions)
        # A value's storage replaced (``w.set_(other)``, ``w.data = other`` on a value a forward
        # returned) bumps no version, or writes no storage: the mark read may be ``other``'s.
        plain = [type(t) in PLAIN_TENSOR_TYPES for t in plan.values]
        plan.addressed_values, addresses = columns([(t, a) for t, a, p in zip(plan.values, value_addresses, plain) if p], 2)
        plan.value_addresses = list(addresses)
        plan.other_values, addresses = columns([(t, a) for t, a, p in zip(plan.values, value_addresses, plain) if not p], 2)
        plan.other_value_addresses = list(addresses)
        plan.armed, plan.armings = tuple(armed), ARMINGS[0]  # each value's counts checked above
        plan.armed_keys, plan.armed_counts = tuple(armed_keys), armed_counts
        plan.armed_checks, plan.value_ids = tuple(armed_checks), frozenset(map(id, plan.values))
        plan.settings_empty = tuple(empty.values())
        # One check per call of every dict's tag and every tensor's description. The frozen
        # values' settings and inputs hold what they were computed with, which the general path
        # just found unchanged; the structure as that path leaves it, having checked just now that
        # everything is prepare's.
        full, then = columns(list(settings.values()), 2)
        try:
            if (list(map(tag, full)) != list(then) or list(map(layout, plan.inputs)) != list(layouts)
                    or list(map(layout, plan.values)) != list(value_layouts)):
                return None
        except Exception:  # a copy's entry replaced by a tensor, where torch reads no tags
            return None
        # Each member's class, every pinned __dict__, and the entries and keys of dicts a call
        # writes (a holder's __dict__), checked with the tags in one pass. Not what a scope changes (the
        # holders' classes, the hoisted values it puts in): the plan is built inside one, where
        # the last plan's watch would not hold, and those are checked apart. Its guard manager
        # (about 10 ms for the seed's 64 sites) is built at the plan's first use, not in the call
        # that builds the plan (a model's first, compiling one among them): a plan that never
        # serves a call costs none.
        ids = Identities(types=typed, dicts=dicted.values(), entries=links, keys=forward_keys)
        # A switch of the structure's modules' training flags (model.train(), model.eval()) is
        # let through where nothing else changed (Watch.same_but_training): the flags that decide
        # a value are checked apart (modes, stateful), and a chain a frozen value was computed
        # by, or whose draws are watched, has its members' dicts among the settings, held whole.
        fixed = [d for k, d in structure.items() if k not in settings]
        plan.watch = Watch((*fixed, *full), (*plan.inputs, *plan.values),
                           previous.watch if previous is not None else None, ids, rooted_after=1, flags_free=len(fixed))
        plan.hoisted = tuple(hoisted)
        plan.demoted = any(h[6] for h in hoisted)
        plan.hooked, plan.hook_dicts, plan.hook_dict_keys = tuple(hooked), tuple(hook_dicts), hook_dict_keys
        plan.onces = tuple(onces)
        # (Empty now, their norms' hooks out: held to hook_dict_keys instead.)
        plan.pre_hooks_empty = tuple(d for d in plan.pre_hooks_empty if not any(d is h for h in hook_dicts))
        plan.hoisted_dicts = tuple(h[0] for h in hoisted)
        plan.hoisted_names = tuple(h[1] for h in hoisted)
        (plan.copied_sites, plan.copied_dicts, plan.copied_names, plan.copied_from, plan.copied_to,
         onces_copied) = columns(copied, 6)
        # Hook-based norms' values stay in __dict__, read or not: their stand-ins tell, where any.
        plan.copied_onces = onces_copied if any(o is not None for o in onces_copied) else None
        plan.copied_tensors, plan.copied_dtypes = copied_list, fusable(copied_list)
        plan.copied_state_dicts, plan.copied_state_keys = map(list, columns(copied_entries, 2))
        plan.until = min(until) if until else None
        plan.site_states = tuple(site_states)
        plan.missed = tuple(missed)
        return plan

    def claim(self) -> None:
        """Claim every holder (the caller holds the scope lock and has checked :func:`holds`),
        then compute the hoisted values and the hook-based norms'. On an exception (every training
        stateful chain's state put back first) the caller releases ``claimed``."""
        self.used = True
        self.enter()
        if self.missed:  # their frozen values served a call unchanged: the changes were not in a row
            for site in self.missed:
                site.misses = site.demotions = 0
            self.missed = ()
        copies = None
        if self.copied_sites:  # training stateful chains: their state now (paramfold.unread)
            copies = Copies(self.copied_tensors, self.copied_state_dicts, self.copied_state_keys, self.copied_dtypes)
            _run(map(setattr, self.copied_sites, repeat("before"),
                     zip(repeat(copies), self.copied_from, self.copied_to, repeat(None), repeat(None))))
        try:
            if self.hoisted:
                self.compute_hoisted()
            if self.hooked:
                self.install_hooked()
        except BaseException:
            if copies is not None:  # nothing read yet: every state as before, a chain's that raised midway too
                copies.computed()
                _run(map(put_back, self.copied_sites))
            raise
        if copies is not None:
            copies.computed()

    def install_hooked(self) -> None:
        """Each hook-based norm's value, frozen or computed by its hook's ``compute_weight``, put in
        its module's ``__dict__`` (the last call's value noted as replaced), then the hooks taken
        out for the call: what the general path does for them (``scope._install``)."""
        for holder, hs, values, hooks in self.hooked:
            replaced = []
            for name, hook, _, frozen, arguments in hooks:
                value = hook.compute_weight(holder, **arguments) if frozen is None else frozen
                replaced.append((name, values.get(name, MISSING)))
                values[name] = value
            hs.replaced = tuple(replaced)
            # hooknorms.detach, written out: the dict holds these hooks alone (holds() checked its keys).
            pre_hooks = holder._forward_pre_hooks
            order = tuple(pre_hooks)
            taken = list(pre_hooks.items())
            pre_hooks.clear()
            hs.hooks_out = (taken, order, [])
        for once in self.onces:
            once.served = once.called = False

    def enter(self) -> None:
        """:meth:`claim`'s bookkeeping: the holders' classes and claim counts, as the general path leaves them."""
        _run(map(_set_class, self.switched, repeat("__class__"), self.inside))
        self.count = Installs.count
        states = self.states
        _run(map(setattr, states, repeat("users"), self.ones))
        _run(map(setattr, self.installing, repeat("installed"), self.installed))
        _run(map(setattr, states, repeat("shareable"), self.shareable))

    def compute_hoisted(self, hoisted: tuple | None = None) -> None:
        """Write every hoisted site's value into its module's ``__dict__``, computed like stock.

        Where :meth:`plain_calls` holds, a chain member's ``forward`` is called directly: with no
        hook, no compiled or instance override and no JIT tracing, ``nn.Module.__call__`` does
        exactly that, through two more Python frames per member (about 3 us each call here).
        Otherwise (a hook, its own or global, a patched call, a ``ParametrizationList`` whose call
        is more than its ``forward``) each value is computed the way stock calls it
        (:func:`~paramfold.compute.compute`). ``hoisted``: those entries only (else all)."""
        direct = self.direct and self.plain_calls()
        if hoisted is None:
            hoisted = self.hoisted
            if self.demoted and _inference_mode():
                # Freeze and auto sites computed at every call for a while: as their frozen values
                # are, outside inference_mode (site_values._uncached); the others as the call is.
                with torch.inference_mode(False), torch.no_grad():
                    self.compute_hoisted(tuple(h for h in hoisted if h[6]))
                hoisted = tuple(h for h in hoisted if not h[6])
        for values, name, holder, originals, chain, forwards, _ in hoisted:
            if chain is None or forwards is None or not direct:
                value = compute(holder, name)
            else:
                args = []
                for d, key in originals:  # a plain loop: a comprehension would be a frame of its own
                    args.append(d[key])
                value = forwards[0](chain[0], *args)
                for i in range(1, len(chain)):
                    value = forwards[i](chain[i], value)
            values[name] = value

    def plain_calls(self) -> bool:
        """Whether calling each member in ``callees`` is, right now, exactly calling its class's
        ``forward``: what ``nn.Module._wrapped_call_impl`` and ``_call_impl`` check. The
        instances' part was found so when the plan was built (``direct``), and :func:`holds` has
        just found it unchanged; this reads the rest live: JIT tracing, global hooks and each
        class's call path (a patched ``nn.Module.__call__``, a class ``forward`` replaced)."""
        if _tracing_state() is not None or any(GLOBAL_HOOKS):
            return False
        return list(map(_call_path, self.callee_classes)) == self.callee_paths

    def release(self) -> bool:
        """Undo :meth:`claim` where no other scope shares a holder and no class was swapped
        meanwhile (the caller holds the scope lock); False leaves it to the general release."""
        if (list(map(_users, self.states)) != self.ones or not all(map(is_, map(type, self.switched), self.inside))
                or Installs.count != self.count):  # values computed again inside the call (a kept one replaced)
            return False
        if self.copied_sites:
            # Where no read took a training stateful chain's value, its state as before the call.
            unread = list(map(contains, self.copied_dicts, self.copied_names))
            if self.copied_onces is not None:  # a hook-based norm's value stays: unread where no call was served it
                unread = [u if once is None else not once.served for u, once in zip(unread, self.copied_onces)]
            if True in unread:
                for site, not_read, values, name in zip(self.copied_sites, unread, self.copied_dicts, self.copied_names):
                    if not_read:
                        give_back(values, name, site)
            _run(map(setattr, self.copied_sites, repeat("before"), repeat(None)))
        _run(map(dict.pop, self.hoisted_dicts, self.hoisted_names, repeat(None)))
        for holder, hs, _, _ in self.hooked:  # the hooks back in their places; the values stay, as stock's
            out = hs.hooks_out
            if out:
                pre_hooks = holder._forward_pre_hooks
                if pre_hooks or out[2] or len(out[0]) != len(out[1]):  # hooks registered, or one put back, meanwhile
                    hooknorms.attach(holder, *out)
                else:
                    pre_hooks.update(out[0])
            hs.hooks_out = hs.replaced = ()
        states = self.states
        _run(map(setattr, states, repeat("users"), repeat(0, len(states))))
        _run(map(setattr, self.installing, repeat("installed"), repeat((), len(self.installing))))
        _run(map(_set_class, self.switched, repeat("__class__"), self.outside))
        return True


def _hooks_servable(holder: nn.Module, hs: ModuleState) -> bool:
    """Whether the hooks the general path took out of ``holder`` for this call are all its
    hook-based norms', and were the only forward pre-hooks there, with none registered since;
    the stand-ins the general path left (``ONCE_ATTR``) are those of its spectral_norms."""
    taken, order, prepended = hs.hooks_out
    hooked = [site for site in hs.sites.values() if site.hook is not None]
    served = {id(site.hook) for site in hooked}
    onces = tuple(site.once_hook for site in hooked if site.stateful)
    standing = holder.__dict__.get(ONCE_ATTR, ())
    return (not prepended and not holder._forward_pre_hooks and len(taken) == len(order) and not hs.left
            and all(id(hook) in served for _, hook in taken)
            and len(standing) == len(onces) and all(map(is_, standing, onces)))


#: The arguments of a hook's ``compute_weight`` (``hooknorms.compute``): a spectral_norm runs its
#: power iteration while its module trains.
_NO_ARGS: dict = {}
_EVAL_NORM = {"do_power_iteration": False}
_TRAINING_NORM = {"do_power_iteration": True}


def _plain_call(module: nn.Module) -> bool:
    """Whether with no hooks a call of ``module`` is a call of its class's ``forward`` function
    (:func:`~paramfold.compute.class_forward`); the instance's part is
    :func:`~paramfold.compute.overrides_its_call`, the class's as it is now :meth:`Plan.plain_calls`."""
    return class_forward(type(module)) is not None


def _rearm_values(plan: Plan) -> bool:
    """Whether each mark found cleared is a kept value's that nothing wrote (its version, address
    and bytes those it was armed with) and nothing else holds, set again: a kernel of the
    compiled code that takes a writable pointer only to read clears it at every call (inductor's
    mkldnn convolutions on a conv weight), and the general path would find the same at every
    call, through a walk of every site (:func:`paramfold.write_marks.rearm_unwritten`, which also
    takes an input's mark, or a value something else holds, to a byte check at every call)."""
    for t, armed_check in zip(plan.armed, plan.armed_checks):
        if is_armed(t):
            continue
        if id(t) not in plan.value_ids or not unwritten(t, armed_check) or not unshared(t) or not arm(t, again=True):
            return False
    return True


def sites_as_built(plan: Plan) -> bool:
    """Whether each site's choices are those ``plan`` was built on: where a chain is computed,
    whether it draws, its watch of its settings, its sharers, its frozen value. A dict written
    and written back since (:meth:`~paramfold.watch.Watch.same_but_training`) holds what it held
    then, but a call meanwhile may have changed a choice from it (a chain found drawing while a
    setting was switched), which a plan kept aside since does not know."""
    return all(site.at_read is at_read and site.raised is raised and site.draws is draws and site.draw_watch is watch
               and site.state_sharers is sharers and site.hoist_until == until and site.frozen is frozen
               for site, at_read, raised, draws, watch, sharers, until, frozen in plan.site_states)


def holds(plan: Plan) -> bool:
    """Whether everything ``plan`` was built on is unchanged: the checks of the general path
    (:func:`paramfold.scope._check_unchanged`, :func:`paramfold.freeze.unchanged` and the mode
    choices), over flat columns, cheapest first. Runs at every call, under the scope lock."""
    try:
        if plan.until is not None and CALLS[0] >= plan.until:  # freezing those sites is tried again
            return False
        states = plan.states
        if any(map(_users, states)) or not all(map(is_, map(_kept, states), plan.kepts)):
            return False
        if computed_under() != plan.under:
            return False
        if not all(map(is_, map(type, plan.claimed), plan.types)):
            return False
        if any(plan.pre_hooks_empty) or list(map(list, plan.pre_hooks)) != plan.pre_hook_keys:  # one added or removed
            return False
        if plan.hook_dicts and list(map(list, plan.hook_dicts)) != plan.hook_dict_keys:  # a hook-based norm's layer's
            return False
        if not all(map(is_, map(getitem, plan.link_dicts, plan.link_keys), plan.links)):  # a kept value replaced
            return False
        if any(map(contains, plan.hoisted_dicts, plan.hoisted_names)):  # a tensor put where a value is hoisted to
            return False
        # The structure's tags, the inputs' and values' descriptions, the members' classes, every
        # checked module's __dict__, a forward set on a holder or taken off it, a value put where
        # one is computed at its read.
        if not (plan.watch.same() or (sites_as_built(plan) and plan.watch.same_but_training())) or (
                list(map(list, plan.ordered)) != plan.order):
            return False
        if any(map(_training, plan.stateful)) or not all(map(is_, map(_training, plan.mode_modules), plan.modes)):
            return False
        if not all(map(is_, map(_requires_grad, plan.flag_tensors), plan.flags)):
            return False
        if list(map(_version, plan.versioned)) != plan.versions:
            return False
        if list(map(_data_ptr, plan.inputs)) != plan.addresses or not same_inputs(plan.unaddressed):
            return False
        if list(map(_version, plan.versioned_values)) != plan.value_versions:  # edited in place by a forward
            return False
        if list(map(_data_ptr, plan.addressed_values)) != plan.value_addresses or (
                plan.other_values and list(map(_address, plan.other_values)) != plan.other_value_addresses):
            return False
        # Written without a version bump, or armed again since (for another value on the storage).
        if plan.armings != ARMINGS[0]:
            # Something was armed since, anywhere (another model's frozen values): a change here
            # only where one of this plan's storages was stamped afresh.
            if arming_stamps(plan.armed_keys) != plan.armed_counts:
                return False
            plan.armings = ARMINGS[0]
        if plan.armed and not all(map(is_armed, plan.armed)) and not _rearm_values(plan):
            return False
        if any(plan.settings_empty):  # freeze.same_settings' other half
            return False
    # A key gone, a tensor without storage or version now, a setting replaced by a tensor or an
    # array (whose == is elementwise).
    except (LookupError, RuntimeError, ValueError, TypeError):
        return False
    if plan.raw_memory and list(map(digest, plan.raw_memory)) != plan.raw_digests:
        return False
    for view, copy in plan.views:
        if not torch.equal(view, copy):
            return False
    return True


# paramfold's own work: dynamo runs it eagerly when it meets it as a frame (paramfold.frames).
run_module_eagerly_as_frames(globals())
