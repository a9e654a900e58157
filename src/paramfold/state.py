"""What paramfold keeps on a prepared module, in its instance ``__dict__`` under ``STATE_ATTR``."""

from __future__ import annotations

import copy
import dataclasses
import functools
import operator
import sys
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.autograd.forward_ad as forward_ad
from torch import nn

from paramfold import hooknorms
from paramfold.compute import is_nested, leaf_originals, members
from paramfold.errors import with_article
from paramfold.frames import run_module_eagerly_as_frames

STATE_ATTR = "_paramfold"
#: Where a holder with a stateful hook-based norm keeps its ``hooknorms.ServedOnce`` stand-ins
#: (instance ``__dict__``), for its read-once class's ``__call__`` and ``forward``.
ONCE_ATTR = "_paramfold_once"
#: What a hook-based norm's layer's ``__dict__`` held under the value's name before a call put
#: this call's there, where it held nothing (``ModuleState.replaced``).
MISSING = object()

#: How freeze tells that a frozen value's inputs changed (``prepare(..., freeze_check=...)``).
FREEZE_CHECKS = ("content", "version")


@dataclasses.dataclass(eq=False)
class FrozenValue:
    value: torch.Tensor
    #: Per input: ``(dict, key, tensor, version, storage address, description)``, the
    #: description being ``watch.layout``'s (type, dtype, device, shape, strides, requires_grad,
    #: conjugate and negative bits); the version None for an inference tensor (:func:`version_of`).
    watch: tuple[tuple, ...]
    #: ``len()`` of each tensor dict, so an added parameter or buffer counts as a change.
    sizes: tuple[int, ...]
    #: With ``freeze_check="content"``: ``(the bytes in place as a ctypes array, their
    #: write_marks.digest)`` of each contiguous host input; ``(byte view, copy)`` of the others
    #: (compared with ``torch.equal``). Inputs whose bytes cannot be read as one view (wrapper
    #: subclasses, meta tensors) have neither.
    raw: tuple[tuple[object, int], ...] = ()
    views: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    #: What else the value was computed from (``freeze.settings``): every chain member's
    #: ``__dict__`` (its plain attributes: a temperature, a scale, ``training``), ``_modules`` and
    #: forward hooks, their classes' dicts, the ``ParametrizationList``'s forward hooks and the global ones (a
    #: hook-based norm: its hook's attributes). Those empty just after computing must stay empty
    #: (``settings_empty``); for the others, ``settings_then`` holds what ``freeze.tag`` read of
    #: each then (its version tag, or a copy where versions cannot be read).
    settings_empty: tuple[dict, ...] = ()
    settings: tuple[dict, ...] = ()
    settings_then: list = dataclasses.field(default_factory=list)
    #: What it was computed under besides its inputs: the autocast state, torch's numerics
    #: settings and the modes active (``compute.computed_under``).
    under: tuple = ()
    #: ``value``'s own version counter when it was computed: a forward that edits the value it
    #: was given in place (stock gives it a fresh tensor at every read) makes it stale.
    value_version: int = 0
    #: The value and (``freeze_check="version"``) the inputs whose storages ``write_marks.arm``
    #: watches: each must still be armed, or something wrote to it without a version counter
    #: seeing it (through ``.data``, ``untyped_storage()``, a numpy array taken since).
    armed: tuple[torch.Tensor, ...] = ()
    #: Their storages' identities and when each was last armed (``write_marks._armings``).
    armed_keys: tuple[int, ...] = ()
    armed_counts: list = dataclasses.field(default_factory=list)
    #: ``value``'s description (``watch.layout``): a forward may re-describe it through ``.data``.
    value_layout: tuple = ()
    #: The chain's modules (the ``ParametrizationList`` and every module below it) and their
    #: classes (``member.__class__ = Other`` touches no dict), then the objects its custom members
    #: hold (``paramfold.held``) and theirs.
    members: tuple = ()
    member_types: tuple = ()
    #: Every object whose ``__dict__`` is among ``settings`` (the chain's modules, the list included,
    #: the held objects) and the ``__dict__`` each had (``obj.__dict__ = {...}`` touches no tag).
    held: tuple = ()
    held_dicts: tuple = ()
    #: The ``OrderedDict`` among ``settings`` and their keys in order (``move_to_end`` touches no tag).
    ordered: tuple = ()
    order: list = dataclasses.field(default_factory=list)
    #: Per tensor of ``armed``: ``(version, storage address, (bytes in place, digest))`` as it was
    #: armed, or None where its bytes are not one contiguous host buffer. A mark cleared with
    #: these unchanged is set again (``write_marks.rearm_unwritten``): a kernel that takes a writable
    #: pointer and writes nothing (inductor's freezing packs a frozen weight so) clears it.
    armed_checks: tuple = ()
    #: ``(__dict__, its entries but torch's compile bookkeeping)`` of each wrapper subclass
    #: input (``freeze.only_bookkeeping``): dynamo marks a tensor it meets in its ``__dict__``.
    wrapped: tuple = ()
    #: ``value``'s storage address when it was computed: a caller that edits the value a forward
    #: returned (``w.data = other``, ``w.set_(other)``) gives it another storage, armed or not.
    value_address: int = 0


