"""Custom parametrizations whose computation writes their own attributes.

A member may keep Python state that its ``forward`` changes at every computation: a step counter
for an annealing schedule, a running statistic in a plain tensor attribute that is not a
registered buffer. Stock changes it at every read. ``find``'s probe must not change it at all
(it runs a copy of each member), and such a chain is served like one that draws random numbers:
computed at every read (auto, inline), refused by hoist and freeze with the model left as it was.
Until 2026-12-03 the probe ran the real member (the counter advanced at ``prepare``, and again at
every call where the counter's write looked like a settings change), and freeze served the first
call's value for good. Compared bitwise with stock; compiled runs use ``backend="eager"``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from helpers import Doubled, Ema, assert_same_tensors, classes, grads

import paramfold

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class Counted(nn.Module):
    """A warm-up schedule: the weight scaled by a factor that grows with each computation."""

    def __init__(self):
        super().__init__()
        self.step = 0

    def forward(self, w):
        self.step += 1
        return w * (1 + 0.01 * self.step)


class Running(nn.Module):
    """A running mean of the weight's scale, kept in a tensor attribute that is not a buffer."""

    def __init__(self):
        super().__init__()
        self.running = torch.ones(())

    def forward(self, w):
        with torch.no_grad():
            self.running.mul_(0.9).add_(0.1 * w.abs().mean())
        return w / self.running


class CountedWithGrad(Counted):
    """Counts grad (training) passes only: keyed on the grad mode, not on ``self.training``. The
    probe ran under no_grad only until 2026-12-04, and saw no write: hoist and auto served it once
    per call, before the forward."""

    def forward(self, w):
        if torch.is_grad_enabled():
            self.step += 1
        return w * (1 + 0.01 * self.step)


MEMBERS = {"counter": Counted, "tensor attribute": Running, "counter with grad only": CountedWithGrad}


