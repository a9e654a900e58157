"""Gradients that paramfold sums in another order than stock: which originals have them
(:func:`reordered_originals`, :func:`tied_originals`; :func:`calls` and :func:`originals_of` for
modules a forward calls more than once), the third reference that sums them as paramfold does
(:func:`once_per_forward`), and the comparison that admits it (:func:`compare_resummed`).

Why a module of its own: the checker (:mod:`~paramfold.testing.check`) holds every result to
stock's, bitwise in eager mode, but for these gradients, which have a second bitwise reference:
a stock copy run with each parametrized tensor computed as hoist computes it. That copy takes
machinery of its own (counting calls and reads, serving values, undoing a chain's random draws)
that nothing else in the checker needs. Its names are the checker's internals, imported by
:mod:`~paramfold.testing.check`, not part of :mod:`paramfold.testing`'s API.

These are the gradients of originals that autograd sums from several contributions in an order
``prepare`` may change. That is

* a parametrized module *called more than once per forward*, or whose tensor is read more than
  once (the same instance registered at two places, called twice by a forward, or its weight
  read directly besides, as a tied output projection does; calls and reads are counted in each
  of stock's steps): stock computes its tensor at every read and autograd sums after the
  chain's backward (``J^T g1 + J^T g2``); hoist, freeze and auto compute it once per forward and
  sum before it (``J^T (g1 + g2)``), except a stateful chain in training (spectral_norm), which
  they compute at every read after the first, as stock does;
* an original *shared by several sites* (tied): hoisted sites are computed when the forward
  starts, in module order, so their backward nodes run in a different order than stock's
  when the forward reads them in another order or only some of them are prepared
  (``filter_fn``), and sums of three or more terms (spectral_norm reads its weight twice)
  round differently.

Mathematically equal, they differ by rounding. So in modes other than ``"inline"`` the
gradient of such an original must equal, bitwise, either stock's or that of a third copy run
stock computing its parametrized tensors as hoist does (:func:`once_per_forward`: once per
forward, when it starts, in module order; a chain whose computation moves its buffers,
spectral_norm training, again at each later read; a chain that draws random numbers at every
read), each read getting a view of its own (stock's fresh tensor per read: a gradient hook the
forward registers at each read scales that read's gradient only, where paramfold's shared value
carries every read's hooks, README "Notes and limits", and the check reports it). That copy
sums as paramfold does, from stock's values. Only a tied original (eagerly), or any of them
under a compiler (which reorders sums too), may also differ from stock by the rounding of its
own summed terms (a stateful tied chain's later reads are not ordered as in that copy):
``rtol`` = ``torch.testing.assert_close``'s default for the lowest-precision floating dtype of
the model and its outputs (bfloat16: 1.6e-2, float32: 1.3e-6), ``atol`` = the step's ``atol`` +
``rtol`` times the largest element of this tensor's gradient, stock's or the third copy's. Until
2026-12-04 every such gradient was held to stock within ``max(1e-5, rtol * (largest gradient
anywhere in the model))``, even eagerly, which let paramfold's 2x stock pass on small gradients
or beside a large one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from paramfold import hooknorms
from paramfold.compute import original_names
from paramfold.sites import parametrization_paths
from paramfold.testing.compare import Tolerance, compare, largest
from paramfold.testing.generators import rng_state, set_rng_state
from paramfold.testing.walks import hook_norms, parametrized

__all__ = ["calls", "compare_resummed", "once_per_forward", "originals_of", "reordered_originals", "tied_originals"]


def reordered_originals(model: nn.Module) -> set[int]:
    """Originals of modules called more than once per forward, and originals shared by sites."""
    registered: dict[int, int] = {}
    inside = parametrization_paths(model)
    for path, module in model.named_modules(remove_duplicate=False):
        if path not in inside:
            registered[id(module)] = registered.get(id(module), 0) + 1
    repeated: set[int] = set()
    for _, module in parametrized(model):
        for plist in module.parametrizations.values():
            if registered.get(id(module), 0) > 1:
                repeated.update(map(id, _chain_tensors(plist)))
    return repeated | tied_originals(model)


def tied_originals(model: nn.Module) -> set[int]:
    """Originals shared by several sites, and the parameters of chain members several sites share
    (one LoRA pair or scale registered on several layers: Tied-LoRA)."""
    users: dict[int, int] = {}
    for _, module in parametrized(model):
        for plist in module.parametrizations.values():
            for key in set(map(id, _chain_tensors(plist))):
                users[key] = users.get(key, 0) + 1
    return {key for key, count in users.items() if count > 1}


@contextlib.contextmanager
def calls(model: nn.Module) -> Iterator[dict[str, int]]:
    """Counts, for each parametrized module of ``model`` and each with a hook-based norm (by
    path), how many times the block called it or read one of its parametrized tensors, whichever
    is more: stock computes a tensor
    at every read (its ``ParametrizationList`` is called), so a forward that reads a module's
    weight directly besides calling it (a tied output projection) reads it twice. Calls during
    backward (a checkpointed region's recomputation) are not counted: they replay the forward's."""
    counts: dict[str, int] = {}
    seen: dict[object, int] = {}
    handles = []

    def counter(path: str, key: object) -> Callable[..., None]:
        def count(*_: Any) -> None:
            if _in_backward():
                return
            seen[key] = seen.get(key, 0) + 1
            counts[path] = max(counts.get(path, 0), seen[key])
        return count

    for path, module in parametrized(model):
        handles.append(module.register_forward_pre_hook(counter(path, path)))
        for name, plist in module.parametrizations.items():
            handles.append(plist.register_forward_pre_hook(counter(path, (path, name))))
    for path, module in dict.fromkeys((path, module) for path, module, _, _ in hook_norms(model)):
        handles.append(module.register_forward_pre_hook(counter(path, (path, "hook-based norm"))))
    try:
        yield counts
    finally:
        for handle in handles:
            handle.remove()


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward in this thread."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def originals_of(model: nn.Module, paths: set[str]) -> set[int]:
    """The ids of the originals of the parametrized modules at ``paths``, and of the parameters
    of their chains' members (a LoRA member's ``A`` and ``B``): every tensor whose gradient sums
    one term per computation of the value."""
    found = {
        id(tensor)
        for path, module in parametrized(model)
        if path in paths
        for plist in module.parametrizations.values()
        for tensor in _chain_tensors(plist)
    }
    for path, module, hook, kind in hook_norms(model):
        if path in paths:
            found.update(id(tensors[key]) for _, tensors, key in hooknorms.originals(module, hook, kind))
    return found


def _chain_tensors(plist: nn.Module) -> list[torch.Tensor]:
    """A parametrization list's originals and its members' own parameters."""
    return [*(getattr(plist, name) for name in original_names(plist)), *plist.parameters()]


@contextlib.contextmanager
def once_per_forward(model: nn.Module) -> Iterator[None]:
    """``model``'s parametrized tensors computed as paramfold's hoist computes them: once per
    forward, when it starts, in module order (``parametrize.cached()`` computes at the first
    read, in the forward's order), each read getting a view of its own, as stock's fresh tensor
    at each read (so a gradient hook registered on a read acts on that read's gradient only, as
    in stock). A chain whose computation moves its buffers (spectral_norm's power iteration in
    training) gives its first read that value and computes again at each later read; one that
    draws random numbers is computed at every read instead. A hook-based norm's tensor is
    computed once per forward too, where it moves no buffer. So the gradients of the originals
    are summed in paramfold's order, from stock's values."""
    plists = [m for _, module in parametrized(model) for m in module.parametrizations.values()]
    plists += [m for m in model.modules() if isinstance(m, parametrize.ParametrizationList) and m not in plists]
    values: dict[int, torch.Tensor] = {}
    first_read_only: set[int] = set()
    for plist in plists:
        before = _chain_state(plist)
        rng = rng_state()
        value = plist()
        after = _chain_state(plist)
        if not torch.equal(before[1], after[1]) or any(not torch.equal(x, y) for x, y in zip(before[2], after[2])):
            # draws random numbers: undone, computed where it is read
            set_rng_state(rng)
            for generator, state in zip(_generators(plist), before[2]):
                generator.set_state(state)
            continue
        values[id(plist)] = value
        if before[0] != after[0]:
            first_read_only.add(id(plist))

    def once(plist: nn.Module) -> Callable[[], torch.Tensor]:
        def forward() -> torch.Tensor:
            value = values.get(id(plist))
            if value is None:
                return type(plist).forward(plist)
            if id(plist) in first_read_only:
                del values[id(plist)]
            try:
                return value.view_as(value)
            except Exception:  # noqa: BLE001 - a tensor subclass without views: the value itself
                return value
        return forward

    # A hook-based norm that moves no buffer (weight_norm; spectral_norm in eval) is computed
    # once too, and each call of its module gets a view of that value, where stock's hook
    # computes it at every call. (In training, spectral_norm's hook runs at each call in both.)
    hooked: list[tuple[nn.Module, int, Any]] = []
    for _, module, hook, kind in hook_norms(model):
        if kind == "weight_norm" or not module.training:
            key = next(k for k, h in module._forward_pre_hooks.items() if h is hook)
            hooked.append((module, key, hook))
            module._forward_pre_hooks[key] = _serving(hook.name, hooknorms.compute(module, hook, kind))
    for plist in plists:
        plist.__dict__["forward"] = once(plist)
    try:
        yield
    finally:
        for plist in plists:
            plist.__dict__.pop("forward", None)
        for module, key, hook in hooked:
            module._forward_pre_hooks[key] = hook


def _serving(name: str, value: torch.Tensor) -> Callable[[nn.Module, Any], None]:
    """A forward pre-hook that sets ``module.<name>`` to a view of ``value`` at each call."""
    def serve(module: nn.Module, args: Any) -> None:
        setattr(module, name, value.view_as(value))
    return serve


#: A chain's buffer versions, torch's global CPU generator state and its own generators' states.
_ChainState = tuple[list[int], torch.Tensor, list[torch.Tensor]]


def _chain_state(plist: nn.Module) -> _ChainState:
    return [b._version for b in plist.buffers()], torch.get_rng_state(), [g.get_state() for g in _generators(plist)]


def _generators(plist: nn.Module) -> list[torch.Generator]:
    return [g for m in plist.modules() for g in vars(m).values() if isinstance(g, torch.Generator)]


def compare_resummed(
    what: str,
    grad: torch.Tensor | None,
    stocks: torch.Tensor | None,
    once: torch.Tensor | None,
    tol: Tolerance,
    eps: float,
    rounding: bool,
    exc: AssertionError,
) -> None:
    """A gradient that differs from stock's (``exc``) and that paramfold sums in another order:
    it must equal ``once``, stock's computing each tensor as paramfold's hoist does, or, where
    ``rounding``, differ from stock's by the rounding of its own summed terms."""
    if once is not None:
        try:
            compare(what, grad, once, tol)
            return
        except AssertionError:
            pass
    if not rounding or grad is None or stocks is None:
        raise AssertionError(
            f"{exc}, and from stock computing each parametrized tensor once per forward, as hoist does, with a "
            "view of it at each read (the order in which paramfold sums the gradients of a tensor read several "
            "times; a gradient hook registered at each read still scales only that read's gradient there, as in "
            "stock, where paramfold's shared value has every read's hooks: README, Notes and limits)"
        ) from None
    # The size of the summed terms, this tensor's own (not the model's largest gradient).
    rtol = {torch.finfo(torch.bfloat16).eps: 1.6e-2, torch.finfo(torch.float16).eps: 1e-3}.get(eps, 1.3e-6)
    size = max(largest(stocks), largest(once) if once is not None else 0.0)
    compare(f"{what} (and differs from stock computing each tensor once per forward)", grad, stocks,
            Tolerance(max(tol.rtol, rtol), tol.atol + rtol * size, tol.of_max))