@dataclasses.dataclass(eq=False)
class SiteState:
    """One prepared tensor: how it is served, and where its inputs live (looked up once)."""

    mode: str
    stateful: bool
    plist: nn.Module
    #: The parametrizations, in order (``compute.members``).
    chain: tuple[nn.Module, ...]
    #: ``plist._modules`` values at prepare time: a cheap test that nothing was appended or removed.
    modules: tuple[nn.Module, ...]
    #: (dict, key) of each leaf original, so reads see assign=True replacements.
    originals: tuple[tuple[dict, str], ...]
    #: Every non-empty ``_parameters``/``_buffers`` dict of the ParametrizationList and its
    #: members (a hook-based norm's: its module's).
    tensor_dicts: tuple[dict, ...]
    #: ``(owner, "_parameters" or "_buffers", dict)`` for each of ``tensor_dicts``: the dicts are
    #: read as captured, so a wholesale replacement (``m._parameters = {...}``, or the owner's
    #: whole ``__dict__`` replaced by one holding another) must be caught before a captured one is
    #: trusted: ``vars(owner)[name] is dict``, the owner's ``__dict__`` read as it is now.
    dict_pins: tuple[tuple[nn.Module, str, dict], ...] = ()
    #: Whether an original is itself parametrized (computed through the inner chain).
    nested: bool = False
    freeze_check: str = "content"
    frozen: FrozenValue | None = None
    #: Inline sites: (instance attribute, ``inline.DictRef`` of the dict, key) of each original a
    #: generated getter reads.
    original_refs: tuple[tuple[str, Any, str], ...] = ()
    #: Inline sites: what the generated getter was made for (``inline.chain_signature``).
    signature: tuple | None = None
    #: Nested inline sites (computed by stock's property, in-graph): the hooks of every module
    #: of the chain at ``prepare`` (``inline.hook_keys``), which compiled code does not guard.
    hook_keys: tuple | None = None
    #: What the values are (known once one was computed): "" plain tensors, "wrapper" traceable
    #: wrapper subclasses (``__tensor_flatten__``), "python" other subclasses
    #: (``x.as_subclass(MyT)``). Compiled code cannot take the last as graph inputs, and
    #: AOTAutograd does not carry gradients from a wrapper graph input back to the originals it
    #: was built from: such values are computed where they are read, in-graph, the first always,
    #: the second whenever they need grad (``site_values._at_read``).
    subclass: str | None = None
    #: Whether the last call scope left this tensor to be computed where it is read (below a
    #: forward pre-hook, FSDP2-sharded originals, a subclass compiled code cannot take): a
    #: checkpointed region's recomputation then computes it with autograd too, as its forward did.
    at_read: bool = False
    #: Whether computing the value at the last call scope's start raised, so that call computes
    #: it where it is read (``scope._install``); the next computes it at its start again.
    raised: bool = False
    #: Hook-based norms (``paramfold.hooknorms``): torch's hook object, its kind and its key in
    #: ``module._forward_pre_hooks``.
    hook: Any = None
    hook_kind: str = ""
    hook_key: int = -1
    #: A stateful hook-based norm's stand-in (``hooknorms.ServedOnce``), which the read-once
    #: class's ``forward`` runs: the scope's value serves the module's first call, its hook the others.
    once_hook: Any = None
    #: While a call scope's value of a training stateful chain is unread: where the copy of the
    #: chain's buffers from before the scope computed it is (``paramfold.unread``), to put back
    #: if no read takes the value.
    before: Any = None
    #: Whether the value the last call scope opened inside ``parametrize.cached()`` installed was
    #: already in the block's cache (an earlier read or call of the block): stock's reads in that
    #: call return it whatever the forward changes before them (``scope_nested.changed``).
    from_cache: bool = False
    #: Every tensor of ``tensor_dicts`` when a call scope last put this site's value in its
    #: module's ``__dict__``: a call nested in that scope compares them, to see originals swapped
    #: inside the forward (``torch.func.functional_call`` of a submodule).
    read_from: tuple = ()
    #: The chain the value in ``__dict__`` was computed with, where a nested call computed it with
    #: members appended or removed inside the forward (``scope_nested``); () for ``modules``.
    read_chain: tuple = ()
    #: Whether ``read_from`` holds a tensor put in for one call (:func:`for_one_call`), which
    #: the scope lets go of when the call ends (``scope._unclaimed``).
    read_for_one_call: bool = False
    #: freeze and auto: how many frozen values in a row served no later call (their inputs
    #: changed, or a grad call of auto's dropped them), how many times the site was computed at
    #: every call for that since a value last served one, and the value of :data:`CALLS` until
    #: which it is (``site_values._demote``).
    misses: int = 0
    demotions: int = 0
    hoist_until: int = 0
    #: Whether the chain changes its state in eval mode too (``Site.stateful_in_eval``).
    stateful_in_eval: bool = False
    #: Whether the chain draws random numbers now, though prepare's probe found it did not (a
    #: noise scale set above 0 since), or changes its state as prepare did not plan for
    #: (``sites.draws_random_numbers``): computed where it is read, as stock does, or refused by
    #: freeze. ``draw_watch``: its settings, and the version counters of the tensors that may switch
    #: it on, when it was last probed (``paramfold.randomness``).
    draws: bool = False
    draw_watch: Any = None
    #: Where this chain shares state with another site's (one stateful member registered on two
    #: tensors, a buffer held by both; ``prepare.state_sharers``, ``scope._share_with_late`` for a
    #: layer added after prepare): the members (a hook-based norm: its module) whose ``training``
    #: flag says that computing a stateful chain of those changes that state, and whether one
    #: changes it in eval mode too.
    state_sharers: tuple[nn.Module, ...] = ()
    sharers_in_eval: bool = False

    @property
    def training_stateful(self) -> bool:
        """Whether computing the value now changes the chain's state: a stateful chain with a
        member in training mode, or one that changes it in eval mode too."""
        return self.stateful and _changes_now(self.stateful_in_eval, self.chain)

    @property
    def shares_changing_state(self) -> bool:
        """Whether computing this value, or another site's that shares its chain's state, changes
        that state now: stock computes each at its reads, in the forward's order, and so must
        the scope (a value computed for every site before the call, in module order, would see
        and leave that state as no read of stock's does)."""
        return bool(self.state_sharers) and _changes_now(self.sharers_in_eval, self.state_sharers)

    def __deepcopy__(self, memo: dict) -> SiteState:
        """A copy for a copied module, without what belongs to one open call of this one
        (``before``: a copy of the model made inside its forward opens its own calls), and
        without its frozen value: the copy freezes its own at its first call, keyed on its own
        tensors and dicts, as stock's copy computes its value at its first read.

        A frozen value is keyed on this module's objects, as they were when it was computed:
        its inputs (tensors, versions, storage addresses, armed storages, bytes in place), its
        members' and their classes' dicts (which ``copy.deepcopy`` cannot copy where a class
        holds a ``staticmethod``, a ``classmethod`` or ``abc.ABC``'s data, and which a copy of
        the copied module would not follow anyway). None of those keys holds for the copy.

        ``read_from`` may hold tensors swapped in for the last call (``torch.func.functional_call``
        with ``p + delta``; inside ``vmap``, its wrappers), which ``copy.deepcopy`` refuses when
        they have an autograd history or are a ``torch.func`` transform's wrappers: the copy then
        starts with none, so its nested calls take its inputs for swapped (computed afresh) until
        its first call scope records its own."""
        dropped = _OPEN_CALL | {"frozen"}
        if any(map(_uncopyable, self.read_from)):
            dropped = dropped | {"read_from"}
        replica = _copy_fields(self, memo, dropped)
        if "read_from" in dropped:
            replica.read_from = ()
        return replica


