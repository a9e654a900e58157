"""``prepare``: switch a parametrized model to hoisted, inlined or frozen parametrizations, in place."""

from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.nn.utils import parametrize

from paramfold import hooknorms
from paramfold.classes import (between_class, injected_by_torch, install_type_before_parametrizations, parametrized_class,
                               plain_base, prepared_class, read_once_class)
from paramfold.compute import has_parametrizations
from paramfold.errors import FoldError
from paramfold.freeze import refuse_unfreezable
from paramfold.inline import chain_signature, hook_keys, inline_property, install_refs, sync_refs
from paramfold.randomness import watch as watch_draws
from paramfold.restore import drop_detached, restore, restore_module
from paramfold.scope import calls_lock, parametrized_below
from paramfold.scope_midcall import watch_backward
from paramfold.state import FREEZE_CHECKS, STATE_ATTR, ModuleState, state_for, syncs_before_forward
from paramfold.sites import Site, find, parametrization_paths

MODES = ("auto", "hoist", "inline", "freeze")
FilterFn = Callable[[nn.Module, str], bool]

# What Python's own class machinery adds to any class made over the module's: ``abc.ABCMeta``'s
# bookkeeping (``class Base(nn.Module, ABC)``, torch.ao's FakeQuantize), ``typing.Generic``'s and
# ``Protocol``'s, and the ``__annotations__`` dict a read of them stores (``typing.get_type_hints``,
# ``torch.jit.script``). Each class paramfold makes has its own; none changes how a module behaves.
_PYTHON_CLASS_KEYS = {
    "__module__", "__doc__", "__dict__", "__weakref__", "__slotnames__",
    "__abstractmethods__", "_abc_impl", "__parameters__", "_is_protocol", "__protocol_attrs__",
    "__non_callable_proto_members__", "__annotations__",
}
#: The functions torch's ``parametrize._inject_new_class`` puts in the class it makes.
_STOCK_CLASS_FUNCTIONS = {"__getstate__": "getstate", "__deepcopy__": "default_deepcopy"}


def _not_stocks(cls: type, names: set[str]) -> list[str]:
    """The entries of ``cls``'s dict (stock's per-instance ``Parametrized*`` class) that neither
    torch's ``parametrize`` nor Python's class machinery put there: a property, ``__deepcopy__``
    or method the user wrote on it, which a class of paramfold's would not keep."""
    extra = []
    for key, value in vars(cls).items():
        if key in _PYTHON_CLASS_KEYS:
            continue
        if key in names and injected_by_torch(value):
            continue
        if key in _STOCK_CLASS_FUNCTIONS and getattr(value, "__module__", None) == parametrize.__name__ and (
                getattr(value, "__qualname__", "") == f"_inject_new_class.<locals>.{_STOCK_CLASS_FUNCTIONS[key]}"):
            continue
        if key == "__subclasshook__" and getattr(value, "__module__", None) in ("typing", "typing_extensions") and (
                getattr(value, "__qualname__", "").endswith("_proto_hook")):
            continue  # typing.Protocol's, for isinstance checks only
        extra.append(key)
    return sorted(extra)