def _model(member: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    parametrize.register_parametrization(model[0], "weight", MEMBERS[member]())
    return model


def _member_state(model: nn.Module) -> tuple:
    member = model[0].parametrizations.weight[0]
    return getattr(member, "step", None), getattr(member, "running", torch.zeros(())).clone()


@pytest.mark.parametrize("member", MEMBERS)
def test_find_changes_nothing_of_a_member(member):
    model = _model(member)
    before = _member_state(model)
    (site,) = paramfold.find(model)
    assert site.writes_itself
    after = _member_state(model)
    assert before[0] == after[0] and torch.equal(before[1], after[1])


@pytest.mark.parametrize("member", MEMBERS)
@pytest.mark.parametrize("mode", ["hoist", "freeze"])
def test_hoist_and_freeze_refuse_and_leave_the_model_as_it_was(member, mode):
    model = _model(member)
    before = _member_state(model)
    _refused_and_left_as_it_was(model, mode, "changes its own attributes")
    after = _member_state(model)
    assert before[0] == after[0] and torch.equal(before[1], after[1])


def _refused_and_left_as_it_was(model: nn.Module, mode: str, match: str) -> None:
    """``prepare(model, mode)`` (freeze: of the model in eval, needing no grad) raises a
    ``FoldError`` matching ``match`` and leaves the classes and the state dict as they were."""
    if mode == "freeze":
        model.eval().requires_grad_(False)
    kinds, state = classes(model), {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(paramfold.FoldError, match=match):
        paramfold.prepare(model, mode)
    assert classes(model) == kinds
    assert_same_tensors(state, model.state_dict())


def _outputs_equal(run: dict, models: tuple[nn.Module, nn.Module], x: torch.Tensor, grad: bool, at: str) -> None:
    """Call stock's and paramfold's model (``run``: each one's callable, by id) on ``x`` in
    ``grad`` mode, backward where grad is on, and require equal outputs."""
    outs = []
    for model in models:
        with torch.set_grad_enabled(grad):
            out = run[id(model)](x)
            if grad:
                out.sum().backward()
        outs.append(out.detach())
    assert torch.equal(outs[0], outs[1]), at


def _runs(stock: nn.Module, ours: nn.Module, grad: bool, compiled: bool) -> tuple[dict, torch.Tensor]:
    """For :func:`_outputs_equal`: each model's callable by id (compiled with the eager backend,
    or itself; in eval where ``grad`` is off), and the input."""
    if not grad:
        stock.eval(), ours.eval()
    run = {id(m): (torch.compile(m, backend="eager") if compiled else m) for m in (stock, ours)}
    return run, torch.randn(4, 6, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("member", MEMBERS)
@pytest.mark.parametrize("mode", ["auto", "inline"])
def test_served_at_every_read_like_stock(mode, member, grad, compiled):
    stock, ours = _model(member), _model(member)
    paramfold.prepare(ours, mode)
    run, x = _runs(stock, ours, grad, compiled)
    for step in range(3):
        _outputs_equal(run, (stock, ours), x, grad, at=f"step {step}")
        expected, actual = _member_state(stock), _member_state(ours)
        assert expected[0] == actual[0] and torch.equal(expected[1], actual[1]), f"step {step}"
        if grad:
            assert_same_tensors(grads(stock), grads(ours), at=f"step {step}")


class Shrinks(nn.Module):
    """Edits its input, the original, in place: stock shrinks the original at every read."""

    def forward(self, w):
        return w.mul_(0.9)


class ClampsInPlace(nn.Module):
    """A max-value constraint applied to the original in place: after the first read it changes
    no byte, yet each read writes the original all the same."""

    def forward(self, w):
        return w.clamp_(-0.2, 0.2)


class ReadsTwiceOrSkips(nn.Module):
    """A fixed (no grad) layer whose member edits the original, read ``reads`` times per call,
    under a trained head."""

    def __init__(self, member: type[nn.Module]):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 6)
        self.lin.weight.requires_grad_(False)  # an in-place edit of a leaf that requires grad raises
        parametrize.register_parametrization(self.lin, "weight", member(), unsafe=True)
        self.head = nn.Linear(6, 3)
        self.reads = 1

    def forward(self, x):
        for _ in range(self.reads):
            x = torch.tanh(self.lin(x))
        return self.head(x)


ORIGINAL_EDITORS = {"shrinks": Shrinks, "clamps": ClampsInPlace}


def _original(model: nn.Module) -> torch.Tensor:
    return model.lin.parametrizations.weight.original.clone()


@pytest.mark.parametrize("member", ORIGINAL_EDITORS)
@pytest.mark.parametrize("mode", ["hoist", "freeze"])
def test_a_chain_that_edits_its_original_is_refused_by_hoist_and_freeze(member, mode):
    # Regression: the probe compared the members' own state only, never their input: a member
    # returning X.mul_(0.9) was found stateless, freeze and auto served the first value for good
    # and hoist shrank the original once per call, read twice or not at all.
    model = ReadsTwiceOrSkips(ORIGINAL_EDITORS[member])
    if mode == "freeze":
        model.eval().requires_grad_(False)
    before, kinds = _original(model), classes(model)
    (site,) = paramfold.find(model)
    assert site.writes_itself and torch.equal(_original(model), before)
    with pytest.raises(paramfold.FoldError, match="lin.weight: .*changes its own attributes or its originals"):
        paramfold.prepare(model, mode)
    assert classes(model) == kinds and torch.equal(_original(model), before)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("member", ORIGINAL_EDITORS)
@pytest.mark.parametrize("mode", ["auto", "inline"])
def test_a_chain_that_edits_its_original_edits_it_at_every_read_like_stock(mode, member, grad, compiled):
    stock = ReadsTwiceOrSkips(ORIGINAL_EDITORS[member])
    ours = paramfold.prepare(ReadsTwiceOrSkips(ORIGINAL_EDITORS[member]), mode)
    run, x = _runs(stock, ours, grad, compiled)
    for step, reads in enumerate([1, 2, 0, 2, 1]):
        for model in (stock, ours):
            model.reads = reads
            model.zero_grad()
        _outputs_equal(run, (stock, ours), x, grad, at=f"step {step}")
        assert torch.equal(_original(stock), _original(ours)), f"step {step}"
        if grad:
            assert_same_tensors(grads(stock), grads(ours), at=f"step {step}")


class _ReadsTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, skip=False):
        if skip:  # the layer's weight not read in this call
            return x * self.lin.bias.sum()
        return x @ self.lin.weight.T + x @ self.lin.weight.T


def _nested(inner: str) -> nn.Module:
    torch.manual_seed(0)
    model = _ReadsTwice()
    parametrize.register_parametrization(model.lin, "weight", Doubled())
    owner = model.lin.parametrizations.weight
    if inner == "spectral_norm":
        torch.nn.utils.parametrizations.spectral_norm(owner, "original")
    else:
        parametrize.register_parametrization(owner, "original", Ema())
    return model


@pytest.mark.parametrize("inner", ["spectral_norm", "averaged"])
@pytest.mark.parametrize("mode", ["hoist", "freeze", "auto", "inline"])
def test_a_chain_on_an_original_that_changes_its_state_is_read_like_stock(inner, mode):
    """A parametrization of an original (nested) that changes its state when computed does so at
    every read of the outer tensor in stock: auto and inline compute it at every read; hoist and
    freeze, which compute once per call or once for many, refuse it with the model intact (they
    used to serve it: the inner power iteration or buffer update ran once per call)."""
    stock, ours = _nested(inner), _nested(inner)
    train = inner == "spectral_norm"  # spectral_norm iterates in training; the other in eval too
    for model in (stock, ours):
        model.train(train).requires_grad_(train)
    if mode in ("hoist", "freeze"):
        if mode == "freeze":  # inference only (a spectral_norm then does not iterate: refused all the same)
            ours.eval().requires_grad_(False)
        kinds, state = classes(ours), {k: v.clone() for k, v in ours.state_dict().items()}
        with pytest.raises(paramfold.FoldError, match="a parametrization of an original that changes its state"):
            paramfold.prepare(ours, mode)
        assert classes(ours) == kinds
        assert_same_tensors(state, ours.state_dict())
        return
    paramfold.prepare(ours, mode)
    x = torch.randn(2, 4)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (stock, ours)] if train else None
    for call in range(4):
        outs = []
        for i, model in enumerate((stock, ours)):
            with torch.set_grad_enabled(train):
                out = model(x, skip=call == 2)
            if train:
                out.sum().backward()
                opts[i].step()
                opts[i].zero_grad()
            outs.append(out.detach())
        assert torch.equal(*outs), call
        for (name, a), b in zip(stock.state_dict().items(), ours.state_dict().values()):
            assert torch.equal(a, b), (call, name)