#: Whether a tensor is one of torch.func's wrappers (vmap's batched tensors, grad's), which have
#: no storage of their own (to copy, or to mark).
functorch_wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", lambda t: False)


def carries_tangents(t: torch.Tensor) -> bool:
    """Whether ``t`` may carry forward-mode derivatives, which ``detach()`` drops: a dual tensor
    of the current forward-AD level (``fwAD.make_dual``, put in by ``functional_call``), or a
    torch.func transform's wrapper (jvp's and jacfwd's carry tangents, at each of their levels;
    every wrapper is made anew at each call of its transform)."""
    return functorch_wrapped(t) or forward_ad.unpack_dual(t).tangent is not None


def for_one_call(t: object) -> bool:
    """Whether ``t``, found in a module's dict, looks put there for one call rather than held by
    the module: a tensor with an autograd history (``functional_call(model, {n: p + delta})``, a
    MAML step's adapted weights), a view (of an original: ``p[:]``, ``fwAD.make_dual(p, t)``) or a
    torch.func transform's wrapper. Kept past its call, it would keep alive what stock frees (the
    history; a view's base, which ``torch.utils.swap_tensors`` then refuses to swap)."""
    return isinstance(t, torch.Tensor) and (t.grad_fn is not None or t._is_view() or functorch_wrapped(t))


