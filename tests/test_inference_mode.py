"""Calls and probes inside ``torch.inference_mode()``: a value computed there serves later grad calls
as stock's reads do, a value computed at every call for a while is the same kind of tensor as the
frozen values around it, and a chain probed inside inference mode (at ``prepare``, after a
settings change, after a deepcopy) is found as stock runs it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import RowScale, _wn_pair
from torch import nn
from torch._dynamo.testing import CompileCounter
from torch.nn.utils import parametrize as P
from torch.nn.utils.parametrizations import weight_norm

import paramfold


@pytest.mark.parametrize("mode", ["freeze", "auto", "hoist"])
def test_value_computed_under_inference_mode_serves_later_grad_calls(mode):
    stock, ours = _wn_pair()
    paramfold.prepare(ours, mode)
    x = torch.randn(2, 4)
    with torch.inference_mode():
        assert torch.equal(ours(x), stock(x))
    xs, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    stock(xs).sum().backward()
    ours(xo).sum().backward()
    assert torch.equal(xs.grad, xo.grad)


class _ReturnsItsWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = weight_norm(nn.Linear(8, 8))

    def forward(self, x):
        return self.lin(x), self.lin.weight


@pytest.mark.parametrize("entry", ["eager", "torch.compile", "model.compile"])
@pytest.mark.parametrize("mode", ["freeze", "auto"])
@pytest.mark.parametrize("steps", ["train, eval", "edits"])
def test_a_value_computed_at_every_call_for_a_while_is_a_frozen_values_kind_of_tensor(steps, mode, entry):
    # Regression (helper-195, 2026-12-07): a freeze or auto site whose inputs changed at the last
    # calls is computed at every call for a while (site_values._demote); under inference_mode
    # that value was an inference tensor, where the frozen values before and after it are not
    # (computed outside inference_mode): the forward read both kinds in a row, and compiled code
    # recompiled on the change of dispatch keys (3 graphs where stock makes 2).
    models, calls, counters = [], [], []
    for prepare in (False, True):
        torch.manual_seed(0)
        model = _ReturnsItsWeight().requires_grad_(False)
        models.append(paramfold.prepare(model, mode) if prepare else model)
        counters.append(CompileCounter())
        if entry == "eager":
            calls.append(model)
        elif entry == "torch.compile":
            calls.append(torch.compile(model, backend=counters[-1]))
        else:
            model.compile(backend=counters[-1])
            calls.append(model)
    x = torch.randn(4, 8)
    kinds = [[], []]
    for i in range(6):
        outs = []
        for which, (model, call) in enumerate(zip(models, calls)):
            if steps == "train, eval":
                model.train(i == 1)
            elif i in (1, 2, 3):  # an EMA-like update before three calls in a row
                with torch.no_grad():
                    model.lin.parametrizations.weight.original0.mul_(1.01)
            with torch.no_grad() if i < 2 else torch.inference_mode():
                out, weight = call(x)
            kinds[which].append(weight.is_inference())
            outs.append(out)
        assert torch.equal(outs[1], outs[0]), i
    # Stock's reads under inference_mode are inference tensors; freeze's and auto's values are not
    # (computed outside it, to serve later calls): one kind from the frozen value on.
    assert kinds[0] == [False, False, True, True, True, True]
    assert not any(kinds[1])
    if entry != "eager":
        assert counters[1].frame_count <= counters[0].frame_count


@pytest.mark.parametrize("mode", ["auto", "hoist", "freeze", "inline"])
@pytest.mark.parametrize("when", ["prepare", "settings changed", "deepcopy"])
def test_chain_probed_inside_inference_mode_like_stock(mode, when):
    """find's probe clones a member's buffers: inside inference_mode those clones were inference
    tensors, whose version counter cannot be read (RuntimeError at prepare, or at the first call
    after a member's settings changed or after a deepcopy, where the chain is probed again)."""
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Linear(4, 4), nn.Tanh()).eval().requires_grad_(False)
    P.register_parametrization(stock[0], "weight", RowScale())
    ours = copy.deepcopy(stock)
    x = torch.randn(2, 4)
    with torch.inference_mode():
        if when == "prepare":
            paramfold.prepare(ours, mode)
    if when != "prepare":
        paramfold.prepare(ours, mode)
    if when == "deepcopy":
        ours = copy.deepcopy(ours)
    for model in (stock, ours):
        if when == "settings changed":
            model[0].parametrizations.weight[0].alpha = 2.0
    with torch.inference_mode():
        assert torch.equal(ours(x), stock(x))
    with torch.no_grad():
        assert torch.equal(ours(x), stock(x))