def prepare(
    model: nn.Module,
    mode: str = "auto",
    *,
    filter_fn: FilterFn | None = None,
    detach_params_under_no_grad: bool = False,
    freeze_check: str = "content",
) -> nn.Module:
    """Make ``torch.compile`` see ``model`` (nearly) as if it had no parametrizations. In place.

    Modes:

    * ``"hoist"``: every call of the model computes each parametrized tensor once, eagerly,
      before compiled code runs (autograd reaches the originals); compiled code reads plain
      tensors. A stateful chain in training read again in the same call (a discriminator
      scoring two batches in one forward) is computed afresh at each later read, so
      spectral_norm's power iteration advances at every read, as in stock (and where the call
      does not read the tensor, its state is put back: ``paramfold.unread``). With inductor's
      ``freezing`` on, ``no_grad`` calls are served as auto serves them (freezing keys compiled
      code on each value's identity, so a fresh value per call would recompile every call).
    * ``"inline"``: tensors are computed inside compiled code through a lean path, so inductor
      can fuse the parametrization math into its consumers.
    * ``"freeze"``: tensors are materialised once (inference) and re-materialised by themselves
      when an original or a parametrization buffer changes (``load_state_dict``, optimizer
      steps, in-place edits). Refused for sites where an original, or a parameter a
      parametrization owns (LoRA's adapters), requires grad, or whose stateful chain
      (spectral_norm) is training.
    * ``"auto"``: on every call, freeze what can be frozen and hoist the rest (under
      ``no_grad``, trainable chains are frozen too: ``model.eval()`` inference needs no
      ``requires_grad_(False)``; a call that records autograd hoists them); tensors that
      neither serves exactly (a chain that draws random numbers) are computed at every read,
      as inline.

    Args:
        model: the model you will call (and may compile, whole or per layer).
        mode: one of ``"auto"``, ``"hoist"``, ``"inline"``, ``"freeze"``.
        filter_fn: ``filter_fn(module, fqn) -> bool`` selects the parametrized modules to
            prepare, as in torchao's ``quantize_``; the others keep stock behaviour.
        detach_params_under_no_grad: also present *plain* parameters to compiled code as
            ``requires_grad=False`` tensors while grad mode is off, so frozen and trainable
            copies of one architecture share graphs under ``no_grad`` (see
            ``paramfold.recompiles``; README, Notes and limits, for the reads that get the
            parameters themselves, and the ones inside compiled code that do not). Off by default.
        freeze_check: how freeze and auto tell that a frozen value's inputs changed:
            ``"content"`` (default) also sees writes through ``.data``, numpy or DLPack that
            bump no version counter (a write mark on each input no other tensor shares, the
            bytes of the others checked at every call); ``"version"`` trusts identity, storage,
            version counters and write marks alone, which miss writes through memory exported
            before the value was computed (a numpy array, DLPack; one exported after has its
            bytes checked at every call from the next call on, while something holds it), and
            writes that bump no version counter into memory no mark can watch (device memory,
            an mmap-loaded checkpoint: ``.data``, ``torch.distributed``'s in-place collectives)
            — use it only if nothing writes the weights that way, or bump their counters after
            such a write (``torch.autograd.graph.increment_version``).

    ``state_dict()`` keys and values are unchanged, :func:`paramfold.restore` undoes
    everything, and if anything fails the model is left exactly as it was.

    Example::

        >>> import torch, paramfold
        >>> from torch.nn.utils.parametrizations import weight_norm
        >>> model = torch.nn.Sequential(weight_norm(torch.nn.Linear(8, 8)), torch.nn.Tanh())
        >>> x = torch.randn(2, 8)
        >>> expected = model(x)
        >>> _ = paramfold.prepare(model, "hoist")
        >>> torch.equal(torch.compile(model, backend="eager")(x), expected)
        True
        >>> _ = paramfold.restore(model)
    """
    if mode not in MODES:
        raise FoldError(f"unknown mode {mode!r}: use one of {', '.join(map(repr, MODES))}")
    if filter_fn is not None and not callable(filter_fn):
        raise FoldError(f"filter_fn must be callable as filter_fn(module, fqn), got {type(filter_fn).__name__}")
    if freeze_check not in FREEZE_CHECKS:
        raise FoldError(f"unknown freeze_check {freeze_check!r}: use one of {', '.join(map(repr, FREEZE_CHECKS))}")
    _refuse_prepared(model)

    inside = parametrization_paths(model)
    paths = _module_paths(model, inside)
    sites = [s for s in find(model) if s.module_path not in inside]
    # Communication parametrizations (SimpleFSDP's all-gather) stay stock, in-graph: hoisting
    # would gather every parameter at the root's call, freezing would keep a stale gather. So
    # do chains whose original a hook computes at each call (prune on the original).
    stock = {s.module for s in sites if {"communication", "computed_original"} & set(s.kind.split("+"))}
    sites = [s for s in sites if s.module not in stock]
    if mode == "inline":
        # A hook-based norm already computes its tensor in-graph, where it is read: inline's
        # semantics. Its hook stays as it is.
        sites = [s for s in sites if not s.hook_based]
    chosen = {s.module: _selected(filter_fn, s.module, s.module_path) for s in sites}  # once per module
    selected = [s for s in sites if chosen[s.module]]
    for site in selected:
        _refuse_unsupported(site)
        if mode in ("hoist", "freeze"):
            _refuse_read_by_read(site, mode)
    if mode == "freeze":  # after: a chain that draws is refused with advice that serves it (not hoist)
        refuse_unfreezable(selected, "with mode='freeze'")

    sharers = state_sharers(model, sites, inside)
    states = _plan(model, paths, selected, mode, filter_fn, detach_params_under_no_grad, freeze_check, sharers, inside)
    install_type_before_parametrizations()
    watch_backward()
    applied: list[nn.Module] = []
    # Under the call scopes' lock, as restore: a call made meanwhile in another thread opens its
    # scope on the whole model prepared, or (this failing) restored.
    with calls_lock():
        try:
            for module, (state, cls) in states.items():
                module.__dict__[STATE_ATTR] = state
                applied.append(module)
                inline = [name for name, site in state.sites.items() if site.mode == "inline" and not site.nested]
                for name in inline:
                    state.ref_keys += install_refs(module, name, state.sites[name])
                if inline:
                    state.load_hook = module.register_load_state_dict_post_hook(_resync_after_load)
                module.__class__ = cls
        except BaseException:
            for module in applied:
                restore_module(module)
            raise
    return model


