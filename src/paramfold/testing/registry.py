"""The registry of real parametrizations that paramfold's property checks draw from.

Why a module of its own: what a parametrization is (how to register it, on which tensors, where
in a chain, which options it takes, which package it needs) is plain data about torch and
torchao, with no Hypothesis in it, so a case that a property test prints can be rebuilt with
:func:`apply_chain` alone. :mod:`paramfold.testing.strategies` draws chains from it.

* :data:`PARAMETRIZATIONS`: torch's ``weight_norm``, ``spectral_norm``, ``orthogonal``; the
  seed's ``unsafe`` dtype cast (:class:`Cast`); a custom ``right_inverse`` returning a tuple
  (:class:`HalfSum`); a custom buffer scale (:class:`Scale`); torchao's ``FakeSparsity`` mask and
  ``Int8WeightOnlyConfig`` + ``unwrap_tensor_subclass``, each applied by
  ``PARAMETRIZATIONS[name].apply(module, tensor_name, **options)``.
* :class:`Step` (a name and its options) and :func:`apply_chain`, which registers a chain of
  steps on one tensor.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize

__all__ = ["PARAMETRIZATIONS", "Cast", "HalfSum", "Recipe", "Scale", "Step", "TensorSpec", "apply_chain"]


# --------------------------------------------------------------------------------------------
# Custom parametrizations
# --------------------------------------------------------------------------------------------


class Cast(nn.Module):
    """The seed's dtype-changing parametrization: stored in ``storage``, read as ``dtype``.

    Register it with ``unsafe=True`` (it changes the dtype), last in a chain.
    """

    def __init__(self, dtype: torch.dtype = torch.bfloat16, storage: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.dtype = dtype
        self.storage = storage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)

    def right_inverse(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.storage)


class HalfSum(nn.Module):
    """A custom parametrization whose ``right_inverse`` returns a tuple: ``w = a + b``.

    ``right_inverse(w) = (w / 2, w / 2)``; halving is exact in binary floating point (outside
    the subnormal range), so registering it leaves the tensor's value bitwise unchanged.
    """

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b

    def right_inverse(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x / 2, x / 2


class Scale(nn.Module):
    """A simple chainable custom parametrization: multiply by a buffer (no ``right_inverse``)."""

    def __init__(self, scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("scale", scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """What a parametrization needs to know about the tensor it will be registered on."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    module_type: type = nn.Linear
    name: str = "weight"
    is_buffer: bool = False

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One parametrization: how to register it, on which tensors, where in a chain.

    Attributes:
        name: registry key.
        apply: ``apply(module, tensor_name, **options)`` registers it on ``module.<tensor_name>``
            (the tensor may already be parametrized when ``position`` allows it).
        supports: whether it can be registered on a tensor like this.
        options: ``options(tensor)`` gives ``apply``'s keyword options on such a tensor: the
            option dicts to choose from (plain data: the registry needs no Hypothesis), or a
            Hypothesis strategy of them. :func:`~paramfold.testing.chains` draws one.
        position: ``"first"`` (must start a chain), ``"any"``, ``"last"`` (must end it) or
            ``"alone"`` (the only parametrization of the tensor and of its module).
        stateful: mutates its buffers in forward when training.
        requires: the module that must be importable (``"torchao"``), or None.
    """

    name: str
    apply: Callable[..., None]
    supports: Callable[[TensorSpec], bool]
    options: Callable[[TensorSpec], Any]  # a sequence of option dicts, or a Hypothesis strategy
    position: str = "any"
    stateful: bool = False
    requires: str | None = None

    @property
    def available(self) -> bool:
        """Whether the package it needs is installed and imports (a torchao built for a newer
        torch is installed but fails at import with ImportError or AttributeError)."""
        return self.requires is None or _importable(self.requires)


@functools.lru_cache(maxsize=None)
def _importable(name: str) -> bool:
    try:
        if importlib.util.find_spec(name) is None:
            return False
        importlib.import_module(name)
    except Exception:  # noqa: BLE001 -- whatever a broken install raises, the recipe is unavailable
        return False
    return True


_FLOATS = (torch.float32, torch.bfloat16)


def _current(module: nn.Module, name: str) -> torch.Tensor:
    with torch.no_grad():
        return getattr(module, name)


def _apply_weight_norm(module: nn.Module, name: str, *, dim: int | None = 0) -> None:
    parametrizations.weight_norm(module, name, dim=dim)


def _apply_spectral_norm(module: nn.Module, name: str, *, dim: int = 0, n_power_iterations: int = 1) -> None:
    parametrizations.spectral_norm(module, name, n_power_iterations=n_power_iterations, dim=dim)


def _apply_orthogonal(
    module: nn.Module, name: str, *, orthogonal_map: str = "matrix_exp", use_trivialization: bool = True
) -> None:
    parametrizations.orthogonal(module, name, orthogonal_map, use_trivialization=use_trivialization)


def _apply_cast(module: nn.Module, name: str, *, dtype: torch.dtype = torch.bfloat16) -> None:
    storage = _current(module, name).dtype
    parametrize.register_parametrization(module, name, Cast(dtype, storage), unsafe=True)


def _apply_half_sum(module: nn.Module, name: str) -> None:
    parametrize.register_parametrization(module, name, HalfSum())


def _apply_scale(module: nn.Module, name: str, *, per_row: bool = True) -> None:
    value = _current(module, name)
    shape = (value.shape[0],) + (1,) * (value.ndim - 1) if per_row else ()
    scale = (torch.rand(shape) + 0.5).to(value.dtype)
    parametrize.register_parametrization(module, name, Scale(scale))


def _apply_fake_sparsity(module: nn.Module, name: str, *, density: float = 0.5) -> None:
    from torchao.prototype.sparsity.sparsifier.utils import FakeSparsity

    value = _current(module, name)
    mask = (torch.rand(value.shape) < density).to(value.dtype)
    mask.view(mask.shape[0] if mask.ndim else 1, -1)[:, 0] = 1  # no all-zero row (0/0 in spectral_norm)
    parametrize.register_parametrization(module, name, FakeSparsity(mask))


def _apply_int8_weight_only(module: nn.Module, name: str) -> None:
    from torchao.quantization import Int8WeightOnlyConfig, quantize_
    from torchao.utils import unwrap_tensor_subclass

    if not isinstance(module, nn.Linear) or name != "weight" or parametrize.is_parametrized(module):
        raise ValueError("int8_weight_only applies to the weight of an unparametrized nn.Linear only")
    quantize_(module, Int8WeightOnlyConfig())
    # unwrap_tensor_subclass only visits children, so give the layer a throwaway parent.
    unwrap_tensor_subclass(nn.Sequential(module))


def _grid(**choices: Sequence[Any]) -> list[dict[str, Any]]:
    """Every combination of the keyword ``choices``, first choices first."""
    return [dict(zip(choices, values)) for values in itertools.product(*choices.values())]


def _no_options(spec: TensorSpec) -> list[dict[str, Any]]:
    return [{}]


def _weight_norm_options(spec: TensorSpec) -> list[dict[str, Any]]:
    return _grid(dim=[None, *range(-spec.ndim, spec.ndim)])


def _spectral_norm_options(spec: TensorSpec) -> list[dict[str, Any]]:
    return _grid(dim=range(spec.ndim), n_power_iterations=[1, 2])


def _orthogonal_options(spec: TensorSpec) -> list[dict[str, Any]]:
    # torch implements right_inverse without the trivialization for householder only.
    return [
        {"orthogonal_map": "matrix_exp"},
        {"orthogonal_map": "cayley"},
        {"orthogonal_map": "householder"},
        {"orthogonal_map": "householder", "use_trivialization": False},
    ]


#: Real parametrizations by name. ``PARAMETRIZATIONS[name].apply(module, tensor_name, **options)``.
#: orthogonal needs float32 (CPU has no bfloat16 QR/LU/householder kernels) and >= 2 dims;
#: weight_norm, orthogonal and half_sum start a chain (tuple originals, or orthogonal's ``base``
#: which only a first registration initialises); int8_weight_only is alone on a Linear weight.
PARAMETRIZATIONS: dict[str, Recipe] = {
    r.name: r
    for r in [
        Recipe(
            "weight_norm",
            _apply_weight_norm,
            lambda s: s.dtype in _FLOATS and s.ndim >= 1,
            _weight_norm_options,
            position="first",
        ),
        Recipe(
            "spectral_norm",
            _apply_spectral_norm,
            lambda s: s.dtype in _FLOATS and s.ndim >= 1,
            _spectral_norm_options,
            stateful=True,
        ),
        Recipe(
            "orthogonal",
            _apply_orthogonal,
            lambda s: s.dtype == torch.float32 and s.ndim >= 2,
            _orthogonal_options,
            position="first",
        ),
        Recipe("cast", _apply_cast, lambda s: s.dtype == torch.float32, _no_options, position="last"),
        Recipe("half_sum", _apply_half_sum, lambda s: s.dtype in _FLOATS, _no_options, position="first"),
        Recipe(
            "scale",
            _apply_scale,
            lambda s: s.dtype in _FLOATS,
            lambda s: _grid(per_row=[False, True]),
        ),
        Recipe(
            "fake_sparsity",
            _apply_fake_sparsity,
            lambda s: s.dtype in _FLOATS,
            lambda s: _grid(density=[0.3, 0.7, 1.0]),
            requires="torchao",
        ),
        Recipe(
            "int8_weight_only",
            _apply_int8_weight_only,
            lambda s: s.dtype in _FLOATS and s.module_type is nn.Linear and s.name == "weight" and not s.is_buffer,
            _no_options,
            position="alone",
            requires="torchao",
        ),
    ]
}


@dataclasses.dataclass(frozen=True)
class Step:
    """One parametrization of a chain: a :data:`PARAMETRIZATIONS` name and its options.

    Its repr is the expression that rebuilds it (``Step('weight_norm', (('dim', 0),))``), so a
    printed :class:`~paramfold.testing.NetSpec` pastes into a test as it is.
    """

    name: str
    options: tuple[tuple[str, Any], ...] = ()

    def __repr__(self) -> str:
        return f"Step({self.name!r}, {self.options!r})" if self.options else f"Step({self.name!r})"

    @property
    def recipe(self) -> Recipe:
        """Its :data:`PARAMETRIZATIONS` entry."""
        return PARAMETRIZATIONS[self.name]


Chain = tuple[Step, ...]


def apply_chain(module: nn.Module, tensor_name: str, chain: Sequence[Step]) -> nn.Module:
    """Register every step of ``chain`` on ``module.<tensor_name>``, in order; return ``module``.

    Example::

        >>> import torch
        >>> from paramfold.testing import Step, apply_chain
        >>> layer = apply_chain(torch.nn.Linear(3, 3), "weight",
        ...                     [Step("weight_norm", (("dim", 0),)), Step("spectral_norm")])
        >>> [type(p).__name__ for p in layer.parametrizations.weight]
        ['_WeightNorm', '_SpectralNorm']
    """
    for step in chain:
        step.recipe.apply(module, tensor_name, **dict(step.options))
    return module