# --- a hook that changes state, on a member of torch's own or on the ParametrizationList -------


def _anneal(module, args, out):
    """A forward hook annealing the weight by a count of its reads, kept on the module it is on."""
    module.count += 1
    return out * (1 + 0.1 * module.count)


HOOKED = {"weight_norm member": ("weight_norm", "member"), "weight_norm list": ("weight_norm", "list"),
          "custom list": ("custom", "list")}


def _hook_target(layer: nn.Module, where: str) -> nn.Module:
    plist = layer.parametrizations.weight
    return plist[0] if where == "member" else plist


class ReadTwiceHooked(nn.Module):
    """A layer called twice per forward (weight sharing), a counting hook on its chain."""

    def __init__(self, case: str, hooked: bool = True):
        super().__init__()
        member, self.where = HOOKED[case]
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 6)
        if member == "weight_norm":
            weight_norm(self.lin)
        else:
            parametrize.register_parametrization(self.lin, "weight", Doubled())
        _hook_target(self.lin, self.where).count = 0
        if hooked:
            self.hook()

    def hook(self):
        _hook_target(self.lin, self.where).register_forward_hook(_anneal)

    @property
    def count(self):
        return _hook_target(self.lin, self.where).count

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


@pytest.mark.parametrize("case", HOOKED)
@pytest.mark.parametrize("mode", ["hoist", "freeze"])
def test_hoist_and_freeze_refuse_a_hook_that_changes_state_on_any_chain(case, mode):
    # Regression: the probe ran only custom members, and never the ParametrizationList's hooks: a
    # counting hook on weight_norm's member or on a list ran once per call (hoist, auto), not at
    # each of the two reads, silently.
    model = ReadTwiceHooked(case)
    (site,) = paramfold.find(model)
    assert site.writes_itself and model.count == 0
    _refused_and_left_as_it_was(model, mode, "lin.weight: .*changes its own attributes")
    assert model.count == 0


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("case", HOOKED)
@pytest.mark.parametrize("mode", ["auto", "inline"])
def test_a_hook_that_changes_state_on_any_chain_runs_at_every_read_like_stock(mode, case, grad, compiled):
    stock, ours = ReadTwiceHooked(case), paramfold.prepare(ReadTwiceHooked(case), mode)
    run, x = _runs(stock, ours, grad, compiled)
    for step in range(3):
        _outputs_equal(run, (stock, ours), x, grad, at=f"step {step}")
        assert stock.count == ours.count == 2 * (step + 1), f"step {step}"
        if grad:
            assert_same_tensors(grads(stock), grads(ours), at=f"step {step}")