@contextlib.contextmanager
def prepared(model: nn.Module, mode: str = "auto", **kwargs) -> Iterator[nn.Module]:
    """Context manager: :func:`prepare` on entry, :func:`restore` on exit (also on error).

    Example::

        >>> import torch, paramfold
        >>> from torch.nn.utils.parametrizations import orthogonal
        >>> model = orthogonal(torch.nn.Linear(4, 4)).requires_grad_(False)
        >>> with paramfold.prepared(model, "freeze") as m:
        ...     y = m(torch.randn(1, 4))
        >>> type(model).__name__
        'ParametrizedLinear'
    """
    prepare(model, mode, **kwargs)
    try:
        yield model
    finally:
        restore(model)


def _resync_after_load(module: nn.Module, incompatible_keys: object) -> None:
    # load_state_dict(assign=True) replaces originals; inline getters read stored references.
    for site in module.__dict__[STATE_ATTR].sites.values():
        if site.mode == "inline":
            sync_refs(module, site)


def _refuse_prepared(model: nn.Module) -> None:
    for path, module in model.named_modules():
        state = module.__dict__.get(STATE_ATTR)
        if state is None or not state.root and drop_detached(module):  # its model holds it no more
            continue
        if not path and state.root:
            raise FoldError(
                "cannot prepare this model: it is already prepared by paramfold. Call "
                "paramfold.restore() on it first to prepare it again (another mode, filter_fn)."
            )
        if not path:  # a part of a prepared model, prepared with it (restore refuses it alone)
            raise FoldError(
                f"cannot prepare this model: it is part of a model prepared by paramfold"
                f"{state.prepared_model_label()}, prepared with it. Call "
                "paramfold.restore() on that model first, then prepare this part alone, or prepare "
                "that model again with filter_fn choosing what to prepare."
            )
        if state.root:  # a copy of a prepared model (AveragedModel, an EMA), or one prepared alone
            raise FoldError(
                f"cannot prepare this model: its submodule {path!r} is already prepared by paramfold, as a "
                f"model of its own (a copy of a prepared model, as AveragedModel/EMA makes, is prepared too). "
                f"Call paramfold.restore(model.get_submodule({path!r})) first, then prepare this model."
            )
        raise FoldError(
            f"cannot prepare this model: its submodule {path!r} ({type(module).__name__}) is already "
            f"prepared by paramfold, as part of another model{state.prepared_model_label()}: a "
            "module shared by two models is prepared for one of them. Prepare one model that holds both "
            "(a parent calling each), or restore the other model first; the unprepared model still "
            "runs the shared module exactly, computing its tensors where they are read."
        )


