"""Property checks for parametrized models: run them in your own test suite.

Three layers, usable separately:

* :func:`assert_equivalent` runs a model stock and prepared by :func:`paramfold.prepare`
  side by side (forward, backward, several steps, optionally compiled) and fails with a message
  naming the first tensor that differs; then it restores the prepared copy and checks that its
  structure is exactly what it was (:func:`structure`, :func:`assert_same_structure`).
* :data:`PARAMETRIZATIONS`, a registry of real parametrizations by name (torch's
  ``weight_norm``, ``spectral_norm``, ``orthogonal``; the ``unsafe`` dtype cast; a custom
  ``right_inverse`` returning a tuple; a custom buffer scale; torchao's ``FakeSparsity`` mask and
  ``Int8WeightOnlyConfig`` + ``unwrap_tensor_subclass``), each applied by
  ``PARAMETRIZATIONS[name].apply(module, tensor_name, **options)``.
* Hypothesis strategies: :func:`chains` (1-3 compatible parametrizations for one tensor),
  :func:`models` (small random models as a printable :class:`ModelSpec`) and :func:`cases`
  (a model factory, its inputs and the case's flags).

Example::

    >>> import torch, paramfold.testing as pt
    >>> from torch.nn.utils.parametrizations import weight_norm
    >>> model = torch.nn.Sequential(weight_norm(torch.nn.Linear(4, 4)), torch.nn.Tanh())
    >>> pt.assert_equivalent(model, torch.randn(2, 4), "hoist", steps=2)

and with Hypothesis::

    from hypothesis import given
    import paramfold.testing as pt

    @given(pt.cases())
    def test_hoist_is_exact(case):
        factory, inputs, flags = case
        pt.assert_equivalent(factory(), inputs, "hoist", steps=2)

Tolerances. In eager mode every comparison is bitwise (``torch.testing.assert_close`` with
``rtol=atol=0`` and ``equal_nan=True``), with one documented exception: gradients of originals
that autograd sums from several contributions in an order ``prepare`` may change. That is

* a parametrized module *called more than once per forward* (the same instance at two
  places): stock computes its tensor once per call and autograd sums after the chain's
  backward (``J^T g1 + J^T g2``); hoist, freeze and auto compute it once per forward and sum
  before it (``J^T (g1 + g2)``);
* an original *shared by several sites* (tied): hoisted sites are computed when the forward
  starts, in module order, so their backward nodes run in a different order than stock's
  when the forward reads them in another order or only some of them are prepared
  (``filter_fn``), and sums of three or more terms (spectral_norm reads its weight twice)
  round differently.

Mathematically equal, they differ by rounding. So in modes other than ``"inline"`` the
gradients of those originals are compared first, bitwise, with a third copy run stock under
``torch.nn.utils.parametrize.cached()`` (one value per tensor per forward, paramfold's
semantics: this covers modules called twice); failing that, with the stock copy at
``rtol`` = ``torch.testing.assert_close``'s default for the lowest-precision floating dtype
of the model and its outputs (bfloat16: 1.6e-2, float32: 1.3e-6) and ``atol = rtol *
(largest gradient element in the model)``, the size of the terms being summed (a sum that
cancels can be far smaller than its terms; this covers the tied case). Everything else,
outputs and buffers included, stays bitwise.
Under ``compile=...`` the default tolerance is :data:`COMPILE_TOLERANCES` for the backend.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib
import importlib.util
import itertools
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch

try:
    from hypothesis import assume
    from hypothesis import strategies as st
except ImportError as _e:  # hypothesis is an optional dependency: the paramfold[testing] extra
    raise ImportError(
        "paramfold.testing needs hypothesis: pip install 'paramfold[testing]'"
    ) from _e
from torch import nn
from torch.nn.utils import parametrizations, parametrize

import paramfold
from paramfold.compute import original_names
from paramfold.sites import inside_parametrization

__all__ = [
    "COMPILE_TOLERANCES",
    "PARAMETRIZATIONS",
    "BufferMix",
    "Case",
    "Cast",
    "Conv1dBlock",
    "Conv2dBlock",
    "HalfSum",
    "LayerSpec",
    "ModelSpec",
    "Recipe",
    "ResidualNet",
    "Scale",
    "Step",
    "Structure",
    "TensorSpec",
    "apply_chain",
    "assert_equivalent",
    "assert_same_structure",
    "cases",
    "chains",
    "grad_mode",
    "models",
    "structure",
]


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
            Hypothesis strategy of them. :func:`chains` draws one.
        position: ``"first"`` (must start a chain), ``"any"``, ``"last"`` (must end it) or
            ``"alone"`` (the only parametrization of the tensor and of its module).
        stateful: mutates its buffers in forward when training.
        requires: the module that must be importable (``"torchao"``), or None.
    """

    name: str
    apply: Callable[..., None]
    supports: Callable[[TensorSpec], bool]
    options: Callable[[TensorSpec], Sequence[dict[str, Any]] | Any]
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
    """One parametrization of a chain: a :data:`PARAMETRIZATIONS` name and its options."""

    name: str
    options: tuple[tuple[str, Any], ...] = ()

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options)
        return f"{self.name}({opts})"

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


