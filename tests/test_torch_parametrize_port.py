"""The kinds of setups PyTorch's own ``test/nn/test_parametrization.py`` builds, through paramfold.

Each setup is written here from what that file exercises (custom chains, nested and buffer
parametrizations, tuple ``right_inverse``, unsafe shape changes, tying, transfer, every orthogonal
map, spectral_norm and weight_norm variants, a wrapper and a plain Python tensor subclass,
LoRA-style owned parameters, a module registered at two paths) and runs through ``find``, every
mode, eager and compiled, against stock with :func:`paramfold.testing.assert_equivalent`
(bitwise; it also checks ``restore``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize as P
from torch.nn.utils.parametrizations import orthogonal, spectral_norm, weight_norm

import paramfold
import paramfold.testing as pt


class Skew(nn.Module):
    def forward(self, x):
        a = x.triu(1)
        return a - a.T


class Cayley(nn.Module):
    def forward(self, x):
        eye = torch.eye(x.size(0), dtype=x.dtype)
        return torch.linalg.solve(eye + x, eye - x)


class Resize(nn.Module):
    def forward(self, x):
        return x[[0]]


class Double(nn.Module):
    def forward(self, x):
        return 2.0 * x

    def right_inverse(self, x):
        return x / 2.0


class RankOne(nn.Module):
    def forward(self, x, y):
        return x.unsqueeze(-1) @ y.unsqueeze(-2)

    def right_inverse(self, z):
        return z[:, 0], z[0, :]


class LowRank(nn.Module):
    def __init__(self, rows, cols):
        super().__init__()
        self.a = nn.Parameter(torch.randn(2, cols) * 0.1)
        self.b = nn.Parameter(torch.randn(rows, 2) * 0.1)

    def forward(self, w):
        return w + self.b @ self.a


class Wrap(nn.Module):
    def forward(self, x):
        from torch.testing._internal.two_tensor import TwoTensor

        return TwoTensor(x * 1, x * 2)


class Tagged(torch.Tensor):
    pass


class AsTagged(nn.Module):
    def forward(self, x):
        return x.as_subclass(Tagged) * 1.0


class Stack(nn.Module):
    def __init__(self, *layers, act=nn.Tanh):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.act = act()

    def forward(self, x):
        for layer in self.layers:
            x = self.act(layer(x))
        return x


def _linear(i=8, o=8):
    return nn.Linear(i, o)


def chain_skew_cayley():
    m = _linear()
    P.register_parametrization(m, "weight", Skew())
    P.register_parametrization(m, "weight", Cayley())
    P.register_parametrization(m, "bias", Double())
    return Stack(m, _linear())


def nested():
    m = _linear()
    P.register_parametrization(m, "weight", Skew())
    P.register_parametrization(m.parametrizations.weight, "original", Double())
    return Stack(m)


def buffer():
    class WithBuffer(nn.Linear):
        def __init__(self):
            super().__init__(8, 8)
            self.register_buffer("shift", torch.randn(8))

        def forward(self, x):
            return super().forward(x) + self.shift

    m = WithBuffer()
    P.register_parametrization(m, "shift", Double())
    return Stack(m)


def tuple_right_inverse():
    m = _linear()
    P.register_parametrization(m, "weight", RankOne())
    return Stack(m, _linear())


def unsafe_resize():
    m = _linear(8, 4)
    P.register_parametrization(m, "weight", Resize(), unsafe=True)
    with torch.no_grad():
        m.bias = nn.Parameter(m.bias[:1].clone())
    return Stack(_linear(), m)


def tied_originals():
    first, second = _linear(), _linear()
    weight_norm(first)
    weight_norm(second)
    second.parametrizations.weight.original0 = first.parametrizations.weight.original0
    second.parametrizations.weight.original1 = first.parametrizations.weight.original1
    return Stack(first, second)


def module_at_two_paths():
    shared = weight_norm(_linear())
    return Stack(shared, _linear(), shared)


def transferred():
    source = _linear()
    P.register_parametrization(source, "weight", Skew())
    P.register_parametrization(source, "bias", Double())
    target = _linear()
    P.transfer_parametrizations_and_params(source, target)
    return Stack(target, _linear())


def initialised_through_right_inverse():
    m = _linear()
    P.register_parametrization(m, "weight", Double())
    m.weight = torch.randn(8, 8)  # goes through right_inverse
    return Stack(m)


def orthogonal_maps():
    layers = []
    for i, (kind, triv) in enumerate(
        [("matrix_exp", True), ("cayley", True), ("householder", True), ("matrix_exp", False), ("householder", False)]
    ):
        shape = (8, 8) if i % 2 == 0 else (8, 8)
        layer = nn.Linear(*shape)
        orthogonal(layer, orthogonal_map=kind, use_trivialization=triv)
        layers.append(layer)
    return Stack(*layers)


def orthogonal_wide_and_tall():
    return nn.Sequential(orthogonal(nn.Linear(8, 5)), nn.Tanh(), orthogonal(nn.Linear(5, 8)))


def spectral_variants():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = spectral_norm(nn.Conv1d(4, 4, 3, padding=1), n_power_iterations=3)
            self.t = spectral_norm(nn.ConvTranspose1d(4, 4, 3, padding=1), dim=1)
            self.lin = spectral_norm(nn.Linear(32, 8), eps=1e-6)

        def forward(self, x):
            y = torch.relu(self.t(torch.relu(self.c(x.view(-1, 4, 2)))))
            return self.lin(y.flatten(1).repeat(1, 4))

    return Net()


def spectral_eval_inside_train():
    model = Stack(spectral_norm(_linear()), _linear())
    model.layers[0].parametrizations.weight.eval()  # stock test_parametrization_same_training_mode
    return model


def weight_norm_dims():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = weight_norm(nn.Conv1d(4, 4, 3, padding=1), dim=0)
            self.b = weight_norm(nn.ConvTranspose1d(4, 4, 3, padding=1), dim=1)
            self.c = weight_norm(nn.Conv1d(4, 4, 1), dim=None)

        def forward(self, x):
            x = x.view(-1, 4, 2)
            return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))).flatten(1)

    return Net()


def owned_parameters():
    m = _linear()
    m.weight.requires_grad_(False)
    P.register_parametrization(m, "weight", LowRank(8, 8))
    return Stack(m)


def wrapper_subclass():
    m = _linear()
    P.register_parametrization(m, "weight", Wrap())
    return nn.Sequential(m)


def python_subclass():
    m = _linear()
    P.register_parametrization(m, "weight", AsTagged())
    return nn.Sequential(m)


SETUPS = {
    f.__name__: f
    for f in (
        chain_skew_cayley, nested, buffer, tuple_right_inverse, unsafe_resize, tied_originals,
        module_at_two_paths, transferred, initialised_through_right_inverse, orthogonal_maps,
        orthogonal_wide_and_tall, spectral_variants, spectral_eval_inside_train, weight_norm_dims,
        owned_parameters, wrapper_subclass, python_subclass,
    )
}
#: Setups whose output is a tensor subclass: stock's own compile of them is out of scope here.
EAGER_ONLY = {"wrapper_subclass"}


def _build(name):
    torch.manual_seed(0)
    return SETUPS[name]()


def _inputs():
    torch.manual_seed(1)
    return torch.randn(3, 8)


@pytest.mark.parametrize("name", sorted(SETUPS))
def test_find_reports_every_registration(name):
    model = _build(name)
    sites = paramfold.find(model)
    expected = {
        (path, tensor)
        for path, module in model.named_modules()
        if P.is_parametrized(module) and "parametrizations" not in path.split(".")
        for tensor in module.parametrizations
    }
    assert {(s.module_path, s.tensor_name) for s in sites} == expected
    assert all(s.kind and s.chain for s in sites)


@pytest.mark.parametrize("mode", ["hoist", "inline", "auto"])
@pytest.mark.parametrize("name", sorted(SETUPS))
def test_training_equal_to_stock(name, mode):
    pt.assert_equivalent(_build(name), _inputs(), mode, steps=2)


@pytest.mark.parametrize("name", sorted(SETUPS))
def test_freeze_inference_equal_to_stock(name):
    model = _build(name).eval().requires_grad_(False)
    with torch.no_grad():
        pt.assert_equivalent(model, _inputs(), "freeze", steps=2)


@pytest.mark.parametrize("name", sorted(set(SETUPS) - EAGER_ONLY))
def test_compiled_training_equal_to_stock(name):
    torch._dynamo.reset()
    pt.assert_equivalent(_build(name), _inputs(), "auto", steps=2, compile={"backend": "aot_eager"})


@pytest.mark.parametrize("mode", ["hoist", "inline", "freeze", "auto"])
def test_reads_under_parametrize_cached_equal_to_stock(mode):
    stock = _build("chain_skew_cayley")
    if mode == "freeze":
        stock.eval().requires_grad_(False)
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    x = _inputs()
    with P.cached():
        expected, actual = stock(x), ours(x)
        assert torch.equal(actual, expected)
        assert torch.equal(ours.layers[0].weight, stock.layers[0].weight)


@pytest.mark.parametrize("training", [False, True], ids=["eval_no_grad", "training"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("mode", ["hoist", "inline", "freeze", "auto"])
def test_a_python_subclass_value_compiled_equal_to_stock(mode, backend, training):
    # A value compiled code cannot take as a graph input (AOTAutograd refuses a plain Python
    # subclass) is computed where it is read, in every mode; until 2026-12-04 hoist, freeze and
    # auto installed it and aot_eager raised "Multiple dispatch failed for aten.t.default".
    if mode == "freeze" and training:
        pytest.skip("freeze serves eval no_grad calls only")
    torch._dynamo.reset()
    torch.manual_seed(0)
    stock = nn.Sequential(_linear(), nn.Tanh(), _linear())
    P.register_parametrization(stock[0], "weight", AsTagged())
    stock.train(training).requires_grad_(training)
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    runs = [(m, torch.compile(m, backend=backend)) for m in (stock, ours)]
    for _ in range(3):
        results = []
        for model, compiled in runs:
            with torch.set_grad_enabled(training):
                out = compiled(_inputs())
            if training:
                out.sum().backward()
            results.append((type(out), out.detach().as_subclass(torch.Tensor),
                            [p.grad for p in model.parameters()]))
            with torch.no_grad():  # an optimizer step, or an edit of the weights between eval calls
                for p in model.parameters():
                    p.sub_(1e-2 * p.grad if p.grad is not None else 1e-2 * p)
                    p.grad = None
        (stock_type, expected, stock_grads), (our_type, actual, our_grads) = results
        assert stock_type is Tagged and our_type is Tagged
        assert torch.equal(actual, expected)
        assert all(map(torch.equal, our_grads, stock_grads)) if training else our_grads == stock_grads
    paramfold.restore(ours)
