"""torch's hook-based ``weight_norm`` and ``spectral_norm``, served like parametrizations.

``torch.nn.utils.weight_norm`` and ``torch.nn.utils.spectral_norm`` (deprecated, still what most
published vocoder, codec and GAN code uses) register a forward pre-hook that recomputes
``module.weight`` from ``weight_g``/``weight_v`` (or ``weight_orig`` with the ``weight_u``/
``weight_v`` buffers) and stores it as a plain attribute before every forward. Dynamo traces that
hook, and the norm, for every layer.

While prepared, the hook in ``module._forward_pre_hooks`` is replaced, at the same key (so the
order of hooks is kept), by a :class:`ScopedNormHook`: when a call scope already installed the
value (hoist or freeze, marked by :func:`marker`), it does nothing, so compiled code reads a plain
tensor; otherwise it runs the original hook, exactly as stock (a module called outside a scope, or
traced inside a bigger compiled region). Values are computed with the hook's own
``compute_weight``, so results, gradients and spectral_norm's ``weight_u``/``weight_v`` evolution
are stock's, once per call. As in stock, ``module.weight`` keeps the last value after a call.
:func:`paramfold.restore` puts the original hook object back at its key.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn


def _classes() -> tuple[type, type]:
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    return WeightNorm, SpectralNorm


def hook_norms(module: nn.Module) -> Iterator[tuple[int, object, str]]:
    """``(hook key, hook, kind)`` of every hook-based norm on ``module`` (a wrapped one included)."""
    weight_norm_cls, spectral_norm_cls = _classes()
    for key, hook in module._forward_pre_hooks.items():
        original = hook.original if isinstance(hook, ScopedNormHook) else hook
        if isinstance(original, weight_norm_cls):
            yield key, original, "weight_norm"
        elif isinstance(original, spectral_norm_cls):
            yield key, original, "spectral_norm"


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


def marker(name: str) -> str:
    """The instance ``__dict__`` key a call scope sets while it has installed ``name``."""
    return f"_paramfold_scoped_{name}"


class ScopedNormHook:
    """Stands in for a hook-based norm's pre-hook while prepared (see the module docstring)."""

    def __init__(self, original: object) -> None:
        self.original = original
        self.name = original.name
        self.marker = marker(original.name)

    def __call__(self, module: nn.Module, inputs: object) -> None:
        if self.marker in module.__dict__:
            return None
        return self.original(module, inputs)


def swap_hook(module: nn.Module, key: int, hook: object) -> None:
    """Put ``hook`` at ``key`` of ``module._forward_pre_hooks`` (order unchanged)."""
    module._forward_pre_hooks[key] = hook