def _uncopyable(t: object) -> bool:
    """Whether ``copy.deepcopy`` refuses ``t``: a tensor with an autograd history, or a
    torch.func transform's wrapper."""
    return isinstance(t, torch.Tensor) and (t.grad_fn is not None or functorch_wrapped(t))


#: Call scopes opened so far, in every thread (counted under the scope lock): the clock of the
#: periods in which freeze and auto compute a site at every call (``SiteState.hoist_until``).
CALLS = [0]


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor`` (without importing it)."""
    return _is_dtensor_type(type(tensor))


@functools.cache
def _is_dtensor_type(cls: type) -> bool:
    return any(c.__name__ == "DTensor" and c.__module__.startswith("torch.distributed") for c in cls.__mro__)


def distributed(site: SiteState) -> bool:
    """Whether an original of ``site`` is a DTensor *now*: sharded by FSDP2 between calls (its
    pre-forward hook swaps in the gathered tensor only for the layer's own forward), or by a
    communication parametrization. Such values are computed where they are read, never earlier."""
    for d, key in site.originals:  # called for every site at every call scope: a plain loop
        cls = type(d[key])
        if cls not in PLAIN_TENSOR_TYPES and _is_dtensor_type(cls):
            return True
    return False


def syncs_before_forward(module: nn.Module) -> bool:
    """Whether ``module`` is a wrapper whose forward writes into the wrapped module's tensors before
    calling it: DDP broadcasts rank 0's buffers (spectral_norm's ``_u``/``_v``) in place, with no
    version bump, at the start of every forward; FSDP1 (``FullyShardedDataParallel``) gathers the
    parameters its forward reads (flat shards between calls). Values below it are computed after that."""
    if isinstance(module, _DDP):
        return True
    # FSDP1 is looked up only once torch has imported it: no instance exists before.
    fsdp = sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel")
    cls = getattr(fsdp, "FullyShardedDataParallel", None)
    return cls is not None and isinstance(module, cls)


_DDP = tuple(c for c in (getattr(torch.nn.parallel, "DistributedDataParallel", None),) if c is not None)


#: The tensor types that are not subclasses: they override none of TensorBase's accessors.
PLAIN_TENSOR_TYPES = frozenset({torch.Tensor, nn.Parameter})

def _changes_now(in_eval: bool, modules: tuple[nn.Module, ...]) -> bool:
    """Whether computing a stateful chain changes its state now: always where it does in eval mode
    too, else while one of ``modules`` is training."""
    if in_eval:
        return True
    for m in modules:
        if m.training:
            return True
    return False


def version_of(t: torch.Tensor) -> int | None:
    """``t``'s version counter; None for an inference tensor (made inside ``torch.inference_mode()``),
    which has none: it can be written in place only inside inference mode, where no counter moves,
    so such an input is always marked (``write_marks.arm``) or has its bytes checked, whatever the check."""
    try:
        return t._version
    except RuntimeError:
        return None


# Plain tensors' accessors, as C callables for map() (only for tensors whose type is in
# PLAIN_TENSOR_TYPES): the version counter and the storage address. An attrgetter
# reaches TensorBase's getter through the type's attribute cache, a fifth faster than calling the
# descriptor's __get__. The address is read without asking for write access
# (``const_data_ptr``), which would disarm a storage that write_marks.arm watches.
tensor_version = operator.attrgetter("_version")
tensor_data_ptr = getattr(torch._C.TensorBase, "const_data_ptr", torch._C.TensorBase.data_ptr)
#: The innermost torch.func transform running (grad, vmap, jacrev, ...), None outside them.
innermost_transform = getattr(torch._C._functorch, "peek_interpreter_stack", lambda: None)


def site_state(module: nn.Module, name: str, mode: str, stateful: bool, freeze_check: str = "content",
               stateful_in_eval: bool = False) -> SiteState:
    plist = module._modules["parametrizations"]._modules[name]
    originals = tuple((d, k) for _, d, k in leaf_originals(plist))
    pins = tuple(pin for pin in _dict_pins(plist.modules()) if pin[2])  # the non-empty dicts
    return SiteState(
        mode, stateful, plist, members(plist), tuple(plist._modules.values()), originals,
        tuple(d for _, _, d in pins), dict_pins=pins, nested=is_nested(plist), freeze_check=freeze_check,
        stateful_in_eval=stateful_in_eval,
    )


def _dict_pins(modules: Iterable[nn.Module]) -> tuple[tuple[nn.Module, str, dict], ...]:
    """``(module, name, dict)`` of each module's ``_parameters`` and ``_buffers``."""
    return tuple((m, attr, m.__dict__[attr]) for m in modules for attr in ("_parameters", "_buffers"))


