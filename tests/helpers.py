"""Small real parametrized models shared by the core tests (and ``Audio``, the wrapper through which
the third-party model tests call transformers models).

The parametrizations are paramfold.testing's own (``pt.Cast``, ``pt.Scale``) and so is the
structure snapshot the tests compare (``pt.structure``); what is here is what they lack. At the
end, what several of the regression files for issue 8's findings share (once one file,
``test_never_wrong.py``), under the names those tests use.
"""

from __future__ import annotations

import contextlib
import copy
import threading

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils import parametrize as P
from torch.nn.utils.parametrizations import orthogonal, spectral_norm, weight_norm
from torch.utils._python_dispatch import TorchDispatchMode

import paramfold
import paramfold.testing as pt


def scale_by_1_5() -> nn.Module:
    """``pt.Scale`` with a fixed scalar buffer, 1.5 (any shape of tensor, deterministic)."""
    return pt.Scale(torch.tensor(1.5))


class Doubled(nn.Module):
    """The simplest parametrization: no tensors or settings of its own, so only its input matters."""

    def forward(self, w):
        return 2 * w


class Ema(nn.Module):
    """A custom stateful member: updates its running average at every computation, in eval too."""

    def __init__(self, shape=(4, 4)):
        super().__init__()
        self.register_buffer("ema", torch.zeros(shape))

    def forward(self, w):
        self.ema.mul_(0.5).add_(w.detach())
        return w + self.ema


class RunningScale(nn.Module):
    """A custom stateful member: a running statistic updated at each computation in training, by
    which it divides (so autograd saves the buffer itself for backward)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(()))

    def forward(self, w):
        if self.training:
            with torch.no_grad():
                self.scale.mul_(0.9).add_(0.1 * w.abs().mean())
        return w / self.scale


class Skew(nn.Module):
    """A custom parametrization: the skew-symmetric part below the diagonal (square weights)."""

    def forward(self, w):
        return w.tril(-1) - w.tril(-1).T


class Split(nn.Module):
    """A custom parametrization whose right_inverse returns a tuple (original0, original1)."""

    def forward(self, a, b):
        return a + 2 * b

    def right_inverse(self, x):
        return x / 2, x / 4


class RowScale(nn.Module):
    """A custom parametrization that paramfold probes, with a setting (``alpha``) and a buffer
    (one factor per row of a 4-row weight)."""

    def __init__(self):
        super().__init__()
        self.alpha = 1.5
        self.register_buffer("s", torch.linspace(0.5, 1.5, 4))

    def forward(self, w):
        return w * self.alpha * self.s.reshape(-1, 1)


class LoRA(nn.Module):
    """Low-rank adaptation as a parametrization: W + B @ A, with A and B owned (and trained) here."""

    def __init__(self, out_features, in_features, rank=2):
        super().__init__()
        self.A = nn.Parameter(torch.randn(rank, in_features) * 0.1)
        self.B = nn.Parameter(torch.randn(out_features, rank) * 0.1)

    def forward(self, weight):
        return weight + self.B @ self.A


class Net(nn.Module):
    def __init__(self, width=32, depth=3):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x)) + x
        return x


class Block(nn.Module):
    """A user-defined layer (dynamo skips torch.nn's own forwards as top-level frames)."""

    def __init__(self, width):
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.proj(x)) + x


