"""``export``: ``torch.export`` a parametrized model as the plain model's program.

``torch.export`` traces every parametrization into the exported graph (pytorch #167645; outside
a ``parametrize.cached()`` block whose eager reads it would take as constants): weight_norm's
``_weight_norm``, spectral_norm's ``mv``/``vdot``
chain, an unsafe cast's ``to`` and its asserts all run on every call of the exported program,
where the same model without parametrizations has none of it. For deployment (ExecuTorch,
AOTInductor) the parametrized tensors are constants, so :func:`export` folds them first: it
exports a copy of the model in which every parametrized tensor is a plain parameter or buffer
holding its current value, under the unparametrized name (``<module>.<tensor>``).

The user's model is never changed: the copy shares every plain parameter and buffer with it (as
``torch.export`` itself does) and gets its own class objects back, so stock's per-instance
``Parametrized*`` classes — shared between a module and its ``deepcopy`` — are left alone (which
is why ``parametrize.remove_parametrizations`` cannot be used on a copy).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from paramfold.errors import FoldError, first_few
from paramfold.compute import compute
from paramfold.freeze import Stopped, unchanging
from paramfold.held import held
from paramfold.hooknorms import hook_norms
from paramfold.state import STATE_ATTR, installed_keys, is_dtensor, state_of
from paramfold.probe import same_bits
from paramfold.sites import Site, computed_per_call, find, parametrization_paths
from paramfold.watch import layout
from paramfold.write_marks import _address

__all__ = ["export", "folded_copy"]

FilterFn = Callable[[nn.Module, str], bool]


def export(
    model: nn.Module,
    args: tuple,
    kwargs: dict[str, Any] | None = None,
    *,
    filter_fn: FilterFn | None = None,
    **export_kwargs: Any,
) -> torch.export.ExportedProgram:
    """``torch.export.export`` of ``model`` with every parametrized tensor folded to its value.

    The program has the ops of the same model without parametrizations; the folded tensors are
    its parameters (buffers when the originals were buffers) under ``<module>.<tensor>``, and its
    outputs equal ``model(*args, **kwargs)``. ``model`` is not changed (a model prepared by
    :func:`paramfold.prepare` may be passed as it is). Values are computed now, under
    ``no_grad``, like stock PyTorch computes them: export again after training. Tensors of
    torch's deprecated hook-based ``weight_norm`` / ``spectral_norm`` are folded too.

    Args:
        model: the parametrized model.
        args, kwargs: example inputs, as for ``torch.export.export``.
        filter_fn: ``filter_fn(module, fqn) -> bool`` selects the parametrized modules to fold;
            the others keep their parametrizations in the program (stock export).
        **export_kwargs: passed to ``torch.export.export`` (``dynamic_shapes``, ``strict``, ...).

    Refused with :class:`paramfold.FoldError`, model unchanged, when a fold would not be exact:
    a stateful chain in training mode (spectral_norm's power iteration moves on every call:
    call ``model.eval()``), a chain that changes its state in eval mode too, or that, in its
    modules' modes now, draws random numbers, writes its own attributes or computes another value
    with grad enabled (stock's program repeats it at every call), originals that are DTensors (communication parametrizations), or a
    value that is a tensor subclass. Modules carrying torchao's ``unwrap_tensor_subclass``
    parametrization are left as they are: it is what makes quantized weights exportable, and the
    program it gives is exact.

    Example::

        >>> import torch, paramfold
        >>> from torch.nn.utils.parametrizations import weight_norm
        >>> model = torch.nn.Sequential(weight_norm(torch.nn.Linear(4, 4)), torch.nn.Tanh())
        >>> x = torch.randn(2, 4)
        >>> ep = paramfold.export(model, (x,))
        >>> "0.weight" in ep.state_dict
        True
        >>> torch.equal(ep.module()(x), model(x))
        True
    """
    plain = folded_copy(model, filter_fn=filter_fn)
    return torch.export.export(plain, args, kwargs, **export_kwargs)


def folded_copy(model: nn.Module, *, filter_fn: FilterFn | None = None) -> nn.Module:
    """A copy of ``model`` without (selected) parametrizations, each tensor holding its value.

    Plain parameters and buffers are shared with ``model``, not copied; the folded tensors are
    new. This is what :func:`export` exports; it is also a plain ``nn.Module`` you can script,
    save whole or hand to another exporter.

    Example::

        >>> import torch, paramfold
        >>> from torch.nn.utils.parametrizations import weight_norm
        >>> from paramfold.export import folded_copy
        >>> model = weight_norm(torch.nn.Linear(4, 3))
        >>> plain = folded_copy(model)
        >>> type(plain).__name__, sorted(n for n, _ in plain.named_parameters())
        ('Linear', ['bias', 'weight'])
        >>> plain.bias is model.bias
        True
    """
    inside = parametrization_paths(model)
    found = [s for s in find(model) if s.module_path not in inside]
    if filter_fn is not None:
        chosen = {s.module: _selected(filter_fn, s) for s in found}  # once per module
        found = [s for s in found if chosen[s.module]]
    # Hook-based norms are folded by torch's own remove_* below (_hook_based_norms).
    sites = [s for s in found if not s.hook_based]
    # torchao's unwrap_tensor_subclass exists to make quantized weights exportable: the program
    # rebuilds the subclass from its plain components, which is exact. Such modules stay as they are.
    kept = {s.module for s in sites if "torchao_subclass" in s.kind.split("+")}
    sites = [s for s in sites if s.module not in kept]
    _refuse_unfoldable(sites)

    values: dict[tuple, torch.Tensor] = {}
    folded: list[tuple[Site, torch.Tensor]] = []
    # Outside inference_mode, as stock's parameters are whatever mode export is called in: an
    # inference tensor would make the program fail in grad mode ("Inference tensors cannot be
    # saved for backward").
    with torch.inference_mode(False), torch.no_grad():
        # Each value computed with a write to any of the model's tensors stopped before it runs
        # (a chain may hold another module), and checked after for what no op shows.
        rebinds = _Bindings([*model.named_parameters(), *model.named_buffers()])
        chains = {id(site): _chain_tensors(site) for site in sites}
        guard = unchanging([*rebinds.tensors, *(t for chain in chains.values() for _, t in chain)])
        for site in sites:
            # Tied sites (same originals, same chain) share one tensor, as tied plain weights do.
            key = (tuple(id(t) for t in site.originals.values()), tuple(id(m) for m in site.chain))
            if key not in values:
                values[key] = _checked_value(site, chains[id(site)], guard, rebinds)
            folded.append((site, values[key]))

    legacy = _hook_based_norms([s for s in found if s.hook_based])
    memo = _sharing_memo(model, {s.module for s in sites})
    _copy_forwarding_wrappers(model, memo)
    replica = copy.deepcopy(model, memo)
    _check_faithful(model, replica)
    _strip_prepared(model, memo)
    _fold_hook_based_norms(legacy, memo)
    tensors: dict[int, torch.Tensor] = {}
    by_module: dict[nn.Module, dict[str, torch.Tensor]] = {}
    for site, value in folded:
        if id(value) not in tensors:
            tensors[id(value)] = _as_plain_tensor(site, value)
        by_module.setdefault(memo[id(site.module)], {})[site.tensor_name] = tensors[id(value)]
    for module, named in by_module.items():
        _fold_into(module, named)
    return replica


def _selected(filter_fn: FilterFn, site: Site) -> bool:
    try:
        return bool(filter_fn(site.module, site.module_path))
    except Exception as exc:
        raise FoldError(
            f"filter_fn raised {type(exc).__name__}: {exc} (on module {site.module_path!r}); nothing "
            "was exported. filter_fn is called as filter_fn(module, fqn) and must return a bool."
        ) from exc


def _refuse_unfoldable(sites: list[Site]) -> None:
    training = [f"{s.fqn} ({s.kind})" for s in sites if s.stateful and s.training]
    if training:
        raise FoldError(
            f"cannot export {first_few(training, 3)} folded: a stateful parametrization in training "
            "mode changes its value on every call (spectral_norm's power iteration). Call "
            "model.eval() first, or exclude these modules with filter_fn to export them stock."
        )
    per_call = [f"{s.fqn} ({s.kind}: {why})" for s in sites for why in (computed_per_call(s),) if why]
    if per_call:
        raise FoldError(
            f"cannot export {first_few(per_call, 3)} folded: stock's program repeats that at every "
            "call, which one value computed now cannot. Exclude these modules with filter_fn to "
            "export them stock."
        )
    distributed = [
        f"{s.fqn} ({s.kind})"
        for s in sites
        if "communication" in s.kind.split("+") or any(is_dtensor(t) for t in s.originals.values())
    ]
    if distributed:
        raise FoldError(
            f"cannot export {first_few(distributed, 3)} folded: its originals are DTensors or its "
            "parametrization communicates (a sharded model). Export the model before sharding it, "
            "or exclude these modules with filter_fn."
        )


def _checked_value(site: Site, chain: list[tuple[str, torch.Tensor]], guard: Any, rebinds: _Bindings) -> torch.Tensor:
    # Computed on the model itself, stopped before any write to one of the model's tensors
    # (``guard``, :func:`paramfold.freeze.unchanging`) or any draw that its probe did not see;
    # then the bytes of its chain's tensors (``chain``, :func:`_chain_tensors`) and every tensor's
    # binding compared with before (a .data rebind or a write through a NumPy view is no op),
    # put back where they moved.
    own = _Bindings(chain, contents=True)
    try:
        with guard:
            value = compute(site.module, site.tensor_name)
    except Stopped as stop:
        raise FoldError(
            f"cannot export {site.fqn} ({site.kind}) folded: computing it would write one of the "
            f"model's tensors or draw random numbers ({stop}), which stock's program repeats at every "
            "call; it was stopped before, the model is unchanged. Exclude this module with filter_fn "
            "to export it stock."
        ) from None
    moved = own.put_back() + rebinds.put_back()
    if moved:
        raise FoldError(
            f"cannot export {site.fqn} ({site.kind}) folded: computing it changed {first_few(moved, 3)}, "
            "which no op shows and stock's program repeats at every call; put back as it was, the model "
            "is unchanged. Exclude this module with filter_fn to export it stock."
        )
    if not isinstance(value, torch.Tensor) or type(value) not in (torch.Tensor, nn.Parameter):
        raise FoldError(
            f"cannot export {site.fqn} ({site.kind}) folded: its value is a "
            f"{type(value).__name__}, not a plain tensor, and the exported program would hold that "
            "subclass instead of the plain model's ops. Exclude this module with filter_fn to "
            "export it stock, or register torchao's unwrap_tensor_subclass parametrization on it."
        )
    return value


def _chain_tensors(site: Site) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every tensor ``site``'s value is computed from: its originals, its
    members' parameters, buffers and tensor attributes, and the tensors in what the members hold
    (dicts, objects)."""
    found = [(f"{site.fqn}'s original {n}", t) for n, t in site.originals.items()]
    for i, member in enumerate(site.chain):
        for path, m in member.named_modules(prefix=f"{site.fqn}'s parametrization {i}"):
            found += [(f"{path}.{k}", t) for k, t in (*m._parameters.items(), *m._buffers.items(), *vars(m).items())
                      if isinstance(t, torch.Tensor)]
            found += [(f"{path}.{k!s}", t) for _, k, t in held(m).tensors]
    return found


class _Bindings:
    """Where each of the ``named`` tensors points now (storage address and description, through
    an alias that keeps its storage alive) and, with ``contents``, a copy of its bytes: what
    :meth:`put_back` restores, naming each tensor a computation moved."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], contents: bool = False) -> None:
        seen: set[int] = set()
        kept = [(n, t) for n, t in named if id(t) not in seen and not seen.add(id(t)) and _plain_layout(t)]
        self.names = [n for n, _ in kept]
        self.tensors = [t for _, t in kept]
        self.aliases = [t.detach() for t in self.tensors]
        self.where = [(_address(t), layout(t)) for t in self.tensors]
        self.copies = [t.detach().clone() for t in self.tensors] if contents else None

    def put_back(self) -> list[str]:
        """Each tensor put back where and as it was; a description of each that had moved."""
        moved = []
        for i, (name, t, alias) in enumerate(zip(self.names, self.tensors, self.aliases)):
            if (_address(t), layout(t)) != self.where[i]:
                t.data = alias
                moved.append(f"{name} (its .data rebound)")
            if self.copies is not None and not same_bits(alias, self.copies[i]):
                alias.copy_(self.copies[i])
                moved.append(f"{name} (written in place)")
        return moved


def _plain_layout(t: torch.Tensor) -> bool:
    """Whether ``t`` is a strided tensor with storage whose bytes can be read (not fake, meta or a
    wrapper subclass, whose inner tensors are compared instead)."""
    return type(t) in (torch.Tensor, nn.Parameter) and t.layout == torch.strided and t.device.type != "meta"


def _hook_based_norms(sites: list[Site]) -> list[tuple[nn.Module, Any]]:
    """The module and hook of each of torch's deprecated hook-based ``weight_norm`` /
    ``spectral_norm`` sites (still common in vocoders and GANs) to fold: a forward pre-hook
    recomputes the tensor, which export would trace on every call."""
    training = [f"{s.fqn} (hook-based spectral_norm)" for s in sites if s.stateful and s.training]
    if training:
        raise FoldError(
            f"cannot export {first_few(training, 3)} folded: torch.nn.utils.spectral_norm in training "
            "mode runs a power iteration on every call. Call model.eval() first, or exclude these "
            "modules with filter_fn to export them stock."
        )
    return [(s.module, s.chain[0]) for s in sites]


def _fold_hook_based_norms(legacy: list[tuple[nn.Module, Any]], memo: dict[int, Any]) -> None:
    """On the copy, torch's own ``remove_weight_norm`` / ``remove_spectral_norm`` (they compute the
    tensor as the hook does, eval mode, and drop the copy's own hook, ``_g``/``_v``/``_u`` entries)."""
    from torch.nn.utils import remove_spectral_norm, remove_weight_norm
    from torch.nn.utils.spectral_norm import SpectralNorm, SpectralNormLoadStateDictPreHook

    with torch.inference_mode(False), torch.no_grad():
        for module, hook in legacy:
            copied = memo[id(module)]
            spectral = isinstance(hook, SpectralNorm)
            originals = [module._parameters.get(hook.name + suffix) for suffix in (("_orig",) if spectral else ("_g", "_v"))]
            (remove_spectral_norm if spectral else remove_weight_norm)(copied, hook.name)
            # torch's remove_spectral_norm misses its load hook, which torch 2.13 keeps wrapped
            # (_WrappedHook): left, it asks every load for weight_orig and weight_u
            for key, pre in list(copied._load_state_dict_pre_hooks.items()):
                fn = getattr(pre, "hook", pre)
                if isinstance(fn, SpectralNormLoadStateDictPreHook) and fn.fn.name == hook.name:
                    del copied._load_state_dict_pre_hooks[key]
            # torch's remove_* registers a new Parameter that requires grad: trainable only where
            # the tensors it is computed from were (a frozen model's weight stays frozen).
            weight = copied._parameters[hook.name]
            weight.requires_grad_(any(p is not None and p.requires_grad for p in originals) and weight.is_floating_point())


def _sharing_memo(model: nn.Module, folded_modules: set[nn.Module]) -> dict[int, Any]:
    """A deepcopy memo under which every tensor, and the parametrizations of folded modules, are
    shared with ``model`` instead of copied, and paramfold's state is left out."""
    memo: dict[int, Any] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        memo[id(tensor)] = tensor
    for module in model.modules():
        if module in folded_modules:
            plists = module._modules["parametrizations"]
            memo[id(plists)] = plists
        state = state_of(module)
        if state is not None:
            memo[id(state)] = state
        for _, hook, _ in hook_norms(module):
            # The tensor a hook-based norm's pre-hook last wrote is a non-leaf, which deepcopy
            # refuses: a folded copy drops it, a stock one (filter_fn) computes its own at each call.
            computed = module.__dict__.get(hook.name)
            if isinstance(computed, torch.Tensor):
                memo[id(computed)] = computed
    return memo


def _copy_forwarding_wrappers(model: nn.Module, memo: dict[int, Any]) -> None:
    """Copy, into ``memo``, the modules ``copy.deepcopy`` would replace by a copy of another one.

    ``copy.deepcopy`` looks ``__deepcopy__`` up on the instance, so a module whose ``__getattr__``
    forwards unknown attributes to a module it wraps (PEFT's ``ModulesToSaveWrapper``, ``PeftModel``
    on a parametrized model, a user's wrapper) is "copied" as a copy of the wrapped module: the
    wrapper, its other submodules and its state dict keys are gone. Such a module is copied here
    as its class copies it (``__reduce_ex__``, as ``copy.deepcopy`` does any module), deepest
    first, so that the main copy finds it in ``memo``.
    """
    for module in reversed(list(model.modules())):  # every descendant before its ancestors
        if id(module) in memo or getattr(type(module), "__deepcopy__", None) is not None:
            continue
        if getattr(module, "__deepcopy__", None) is not None:  # found on another object
            copy._reconstruct(module, memo, *module.__reduce_ex__(4))  # type: ignore[attr-defined]


def _check_faithful(model: nn.Module, replica: nn.Module) -> None:
    """Refuse a copy whose module tree is not ``model``'s (a ``__deepcopy__`` of a module's own)."""
    ours = [path for path, _ in model.named_modules(remove_duplicate=False)]
    theirs = [path for path, _ in replica.named_modules(remove_duplicate=False)]
    if ours != theirs:
        lost = next((p for p, q in zip(ours, theirs) if p != q), ours[-1])
        raise FoldError(
            f"cannot export this model folded: copy.deepcopy(model) does not give its module tree "
            f"(module {lost!r} and what follows differ; a __deepcopy__ of its own?), and "
            "paramfold.export folds a copy. Export it stock with torch.export.export(model)."
        )


def _strip_prepared(model: nn.Module, memo: dict[int, Any]) -> None:
    """On the copy, undo :func:`paramfold.prepare` without touching the original's state."""
    for module in model.modules():
        state = state_of(module)
        if state is None:
            continue
        replica = memo[id(module)]
        values = replica.__dict__
        values.pop(STATE_ATTR)
        for name in installed_keys(module, state):
            values.pop(name, None)
        if state.load_hook is not None:
            replica._load_state_dict_post_hooks.pop(state.load_hook.id, None)
        replica.__class__ = state.original_class


def _as_plain_tensor(site: Site, value: torch.Tensor) -> torch.Tensor:
    value = value.detach()
    if site.is_buffer:
        return value
    trainable = site.requires_grad or any(p.requires_grad for m in site.chain for p in m.parameters())
    return nn.Parameter(value, requires_grad=trainable and (value.is_floating_point() or value.is_complex()))


def _fold_into(module: nn.Module, named: dict[str, torch.Tensor]) -> None:
    """Turn the copy ``module`` into its plain class, ``named`` tensors registered in place of its
    parametrizations (every one of them: ``filter_fn`` selects whole modules)."""
    base = parametrize.type_before_parametrizations(module)
    # The copy still points at the original's ModuleDict (shared by the memo): only the copy drops it.
    del module._modules["parametrizations"]
    # torch's weight_norm parametrization renames old weight_g/weight_v keys to its originals'
    # at load time, through a local function (which pickle cannot save): nothing to rename to now.
    for key, hook in list(module._load_state_dict_pre_hooks.items()):
        if getattr(getattr(hook, "hook", hook), "__qualname__", "").endswith("weight_norm.<locals>._weight_norm_compat_hook"):
            del module._load_state_dict_pre_hooks[key]
    module.__class__ = base
    for name, tensor in named.items():
        module.__dict__.pop(name, None)  # a tensor the user put there, hidden by the property until now
        if isinstance(tensor, nn.Parameter):
            module.register_parameter(name, tensor)
        else:
            module.register_buffer(name, tensor)