def state_for(site: Any, mode: str, freeze_check: str = "content") -> SiteState:
    """The :class:`SiteState` of a :class:`paramfold.Site` (a parametrization or a hook-based norm)."""
    if not site.hook_based:
        return site_state(site.module, site.tensor_name, mode, site.stateful, freeze_check, site.stateful_in_eval)
    hook = site.chain[0]
    key = next(k for k, h, _ in hooknorms.hook_norms(site.module) if h is hook)
    return hook_site_state(site.module, key, hook, site.kind, mode, freeze_check)


def hook_site_state(module: nn.Module, key: int, hook: object, kind: str, mode: str, freeze_check: str) -> SiteState:
    """A :class:`SiteState` for a tensor computed by torch's hook-based weight_norm/spectral_norm."""
    originals = tuple((d, k) for _, d, k in hooknorms.originals(module, hook, kind))
    pins = _dict_pins((module,))
    return SiteState(
        mode, kind == "spectral_norm", None, (module,), (), originals,
        (module._parameters, module._buffers), dict_pins=pins, freeze_check=freeze_check,
        hook=hook, hook_kind=kind, hook_key=key,
    )


@dataclasses.dataclass(eq=False)
class ModuleState:
    original_class: type
    #: The tensor names stock's class had properties for at prepare time (``original_class`` is
    #: then stock's per-instance ``Parametrized*`` class); empty for unparametrized modules.
    stock_names: frozenset[str] = frozenset()
    #: The shared class this module was switched to.
    prepared_class: type | None = None
    #: This module's own prepared tensors, by name.
    sites: dict[str, SiteState] = dataclasses.field(default_factory=dict)
    #: Whether plain parameters of this module are detached under no_grad.
    detach_params: bool = False
    #: ``(name, parameter)`` of each plain parameter presented detached in ``__dict__`` by the
    #: last call scope (under ``no_grad``); a nested call takes out those that stopped standing for
    #: stock's read (``scope_nested.undetach``).
    detached: tuple = ()
    #: ``{name: (parameter, its detached alias, the alias's layout then)}`` of the open call, for
    #: what the call does to an alias to reach its parameter (``scope_nested.settle_detached``).
    aliases: dict = dataclasses.field(default_factory=dict)
    #: Instance ``__dict__`` keys holding inline getters' inputs (see ``inline.install_refs``).
    ref_keys: list[str] = dataclasses.field(default_factory=list)
    #: The load_state_dict post-hook that re-syncs them, removed by restore.
    load_hook: Any = None
    #: For entries: the modules with sites or detached parameters at or below this one.
    holders: list[nn.Module] = dataclasses.field(default_factory=list)
    #: For entries: every entry at or below this one.
    entries: list[nn.Module] = dataclasses.field(default_factory=list)
    #: For entries: the parametrized modules below this one when its state sharing was last
    #: worked out (``prepare``, or a call that found one more: ``scope._share_with_late``).
    parametrized: tuple[nn.Module, ...] = ()
    #: Whether this is the model passed to ``prepare`` (its class keeps saying so only while
    #: torch's ``remove_parametrizations`` has not unwrapped it).
    root: bool = False
    #: For entries: ``id()`` of every entry a scope opened here covers.
    covers: frozenset[int] = frozenset()
    #: For holders: how many open call scopes (of any thread) use the values installed now, the
    #: names installed, and under what another thread's call may share them (``scope._shareable``:
    #: None where it may not, else the autocast state they were computed under).
    users: int = 0
    #: For holders: how many calls (of any thread) run with no scope now, each value computed
    #: where it is read (``paramfold.compile_reads.Bare``): no call installs values meanwhile.
    bare: int = 0
    installed: tuple[str, ...] = ()
    shareable: tuple | None = None
    #: Hook-based norms' hooks taken out of ``_forward_pre_hooks`` while values are installed,
    #: and the dict's key order to put them back in (``hooknorms.detach`` / ``attach``).
    hooks_out: tuple = ()
    #: Whether a site is a hook-based norm's (what a checkpointed region's recomputation may
    #: replay: ``paramfold.hooknorm_regions``).
    hook_sites: bool = False
    #: Hook-based norms' values of the last call, ``(name, value)``, taken out of ``__dict__``
    #: while their hooks run in a call (``scope._install``), put back if the call ended first.
    left: tuple = ()
    #: Hook-based norms' values of the last call, ``(name, value)``, that the open call's values
    #: replaced in ``__dict__`` (``scope._install``): stock's ``__dict__`` holds them until the
    #: module's call in this one, and so does a copy made before it (``scope_midcall.copied_hook_values``).
    replaced: tuple = ()
    #: For holders with hoisted or frozen values: the class the module has between calls (a
    #: subclass of ``prepared_class`` whose data descriptors compute every read like stock), and
    #: the names whose frozen values stay in ``__dict__`` meanwhile, for the next call to reuse.
    between_class: type | None = None
    kept: tuple[str, ...] = ()
    #: What the user put in the module's ``__dict__`` under a site's name (``vars(layer)[name] =
    #: t``), which stock keeps there, hidden by its class's property: set aside by the next call
    #: (``scope._install``), whose value goes there, and put back by ``restore``.
    foreign: dict = dataclasses.field(default_factory=dict)
    #: For holders with a stateful chain (not inline) or hook-based spectral_norm: the class it has
    #: inside a call scope while one trains (``classes.read_once_class``: the first read of such a
    #: value, or call of the module, takes it; later ones compute afresh, as stock's all do).
    read_once_class: type | None = None
    #: The module's own ``__dict__`` while it has that class, where compiled code asks whether
    #: the value is there yet (``site_reads._ReadOnce``: dynamo guards that for a plain dict, not
    #: for ``module.__dict__``). Not copied: a copy's first call sets its own.
    own_dict: dict | None = None
    #: For entries: the call scope's steady-state fast path (``scope_plan.Plan``), if it has one,
    #: and the last one of the other grad mode, whose guards a plan rebuilt for that mode reuses.
    plan: Any = None
    spare_plans: tuple = ()
    #: For entries: calls to open the general way before building a plan again, the current
    #: wait, and whether the last build found none (``scope._replan``).
    plan_wait: int = 0
    plan_backoff: int = 0
    plan_unbuilt: bool = False
    #: For entries: what a call nested in a scope checks (``scope._nested_check``), if built.
    nested_check: Any = None
    #: For entries: torch's next hook handle number when a nested call last checked for hooks
    #: registered during the call, and its scope's when it opened (``scope._hooks_since``).
    hooks_checked: int = -1
    hooks_checked_from: int = -1
    #: The model passed to ``prepare`` (a weak reference): a copy of this module made without it
    #: (``copy.deepcopy(model.layer)``) is part of no prepared model (see :func:`orphaned_copy`).
    prepared_root: Any = None

    def keep_copied(self, original: ModuleState, memo: dict) -> None:
        """After ``copy.deepcopy`` of a module copied all it holds (this is the copy's state,
        ``original`` the module's): its lists of modules are the copies of those the copy holds.
        A module swapped out of the model since (which ``original``'s restore still lists) and not
        held by it anywhere else is not the copy's, as stock's copy does not hold it: copied, a
        hook-based norm's layer would raise (its weight is not a leaf)."""
        for name in _MODULE_LISTS:
            kept = [memo[id(m)] for m in getattr(original, name) if id(m) in memo]
            setattr(self, name, kept if isinstance(getattr(original, name), list) else tuple(kept))
        # Which entries a scope covers is kept by id(): the copy's own entries, not the original's.
        self.covers = frozenset(id(m) for m in self.entries)

    def drop_kept(self, name: str) -> bool:
        """Stop keeping ``name``'s frozen value for the next call; whether it was kept. ``kept``
        becomes a new tuple: steady plans check it by identity."""
        if name not in self.kept:
            return False
        self.kept = tuple(n for n in self.kept if n != name)
        return True

    def reads_once(self, holder: nn.Module) -> bool:
        """Whether ``holder``, this state's module, has its :attr:`read_once_class` now (inside a
        call scope while a stateful chain of it trains)."""
        return type(holder) is self.read_once_class

    def served_once(self, holder: nn.Module, site: SiteState) -> bool:
        """Whether ``site``'s hook-based norm served ``holder``'s first call in this scope through
        the read-once class, whose stand-in runs the hook at each later call of the module."""
        once = site.once_hook
        return once is not None and once.served and self.reads_once(holder)

    def prepared_model(self) -> nn.Module | None:
        """The model passed to ``prepare``, while it lives."""
        return self.prepared_root() if self.prepared_root is not None else None

    def prepared_model_label(self) -> str:
        """`` (a <class of the model passed to prepare>)`` for a message, while that model lives; else ``""``."""
        root = self.prepared_model()
        return "" if root is None else f" ({with_article(type(root).__name__)})"

    def drop_caches(self) -> None:
        """Forget what was built from this entry's holders and sites (:data:`_CACHES`: its steady
        plans, its nested check) after they changed: its next call builds them again."""
        for name, empty in _CACHES.items():
            setattr(self, name, empty)

    def __deepcopy__(self, memo: dict) -> ModuleState:
        """A copy for a copied module (``copy.deepcopy(model)``), without the caches built from
        this module's objects (plans, ``nested_check``): the copy's first calls build its own.
        Nor does it keep frozen values: its sites' are dropped (``SiteState.__deepcopy__``), and
        the module's copy leaves those kept in ``__dict__`` out (``scope_midcall.not_copied``)."""
        dropped = _CACHES.keys() | {"prepared_root", "own_dict", "detached", "aliases", "replaced", "kept", *_MODULE_LISTS}
        replica = _copy_fields(self, memo, dropped)
        replica.drop_caches()
        # The tensors of this module's last call (one with a history, too).
        replica.detached = replica.replaced = replica.kept = ()
        replica.aliases = {}
        replica.holders, replica.entries, replica.parametrized = [], [], ()  # (keep_copied, below)
        replica.covers = frozenset()
        root = self.prepared_model()
        if root is not None and id(root) in memo:  # copied with its model (the memo has it first)
            replica.prepared_root = weakref.ref(memo[id(root)])
        return replica