def _module_paths(model: nn.Module, inside: frozenset[str]) -> dict[str, nn.Module]:
    return {path: module for path, module in model.named_modules() if path not in inside}


def _selected(filter_fn: FilterFn | None, module: nn.Module, fqn: str) -> bool:
    if filter_fn is None:
        return True
    try:
        return bool(filter_fn(module, fqn))
    except Exception as exc:
        raise FoldError(
            f"filter_fn raised {type(exc).__name__}: {exc} (on module {fqn!r}); the model was not "
            "changed. filter_fn is called as filter_fn(module, fqn) and must return a bool."
        ) from exc


def _refuse_unsupported(site: Site) -> None:
    if site.hook_based:
        return
    # (Stock's class: a wrapper class made of it since, FSDP2's, is kept by paramfold's classes.)
    cls = parametrized_class(site.module) or type(site.module)
    extra = _not_stocks(cls, set(site.module.parametrizations))
    if extra or not isinstance(site.module.parametrizations[site.tensor_name], parametrize.ParametrizationList):
        raise FoldError(
            f"{site.fqn}: its class {cls.__name__} is not the one torch.nn.utils.parametrize made "
            f"(attributes written on it since: {extra}); paramfold's classes would not keep them. "
            "Exclude this module with filter_fn, or define them on the module's own class before "
            "registering the parametrization."
        )


def _read_by_read(site: Site, mode: str) -> str | None:
    """Why only a value computed at every read, like stock's (inline), serves ``site`` exactly
    under ``mode``, or None."""
    if site.hook_based:
        return None  # torch's hook computes once per forward: a value per call is stock's
    if site.random:
        return (
            f"its parametrization ({site.kind}) draws random numbers each time it computes the tensor, "
            "and stock draws them at every read, in the forward's order, which a value computed "
            "before the call (hoist) or once for many calls (freeze) cannot reproduce"
        )
    if site.unprobed:
        return (
            f"paramfold cannot tell what its parametrization ({site.kind}) changes when it computes the "
            f"tensor: it finds out on a copy, and {site.unprobed}; so it is taken as one that may change its "
            "own state at every read, as stock's read would then do again and again, which a value "
            "computed before the call (hoist) or once for many calls (freeze) cannot reproduce"
        )
    if site.writes_itself:
        return (
            f"its parametrization ({site.kind}) changes its own attributes or its originals each time it "
            "computes the tensor (a step counter, a tensor attribute that is not a registered buffer, an "
            "original it edits in place, a parametrization of an original that changes its state, as "
            "spectral_norm's power iteration), and stock changes them at every read, which a value "
            "computed before the call (hoist) or once for many calls (freeze) cannot reproduce"
        )
    if site.grad_dependent:
        return (
            f"its parametrization ({site.kind}) computes another value with grad enabled than under "
            "no_grad from the same tensors (a branch on torch.is_grad_enabled(), say; or it does not compute the "
            "same value twice at all, reading a global counter or other state that changes from call to call), "
            "and stock computes it "
            "in the grad mode of each read, which a value computed before the call (hoist, under the "
            "call's mode, not a region's inside the forward) or once for many calls (freeze) cannot follow"
        )
    # A stateful chain read several times per forward (torch's RNNs read each weight up to four
    # times in _update_flat_weights) is served by the read-once class: the first read takes the
    # hoisted value, each later one computes afresh, as stock's does (classes.read_once_class).
    return None


def _refuse_read_by_read(site: Site, mode: str) -> None:
    why = _read_by_read(site, mode)
    if why is not None:
        raise FoldError(
            f"{site.fqn}: {why}, so mode={mode!r} cannot serve it. Prepare the model with mode='auto' "
            "(which computes such tensors at every read, as inline does) or mode='inline', or leave "
            "this module stock with filter_fn (e.g. lambda m, fqn: fqn != "
            f"{site.module_path!r})."
        )


