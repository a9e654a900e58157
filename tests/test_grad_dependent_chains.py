"""Custom parametrizations whose value depends on the grad mode they are computed in.

A member may compute differently where gradients are recorded: a straight-through estimator
taken only with grad enabled, a cheaper expression where no gradient is recorded (which rounds
differently), a scale chosen by ``torch.is_grad_enabled()``. Stock computes it in the grad mode of
each read. freeze and auto computed their values under ``no_grad`` whatever the call's mode, so
until 2026-12-05 such a chain called under ``torch.enable_grad()`` (its tensors needing no grad)
gave another output than stock at every call. ``find``'s probe now runs each custom member with
grad enabled and under ``no_grad``, from the same tensors, none requiring grad, and compares the
values bit for bit and the ops run: such a chain is served like one that draws random numbers,
computed at every read (auto, inline) and refused by hoist and freeze with the model left as it
was. A member that does not ask is not flagged, trainable or not. Compared bitwise with stock;
compiled runs use ``backend="eager"``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from helpers import assert_same_tensors, classes

import paramfold

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class ScaledByMode(nn.Module):
    def forward(self, w):
        return w * (2.0 if torch.is_grad_enabled() else 3.0)


class Normalized(nn.Module):
    """A weight scaled to a fixed norm, by a cheaper expression where no gradient is recorded
    (which rounds differently); ``shortcut`` off, the same expression in both modes."""

    def __init__(self):
        super().__init__()
        self.shortcut = True

    def forward(self, w):
        if self.shortcut and not torch.is_grad_enabled():
            return w * (1.5 / w.norm())
        return w / w.norm() * 1.5


class Projected(nn.Module):
    """Asks nothing of the grad mode; a matmul with a trainable parameter of its own."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Parameter(torch.eye(5) + 0.01)

    def forward(self, w):
        return self.proj @ w


class Cast(nn.Module):
    def forward(self, w):
        return w.to(torch.bfloat16).to(torch.float32)


DEPENDENT = {"scaled": ScaledByMode, "normalized": Normalized}


def _model(member: type[nn.Module], trainable: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    parametrize.register_parametrization(model[0], "weight", member())
    return model.eval().requires_grad_(trainable)


def test_find_flags_a_member_that_asks_the_grad_mode_and_no_other():
    for member in DEPENDENT.values():
        (site,) = paramfold.find(_model(member))
        assert site.grad_dependent and not site.random and not site.writes_itself, member
    for member in (Projected, Cast):
        for trainable in (False, True):
            (site,) = paramfold.find(_model(member, trainable))
            assert not site.grad_dependent, (member, trainable)


@pytest.mark.parametrize("member", DEPENDENT)
@pytest.mark.parametrize("mode", ["hoist", "freeze"])
def test_hoist_and_freeze_refuse_and_leave_the_model_as_it_was(member, mode):
    model = _model(DEPENDENT[member])
    kinds, state = classes(model), {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(paramfold.FoldError, match="with grad enabled than under no_grad"):
        paramfold.prepare(model, mode)
    assert classes(model) == kinds
    assert_same_tensors(state, model.state_dict())


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("member", DEPENDENT)
@pytest.mark.parametrize("mode", ["auto", "inline"])
def test_served_in_the_grad_mode_of_each_call_like_stock(mode, member, compiled):
    stock, ours = _model(DEPENDENT[member]), _model(DEPENDENT[member])
    paramfold.prepare(ours, mode)
    run = {id(m): (torch.compile(m, backend="eager") if compiled else m) for m in (stock, ours)}
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    for step, grad in enumerate((False, True, True, False, True, False, False)):
        with torch.set_grad_enabled(grad):
            outs = [run[id(m)](x) for m in (stock, ours)]
        assert torch.equal(outs[0], outs[1]), (step, grad)


@pytest.mark.parametrize("mode", ["auto", "freeze"])
def test_a_switch_to_asking_the_grad_mode_after_prepare_is_followed_or_refused(mode):
    # Prepared with the shortcut off (nothing asks the grad mode); switched on between calls:
    # auto computes it at each read from then on, freeze refuses the call.
    stock, ours = _model(Normalized), _model(Normalized)
    for model in (stock, ours):
        model[0].parametrizations.weight[0].shortcut = False
    paramfold.prepare(ours, mode)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    with torch.enable_grad():
        for _ in range(2):
            assert torch.equal(ours(x), stock(x))
        for model in (stock, ours):
            model[0].parametrizations.weight[0].shortcut = True
        if mode == "freeze":
            with pytest.raises(paramfold.FoldError, match="with grad\\s+enabled than under no_grad"):
                ours(x)
            return
        for _ in range(2):
            assert torch.equal(ours(x), stock(x))


class Identity(nn.Module):
    def forward(self, w):
        return w


class TracksInTraining(nn.Module):
    """Changes its state in training only (a running scale), and asks the grad mode."""

    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, w):
        if self.training:
            with torch.no_grad():
                self.seen.add_(1.0)
        return w * (2.0 if torch.is_grad_enabled() else 3.0)


def _nested() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    parametrize.register_parametrization(model[0], "weight", Cast())
    parametrize.register_parametrization(model[0].parametrizations.weight, "original", ScaledByMode())
    return model.eval().requires_grad_(False)


def _list_hooked() -> nn.Module:
    model = _model(Identity)
    model[0].parametrizations.weight.register_forward_hook(
        lambda module, args, out: out * (2.0 if torch.is_grad_enabled() else 3.0))
    return model


def _stateful_in_training() -> nn.Module:
    return _model(TracksInTraining)


ELSEWHERE = {"on an original": _nested, "a hook on the list": _list_hooked,
             "stateful in training": _stateful_in_training}


@pytest.mark.parametrize("case", ELSEWHERE)
def test_a_grad_dependence_anywhere_in_the_chain_is_found_and_served_like_stock(case):
    # Regression (the hunt on this fix): not found where the asking member sits on an original
    # (the outer site was not flagged), in a forward hook on the ParametrizationList, or in a
    # chain that changes its state in training (not asked at all, yet frozen in eval).
    build = ELSEWHERE[case]
    assert [s.grad_dependent for s in paramfold.find(build())] == [True]
    with pytest.raises(paramfold.FoldError, match="with grad enabled than under no_grad"):
        paramfold.prepare(build(), "freeze")
    stock, ours = build(), paramfold.prepare(build(), "auto")
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    for grad in (False, True, True, False):
        with torch.set_grad_enabled(grad):
            assert torch.equal(ours(x), stock(x)), grad


_DRAWN = [0]


class ChangesFromRunToRun(nn.Module):
    """Its bits change at every run whatever the grad mode, as a nondeterministic kernel's may."""

    def forward(self, w):
        _DRAWN[0] += 1
        return w + torch.tensor(_DRAWN[0] * 1e-3)  # the same ops each run, other bits


def test_a_member_whose_bits_change_from_run_to_run_is_not_taken_for_one_that_asks():
    # Regression: torch.linalg.lstsq's bits change from run to run on CPU; one no_grad run against
    # one grad run took that for grad dependence, and freeze and hoist refused the chain.
    (site,) = paramfold.find(_model(ChangesFromRunToRun))
    assert not site.grad_dependent