def _available(names: Sequence[str] | None) -> list[Recipe]:
    chosen = PARAMETRIZATIONS.values() if names is None else [PARAMETRIZATIONS[n] for n in names]
    return [r for r in chosen if r.available]


def _options(recipe: Recipe, tensor: TensorSpec) -> st.SearchStrategy[dict[str, Any]]:
    """A strategy for ``recipe``'s options on ``tensor``: one of its option dicts, or its own strategy."""
    options = recipe.options(tensor)
    return options if isinstance(options, st.SearchStrategy) else st.sampled_from([dict(o) for o in options])


@st.composite
def chains(
    draw: st.DrawFn,
    tensor: TensorSpec,
    *,
    names: Sequence[str] | None = None,
    min_length: int = 1,
    max_length: int = 3,
) -> Chain:
    """Hypothesis strategy: a chain of compatible parametrizations for one tensor.

    Respects each :class:`Recipe`'s ``supports`` and ``position``; no name appears twice.
    ``names`` restricts the registry (default: every available entry).

    Example::

        >>> import torch
        >>> from hypothesis import given, settings
        >>> from paramfold.testing import TensorSpec, apply_chain, chains
        >>> @settings(max_examples=5)
        ... @given(chains(TensorSpec((4, 4)), names=["weight_norm", "spectral_norm", "scale"]))
        ... def check(chain):
        ...     layer = apply_chain(torch.nn.Linear(4, 4), "weight", chain)
        ...     assert len(layer.parametrizations.weight) == len(chain)
        >>> check()
    """
    recipes = [r for r in _available(names) if r.supports(tensor)]
    length = draw(st.integers(min_length, max_length))
    if length == 0:
        return ()
    alone = [r for r in recipes if r.position == "alone"]
    if alone and draw(st.integers(0, 3)) == 0:
        recipe = draw(st.sampled_from(alone))
        return (Step(recipe.name, tuple(sorted(draw(_options(recipe, tensor)).items()))),)
    steps: list[Step] = []
    for i in range(length):
        allowed = ("first", "any") if i == 0 else ("any",)
        if i == 0 and any(r.position == "first" for r in recipes) and draw(st.booleans()):
            allowed = ("first",)  # half the chains start with one: they are fewer, and rarer
        pool = [r for r in recipes if r.position in allowed]
        last = [r for r in recipes if r.position == "last"]
        if i == length - 1 and last and draw(st.booleans()):
            pool = last
        pool = [r for r in pool if r.name not in {s.name for s in steps}]
        if not pool:
            break
        recipe = draw(st.sampled_from(pool))
        steps.append(Step(recipe.name, tuple(sorted(draw(_options(recipe, tensor)).items()))))
    return tuple(steps)


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


