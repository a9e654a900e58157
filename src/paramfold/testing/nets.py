"""The small parametrized models that paramfold's property checks run, as printable data.

Why a module of its own: a :class:`NetSpec` (layers, their chains, dtype, tie, repeat,
requires_grad, train mode, seed) rebuilds the same model bitwise every time and needs no
Hypothesis, so the spec a failing property test prints can be pasted into a plain regression
test: its repr is the expression that rebuilds it, given
``from paramfold.testing import LayerSpec, NetSpec, Step``.
:mod:`paramfold.testing.strategies` draws them; the layer classes here are the blocks they
are built from.
"""

from __future__ import annotations

import dataclasses
import random

import torch
from torch import nn

from paramfold.compute import original_names
from paramfold.testing.registry import Chain, Step, TensorSpec, apply_chain

__all__ = ["BufferMix", "Conv1dBlock", "Conv2dBlock", "LayerSpec", "NetSpec", "ResidualNet"]


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


class WithUnused(nn.Module):
    """``net(x)``, holding a layer it never calls (``unused``): prepared with the rest, it must
    not change (a training spectral_norm there must not run its power iteration)."""

    def __init__(self, net: nn.Module, unused: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.unused = unused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One layer of a :class:`NetSpec`: its kind, sizes and a chain per parametrized tensor."""

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
class NetSpec:
    """A small parametrized network as data, printable (Hypothesis shows it on failure) and
    rebuilt exactly. (Called ``ModelSpec`` before, a name now deprecated: ``paramfold.bench``'s
    ``ModelSpec`` is a benchmark model, a different thing.)

    :meth:`build` is deterministic: the same spec gives bitwise identical models (it seeds
    torch's RNG inside ``torch.random.fork_rng``, so the caller's RNG is untouched).

    Example::

        >>> from paramfold.testing import LayerSpec, NetSpec, Step
        >>> layer = LayerSpec("linear", 4, 4, chains=(("weight", (Step("weight_norm"),)),))
        >>> model = NetSpec((layer, layer), tie=(0, 1, "weight")).build()
        >>> model[0].parametrizations.weight.original0 is model[1].parametrizations.weight.original0
        True
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
    #: Index of a layer the model holds but its forward never calls (a GAN container's
    #: discriminator in the generator's step): the root wraps the rest (:class:`WithUnused`).
    unused: int | None = None

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
        if self.unused is not None:
            order = [layer for layer in order if layer is not layers[self.unused]]
        if self.residual:
            model: nn.Module = ResidualNet(order[0], nn.Sequential(*order[1:]))
        else:
            model = nn.Sequential(*order)
        if self.unused is not None:
            model = WithUnused(model, layers[self.unused])
        return model.train(self.training)

    def inputs(self) -> tuple[torch.Tensor, ...]:
        """Inputs for the model: token ids for an embedding stem, else ``(2, 3, width)``."""
        generator = torch.Generator().manual_seed(self.seed + 1)
        first = self.layers[0]
        if first.kind == "embedding":
            return (torch.randint(0, first.width_in, (2, 3), generator=generator),)
        return (torch.randn(2, 3, first.width_in, generator=generator).to(self.compute_dtype),)
