"""paramfold.testing.assert_equivalent on the arguments a user passes and on what a model's own
calls change.

Why this file exists: ``assert_equivalent`` must never fail where paramfold is right and never
pass where it is wrong (helper-243's probe found both). Here: an ``lr`` given as a NumPy scalar or
a tensor of one element, as optimizers and schedulers hold it, was refused with steps > 1.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations as PZ

import paramfold
import paramfold.testing as pt


class _LeavesWhenPrepared(nn.Module):
    """A weight-normed Linear whose forward, once prepared, calls ``change``."""

    def __init__(self, change):
        super().__init__()
        torch.manual_seed(0)
        self.lin = PZ.weight_norm(nn.Linear(8, 8))
        self.change = change

    def forward(self, x):
        if paramfold.state.STATE_ATTR in self.__dict__:
            self.change()
        return self.lin(x)


@pytest.mark.parametrize("lr", [np.float32(1e-3), torch.tensor(1e-3), torch.tensor([1e-3]), torch.tensor(1e-3).double()],
                         ids=["np.float32", "0-dim tensor", "1-element tensor", "float64 tensor"])
def test_an_lr_given_as_a_numpy_scalar_or_a_tensor_is_accepted(lr):
    # Refused (np.float64, a float subclass, was not): "not a finite number above 0".
    pt.assert_equivalent(_LeavesWhenPrepared(lambda: None), torch.randn(4, 8), "hoist", steps=2, lr=lr)


@pytest.mark.parametrize("lr", [torch.tensor(0.0), torch.tensor(-1e-3), np.float32("nan"), torch.tensor(float("inf")),
                                torch.tensor([1e-3, 1e-3]), "1e-3", None],
                         ids=["zero tensor", "negative tensor", "np nan", "inf tensor", "two elements", "str", "None"])
def test_an_lr_that_is_no_positive_finite_real_number_is_refused(lr):
    with pytest.raises(ValueError, match=r"lr=.* with steps=2: .*pass lr > 0"):
        pt.assert_equivalent(_LeavesWhenPrepared(lambda: None), torch.randn(4, 8), "hoist", steps=2, lr=lr)
