"""User classes that look like torch's: a parametrization named like one of torch's or torchao's
(``FakeSparsity``, ``_WeightNorm``) and a subclass of torch's ``WeightNorm`` hook are served as
what they are, like stock, not as the torch class they resemble.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import ALL_MODES, assert_same_tensors
from torch import nn
from torch.nn.utils import parametrize as P
from torch.nn.utils.weight_norm import WeightNorm as WeightNormHook

import paramfold


class FakeSparsity(nn.Module):
    """The user's own, named like torch.ao's and torchao's mask: it scales by a list's entry."""

    def __init__(self) -> None:
        super().__init__()
        self.scales = [2.0]

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * self.scales[0]


class _WeightNorm(nn.Module):
    """The user's own, named like torch's weight_norm: it draws a dropout mask."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(w, 0.5, True)


class OneLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("member", [FakeSparsity, _WeightNorm])
def test_a_users_class_named_like_torchs_parametrization_is_served_like_stock(member, mode):
    # Regression: torch's and torchao's parametrizations were recognised by class name alone, and
    # trusted: a user's FakeSparsity holding a list was frozen without a watch on it (a stale
    # value after the list changed, freeze and auto), a user's _WeightNorm drawing random numbers
    # was not probed for draws.
    def build():
        torch.manual_seed(0)
        model = OneLinear()
        P.register_parametrization(model.lin, "weight", member())
        return model.eval().requires_grad_(False)

    stock, ours = build(), build()
    assert [site.kind for site in paramfold.find(ours)] == ["custom"]
    refused = {(FakeSparsity, "freeze"), (_WeightNorm, "freeze"), (_WeightNorm, "hoist")}  # a list; draws
    if (member, mode) in refused:
        with pytest.raises(paramfold.FoldError):
            paramfold.prepare(ours, mode)
        assert paramfold.find(ours)[0].chain[0].__class__ is member  # left as it was
        return
    paramfold.prepare(ours, mode)
    x = torch.randn(2, 4)
    with torch.no_grad():
        for step in range(3):
            if step == 2 and member is FakeSparsity:
                stock.lin.parametrizations.weight[0].scales[0] = 3.0
                ours.lin.parametrizations.weight[0].scales[0] = 3.0
            torch.manual_seed(step)
            expected = stock(x)
            torch.manual_seed(step)
            assert torch.equal(ours(x), expected), step


class HalvedWeightNorm(WeightNormHook):
    """A subclass of torch's hook whose call does more than torch's: it halves the weight."""

    def __call__(self, module: nn.Module, inputs) -> None:
        setattr(module, self.name, self.compute_weight(module) * 0.5)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_a_subclass_of_torchs_weight_norm_hook_runs_like_stock(mode):
    # Regression: a hook was taken for torch's weight_norm by isinstance, and served through
    # compute_weight without the subclass's own call: the weight was not halved.
    def build():
        torch.manual_seed(0)
        model = OneLinear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            torch.nn.utils.weight_norm(model.lin)
        hooks = model.lin._forward_pre_hooks
        (key,) = hooks
        hooks[key] = HalvedWeightNorm(hooks[key].name, hooks[key].dim)
        return model.eval().requires_grad_(False)

    stock, ours = build(), build()
    paramfold.prepare(ours, mode)
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(ours(x), stock(x))
    assert_same_tensors(dict(stock.state_dict()), dict(ours.state_dict()))