class BlockNet(nn.Module):
    def __init__(self, width=32, depth=3):
        super().__init__()
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def build(kind: str, width: int = 32, depth: int = 3, seed: int = 0, blocks: bool = False) -> nn.Module:
    """A ``Net`` (or ``BlockNet``) whose Linear layers carry the parametrization ``kind``."""
    torch.manual_seed(seed)
    net = BlockNet(width, depth) if blocks else Net(width, depth)
    linears = [block.proj for block in net.layers] if blocks else list(net.layers)
    for layer in linears:
        if kind == "weight_norm":
            weight_norm(layer)
        elif kind == "spectral_norm":
            spectral_norm(layer)
        elif kind.startswith("orthogonal"):
            orthogonal(layer, orthogonal_map=kind.partition(":")[2] or None)
        elif kind == "split":
            parametrize.register_parametrization(layer, "weight", Split())
        elif kind == "chain":
            weight_norm(layer)
            parametrize.register_parametrization(layer, "weight", scale_by_1_5())
            parametrize.register_parametrization(layer, "bias", scale_by_1_5())
        elif kind == "lora":
            layer.weight.requires_grad_(False)  # frozen base weight, trainable adapters
            parametrize.register_parametrization(layer, "weight", LoRA(width, width))
        elif kind == "buffer":
            layer.register_buffer("shift", torch.randn(width))
            parametrize.register_parametrization(layer, "shift", scale_by_1_5())
        elif kind != "plain":
            raise ValueError(kind)
    return net


class SeedModel(nn.Module):
    """Seed 003: a Sequential of Linear layers, every weight and bias cast to bfloat16."""

    def __init__(self, n=4, width=64):
        super().__init__()
        self.seq = nn.Sequential(*[nn.Linear(width, width) for _ in range(n)])

    def forward(self, x):
        return self.seq(x)


def seed_model(n=4, width=64, parametrized=True, seed=0) -> nn.Module:
    torch.manual_seed(seed)
    model = SeedModel(n, width)
    if not parametrized:
        return model.to(torch.bfloat16)
    for module in list(model.modules()):
        for name, p in list(module._parameters.items()):
            if p is not None:
                parametrize.register_parametrization(module, name, pt.Cast(), unsafe=True)
    return model


def assert_same_tensors(expected: dict, actual: dict, at: object = "") -> None:
    """Same names, and bitwise equal tensors under each (``None`` where ``expected`` has ``None``)."""
    assert actual.keys() == expected.keys(), at
    for name, e in expected.items():
        a = actual[name]
        assert (a is None and e is None) or (a is not None and e is not None and torch.equal(a, e)), (at, name)


def assert_same_nested(expected, actual, path: str = "result") -> None:
    """Bitwise equality of nested lists, tuples and dicts (keys in order) of tensors (same dtype
    and shape) and plain values (``==``)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), path
        assert (expected.dtype, expected.shape) == (actual.dtype, actual.shape), path
        assert torch.equal(expected, actual), path
    elif isinstance(expected, dict):
        assert list(expected) == list(actual), path
        for key in expected:
            assert_same_nested(expected[key], actual[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(expected) == len(actual), path
        for i, (e, a) in enumerate(zip(expected, actual)):
            assert_same_nested(e, a, f"{path}[{i}]")
    else:
        assert expected == actual, path


def grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: p.grad for n, p in model.named_parameters()}


def classes(model: nn.Module) -> dict[str, type]:
    """The class of every module, by path (prepare swaps them, restore must give each its own back)."""
    return {path: type(module) for path, module in model.named_modules()}


class Audio(nn.Module):
    """A transformers model called the way a user's training step calls it, returning tensors."""

    def __init__(self, model: nn.Module, field: str):
        super().__init__()
        self.model = model
        self.field = field

    def forward(self, x):
        return getattr(self.model(x), self.field)


class _Scale(nn.Module):
    def forward(self, w):
        return w * 1.5


class _Shift(nn.Module):
    def forward(self, w):
        return w + 0.25


