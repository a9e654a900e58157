"""A parametrization registered on another parametrization's original (a nested chain): ``find``
reports it, every mode computes it as stock does, and ``restore`` undoes ``prepare`` exactly.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import ALL_MODES, Skew, assert_same_tensors, grads, _inference
from torch import nn
from torch.nn.utils import parametrize as P

import paramfold
import paramfold.testing as pt


def nested_linear() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Linear(4, 4)
    P.register_parametrization(m, "weight", Skew())
    P.register_parametrization(m.parametrizations.weight, "original", Skew())
    return m


def test_find_reports_nested_parametrization():
    (site,) = paramfold.find(nested_linear())
    assert site.kind == "custom"
    assert site.nested
    assert len(site.chain) == 1 and isinstance(site.chain[0], Skew)
    leaf = site.module.parametrizations.weight.parametrizations.original.original
    assert list(site.originals.values())[0] is leaf


@pytest.mark.parametrize("mode", ALL_MODES)
def test_nested_parametrization_every_mode_equal_to_stock(mode):
    stock = nested_linear()
    if mode == "freeze":
        _inference(stock)
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    x = torch.randn(2, 4)
    grad = mode != "freeze"
    for _ in range(2):
        out_s, out_o = stock(x), ours(x)
        assert torch.equal(out_s, out_o)
        assert torch.equal(torch.compile(ours, backend="eager")(x), out_s)
        if grad:
            out_s.sum().backward()
            out_o.sum().backward()
            assert_same_tensors(grads(stock), grads(ours))
            with torch.no_grad():
                for p in (*stock.parameters(), *ours.parameters()):
                    p.add_(0.1)
    assert torch.equal(stock.weight, ours.weight)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_nested_parametrization_restores_exactly(mode):
    model = nested_linear()
    if mode == "freeze":
        _inference(model)
    shape = pt.structure(model, values=False)
    paramfold.prepare(model, mode)(torch.randn(2, 4))
    paramfold.restore(model)
    pt.assert_same_structure(shape, pt.structure(model, values=False))
