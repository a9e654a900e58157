"""The model zoo: the parametrized models ``paramfold bench`` measures, and how to unparametrize them.

It exists apart from the measurement so that the models can be built, inspected and reused
(``examples/percall_bench.py``, tests) without anything that times or compiles them. Each
:class:`ZooModel` says how to build the stock parametrized model of a given depth and width and
what its input looks like; :func:`unparametrize` turns such a model into the plain model (the
benchmark's ``baseline``) holding the values its parametrizations compute.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parametrize

__all__ = ["MODELS", "CastToBFloat16", "Layer", "Stack", "ZooModel", "unparametrize"]


class Layer(nn.Module):
    """One layer of the zoo: a ``Linear``, then the activation if there is one.

    The layers are a user-defined class, as in torchtune, because ``.compile()`` on a built-in
    ``nn.Linear`` compiles nothing (dynamo skips frames of ``torch.nn`` itself), which would leave
    ``--entry layers`` measuring plain eager execution.
    """

    def __init__(self, in_features: int, out_features: int, act: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=True)
        self.act = nn.GELU() if act else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        return self.act(x) if self.act is not None else x


class Stack(nn.Module):
    """``self.seq``: an ``nn.Sequential`` of :class:`Layer` with the given widths."""

    def __init__(self, dims: Sequence[int], act: bool) -> None:
        super().__init__()
        self.seq = nn.Sequential(*[Layer(a, b, act) for a, b in zip(dims[:-1], dims[1:])])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.seq(x)


class CastToBFloat16(nn.Module):
    """The seed's dtype-changing parametrization (``half`` on CUDA there, ``bfloat16`` on CPU here)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.bfloat16)

    def right_inverse(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float32)


def _build_seed(layers: int, width: int) -> nn.Module:
    # Seed 003: a Sequential of N Linear(W, W), no activation, every parameter cast on access.
    model = Stack([width] * (layers + 1), act=False)
    for module in list(model.modules()):
        for name, param in list(module._parameters.items()):
            if param is not None:
                parametrize.register_parametrization(module, name, CastToBFloat16(), unsafe=True)
    return model


def _build_weight_norm(layers: int, width: int) -> nn.Module:
    model = _build_weight_norm_plain(layers, width)
    for layer in model.seq:
        torch.nn.utils.parametrizations.weight_norm(layer.linear)
    return model


def _build_spectral_norm(layers: int, width: int) -> nn.Module:
    model = Stack([width] * (layers + 1), act=True)
    for layer in model.seq:
        torch.nn.utils.parametrizations.spectral_norm(layer.linear)
    return model


def _build_orthogonal(layers: int, width: int) -> nn.Module:
    model = Stack([width] * (layers + 1), act=True)
    for layer in model.seq:
        torch.nn.utils.parametrizations.orthogonal(layer.linear)
    return model


def _build_weight_norm_hooks(layers: int, width: int) -> nn.Module:
    model = _build_weight_norm_plain(layers, width)
    for layer in model.seq:
        _hook_based(torch.nn.utils.weight_norm, layer.linear)
    return model


def _build_spectral_norm_hooks(layers: int, width: int) -> nn.Module:
    model = Stack([width] * (layers + 1), act=True)
    for layer in model.seq:
        _hook_based(torch.nn.utils.spectral_norm, layer.linear)
    return model


def _build_weight_norm_plain(layers: int, width: int) -> nn.Module:
    return Stack([_half_width(width) if i % 2 == 0 else width for i in range(layers + 1)], act=True)


def _hook_based(norm: Callable[[nn.Module], nn.Module], module: nn.Module) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch deprecates the hook-based API
        norm(module)


def _full_width(width: int) -> int:
    return width


