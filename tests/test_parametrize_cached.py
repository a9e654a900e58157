"""``torch.nn.utils.parametrize.cached()`` around calls of a prepared model.

Inside the block stock computes each tensor at its first read and serves that value to every
later call and read, even after the weights change; a prepared model does the same in every
mode, eager and compiled, and a block's first read under ``no_grad`` is the tensor stock's
``no_grad`` read gives (a leaf that requires grad, or the original itself).
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_same_tensors, grads, _Transposed
from torch import nn
from torch.nn.utils import parametrize as P
from torch.nn.utils.parametrizations import spectral_norm, weight_norm

import paramfold


class _Same(nn.Module):
    def forward(self, w):
        return w


class _NotesItsWeight(nn.Linear):
    def forward(self, x):
        w = self.weight
        self.seen.append((w.requires_grad, w.is_leaf, w.grad_fn is None))
        return x @ w.T + self.bias


class _CachedBlockUnderNoGrad(nn.Module):
    def __init__(self, chain: str) -> None:
        super().__init__()
        self.lin = _NotesItsWeight(3, 3)
        self.lin.seen = []
        if chain == "weight_norm":
            weight_norm(self.lin)
        else:
            P.register_parametrization(self.lin, "weight", _Transposed() if chain == "transposed" else _Same())

    def forward(self, x):
        with torch.no_grad(), P.cached():
            first = self.lin(x)
        return self.lin(x) + first


@pytest.mark.parametrize("mode", ["hoist", "auto", "inline"])
@pytest.mark.parametrize("chain", ["transposed", "same", "weight_norm"])
def test_a_cached_blocks_first_read_under_no_grad_is_what_stocks_no_grad_read_is(chain, mode):
    # Regression (2026-12-07): a block's value made under no_grad was the call's value detached,
    # where stock's no_grad read of a view of an original that requires grad is a leaf that
    # requires grad, and of an identity chain the original itself.
    models = []
    for prepare in (False, True):
        torch.manual_seed(0)
        model = _CachedBlockUnderNoGrad(chain)
        models.append(paramfold.prepare(model, mode) if prepare else model)
    x = torch.randn(2, 3)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(models[1](x), models[0](x))
    assert models[1].lin.seen == models[0].lin.seen


@pytest.mark.parametrize("entry", ["eager", "torch.compile", "model.compile", "layer.compile"])
@pytest.mark.parametrize("mode", ["hoist", "auto", "inline"])
def test_parametrize_cached_around_several_calls_equal_to_stock(mode, entry):
    # Regression: inside one parametrize.cached() block (an SN-GAN discriminator run on real and
    # fake batches), stock computes each tensor once and reuses it; hoist and auto computed it at
    # every call (the power iteration ran twice), and inline did in compiled code.
    torch.manual_seed(0)
    stock = nn.Sequential(spectral_norm(nn.Linear(4, 4)), nn.Tanh(), weight_norm(nn.Linear(4, 4)))
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    run = ours
    if entry == "torch.compile":
        run = torch.compile(ours, backend="eager")
    elif entry == "model.compile":
        ours.compile(backend="eager")
    elif entry == "layer.compile":
        ours[0].compile(backend="eager")
        ours[2].compile(backend="eager")
    torch._dynamo.reset()
    for step in range(2):
        xs = [torch.randn(3, 4) for _ in range(2)]
        with P.cached():
            expected = [stock(x) for x in xs]
            got = [run(x) for x in xs]
        for a, b in zip(expected, got):
            assert torch.equal(a, b), step
        sum(y.square().sum() for y in expected).backward()
        sum(y.square().sum() for y in got).backward()
        assert_same_tensors(grads(stock), grads(ours), step)
        assert_same_tensors(stock.state_dict(), ours.state_dict(), step)
        for m in (stock, ours):
            m.zero_grad()


@pytest.mark.parametrize("check", ["content", "version"])
@pytest.mark.parametrize("entry", ["eager", "torch.compile"])
@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_parametrize_cached_serves_the_blocks_first_value_to_frozen_sites(mode, entry, check):
    # Regression: inside parametrize.cached(), stock's first read computes a value and every later
    # call and read of the block gets that one, even after the weights changed; freeze and auto
    # served their own frozen value instead (recomputed after the change) and never filled the
    # cache, so calls and reads after an in-place update differed from stock.
    models = []
    for prepare in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(weight_norm(nn.Linear(4, 4)), nn.Tanh(), nn.Linear(4, 4))
        model.eval().requires_grad_(False)
        if prepare:
            paramfold.prepare(model, mode, freeze_check=check)
        models.append(model)
    stock, ours = models
    run = torch.compile(ours, backend="eager") if entry == "torch.compile" else ours
    torch._dynamo.reset()
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):  # a frozen value, kept, and a steady plan
            assert torch.equal(run(x), stock(x))
        with P.cached():
            for step in range(3):
                assert torch.equal(run(x), stock(x)), step
                assert torch.equal(ours[0].weight, stock[0].weight), step
                for model in models:
                    model[0].parametrizations.weight.original1.add_(0.25)
        assert torch.equal(run(x), stock(x))  # after the block: the changed weights