def tensor_label(module: nn.Module, name: str) -> str:
    """``path.name (Class)``: a prepared module's tensor as an error message names it, by its path
    in the model it was prepared in (``filter_fn`` takes that path); ``Class.name`` without one."""
    state = module.__dict__.get(STATE_ATTR)
    root = state.prepared_model() if state is not None else None
    path = None if root is None else next((p for p, m in root.named_modules(remove_duplicate=False) if m is module), None)
    if path is None:
        return f"{type(module).__name__}.{name}"
    return f"{path + '.' if path else ''}{name} ({type(module).__name__})"


def orphaned_copy(module: nn.Module, memo: dict) -> bool:
    """Whether ``module``, being deep-copied, is prepared as part of a model that this copy does
    not copy: the copy would hold paramfold's state for a model it is not part of."""
    state = module.__dict__.get(STATE_ATTR)
    if state is None or state.root or memo.get(id(state)) is state:
        # (A copy given the original's state itself, by a memo made so, is its maker's to strip:
        # paramfold.export's. Restored as an orphan, it would release the original's values.)
        return False
    root = state.prepared_model()
    return root is None or id(root) not in memo


#: ModuleState's fields that hold what a call scope derived from the module, not its state, each
#: with its value when nothing is built.
_CACHES = {"plan": None, "spare_plans": (), "nested_check": None, "plan_wait": 0, "plan_backoff": 0,
           "plan_unbuilt": False, "hooks_checked": -1,
           "hooks_checked_from": -1}