def small_net(kind: str) -> nn.Sequential:
    """A seeded two-layer net with one kind of parametrization: torch's ``weight_norm``,
    ``spectral_norm``, ``orthogonal``, a custom two-member chain, the hook-based norms, or convs."""
    torch.manual_seed(0)
    if kind == "weight_norm":
        return nn.Sequential(weight_norm(nn.Linear(4, 6)), nn.Tanh(), weight_norm(nn.Linear(6, 3)))
    if kind == "spectral_norm":
        return nn.Sequential(spectral_norm(nn.Linear(4, 6)), nn.Tanh(), nn.Linear(6, 3))
    if kind == "orthogonal":
        return nn.Sequential(orthogonal(nn.Linear(4, 4)), nn.Tanh(), nn.Linear(4, 3))
    if kind == "custom":
        layer = nn.Linear(4, 6)
        parametrize.register_parametrization(layer, "weight", _Scale())
        parametrize.register_parametrization(layer, "weight", _Shift())
        return nn.Sequential(layer, nn.Tanh(), nn.Linear(6, 3))
    if kind == "hook_weight_norm":
        return nn.Sequential(nn.utils.weight_norm(nn.Linear(4, 6)), nn.Tanh(), nn.Linear(6, 3))
    if kind == "hook_spectral_norm":
        return nn.Sequential(nn.utils.spectral_norm(nn.Linear(4, 6)), nn.Tanh(), nn.Linear(6, 3))
    if kind == "conv2d":
        return nn.Sequential(weight_norm(nn.Conv2d(2, 4, 3)), nn.ReLU(), spectral_norm(nn.Conv2d(4, 2, 3)))
    raise ValueError(kind)



def twin_nets(kind: str, mode: str, *, eval_only: bool = False, **options) -> tuple[nn.Module, nn.Module]:
    """Two :func:`small_net` of ``kind`` (in eval with no grad where ``eval_only``): stock, and
    prepared with ``mode`` (and ``options``)."""
    stock, ours = small_net(kind), small_net(kind)
    if eval_only:
        for model in (stock, ours):
            model.eval().requires_grad_(False)
    return stock, paramfold.prepare(ours, mode, **options)

class PausedOffMain(nn.Module):
    """Runs ``inner``; run off the main thread, its forward first sets ``inside`` and waits for
    ``go``, so a test can act while another thread's call of the model is open."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.inside, self.go = threading.Event(), threading.Event()

    def forward(self, x):
        if threading.current_thread() is not threading.main_thread():
            self.inside.set()
            assert self.go.wait(30)
        return self.inner(x)


class HalveProducts(TorchDispatchMode):
    """A mode that changes values: every ``aten.mul.Tensor`` and ``aten.div.Tensor`` result halved."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 0.5 if func in (torch.ops.aten.mul.Tensor, torch.ops.aten.div.Tensor) else out


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """``torch.set_default_dtype(dtype)`` for the block."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def calls_like_stock_or_refused(stock: nn.Module, run, x: torch.Tensor, calls: int, each=None) -> None:
    """``calls`` calls of ``stock`` and of ``run`` on ``x``: each output bitwise stock's, or a
    ``FoldError`` saying the parametrizations changed after ``prepare`` (a refusal is not a
    silent difference); ``each(expected, out)`` after every call served."""
    for _ in range(calls):
        expected = stock(x)
        try:
            out = run(x)
        except paramfold.FoldError as e:
            assert "changed after paramfold.prepare" in str(e)
            continue
        assert torch.equal(out, expected)
        if each is not None:
            each(expected, out)


# Shared by the regression files for issue 8's findings; their tests spell these names so.
ALL_MODES = ["hoist", "inline", "freeze", "auto"]


def skew_pair() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    P.register_parametrization(m[0], "weight", Skew())
    P.register_parametrization(m[2], "weight", Skew())
    return m


def _inference(model: nn.Module) -> nn.Module:
    return model.eval().requires_grad_(False)


class _Twice(nn.Module):
    def forward(self, w):
        return w * 2.0


def _wn_pair():
    torch.manual_seed(0)
    stock = _inference(nn.Sequential(weight_norm(nn.Linear(4, 4)), nn.Tanh(), spectral_norm(nn.Linear(4, 4))))
    return stock, copy.deepcopy(stock)


class _Transposed(nn.Module):
    """A value that is a view of its original (``unsafe``: the shape changes)."""

    def forward(self, w):
        return w.t()

    def right_inverse(self, w):
        return w.t()
