"""``torch.nn.utils.prune`` on a parametrization's original (a forward pre-hook of the
``ParametrizationList`` computes it from ``original_orig`` and ``original_mask``): pruned before
``prepare``, that site is left stock and the rest is prepared; pruned after, the next call is
refused naming the pruning, and ``restore`` then serves it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_same_tensors, _inference, _Scale
from torch import nn
from torch.nn.utils import parametrize as P
from torch.nn.utils.parametrizations import weight_norm

import paramfold


@pytest.mark.parametrize("mode", ["hoist", "inline", "auto"])
@pytest.mark.parametrize("kind", ["custom", "weight_norm"])
def test_a_pruned_original_is_left_stock_and_the_rest_is_prepared(kind, mode):
    # Regression: torch.nn.utils.prune on a parametrization's original (a pre-hook of the
    # ParametrizationList computes it from original_orig and original_mask) made find() and
    # prepare() raise KeyError.
    import torch.nn.utils.prune as prune

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), weight_norm(nn.Linear(4, 2)))
        if kind == "custom":
            P.register_parametrization(model[0], "weight", _Scale())
        else:
            weight_norm(model[0])
        original = "original" if kind == "custom" else "original1"
        torch.manual_seed(1)
        prune.random_unstructured(model[0].parametrizations.weight, original, amount=0.5)
        return model

    stock, ours = build(), build()
    kinds = {(s.module_path, s.kind) for s in paramfold.find(ours)}
    assert kinds == {("0", "computed_original"), ("2", "weight_norm")}
    pruned_class = type(ours[0])
    paramfold.prepare(ours, mode)
    assert type(ours[0]) is pruned_class and type(ours[2]) is not type(stock[2])  # stock, prepared
    opt_s, opt_o = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (stock, ours))
    for step in range(3):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        for model, opt in ((stock, opt_s), (ours, opt_o)):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        assert_same_tensors(dict(stock.state_dict()), dict(ours.state_dict()), step)


@pytest.mark.parametrize("mode", ["hoist", "auto"])
def test_an_original_pruned_after_prepare_is_refused_naming_the_pruning_and_restore_then_serves_it(mode):
    # The refusal listed every change of a prepared module's parametrizations but pruning
    # (helper-226): a user pruning between steps could not tell what the message meant.
    import torch.nn.utils.prune as prune

    torch.manual_seed(0)
    stock = nn.Sequential(weight_norm(nn.Linear(4, 4)), nn.Tanh(), nn.Linear(4, 2))
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    x = torch.randn(3, 4)
    ours(x)
    for model in (stock, ours):
        torch.manual_seed(1)
        prune.random_unstructured(model[0].parametrizations.weight, "original1", amount=0.5)
    with pytest.raises(paramfold.FoldError, match=r"an original pruned \(torch\.nn\.utils\.prune.*paramfold\.restore"):
        ours(x)
    paramfold.restore(ours)
    paramfold.prepare(ours, mode)
    assert torch.equal(ours(x), stock(x))


@pytest.mark.parametrize("mode", ["hoist", "inline", "freeze", "auto"])
def test_pruning_an_original_after_prepare_is_refused_at_the_next_call(mode):
    # Regression: hoist/freeze/auto raised a bare KeyError ('original'): the check of what changed
    # since prepare did not see an original taken out of its dict.
    import torch.nn.utils.prune as prune

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    P.register_parametrization(model[0], "weight", _Scale())
    stock = copy.deepcopy(model)
    ours = paramfold.prepare(_inference(model) if mode == "freeze" else model, mode)
    x = torch.randn(2, 4)
    with torch.no_grad():
        ours(x)  # steady state first
        torch.manual_seed(1)
        prune.l1_unstructured(ours[0].parametrizations.weight, "original", amount=0.5)
        with pytest.raises(paramfold.FoldError, match="changed after paramfold.prepare"):
            ours(x)
        paramfold.restore(ours)
        prune.l1_unstructured(stock[0].parametrizations.weight, "original", amount=0.5)
        assert torch.equal(ours(x), stock(x))