def state_sharers(model: nn.Module, sites: list[Site],
                  inside: frozenset[str] | None = None) -> dict[int, tuple[tuple[nn.Module, ...], bool]]:
    """For each site (by ``id``) whose chain shares state with another's, where one of them is
    stateful: ``(the modules whose training flag says that computing a stateful one changes the
    state, whether one changes it in eval mode too)`` (``SiteState.state_sharers``).

    Shared state: one member object registered on two tensors (a layer's spectral_norm module
    registered on another layer too), or a tensor one member holds held by another's (by object
    or storage). A stateful member that is also a plain submodule of ``model``, which its forward
    may call, shares its state with that call. The originals are not state: tied weights are
    read, never changed, by computing a value."""
    owners: dict[tuple, list[int]] = defaultdict(list)
    stateful: dict[int, Site] = {}
    keys: dict[int, set] = {}
    for site in sites:
        found = keys[id(site)] = _state_keys(site)
        for key in found:
            owners[key].append(id(site))
        if site.stateful:
            stateful[id(site)] = site
    if inside is None:  # the paths under a ParametrizationList, where prepare has not found them already
        inside = parametrization_paths(model)
    for path, module in model.named_modules(remove_duplicate=False):
        if path not in inside:
            owners[("module", id(module))].append(-1)  # a use by the forward, which may call it
    shared = {}
    for site in sites:
        peers = {i for key in keys[id(site)] for i in owners[key]} - {id(site)}
        changers = [stateful[i] for i in (id(site), *peers) if i in stateful]
        if peers and changers:
            modules = tuple(dict.fromkeys(m for s in changers for m in _trained(s)))
            shared[id(site)] = (modules, any(s.stateful_in_eval for s in changers))
    return shared


def _state_keys(site: Site) -> set[tuple]:
    """What computing ``site``'s value may change or read besides its originals: each member
    that holds tensors, and those tensors (object and storage)."""
    if site.hook_based:
        tensors = [d[k] for _, d, k in hooknorms.state_tensors(site.module, site.chain[0], site.kind)]
        return {key for t in tensors for key in _tensor_keys(t)}
    found = set()
    for module in site.module.parametrizations[site.tensor_name].modules():
        if isinstance(module, (parametrize.ParametrizationList, nn.ModuleDict)):
            continue  # the originals' holders
        tensors = [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]
        if tensors:
            found.add(("module", id(module)))
        found.update(key for t in tensors for key in _tensor_keys(t))
    return found


def _tensor_keys(t: torch.Tensor) -> list[tuple]:
    keys: list[tuple] = [("tensor", id(t))]
    try:
        address = t.untyped_storage().data_ptr()
    except Exception:  # a tensor subclass without one storage
        address = 0
    if address:
        keys.append(("storage", str(t.device), address))
    return keys


def _trained(site: Site) -> list[nn.Module]:
    """The modules whose ``training`` flag makes ``site``'s stateful chain change its state."""
    if site.hook_based:
        return [site.module]
    plist = site.module.parametrizations[site.tensor_name]
    return [m for m in plist.modules() if not isinstance(m, (parametrize.ParametrizationList, nn.ModuleDict))]


def _ancestors(path: str, top: str = "") -> list[str]:
    """``path`` and the paths above it, up to ``top`` (the call root's path)."""
    parts = path.split(".") if path else []
    found = [""] + [".".join(parts[: i + 1]) for i in range(len(parts))]
    return [p for p in found if not top or p == top or p.startswith(top + ".")]