def _half_width(width: int) -> int:
    return max(width // 2, 1)


@dataclass(frozen=True)
class ZooModel:
    """One entry of the model zoo: how to build the stock parametrized model and its input.

    Called ``ModelSpec`` before 0.2 (``paramfold.bench.ModelSpec`` still answers, with a
    ``DeprecationWarning``); renamed because ``paramfold.testing`` had a ``ModelSpec`` too, a
    different thing (now ``paramfold.testing.NetSpec``).
    """

    name: str
    description: str
    default_layers: int
    default_width: int
    build: Callable[[int, int], nn.Module]
    input_features: Callable[[int], int] = _full_width
    dtype: torch.dtype = torch.float32


MODELS: dict[str, ZooModel] = {
    spec.name: spec
    for spec in (
        ZooModel("seed", "seed 003: N Linear(W,W), every weight and bias cast to bfloat16 "
                 "(unsafe=True)", 32, 128, _build_seed, dtype=torch.bfloat16),
        ZooModel("weight_norm", "N Linear alternating W/2 <-> W with parametrizations.weight_norm, "
                 "GELU between", 16, 128, _build_weight_norm, _half_width),
        ZooModel("spectral_norm", "N Linear(W,W) with parametrizations.spectral_norm, GELU between",
                 16, 64, _build_spectral_norm),
        ZooModel("weight_norm_hooks", "as weight_norm, with the deprecated hook-based "
                 "torch.nn.utils.weight_norm", 16, 128, _build_weight_norm_hooks, _half_width),
        ZooModel("spectral_norm_hooks", "as spectral_norm, with the deprecated hook-based "
                 "torch.nn.utils.spectral_norm", 16, 64, _build_spectral_norm_hooks),
        ZooModel("orthogonal", "N Linear(W,W) with parametrizations.orthogonal (matrix_exp), GELU "
                 "between", 16, 64, _build_orthogonal),
    )
}


# --------------------------------------------------------------------------------------------
# Configuration and variants


def unparametrize(model: nn.Module) -> nn.Module:
    """Turn ``model`` (in place) into the plain model holding the values its parametrizations compute.

    Unlike ``parametrize.remove_parametrizations(..., leave_parametrized=True)`` this also works
    when a parametrization changes the dtype (``unsafe=True``), as in seed 003.  Values are computed
    under ``no_grad`` in the model's current train/eval mode; ``requires_grad`` follows the originals.

    Example::

        >>> m = nn.Linear(3, 3)
        >>> _ = torch.nn.utils.parametrizations.weight_norm(m)
        >>> w = m.weight.detach().clone()
        >>> plain = unparametrize(m)
        >>> parametrize.is_parametrized(plain), torch.equal(plain.weight, w)
        (False, True)
    """
    from torch.nn.utils import remove_spectral_norm, remove_weight_norm

    from paramfold.hooknorms import hook_norms

    for module in list(model.modules()):
        for _, hook, kind in list(hook_norms(module)):
            originals = [module._parameters[n] for n in ((f"{hook.name}_g", f"{hook.name}_v") if kind == "weight_norm" else (f"{hook.name}_orig",))]
            requires_grad = any(t.requires_grad for t in originals)
            with torch.no_grad():
                # In training, stock's first forward runs one power iteration first: so does this.
                hook(module, None)
                (remove_weight_norm if kind == "weight_norm" else remove_spectral_norm)(module, hook.name)
            module._parameters[hook.name].requires_grad_(requires_grad)
        if not parametrize.is_parametrized(module):
            continue
        for name in list(module.parametrizations.keys()):
            plist = module.parametrizations[name]
            originals = [t for _, t in plist.named_parameters(recurse=False)] or list(
                plist.buffers(recurse=False)
            )
            is_param = any(isinstance(t, nn.Parameter) for t in originals)
            requires_grad = any(t.requires_grad for t in originals)
            with torch.no_grad():
                value = getattr(module, name).detach().clone()
            # torch refuses leave_parametrized=False for tuple originals, and True for a dtype
            # change; either way the value is replaced below.
            parametrize.remove_parametrizations(
                module, name, leave_parametrized=len(originals) > 1
            )
            delattr(module, name)
            if is_param:
                module.register_parameter(name, nn.Parameter(value, requires_grad=requires_grad))
            else:
                module.register_buffer(name, value)
    return model
