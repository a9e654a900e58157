"""torch's hook-based ``weight_norm`` and ``spectral_norm``, served like parametrizations.

``torch.nn.utils.weight_norm`` and ``torch.nn.utils.spectral_norm`` (deprecated, still what most
published vocoder, codec and GAN code uses) register a forward pre-hook that recomputes
``module.weight`` from ``weight_g``/``weight_v`` (or ``weight_orig`` with the ``weight_u``/
``weight_v`` buffers) and stores it as a plain attribute before every forward. Dynamo traces that
hook, and the norm, for every layer.

While a call scope is open (hoist or freeze), the scope computes the value with the hook's own
``compute_weight`` — so results, gradients and spectral_norm's ``weight_u``/``weight_v`` evolution
are stock's, once per call — stores it as ``module.weight``, and takes the hook out of
``module._forward_pre_hooks`` (:func:`detach`): compiled code then sees a module without hooks,
exactly like the plain model. While a spectral_norm trains, the module's class for the call has
a ``__call__`` and a ``forward`` that run a :class:`ServedOnce` first: the module's first call in
the scope is served the value, each later call (a discriminator scoring two batches in one
forward) runs torch's hook, as every call does in stock, and a ``forward`` called directly
(``layer.forward(x)``, which skips stock's hooks) runs none; a module whose calls do not reach that ``forward`` (one set on the
instance: :func:`calls_class_forward`) keeps its hook in, which runs at every call as in stock.
:func:`attach` puts the very same hook object back at its key, in its place among the others,
when the scope closes, or as soon as the forward assigns or deletes ``module.<name>``
(``scope_midcall.hook_value_replaced``: stock's hook computes it again at the module's next call; the
hook's own assignment, wherever it runs, leaves all as it is).
Outside a scope the hook is where torch put it and runs as in stock (a layer called on its own,
a bigger compiled region). As in stock, ``module.weight`` keeps the last value after a call (and
a copy of the module made during a call, before its call there, holds that one:
``scope_midcall.copied_hook_values``). Where a call keeps the hook in (a forward pre-hook that may change
the originals runs before it), that value is out of ``__dict__`` until the hook sets it again
(``scope._install``), and the module's class serves it to any read before
(``site_reads.LastCallValue``: a global pre-hook, one registered with ``prepend=True``), as stock's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from paramfold.compute import sets_its_own_forward
from paramfold.frames import run_module_eagerly_as_frames


def _classes() -> tuple[type, type]:
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    return WeightNorm, SpectralNorm


def hook_norms(module: nn.Module, taken_out: tuple = ()) -> Iterator[tuple[int, object, str]]:
    """``(hook key, hook, kind)`` of every hook-based norm on ``module``: torch's own hooks, not a
    subclass (whose call may do more than ``compute_weight``), and only where the tensors it reads
    are the module's registered parameters and buffers, as torch registers them (FSDP1 with
    ``use_orig_params=False`` leaves plain attributes there, set by its forward), and the tensor it
    computes is not one (:func:`shadowed`). Any other stays a hook and runs as in stock.
    ``taken_out``: ``(key, hook)`` pairs :func:`detach` took off the module for now, counted too."""
    weight_norm_cls, spectral_norm_cls = _classes()
    for key, hook in (*module._forward_pre_hooks.items(), *taken_out):
        kind = "weight_norm" if type(hook) is weight_norm_cls else "spectral_norm" if type(hook) is spectral_norm_cls else None
        if kind is not None and not shadowed(module, hook.name) and all(
                k in d for _, d, k in (*originals(module, hook, kind), *state_tensors(module, hook, kind))):
            yield key, hook, kind


def shadowed(module: nn.Module, name: str) -> bool:
    """Whether ``module.<name>``, which a hook-based norm computes, is now a registered parameter or
    buffer (``module.weight = p``: transformers' ``tie_weights()`` on a normed ``lm_head``), or a
    parametrized tensor (torchao's ``unwrap_tensor_subclass`` registers one). Stock's hook then
    cannot set it at any call (``TypeError: cannot assign ... as parameter``; the
    parametrization's ``right_inverse`` raises or refuses); a value the scope wrote into ``__dict__``
    would hide it from every read instead."""
    if name in module._parameters or name in module._buffers:
        return True
    plists = module._modules.get("parametrizations")
    return plists is not None and name in plists._modules


def originals(module: nn.Module, hook: object, kind: str) -> list[tuple[str, dict, str]]:
    """``(name, dict, key)`` of the tensors the hook computes ``module.<hook.name>`` from."""
    name = hook.name
    if kind == "weight_norm":
        return [(f"{name}_g", module._parameters, f"{name}_g"), (f"{name}_v", module._parameters, f"{name}_v")]
    return [(f"{name}_orig", module._parameters, f"{name}_orig")]


def state_tensors(module: nn.Module, hook: object, kind: str) -> list[tuple[str, dict, str]]:
    """Buffers the hook mutates (spectral_norm's power iteration vectors)."""
    if kind != "spectral_norm":
        return []
    return [(f"{hook.name}_{b}", module._buffers, f"{hook.name}_{b}") for b in ("u", "v")]


def compute(module: nn.Module, hook: object, kind: str) -> torch.Tensor:
    """What the hook would store as ``module.<name>`` before a forward, computed the same way."""
    if kind == "weight_norm":
        return hook.compute_weight(module)
    return hook.compute_weight(module, do_power_iteration=module.training)


def calls_class_forward(module: nn.Module) -> bool:
    """Whether a call of ``module`` reaches its class's ``forward``, where the read-once class runs
    the :class:`ServedOnce` stand-ins: no ``forward`` or ``_call_impl`` set on the instance
    (``m.forward = torch.compiler.disable(m.forward)``, accelerate's hooks), which stock's call
    runs instead, and which would never mark the value served."""
    return not sets_its_own_forward(module)


class ServedOnce:
    """Stands in for a training spectral_norm's hook, taken out while a call scope is open: the
    read-once class's ``__call__`` and ``forward`` (``classes.read_once_class``) serve the
    module's first call the value the scope computed (and ran the power iteration for), and mark
    it ``served``; at each later call they run torch's ``hook``, which computes and stores it
    afresh, as stock's every call does, then (eagerly) ``after``: the scope's check of what
    changed takes the hook's own buffer updates as they are. ``called``: the module's call is
    on its way to its ``forward`` (a ``forward`` called directly runs no hook, as in stock). Not
    a forward pre-hook: dynamo traces a module with hooks through all of ``_call_impl``, several
    times the cost of one more ``forward``."""

    def __init__(self, hook: object, after: Callable[[], None]) -> None:
        self.hook = hook
        self.after = after
        self.served = False
        self.called = False


def detach(module: nn.Module, keys: list[int]) -> tuple[list[tuple[int, object]], tuple[int, ...], list[int]]:
    """Take the hooks at ``keys`` out of ``module._forward_pre_hooks``; returns what :func:`attach`
    needs, with a list where the module's class records the pre-hooks registered with
    ``prepend=True`` meanwhile (``classes._recording_prepends``)."""
    hooks = module._forward_pre_hooks
    order = tuple(hooks)
    return [(key, hooks.pop(key)) for key in keys], order, []


def attach(module: nn.Module, taken: list[tuple[int, object]], order: tuple[int, ...], prepended: list[int]) -> None:
    """Put hooks taken by :func:`detach` back, each at its key, in the order the dict had; pre-hooks
    registered meanwhile go where stock's dict has them: before everything with ``prepend=True``,
    after everything otherwise."""
    hooks = module._forward_pre_hooks
    front = [k for k in hooks if k in prepended]  # a later prepend is in front, as in stock
    for key, hook in taken:
        hooks[key] = hook
    for key in (*front, *order, *(k for k in list(hooks) if k not in order and k not in front)):
        if key in hooks:
            hooks.move_to_end(key)


# paramfold's own work: dynamo runs it eagerly when it meets it as a frame (paramfold.frames).
run_module_eagerly_as_frames(globals())