class Conv1dBlock(nn.Module):
    """``Conv1d`` over the sequence of a ``(batch, seq, width)`` activation, length preserved."""

    def __init__(self, width_in: int, width_out: int, kernel: int, bias: bool) -> None:
        super().__init__()
        self.conv = nn.Conv1d(width_in, width_out, kernel, padding=kernel // 2, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.transpose(1, 2)).transpose(1, 2)


class Conv2dBlock(nn.Module):
    """``Conv2d`` on a ``(batch, width, seq, 1)`` view of a ``(batch, seq, width)`` activation."""

    def __init__(self, width_in: int, width_out: int, kernel: tuple[int, int], bias: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(width_in, width_out, kernel, padding=(kernel[0] // 2, kernel[1] // 2), bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.transpose(1, 2).unsqueeze(-1)).squeeze(-1).transpose(1, 2)


class BufferMix(nn.Module):
    """``x + x @ mix`` with ``mix`` a *buffer*, so that parametrized buffers get covered."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("mix", torch.randn(width, width) / width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + x @ self.mix


class ResidualNet(nn.Module):
    """``h = stem(x); h + body(h)``: a small custom root module with a residual."""

    def __init__(self, stem: nn.Module, body: nn.Module) -> None:
        super().__init__()
        self.stem = stem
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        return h + self.body(h)


_LAYER_KINDS = ("linear", "conv1d", "conv2d", "layernorm", "buffer")


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One layer of a :class:`ModelSpec`: its kind, sizes and a chain per parametrized tensor."""

    kind: str  # "linear" | "conv1d" | "conv2d" | "layernorm" | "buffer" | "embedding"
    width_in: int
    width_out: int
    kernel: tuple[int, ...] = ()
    bias: bool = True
    chains: tuple[tuple[str, Chain], ...] = ()

    def build(self) -> nn.Module:
        """The plain layer (float32, no parametrization yet)."""
        if self.kind == "linear":
            return nn.Linear(self.width_in, self.width_out, bias=self.bias)
        if self.kind == "conv1d":
            return Conv1dBlock(self.width_in, self.width_out, self.kernel[0], self.bias)
        if self.kind == "conv2d":
            return Conv2dBlock(self.width_in, self.width_out, (self.kernel[0], self.kernel[1]), self.bias)
        if self.kind == "layernorm":
            norm = nn.LayerNorm(self.width_in, bias=self.bias)
            with torch.no_grad():  # stock init is ones/zeros: weight_norm of zeros would be NaN
                for param in norm.parameters():
                    param.normal_(1.0 if param is norm.weight else 0.0, 0.5)
            return norm
        if self.kind == "buffer":
            return BufferMix(self.width_in)
        if self.kind == "embedding":
            return nn.Embedding(self.width_in, self.width_out)  # width_in is the vocabulary size
        raise ValueError(f"unknown layer kind {self.kind!r}")

    def target(self, layer: nn.Module) -> nn.Module:
        """The module holding this layer's tensors (the conv inside a conv block)."""
        return layer.conv if self.kind in ("conv1d", "conv2d") else layer

    def tensors(self, dtype: torch.dtype) -> list[TensorSpec]:
        """The parametrizable tensors of this layer, computed without building it."""
        i, o = self.width_in, self.width_out
        if self.kind == "linear":
            specs = [TensorSpec((o, i), dtype, nn.Linear, "weight")]
            bias = (o,)
        elif self.kind == "conv1d":
            specs = [TensorSpec((o, i, *self.kernel), dtype, nn.Conv1d, "weight")]
            bias = (o,)
        elif self.kind == "conv2d":
            specs = [TensorSpec((o, i, *self.kernel), dtype, nn.Conv2d, "weight")]
            bias = (o,)
        elif self.kind == "layernorm":
            specs = [TensorSpec((i,), dtype, nn.LayerNorm, "weight")]
            bias = (i,)
        elif self.kind == "buffer":
            return [TensorSpec((i, i), dtype, BufferMix, "mix", is_buffer=True)]
        else:
            return [TensorSpec((i, o), dtype, nn.Embedding, "weight")]
        if self.bias:
            specs.append(TensorSpec(bias, dtype, specs[0].module_type, "bias"))
        return specs


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A small random model, printable (Hypothesis shows it on failure) and rebuilt exactly.

    :meth:`build` is deterministic: the same spec gives bitwise identical models (it seeds
    torch's RNG inside ``torch.random.fork_rng``, so the caller's RNG is untouched).
    """

    layers: tuple[LayerSpec, ...]
    dtype: str = "float32"  # "float32" | "bfloat16" | "cast" (float32 stored, bfloat16 read)
    residual: bool = False
    #: Index of a layer whose instance is called a second time, right after itself.
    repeat: int | None = None
    #: ``(i, j, tensor_name)``: layer j's originals of that tensor are layer i's.
    tie: tuple[int, int, str] | None = None
    requires_grad: str = "all"  # "all" | "none" | "some"
    training: bool = True
    seed: int = 0

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.dtype == "bfloat16" else torch.float32

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.float32 if self.dtype == "float32" else torch.bfloat16

    def build(self) -> nn.Module:
        """A fresh model: layers, their chains, the tie, requires_grad, repeat, train mode."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            return self._build()

    def _build(self) -> nn.Module:
        layers = [spec.build().to(self.storage_dtype) for spec in self.layers]
        for spec, layer in zip(self.layers, layers):
            target = spec.target(layer)
            chains = dict(spec.chains)
            for tensor in spec.tensors(self.storage_dtype):
                chain = chains.get(tensor.name, ())
                if self.dtype == "cast":
                    chain = (*chain, Step("cast"))
                apply_chain(target, tensor.name, chain)
        if self.tie is not None:
            i, j, name = self.tie
            src = self.layers[i].target(layers[i]).parametrizations[name]
            dst = self.layers[j].target(layers[j]).parametrizations[name]
            for original in original_names(src):
                setattr(dst, original, getattr(src, original))
        pick = random.Random(self.seed)
        for layer in layers:
            for param in layer.parameters():
                if param.is_floating_point():
                    wanted = {"all": True, "none": False}.get(self.requires_grad)
                    param.requires_grad_(pick.random() < 0.5 if wanted is None else wanted)
        order = list(layers)
        if self.repeat is not None:
            order.insert(self.repeat + 1, layers[self.repeat])
        if self.residual:
            model: nn.Module = ResidualNet(order[0], nn.Sequential(*order[1:]))
        else:
            model = nn.Sequential(*order)
        return model.train(self.training)

    def inputs(self) -> tuple[torch.Tensor, ...]:
        """Inputs for the model: token ids for an embedding stem, else ``(2, 3, width)``."""
        generator = torch.Generator().manual_seed(self.seed + 1)
        first = self.layers[0]
        if first.kind == "embedding":
            return (torch.randint(0, first.width_in, (2, 3), generator=generator),)
        return (torch.randn(2, 3, first.width_in, generator=generator).to(self.compute_dtype),)


@st.composite
def _layer(draw: st.DrawFn, index: int, width: int, max_width: int, residual: bool) -> LayerSpec:
    kinds = _LAYER_KINDS + (("embedding",) if index == 0 else ())
    kind = draw(st.sampled_from(kinds))
    keeps_width = kind in ("layernorm", "buffer") or (residual and index > 0)
    out = width if keeps_width or draw(st.booleans()) else draw(st.integers(2, max_width))
    kernel: tuple[int, ...] = ()
    if kind == "conv1d":
        kernel = (draw(st.sampled_from([1, 3])),)
    elif kind == "conv2d":
        kernel = (draw(st.sampled_from([1, 3])), draw(st.sampled_from([1, 3])))
    if kind == "embedding":
        return LayerSpec(kind, draw(st.integers(2, max_width)), out)
    return LayerSpec(kind, width, out, kernel, bias=draw(st.booleans()))


@st.composite
def models(
    draw: st.DrawFn,
    *,
    max_layers: int = 3,
    max_width: int = 12,
    dtypes: Sequence[str] = ("float32", "bfloat16", "cast"),
    names: Sequence[str] | None = None,
    tying: bool = True,
    repeats: bool = True,
    training: bool | None = None,
    requires_grad: Sequence[str] = ("all", "all", "none", "some"),
) -> ModelSpec:
    """Hypothesis strategy: a :class:`ModelSpec` for a small random parametrized model.

    Layers are Linear, Conv1d and Conv2d (in blocks), LayerNorm, a module with a parametrizable
    *buffer*, and an Embedding stem; the root is an ``nn.Sequential`` or a custom module with a
    residual. Each tensor gets a random chain (:func:`chains`) or none; with ``dtype="cast"``
    every floating tensor also gets the seed's ``unsafe`` cast to bfloat16, last. Optionally one
    tensor's originals are shared by two same-shaped layers (``tie``), or one layer instance is
    called twice (``repeat``; never for a stateful chain in training, where stock PyTorch runs
    the power iteration once per call and paramfold once per forward).

    Example::

        >>> import torch
        >>> from hypothesis import given, settings
        >>> from paramfold.testing import models
        >>> @settings(max_examples=5)
        ... @given(models(max_layers=2, dtypes=["float32"]))
        ... def check(spec):
        ...     same = spec.build()(*spec.inputs()), spec.build()(*spec.inputs())
        ...     torch.testing.assert_close(*same, rtol=0, atol=0, equal_nan=True)  # deterministic
        >>> check()
    """
    dtype = draw(st.sampled_from(list(dtypes)))
    residual = draw(st.booleans())
    is_training = draw(st.booleans()) if training is None else training
    allowed = [n for n in (names if names is not None else PARAMETRIZATIONS) if n != "cast"]
    if dtype == "cast":
        allowed = [n for n in allowed if n != "int8_weight_only"]
    storage = torch.bfloat16 if dtype == "bfloat16" else torch.float32

    count = draw(st.integers(1, max_layers))
    width = draw(st.integers(2, max_width))
    layers: list[LayerSpec] = []
    for index in range(count):
        previous = layers[-1] if layers else None
        if (
            previous is not None
            and previous.kind != "embedding"
            and previous.width_in == previous.width_out
            and draw(st.booleans())
        ):
            spec = dataclasses.replace(previous, chains=())  # same kind and sizes: tying candidates
        else:
            spec = draw(_layer(index, width, max_width, residual))
        tensor_chains = []
        for tensor in spec.tensors(storage):
            if tensor_chains and tensor_chains[0][1][:1] == (Step("int8_weight_only"),):
                break  # torchao's unwrap needs the module otherwise unparametrized
            chain = draw(chains(tensor, names=allowed, min_length=0))
            if chain:
                tensor_chains.append((tensor.name, chain))
        layers.append(dataclasses.replace(spec, chains=tuple(tensor_chains)))
        width = spec.width_out

    tie = None
    if tying:
        int8 = Step("int8_weight_only")
        plain = [i for i, layer in enumerate(layers) if all(int8 not in c for _, c in layer.chains)]
        pairs = [
            (i, j, name)
            for i in plain
            for j in plain
            if i < j and layers[i].kind == layers[j].kind and layers[i].tensors(storage) == layers[j].tensors(storage)
            for name, _ in layers[i].chains
        ]
        if pairs and draw(st.sampled_from([True, True, True, False])):
            i, j, name = draw(st.sampled_from(pairs))
            shared = dict(layers[j].chains) | {name: dict(layers[i].chains)[name]}
            layers[j] = dataclasses.replace(layers[j], chains=tuple(shared.items()))
            tie = (i, j, name)

    repeat = None
    if repeats:
        candidates = [
            i
            for i, layer in enumerate(layers)
            if layer.width_in == layer.width_out
            and layer.kind != "embedding"
            and not (is_training and any(s.recipe.stateful for _, c in layer.chains for s in c))
        ]
        if candidates and draw(st.integers(0, 3)) == 0:
            repeat = draw(st.sampled_from(candidates))

    return ModelSpec(
        layers=tuple(layers),
        dtype=dtype,
        residual=residual and count > 1,
        repeat=repeat,
        tie=tie,
        requires_grad=draw(st.sampled_from(list(requires_grad))),
        training=is_training,
        seed=draw(st.integers(0, 2**16)),
    )


class Case(NamedTuple):
    """What :func:`cases` draws: ``factory()`` builds a fresh identical model every call."""

    factory: Callable[[], nn.Module]
    inputs: tuple[torch.Tensor, ...]
    flags: dict[str, Any]


@st.composite
def cases(draw: st.DrawFn, **model_options: Any) -> Case:
    """Hypothesis strategy: ``(model_factory, inputs, flags)`` for a random parametrized model.

    ``flags`` holds ``spec`` (the :class:`ModelSpec`), ``training``, ``requires_grad``,
    ``dtype``, ``tied``, ``repeated``, ``grad_enabled`` (whether to run the case with grad
    mode on; see :func:`grad_mode`) and ``input_requires_grad`` (float inputs then require
    grad, so even frozen models run backward). Keyword options go to :func:`models`.

    Example::

        >>> from hypothesis import given, settings
        >>> from paramfold.testing import assert_equivalent, cases, grad_mode
        >>> @settings(max_examples=5, deadline=None)
        ... @given(cases(max_layers=2))
        ... def check(case):
        ...     factory, inputs, flags = case
        ...     with grad_mode(flags):
        ...         assert_equivalent(factory(), inputs, "hoist")
        >>> check()
    """
    spec = draw(models(**model_options))
    # A model without any parametrization would check nothing paramfold does.
    assume(spec.dtype == "cast" or any(dict(layer.chains) for layer in spec.layers))
    flags = {
        "spec": spec,
        "training": spec.training,
        "requires_grad": spec.requires_grad,
        "dtype": spec.dtype,
        "tied": spec.tie is not None,
        "repeated": spec.repeat is not None,
        "grad_enabled": draw(st.sampled_from([True, True, True, False])),
        "input_requires_grad": draw(st.sampled_from([False, False, False, True])),
    }
    inputs = spec.inputs()
    if flags["input_requires_grad"]:
        inputs = tuple(x.requires_grad_() if x.is_floating_point() else x for x in inputs)
    return Case(spec.build, inputs, flags)


def grad_mode(flags: Mapping[str, Any]) -> contextlib.AbstractContextManager:
    """``torch.enable_grad()`` or ``torch.no_grad()`` as a case's ``flags`` ask.

    Example::

        >>> import torch
        >>> from paramfold.testing import grad_mode
        >>> with grad_mode({"grad_enabled": False}):
        ...     torch.is_grad_enabled()
        False
    """
    return torch.enable_grad() if flags.get("grad_enabled", True) else torch.no_grad()


# --------------------------------------------------------------------------------------------
# Structure snapshots
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Structure:
    """A snapshot of a model's object structure (and, optionally, its state dict values).

    ``modules`` lists, for every module reached by ``named_modules(remove_duplicate=False)``
    (parametrization modules included): its path, object id, class object, ``__dict__`` keys,
    and the ids and ``requires_grad`` of its own parameters and buffers.
    """

    modules: tuple[tuple[Any, ...], ...]
    state: dict[str, torch.Tensor] | None


#: ``__dict__`` entries that are not paramfold's business: ``torch.compile(module)`` marks the
#: module it wraps.
_IGNORED_KEYS = frozenset({"_is_torch_compile"})


def structure(model: nn.Module, *, values: bool = True) -> Structure:
    """Snapshot ``model`` for :func:`assert_same_structure`; ``values`` also copies its state dict.

    Example::

        >>> import torch, paramfold
        >>> from paramfold.testing import structure, assert_same_structure
        >>> from torch.nn.utils.parametrizations import weight_norm
        >>> model = weight_norm(torch.nn.Linear(2, 2))
        >>> before = structure(model)
        >>> _ = paramfold.restore(paramfold.prepare(model, "hoist"))
        >>> assert_same_structure(before, structure(model))
    """
    rows = []
    for path, module in model.named_modules(remove_duplicate=False):
        params = tuple((n, id(p), p is not None and p.requires_grad) for n, p in module._parameters.items())
        buffers = tuple((n, id(b)) for n, b in module._buffers.items())
        keys = tuple(sorted(k for k in module.__dict__ if k not in _IGNORED_KEYS))
        rows.append((path, id(module), type(module), keys, params, buffers))
    state = None
    if values:
        state = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
    return Structure(tuple(rows), state)


def assert_same_structure(before: Structure, after: Structure) -> None:
    """Fail with a readable message unless two :func:`structure` snapshots agree.

    State values are compared (bitwise) only when both snapshots carry them.
    """
    if len(before.modules) != len(after.modules):
        raise AssertionError(f"module count changed: {len(before.modules)} -> {len(after.modules)}")
    fields = ("path", "module object", "class", "__dict__ keys", "parameters", "buffers")
    for old, new in zip(before.modules, after.modules):
        for field, a, b in zip(fields, old, new):
            if a == b:
                continue
            where = old[0] or "<root>"
            if field == "class":
                change = f"{a.__module__}.{a.__qualname__} (id {id(a)}) -> {b.__module__}.{b.__qualname__} (id {id(b)})"
            elif field == "__dict__ keys":
                change = f"added {sorted(set(b) - set(a))}, removed {sorted(set(a) - set(b))}"
            else:
                change = f"{a!r} -> {b!r}"
            raise AssertionError(f"module {where!r}: {field} changed: {change}")
    if before.state is not None and after.state is not None:
        _compare_dicts("", "state_dict", before.state, after.state, _BITWISE)


# --------------------------------------------------------------------------------------------
# assert_equivalent
# --------------------------------------------------------------------------------------------

#: Default tolerance factor ``k`` under ``compile=dict(backend=...)`` when neither ``atol`` nor
#: ``rtol`` is given: with ``eps`` that of the lowest-precision floating dtype among the model's
#: tensors and outputs (bfloat16 for the seed's cast), each element may differ from stock by
#: ``1e-5 + k * eps * (|stock element| + max|stock tensor|)``; 0 means bitwise. Measured on
#: this module's random :func:`cases` (float32, bfloat16 and cast models; hoist, inline, auto,
#: freeze; torch 2.13 CPU): ``"eager"`` and ``"aot_eager"`` run eager's ATen kernels and
#: matched bitwise in all ~380 cases tried (except the hoisted tensor-subclass gradient bug of
#: ``tests/test_properties.py``, which is not a rounding difference). Inductor generates its own kernels and
#: computes low-precision math in float32; its worst difference was 3.5 in units of
#: ``eps * max|stock tensor|`` (float32 gradients), and near-zero gradients that cancel in eager
#: (a LayerNorm of width 2) need the ``1e-5`` floor. The default 16 leaves a 4x margin.
#: Inductor on models *stored* in bfloat16 also produced different inf/NaN patterns in rare
#: near-singular cases (spectral_norm of a masked weight): pass ``atol``/``rtol`` for those.
COMPILE_TOLERANCES: dict[str, float] = {"eager": 0.0, "aot_eager": 0.0, "inductor": 16.0}


@dataclasses.dataclass(frozen=True)
class _Tolerance:
    """``|actual - expected| <= atol + of_max * max|expected| + rtol * |expected|``, elementwise."""

    rtol: float = 0.0
    atol: float = 0.0
    of_max: float = 0.0

    def describe(self) -> str:
        if not (self.rtol or self.atol or self.of_max):
            return "bitwise"
        return f"rtol={self.rtol:.3g}, atol={self.atol:.3g} + {self.of_max:.3g} * max|stock|"


_BITWISE = _Tolerance()


def assert_equivalent(
    model: nn.Module,
    inputs: torch.Tensor | Sequence[Any],
    mode: str = "auto",
    *,
    steps: int = 1,
    compile: Mapping[str, Any] | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    lr: float = 1e-3,
) -> None:
    """Assert that ``paramfold.prepare(model, mode)`` changes nothing observable, then undo it.

    ``model`` itself is never touched: it is deep-copied twice, one copy stays stock (eager)
    and one is prepared (and compiled with ``torch.compile(copy, **compile)`` when ``compile``
    is given). For each of ``steps`` steps both copies run ``inputs`` (a tensor or a sequence
    of positional arguments) under the caller's grad mode; when the stock output requires grad,
    both run backward on ``sum(o.float().sum() for o in outputs)``. Checked after each step:
    outputs, the gradient of every parameter (originals included) and of every input that
    requires grad, every buffer (so
    spectral_norm's ``_u``/``_v`` must evolve identically) and ``state_dict()`` keys and values.
    Between steps every floating parameter and parametrized buffer is updated in place on both
    copies, as an optimizer or ``load_state_dict`` would (an SGD step with the *stock* gradient
    and rate ``lr``, or a 1% shrink where there is none), so stale hoisted or frozen values
    would show; before each step every parametrized tensor is also read as an attribute
    outside any forward (parametrizations in eval mode) and must equal stock's.
    Finally the prepared copy is restored with :func:`paramfold.restore` and must have exactly
    its structure from before ``prepare`` (classes, module, parametrization and ``Parameter``
    objects, ``__dict__`` keys), and must still compute the stock outputs.

    Step comparisons are bitwise unless ``atol``/``rtol`` are given (then as in
    ``torch.testing.assert_close``), or compiled (:data:`COMPILE_TOLERANCES`; a backend without a
    measured tolerance, or a callable backend, needs ``atol``/``rtol``); see the module
    docstring for the one exception (modules called twice per forward: their originals' gradients
    are compared within the rounding of the summed terms, with an absolute floor of 1e-5).
    :class:`paramfold.FoldError` from ``prepare`` propagates (``mode="freeze"`` refuses
    originals that require grad and training stateful chains). Under ``compile`` call
    ``torch._dynamo.reset()`` between unrelated checks yourself.

    Raises:
        AssertionError: naming the first tensor that differs, and the step.

    Example::

        >>> import torch, paramfold.testing as pt
        >>> from torch.nn.utils.parametrizations import spectral_norm
        >>> model = torch.nn.Sequential(spectral_norm(torch.nn.Linear(4, 4)), torch.nn.ReLU())
        >>> pt.assert_equivalent(model, torch.randn(3, 4), "hoist", steps=3)
    """
    args = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    stock, candidate = copy.deepcopy(model), copy.deepcopy(model)
    for copy_ in (stock, candidate):
        for param in copy_.parameters():
            param.grad = None
    before = structure(candidate, values=False)

    paramfold.prepare(candidate, mode, filter_fn=filter_fn)
    run: Callable[..., Any] = candidate
    factor = 0.0
    if compile is not None:
        run = torch.compile(candidate, **compile)
        backend = compile.get("backend", "inductor")
        if rtol is None and atol is None:
            if not isinstance(backend, str) or backend not in COMPILE_TOLERANCES:
                raise ValueError(
                    f"assert_equivalent has no measured tolerance for backend {backend!r} (known: "
                    f"{', '.join(COMPILE_TOLERANCES)}): pass atol= and/or rtol= for it"
                )
            factor = COMPILE_TOLERANCES[backend]
    _compare_dicts(" after prepare", "state_dict", candidate.state_dict(), stock.state_dict(), _BITWISE)
    # Originals whose gradient sums several contributions in an order prepare may change, and
    # a stock copy run under parametrize.cached() (one value per tensor per forward, like
    # hoist and freeze) to compare them with first: see the module docstring.
    loose = _reordered_originals(candidate) if mode != "inline" else set()
    cached = copy.deepcopy(stock) if loose else None

    tol = _BITWISE
    for step in range(steps):
        if step:
            _update(stock, [candidate] + ([cached] if cached is not None else []), lr)
        at = f" at step {step + 1}" if steps > 1 else ""
        # Compiled steps may leave state (spectral_norm's _u/_v) within the step tolerance.
        _compare_reads(candidate, stock, f" before step {step + 1}", tol)
        stock_args, candidate_args = _fresh(args), _fresh(args)
        expected = stock(*stock_args)
        actual = run(*candidate_args)
        eps = torch.finfo(_lowest_precision(stock, expected)).eps
        tol = _Tolerance(rtol or factor * eps, 1e-5 if factor else atol or 0.0, factor * eps)
        _compare_outputs(actual, expected, at, tol)
        expected_loss = _loss(expected)
        if expected_loss is not None and expected_loss.requires_grad:
            actual_loss = _loss(actual)
            if actual_loss is None or not actual_loss.requires_grad:
                raise AssertionError(f"stock output requires grad but prepared output does not{at}")
            expected_loss.backward()
            actual_loss.backward()
        if cached is not None:
            with parametrize.cached():
                cached_loss = _loss(cached(*_fresh(args)))
            if cached_loss is not None and cached_loss.requires_grad:
                cached_loss.backward()
        _compare_grads(candidate, stock, cached, at, loose, tol, eps)
        for i, (a, e) in enumerate(zip(candidate_args, stock_args)):
            if isinstance(e, torch.Tensor) and e.requires_grad:
                _compare(f"grad of input {i}{at}", a.grad, e.grad, tol)
        _compare_dicts(at, "buffer", dict(candidate.named_buffers()), dict(stock.named_buffers()), tol)
        _compare_dicts(at, "state_dict", candidate.state_dict(), stock.state_dict(), tol)

    paramfold.restore(candidate)
    try:
        assert_same_structure(before, structure(candidate, values=False))
    except AssertionError as exc:
        raise AssertionError(f"after paramfold.restore: {exc}") from None
    with torch.no_grad():
        _compare_outputs(candidate(*args), stock(*args), " after restore", _BITWISE)


def _fresh(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Per-copy leaves for inputs that require grad, so each copy's input gradient is its own."""
    return tuple(
        a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args
    )


def _loss(outputs: Any) -> torch.Tensor | None:
    tensors = [t for t in _flatten(outputs) if t.is_floating_point()]
    return sum((t.float().sum() for t in tensors[1:]), tensors[0].float().sum()) if tensors else None


def _flatten(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _flatten(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _flatten(v)


def _compare_outputs(actual: Any, expected: Any, at: str, tol: _Tolerance) -> None:
    got, want = list(_flatten(actual)), list(_flatten(expected))
    if len(got) != len(want):
        raise AssertionError(f"output has {len(got)} tensors, stock has {len(want)}{at}")
    for i, (a, e) in enumerate(zip(got, want)):
        name = "output" if len(want) == 1 else f"output[{i}]"
        _compare(f"{name}{at}", a, e, tol)


def _compare(what: str, actual: torch.Tensor | None, expected: torch.Tensor | None, tol: _Tolerance) -> None:
    if actual is None or expected is None:
        if actual is not expected:
            state = ("None", "a tensor") if actual is None else ("a tensor", "None")
            raise AssertionError(f"{what}: prepared has {state[0]}, stock has {state[1]}")
        return
    if _is_subclass(actual) or _is_subclass(expected):
        # e.g. torchao's Int8Tensor: compare its plain inner tensors and metadata instead.
        if type(actual) is not type(expected):
            raise AssertionError(f"{what}: prepared is a {type(actual).__name__}, stock a {type(expected).__name__}")
        names, meta = expected.__tensor_flatten__()
        if actual.__tensor_flatten__() != (names, meta):
            raise AssertionError(f"{what}: tensor subclass metadata differs")
        for inner in names:
            _compare(f"{what}.{inner}", getattr(actual, inner), getattr(expected, inner), tol)
        return
    atol = tol.atol
    if tol.of_max and expected.is_floating_point():
        atol += tol.of_max * _largest(expected)
    try:
        torch.testing.assert_close(actual.detach(), expected.detach(), rtol=tol.rtol, atol=atol, equal_nan=True)
    except AssertionError as exc:
        detail = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        raise AssertionError(f"{what} differs from stock ({tol.describe()}): {detail}") from None


def _largest(t: torch.Tensor) -> float:
    """The largest finite magnitude in ``t`` (0 for an empty or all non-finite tensor)."""
    finite = t.detach().float().nan_to_num(0.0, 0.0, 0.0)
    return float(finite.abs().max()) if finite.numel() else 0.0


def _is_subclass(t: torch.Tensor) -> bool:
    return type(t) not in (torch.Tensor, nn.Parameter) and hasattr(t, "__tensor_flatten__")


def _compare_dicts(
    at: str, what: str, actual: Mapping[str, Any], expected: Mapping[str, Any], tol: _Tolerance
) -> None:
    if list(actual) != list(expected):
        missing, extra = sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected))
        raise AssertionError(f"{what} keys differ{at}: missing {missing}, unexpected {extra} (or order changed)")
    for key in expected:
        _compare(f"{what} {key!r}{at}", actual[key], expected[key], tol)


def _compare_reads(candidate: nn.Module, stock: nn.Module, at: str, tol: _Tolerance) -> None:
    """Every parametrized tensor read as an attribute, outside any forward, equals stock's.

    Read with the parametrizations in eval mode, so spectral_norm's power iteration does not
    advance (and the two copies stay in step); their training flags are put back after.
    """
    pairs = [(path, c, s) for (path, c), (_, s) in zip(_parametrized(candidate), _parametrized(stock))]
    flags = [(m, m.training) for _, c, s in pairs for owner in (c, s) for m in owner.parametrizations.modules()]
    try:
        for m, _ in flags:
            m.training = False
        with torch.no_grad():
            for path, c, s in pairs:
                for name in s.parametrizations:
                    where = f"{path}.{name}" if path else name
                    _compare(f"{where} read outside forward{at}", getattr(c, name), getattr(s, name), tol)
    finally:
        for m, training in flags:
            m.training = training


def _parametrized(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (path, m)
        for path, m in model.named_modules()
        if parametrize.is_parametrized(m) and not inside_parametrization(path)
    ]


def _compare_grads(
    candidate: nn.Module,
    stock: nn.Module,
    cached: nn.Module | None,
    at: str,
    loose: set[int],
    tol: _Tolerance,
    eps: float,
) -> None:
    got, want = dict(candidate.named_parameters()), dict(stock.named_parameters())
    if list(got) != list(want):
        raise AssertionError(f"parameter names differ{at}: {sorted(set(got) ^ set(want))}")
    loose_tol = tol
    if loose:
        # See the module docstring; the largest gradient stands for the size of the summed terms,
        # and 1e-5 is an absolute floor for gradients that cancel to near zero (documented in
        # assert_equivalent's docstring).
        rtol = {torch.finfo(torch.bfloat16).eps: 1.6e-2, torch.finfo(torch.float16).eps: 1e-3}.get(eps, 1.3e-6)
        largest = max((_largest(p.grad) for p in want.values() if p.grad is not None), default=0.0)
        loose_tol = _Tolerance(max(tol.rtol, rtol), max(tol.atol, 1e-5, rtol * largest), tol.of_max)
    same_as_cached = dict(cached.named_parameters()) if cached is not None else {}
    for name, param in got.items():
        what = f"grad of {name!r}{at}"
        if id(param) not in loose:
            _compare(what, param.grad, want[name].grad, tol)
            continue
        try:
            _compare(what, param.grad, same_as_cached[name].grad, tol)
        except (AssertionError, KeyError):
            _compare(f"{what} (and differs from stock under parametrize.cached())", param.grad, want[name].grad, loose_tol)


def _update(stock: nn.Module, others: list[nn.Module], lr: float) -> None:
    """The same in-place step on ``stock`` and ``others``, driven by ``stock``'s gradients."""

    def tensors(model: nn.Module) -> list[torch.Tensor]:
        originals = [b for n, b in model.named_buffers() if n.rsplit(".", 1)[-1].startswith("original")]
        return [*model.parameters(), *originals]

    with torch.no_grad():
        for reference, *copies in zip(tensors(stock), *map(tensors, others)):
            if not reference.is_floating_point():
                continue
            grad = reference.grad
            for tensor in (reference, *copies):
                if grad is not None:
                    tensor.add_(grad, alpha=-lr)
                else:
                    tensor.mul_(0.99)


def _reordered_originals(model: nn.Module) -> set[int]:
    """Originals of modules called more than once per forward, and originals shared by sites."""
    calls: dict[int, int] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        if not inside_parametrization(path):
            calls[id(module)] = calls.get(id(module), 0) + 1
    users: dict[int, int] = {}
    repeated: set[int] = set()
    for path, module in model.named_modules():
        if inside_parametrization(path) or not parametrize.is_parametrized(module):
            continue
        for plist in module.parametrizations.values():
            for name in original_names(plist):
                key = id(getattr(plist, name))
                users[key] = users.get(key, 0) + 1
                if calls.get(id(module), 0) > 1:
                    repeated.add(key)
    return repeated | {key for key, count in users.items() if count > 1}


def _lowest_precision(model: nn.Module, outputs: Any) -> torch.dtype:
    tensors = [*model.parameters(), *model.buffers(), *_flatten(outputs)]
    dtypes = {t.dtype for t in tensors if t.is_floating_point()} or {torch.float32}
    return max(dtypes, key=lambda d: torch.finfo(d).eps)