def _plan(
    model: nn.Module,
    paths: dict[str, nn.Module],
    selected: list[Site],
    mode: str,
    filter_fn: FilterFn | None,
    detach_params: bool,
    freeze_check: str,
    sharers: dict[int, tuple[tuple[nn.Module, ...], bool]],
    inside: frozenset[str],
) -> dict[nn.Module, tuple[ModuleState, type]]:
    """Every module's new state and class, computed before anything is changed."""
    states: dict[nn.Module, ModuleState] = {}
    holder_paths: dict[nn.Module, str] = {}

    def state(module: nn.Module) -> ModuleState:
        if module not in states:
            states[module] = ModuleState(original_class=type(module))
        return states[module]

    for site in selected:
        hs = state(site.module)
        # auto serves what neither freeze nor hoist can serve exactly the way inline does.
        site_mode = "inline" if mode == "auto" and _read_by_read(site, mode) else mode
        hs.sites[site.tensor_name] = ss = state_for(site, site_mode, freeze_check)
        hs.hook_sites = hs.hook_sites or ss.hook is not None
        if site_mode != "inline":  # inline's getter runs the chain at each read, as stock does
            ss.draw_watch = watch_draws(ss)
            ss.state_sharers, ss.sharers_in_eval = sharers.get(id(site), ((), False))
        holder_paths[site.module] = site.module_path
    if detach_params:
        for path, module in paths.items():
            has_params = any(p is not None for p in module._parameters.values())
            if has_params and _selected(filter_fn, module, path):
                state(module).detach_params = True
                holder_paths.setdefault(module, path)

    path_of = {module: path for path, module in paths.items()}
    top = _call_root(model)
    # Every path of a module the model holds at several places (a layer two blocks share): the
    # block on its second path calls it too, so its scope serves it, and its nested check and a
    # checkpointed region's replay of a call of it compiled on its own see it.
    at: dict[str, nn.Module] = {}
    every_path: dict[nn.Module, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        if path not in inside:
            at[path] = module
            every_path.setdefault(module, []).append(path)

    def above(module: nn.Module) -> dict[nn.Module, None]:
        """``module`` and the modules above it on any of its paths, up to the call root, once each."""
        return dict.fromkeys(at[a] for path in every_path[module] for a in _ancestors(path, path_of[top]))

    for holder in holder_paths:
        for ancestor in above(holder):
            state(ancestor).holders.append(holder)
    for module in list(states):
        for ancestor in above(module):
            states[ancestor].entries.append(module)

    planned = {}
    for module, st in states.items():
        own = frozenset(n for n, site in st.sites.items() if site.hook is None)
        if has_parametrizations(module):
            st.stock_names = frozenset(module._modules["parametrizations"]._modules)
        if own:
            base = plain_base(module)
        else:
            # An entry that is parametrized but not selected keeps its stock per-instance class
            # as base, so its stock properties keep working.
            base = type(module)
        inline = []
        for n, site in st.sites.items():
            if site.mode == "inline" and not site.nested:
                site.signature = chain_signature(module, n)
                inline.append((n, inline_property(n, site.signature)))
            elif site.mode == "inline" and site.hook is None:
                site.hook_keys = hook_keys(site.plist)
        inline = tuple(sorted(inline))
        st.covers = frozenset(id(m) for m in st.entries)
        if st.entries:
            st.parametrized = parametrized_below(module)
        st.root = module is model
        st.prepared_root = weakref.ref(model)
        hooked_names = frozenset(n for n, site in st.sites.items() if site.hook is not None and site.mode != "inline")
        st.prepared_class = prepared_class(base, own, module is top, inline, hooked_names)
        if any(site.mode != "inline" and site.hook is None for site in st.sites.values()):
            # Its values are put in its __dict__ for calls: between calls (from now on) a read
            # goes through a data descriptor, as stock's property, whatever that dict holds.
            st.between_class = between_class(st.prepared_class)
        stateful = frozenset(n for n, site in st.sites.items() if site.stateful and site.hook is None and site.mode != "inline")
        hooked = any(site.stateful and site.hook is not None for site in st.sites.values())
        if stateful or hooked:
            st.read_once_class = read_once_class(st.prepared_class, stateful, hooked)
        planned[module] = (st, st.between_class or st.prepared_class)
    if top is not model and top in states:
        # The wrapper keeps its class and opens no scope: restore(model) and busy checks find
        # the wrapped module's entries and holders through it.
        outer = ModuleState(original_class=type(model), root=True, prepared_class=type(model),
                            prepared_root=weakref.ref(model))
        outer.entries, outer.holders = [model, *states[top].entries], states[top].holders
        planned[model] = (outer, type(model))
    return planned


def _call_root(model: nn.Module) -> nn.Module:
    """The module whose call opens the call scope: ``model``, or the module a DDP or FSDP1 wrapper
    wraps (:func:`~paramfold.state.syncs_before_forward`), called once the wrapper has broadcast
    its buffers or gathered its parameters."""
    while syncs_before_forward(model) and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model