@pytest.mark.parametrize("case", HOOKED)
@pytest.mark.parametrize("mode", ["hoist", "auto"])
def test_a_hook_that_changes_state_registered_after_prepare_runs_at_every_read_like_stock(mode, case):
    # Regression: a chain of torch's own members had no watch of its hooks: hoist and auto ran a
    # hook registered later once per call. Its chain is probed again, and computed where read.
    stock, ours = ReadTwiceHooked(case, hooked=False), paramfold.prepare(ReadTwiceHooked(case, hooked=False), mode)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    for step in range(4):
        if step == 1:
            stock.hook(), ours.hook()
        with torch.no_grad():
            assert torch.equal(stock(x), ours(x)), step
        assert stock.count == ours.count, step


class HoldsAMappingProxy(nn.Module):
    """Reads a read-only view of a config: changes nothing, but cannot be deep-copied."""

    def __init__(self):
        super().__init__()
        import types

        self.config = types.MappingProxyType({"scale": 2.0})

    def forward(self, w):
        return w * self.config["scale"]


@pytest.mark.parametrize("mode", ["hoist", "freeze"])
def test_a_member_the_probe_cannot_copy_is_refused_for_what_it_is(mode):
    # Regression: the refusal said only that the chain changes its own attributes each time it
    # computes the tensor; this one changes nothing, but its probe runs on a copy, and
    # copy.deepcopy of a mappingproxy fails, so paramfold cannot tell.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5))
    parametrize.register_parametrization(model[0], "weight", HoldsAMappingProxy())
    _refused_and_left_as_it_was(
        model, mode, r"it finds out on a copy, and copy\.deepcopy of its HoldsAMappingProxy failed "
                     r"\(TypeError: cannot pickle 'mappingproxy' object\)")
    # find() says so too (the refusal said "or paramfold could not tell" for every chain that
    # writes itself, the probe having run or not; find() said nothing).
    [site] = paramfold.find(model)
    assert site.writes_itself and site.unprobed == (
        "copy.deepcopy of its HoldsAMappingProxy failed (TypeError: cannot pickle 'mappingproxy' object)")


def test_a_chain_that_writes_itself_is_refused_without_a_copy_failure_named():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5))
    parametrize.register_parametrization(model[0], "weight", Counted())
    [site] = paramfold.find(model)
    assert site.writes_itself and site.unprobed == ""
    with pytest.raises(paramfold.FoldError) as refused:
        paramfold.prepare(model, "hoist")
    assert "changes its own attributes" in str(refused.value) and "deepcopy" not in str(refused.value)
