"""torch.func transforms and model surgery around a prepared model, bitwise against stock.

Real code does more to a model than call it: it takes ``torch.func`` transforms of it (Hessians
of a loss w.r.t. the input, ``functional_call`` with dicts naming the originals, the computed
weight or spectral_norm's power-iteration buffers), and it edits the model after ``prepare``
(a layer replaced, added or deleted, a parametrized layer swapped in). Each test runs the same
steps on a stock twin and compares outputs, gradients and ``state_dict`` bitwise (CPU; compiled
with the eager backend), or checks that paramfold refuses with a ``FoldError``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, hessian, jacrev
from torch.nn.utils.parametrizations import orthogonal, spectral_norm, weight_norm

import paramfold

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

MODES = ["hoist", "inline", "auto"]


def _inference(model: nn.Module) -> nn.Module:
    return model.eval().requires_grad_(False)


def wn_head() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(weight_norm(nn.Linear(4, 4)), nn.Tanh(), nn.Linear(4, 1))


# --- torch.func transforms -----------------------------------------------------------------


@pytest.mark.parametrize("transform", ["hessian", "jacrev_jacrev"])
@pytest.mark.parametrize("mode", ["auto", "freeze"])
def test_nested_transform_of_an_inference_model_twice_equals_stock(mode, transform):
    # Regression: freeze (and auto, whose values of a model that needs no grad are frozen)
    # computed the frozen value inside the transforms, where torch.func wraps every result for
    # its levels, and kept that wrapper: the next call of the same nested transform met a
    # wrapper of dead levels and raised torch's INTERNAL ASSERT "level.has_value() && level <=
    # current_level" (stock computes the Hessian again). A value computed from plain tensors
    # is now computed outside the transforms: a plain tensor, as frozen outside them.
    stock = _inference(wn_head())
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    make = hessian if transform == "hessian" else (lambda f: jacrev(jacrev(f)))
    x = torch.randn(4)
    for _ in range(3):
        expected = make(lambda t: stock(t).sum())(x)
        assert torch.equal(make(lambda t: ours(t).sum())(x), expected)
        assert torch.equal(ours(x), stock(x))


@pytest.mark.parametrize("mode", ["auto", "freeze"])
def test_hessian_through_functional_call_with_the_same_dict_twice_equals_stock(mode):
    # The same bug through functional_call with a dict of detached originals (a Hessian w.r.t.
    # the input at fixed weights, as in curvature or influence computations).
    stock = _inference(wn_head())
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    x = torch.randn(4)
    params = {m: {k: v.detach() + 0.01 for k, v in m.named_parameters()} for m in (stock, ours)}
    for _ in range(2):
        got = hessian(lambda t: functional_call(ours, params[ours], (t,)).sum())(x)
        assert torch.equal(got, hessian(lambda t: functional_call(stock, params[stock], (t,)).sum())(x))