#: SiteState's field that holds what one open call of its module keeps.
_OPEN_CALL = frozenset({"before"})


#: ModuleState's lists of modules (below the module): copied as the copies of those its copy holds.
_MODULE_LISTS = ("holders", "entries", "parametrized")


def _copy_fields(state: Any, memo: dict, dropped: set[str] | frozenset[str]) -> Any:
    """A deep copy of the dataclass ``state`` whose fields named in ``dropped`` are None."""
    replica = copy.copy(state)
    memo[id(state)] = replica
    for field in dataclasses.fields(state):
        value = None if field.name in dropped else copy.deepcopy(getattr(state, field.name), memo)
        setattr(replica, field.name, value)
    return replica


def state_of(module: nn.Module) -> ModuleState | None:
    return module.__dict__.get(STATE_ATTR)


def kept_values(module: nn.Module, state: ModuleState) -> list[str]:
    """The names under which ``module``'s ``__dict__`` holds the frozen values kept for its next
    call, by identity: a tensor put there under its name since is the user's."""
    values = module.__dict__
    return [name for name, site in state.sites.items()
            if name in state.kept and site.frozen is not None and values.get(name) is site.frozen.value]


def installed_keys(module: nn.Module, state: ModuleState) -> list[str]:
    """The keys paramfold may have written into a prepared ``module``'s ``__dict__`` besides its
    state: its sites' values where they are there (not a hook-based norm's tensor, which stock
    keeps there too; nor a site's name once its parametrization was removed and the name given a
    value of the user's, such as a hook-based norm's applied since), inline's inputs, the read-once
    hooks, and detached parameters."""
    kept = kept_values(module, state)
    keys = [name for name, site in state.sites.items() if site.hook is None and (name in state.installed or name in kept)]
    keys += [*state.ref_keys, ONCE_ATTR]
    if state.detach_params:
        keys += list(module._parameters)
    return keys


# paramfold's own work: dynamo runs it eagerly when it meets it as a frame (paramfold.frames).
run_module_eagerly_as_frames(globals())
