"""A training stateful chain (spectral_norm's power iteration) whose value a call does not read.

hoist and auto compute a training spectral_norm's value before the call, which runs the power
iteration; stock runs it at a read. Where the forward skips the layer (a branch, an exception
raised before it) or changes its originals before calling it (``functional_call`` of the layer,
MoCo's momentum update), the state must end as stock's: ``_u``/``_v`` (hook-based:
``weight_u``/``weight_v``) untouched by the unread computation (``paramfold.unread``). Until
2026-12-03 these advanced once more than in stock (a documented limit). Everything is compared
bitwise with stock; compiled runs use ``backend="eager"``, the same ops as stock compiled so.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import spectral_norm

from helpers import RunningScale, assert_same_nested, assert_same_tensors, grads

import paramfold

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

MODES = ["hoist", "auto"]
KINDS = ["parametrization", "hook"]
HOWS = ["eager", "torch.compile", "module.compile", "layer.compile"]


def _norm(kind: str):
    if kind == "custom":
        return _running_scale
    return spectral_norm if kind == "parametrization" else nn.utils.spectral_norm


def _running_scale(layer: nn.Module) -> nn.Module:
    parametrize.register_parametrization(layer, "weight", RunningScale())
    return layer


class Branches(nn.Module):
    """Each call runs one of two spectral_norm layers (a conditional branch, a skipped block)."""

    def __init__(self, kind: str):
        super().__init__()
        self.a = _norm(kind)(nn.Linear(4, 4))
        self.b = _norm(kind)(nn.Linear(4, 4))
        self.use_b = False

    def forward(self, x):
        return self.b(x) if self.use_b else self.a(x)


def _twins(make, mode: str) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    stock = make()
    return stock, paramfold.prepare(copy.deepcopy(stock), mode)


def _runner(model: nn.Module, how: str):
    if how == "torch.compile":
        return torch.compile(model, backend="eager")
    if how == "module.compile":
        model.compile(backend="eager")
    if how == "layer.compile":  # torchtune style: each child compiled, the root eager
        for child in model.children():
            child.compile(backend="eager")
    return model


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.named_buffers()}


def _steps(model: nn.Module, call, steps: int, before_step=lambda model, step: None) -> list:
    """``steps`` training steps from one random state: outputs, buffers and gradients of each."""
    torch.manual_seed(1)
    record = []
    for step in range(steps):
        before_step(model, step)
        model.zero_grad()
        out = call(torch.randn(3, 4))
        out.square().sum().backward()
        record.append([out, _buffers(model), grads(model)])
    return record


def _use_b_every_other_step(model: nn.Module, step: int) -> None:
    model.use_b = step % 2 == 1


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES)
def test_a_layer_the_forward_skips_keeps_its_state_as_in_stock(mode, kind, how):
    stock, prepared = _twins(lambda: Branches(kind), mode)
    assert_same_nested(*(_steps(m, _runner(m, how), 4, _use_b_every_other_step) for m in (stock, prepared)))


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("mode", MODES)
def test_a_hook_based_layer_the_forward_skips_keeps_the_weight_stock_keeps(mode, how):
    # Regression: a training hook-based spectral_norm's layer that a call did not call kept the
    # value paramfold computed for it up front (from the power iteration it then put back),
    # where stock's __dict__ keeps the weight of the layer's last call; read after the call
    # (logging, a copy, an EMA of the weights), it differed.
    stock, prepared = _twins(lambda: Branches("hook"), mode)
    weights = []
    for model in (stock, prepared):
        call, optimizer = _runner(model, how), torch.optim.SGD(model.parameters(), lr=0.1)
        seen = []
        torch.manual_seed(1)
        for step in range(5):
            _use_b_every_other_step(model, step)
            call(torch.randn(3, 4)).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            seen.append([model.a.weight.detach().clone(), model.b.weight.detach().clone(), _buffers(model)])
        weights.append(seen)
    assert_same_nested(*weights)


class RaisesMidway(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.a = _norm(kind)(nn.Linear(4, 4))
        self.b = _norm(kind)(nn.Linear(4, 4))

    def forward(self, x):
        y = self.a(x)
        if bool(y.sum() > -1e9):  # always: the layer after it is never reached
            raise ValueError("bad batch")
        return self.b(y)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES)
def test_an_exception_before_a_layer_leaves_its_state_as_in_stock(mode, kind):
    stock, prepared = _twins(lambda: RaisesMidway(kind), mode)
    x = torch.randn(3, 4)
    for model in (stock, prepared):
        with pytest.raises(ValueError, match="bad batch"):
            model(x)
    assert_same_tensors(_buffers(stock), _buffers(prepared))


class MomentumInside(nn.Module):
    """Updates a child's originals in place inside the forward, then calls it (MoCo's key encoder)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.lin = _norm(kind)(nn.Linear(4, 4))

    def forward(self, x):
        with torch.no_grad():
            original = self.lin.weight_orig if self.kind == "hook" else self.lin.parametrizations.weight.original
            original.mul_(0.9)
        return self.lin(x)


class SwapsInside(nn.Module):
    """Runs its child with other weights (``torch.func.functional_call``, meta-learning style)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.lin = _norm(kind)(nn.Linear(4, 4))
        self.fast = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        key = "parametrizations.weight.original" if self.kind == "parametrization" else "weight_orig"
        return torch.func.functional_call(self.lin, {key: self.fast}, (x,))


@pytest.mark.parametrize("make", [MomentumInside, SwapsInside])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", [*MODES, "inline"])
def test_originals_changed_inside_the_forward_run_the_power_iteration_once_as_in_stock(mode, kind, make):
    stock, prepared = _twins(lambda: make(kind), mode)
    assert_same_nested(*(_steps(m, m, 3) for m in (stock, prepared)))


class MomentumThenTwoCalls(nn.Module):
    """MoCo's momentum update of a key encoder inside the forward, then two calls of it (a
    discriminator scoring two batches): each forward's first call computes afresh."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.j = nn.Linear(4, 4)
        self.k = _norm(kind)(nn.Linear(4, 4))

    def forward(self, x):
        y = self.j(x)
        with torch.no_grad():
            original = self.k.weight_orig if self.kind == "hook" else self.k.parametrizations.weight.original
            original.add_(0.01)
        return self.k(y) + self.k(x)


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", [*MODES, "inline"])
def test_originals_changed_before_two_calls_of_a_layer_compute_afresh_at_every_forward(mode, kind, grad):
    # Until 2026-12-05, with the hook-based norm, hoist and auto served from the second forward
    # on the value computed before the update: the nested check built at the layer's second call
    # (after its first had run the hook) left the layer out and outlived the call. With grad,
    # backward raised "modified by an inplace operation"; under no_grad, outputs and weight_u drifted.
    stock, prepared = _twins(lambda: MomentumThenTwoCalls(kind), mode)
    record = []
    for model in (stock, prepared):
        if grad:
            record.append(_steps(model, model, 4))
        else:
            torch.manual_seed(1)
            with torch.no_grad():
                record.append([[model(torch.randn(3, 4)), _buffers(model)] for _ in range(4)])
        record[-1].append(dict(model.state_dict()))
    assert_same_nested(*record)


@pytest.mark.parametrize("mode", MODES)
def test_inside_parametrize_cached_a_layer_read_by_a_later_call_advances_once_as_in_stock(mode):
    # The block's first call skips b: the value computed for it leaves the cache with its state
    # put back, so the second call's read computes it, as stock's first read in the block does.
    stock, prepared = _twins(lambda: Branches("parametrization"), mode)
    x = torch.randn(3, 4)
    outs = []
    for model in (stock, prepared):
        with parametrize.cached():
            model.use_b = False
            first = model(x)
            model.use_b = True
            second = model(x)
        outs.append([first, second, _buffers(model)])
    assert_same_nested(*outs)


class AutocastInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = spectral_norm(nn.Linear(4, 4))
        self.b = spectral_norm(nn.Linear(4, 4))

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.b(self.a(x))


@pytest.mark.parametrize("mode", MODES)
def test_a_call_refused_inside_the_forward_leaves_the_state_as_it_was(mode):
    # A training spectral_norm read under an autocast region of the forward is refused (stock
    # runs the power iteration at that read); the values computed at the call's start went unread.
    torch.manual_seed(0)
    prepared = paramfold.prepare(AutocastInside(), mode)
    before = _buffers(prepared)
    with pytest.raises(paramfold.FoldError, match="stateful"):
        prepared(torch.randn(3, 4))
    assert_same_tensors(before, _buffers(prepared))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES)
def test_a_state_written_by_someone_else_during_the_call_is_not_put_back(mode, kind):
    # The copy goes back only over what the scope's own computation wrote: a buffer written since
    # (here by the forward itself, loading another state) keeps that write, as in stock.
    class LoadsState(Branches):
        def forward(self, x):
            with torch.no_grad():
                for buffer in self.b.buffers():
                    buffer.fill_(0.5)
            return self.a(x)

    stock, prepared = _twins(lambda: LoadsState(kind), mode)
    x = torch.randn(3, 4)
    assert torch.equal(stock(x), prepared(x))
    assert_same_tensors(_buffers(stock), _buffers(prepared))


@pytest.mark.parametrize("mode", MODES)
def test_paramfold_testing_checks_a_layer_the_model_holds_but_never_calls(mode):
    # paramfold.testing's NetSpec.unused (drawn by models()): the checker compares the unused
    # layer's buffers with stock's too; before paramfold.unread it reported `_u` moved.
    from paramfold.testing import LayerSpec, NetSpec, Step, assert_equivalent

    chain = (("weight", (Step("spectral_norm"),)),)
    spec = NetSpec((LayerSpec("linear", 4, 4, chains=chain), LayerSpec("linear", 4, 4, chains=chain)), unused=1)
    assert [name for name, _ in spec.build().named_children()] == ["net", "unused"]
    assert_equivalent(spec.build(), spec.inputs(), mode)


class CopiesItself(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = spectral_norm(nn.Linear(4, 4))
        self.copies = []

    def forward(self, x):
        y = self.a(x)
        self.copies.append(copy.deepcopy(self.a))  # an EMA model made inside the forward, say
        return y


@pytest.mark.parametrize("mode", MODES)
def test_a_copy_made_inside_the_forward_carries_nothing_of_the_open_call(mode):
    # A copy of part of the model is a stock module (tests/test_core.py), with the state stock's
    # copy made at the same point has, and nothing of the call that was open.
    torch.manual_seed(0)
    stock = CopiesItself()
    prepared = paramfold.prepare(copy.deepcopy(stock), mode)
    x = torch.randn(3, 4)
    stock(x), prepared(x)
    (replica,), (expected,) = prepared.copies, stock.copies
    assert "_paramfold" not in vars(replica) and type(replica) is type(stock.a)
    for (name, a), b in zip(replica.state_dict().items(), expected.state_dict().values()):
        assert torch.equal(a, b), name
    assert torch.equal(replica(x), expected(x))


class SavesMidway(Branches):
    """Takes its own ``state_dict()`` between its first and second layer (a checkpoint or EMA
    snapshot made from a forward hook), before the second layer's power iteration runs."""

    def __init__(self, kind: str):
        super().__init__(kind)
        self.saved = []

    def forward(self, x):
        y = self.a(x)
        state = self.state_dict()
        self.saved.append((state, {k: v.clone() for k, v in state.items()}))
        return self.b(y)


@pytest.mark.parametrize("how", ["eager", "torch.compile"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES)
def test_a_state_dict_taken_inside_the_call_holds_the_state_stock_has_there(mode, kind, how):
    # The scope computed b's value (one power iteration) before the call; the state_dict taken
    # before b is read holds b's state from before that, as stock's (and a copy made there) does,
    # and its entries stay the buffers themselves, which the rest of the call advances as in stock.
    # Until 2026-12-05 hoist and auto showed b one iteration ahead there.
    stock, prepared = _twins(lambda: SavesMidway(kind), mode)
    assert_same_nested(*(_steps(m, _runner(m, how), 3) for m in (stock, prepared)))
    for (expected, expected_then), (actual, actual_then) in zip(stock.saved, prepared.saved):
        assert_same_tensors(expected_then, actual_then)
        assert_same_tensors(expected, actual)


@pytest.fixture
def buffer_copying_hook():
    """A global buffer registration hook that returns a copy (same values, another tensor), as
    device placement or offloading hooks do: it runs at every ``self._u = ...`` of spectral_norm's
    power iteration, which then stores a new tensor in ``_buffers``."""
    handle = torch.nn.modules.module.register_module_buffer_registration_hook(lambda module, name, value: value.clone())
    yield handle
    handle.remove()


def _held(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_buffers())


@pytest.mark.parametrize("how", ["eager", "torch.compile"])
@pytest.mark.parametrize("mode", [*MODES, "inline"])
def test_a_skipped_layer_under_a_buffer_hook_that_stores_copies_keeps_its_state_as_in_stock(
        mode, how, buffer_copying_hook):
    # The scope's power iteration for b (skipped at the first call) stored new tensors in b's
    # _buffers; the put-back restored the old ones' contents only, so b ran one iteration ahead
    # of stock from then on (until 2026-12-05). As stock, which never ran it: the same tensors
    # there, with the same contents.
    stock, prepared = _twins(lambda: Branches("parametrization"), mode)
    runs = [_runner(m, how) for m in (stock, prepared)]
    for model, run in zip((stock, prepared), runs):
        before = _held(model.b)
        run(torch.randn(3, 4))  # b skipped
        assert all(t is before[k] for k, t in _held(model.b).items())
    assert_same_nested(*(_steps(m, run, 4, _use_b_every_other_step) for m, run in zip((stock, prepared), runs)))
    buffer_copying_hook.remove()
    assert_same_nested(*(_steps(m, run, 3, _use_b_every_other_step) for m, run in zip((stock, prepared), runs)))


@pytest.mark.parametrize("make", [RaisesMidway, MomentumInside, SavesMidway])
@pytest.mark.parametrize("mode", MODES)
def test_state_put_back_under_a_buffer_hook_that_stores_copies_is_stock_state(mode, make, buffer_copying_hook):
    # The other ways a computed value goes unread: an exception before the layer, originals
    # changed inside the forward (scope_nested.call_changed), a state_dict() taken before the
    # layer's read (unread.drop).
    stock, prepared = _twins(lambda: make("parametrization"), mode)
    x = torch.randn(3, 4)
    for _ in range(3):
        outs = []
        for model in (stock, prepared):
            try:
                outs.append(model(x))
            except ValueError:
                outs.append(None)
        assert_same_nested(*outs)
        assert_same_tensors(_buffers(stock), _buffers(prepared))
    if make is SavesMidway:
        for (expected, expected_then), (actual, actual_then) in zip(stock.saved, prepared.saved):
            assert_same_tensors(expected_then, actual_then)


@pytest.mark.parametrize("mode", MODES)
def test_plain_state_dict_under_a_buffer_hook_that_stores_copies_leaves_the_buffers_as_they_were(
        mode, buffer_copying_hook):
    stock, prepared = _twins(lambda: Branches("parametrization"), mode)
    x = torch.randn(3, 4)
    before = _held(prepared)
    values = _buffers(prepared)
    paramfold.plain_state_dict(prepared)
    assert all(t is before[k] for k, t in _held(prepared).items())
    assert_same_tensors(values, _buffers(prepared))
    stock.use_b = prepared.use_b = True
    assert torch.equal(stock(x), prepared(x))
    assert_same_tensors(_buffers(stock), _buffers(prepared))


def _saves_its_state(kind: str) -> nn.Module:
    layer = nn.Linear(4, 4)
    if kind == "hook":  # an eval call of the hook-based spectral_norm saves weight_u/weight_v themselves
        return nn.utils.spectral_norm(layer)
    return _norm("custom")(layer)


@pytest.mark.parametrize("how", ["eager", "torch.compile"])
@pytest.mark.parametrize("kind", ["custom", "hook"])
@pytest.mark.parametrize("mode", [*MODES, "inline"])
def test_a_graph_that_saved_a_state_buffer_survives_a_later_call_that_skips_its_layer(mode, kind, how):
    # Regression: a call that did not read the layer's value put its state back with copy_, which
    # moved the buffers' version counters where stock never touches them; an earlier call's graph
    # that saved them (gradient accumulation over two forwards, one backward) then raised
    # "modified by an inplace operation" at backward. The counters now go back with the contents.
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = _saves_its_state(kind), nn.Linear(4, 4)

        def forward(self, x, use_a):
            return self.a(x) if use_a else self.b(x)

    stock, prepared = _twins(TwoHeads, mode)
    x = torch.randn(3, 4)
    for model in (stock, prepared):
        run = _runner(model, how)
        model.eval() if kind == "hook" else model.train()
        first = run(x, True).sum()  # saves a's state
        model.train()
        (first + run(x, False).sum()).backward()  # a skipped
        model.out = first
    assert torch.equal(prepared.out, stock.out)
    assert_same_tensors(grads(stock), grads(prepared))
    assert_same_tensors(_buffers(stock), _buffers(prepared))


@pytest.mark.parametrize("mode", MODES)
def test_plain_state_dict_between_forward_and_backward_leaves_the_saved_state_usable(mode):
    # plain_state_dict runs the chain and puts its state back: the version counters too, so the
    # forward's graph, which saved the buffer, still runs its backward as stock's does.
    stock, prepared = _twins(lambda: _saves_its_state("custom"), mode)
    x = torch.randn(3, 4)
    for model in (stock, prepared):
        out = model(x).sum()
        if model is prepared:
            paramfold.plain_state_dict(model)
        else:
            model.state_dict()
        out.backward()
    assert_same_tensors(grads(stock), grads(prepared))
    assert_same_tensors(_buffers(stock), _buffers(prepared))


#: A flag none of paramfold's checks watches (a global the chain reads): the steady plan's
#: computation at the call's start raises, where the flag on the member goes the general way.
_FAILING = [False]


class RaisesOnFlag(nn.Module):
    """A parametrization that raises while its flag, or the global one, is set."""

    def __init__(self):
        super().__init__()
        self.fail = False

    def forward(self, X):
        if self.fail or _FAILING[0]:
            raise RuntimeError("chain failed")
        return X * 2


class TrainsThenRaises(nn.Module):
    """A training spectral_norm layer read before a layer whose parametrization raises (or after it)."""

    def __init__(self, kind: str, raising_first: bool = False):
        super().__init__()
        self.a = _norm(kind)(nn.Linear(4, 4))
        self.b = nn.Linear(4, 4)
        parametrize.register_parametrization(self.b, "weight", RaisesOnFlag())
        self.raising_first = raising_first

    def forward(self, x):
        if self.raising_first:
            return self.a(torch.tanh(self.b(x)))
        return self.b(torch.tanh(self.a(x)))


@pytest.fixture
def failing_flag():
    yield _FAILING
    _FAILING[0] = False


def _set_flag(where: str):
    def set_flag(model: nn.Module, on: bool) -> None:
        if where == "global":
            _FAILING[0] = on
        else:
            member = model.b.parametrizations.weight[0]
            if member.fail != on:  # written when it changes only: the calls between are steady
                member.fail = on
    return set_flag


def _steps_raising(model: nn.Module, call, set_flag, steps: int = 7, failing=(2, 3), grad: bool = True,
                   width: int = 4) -> list:
    """Training steps (``grad``) or no_grad calls from one random state, the chain raising at the
    steps in ``failing`` (the loop catches the error and goes on): outputs, buffers, gradients."""
    torch.manual_seed(1)
    record = []
    for step in range(steps):
        set_flag(model, step in failing)
        model.zero_grad()
        x = torch.randn(3, width)
        try:
            with torch.set_grad_enabled(grad):
                out = call(x)
        except RuntimeError as error:
            record.append([str(error), _buffers(model)])
            continue
        if grad:
            out.square().sum().backward()
        record.append([out, _buffers(model), grads(model)])
    return record


@pytest.mark.parametrize("raising_first", [False, True])
@pytest.mark.parametrize("where", ["attribute", "global"])
@pytest.mark.parametrize("how", ["eager", "torch.compile"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", [*MODES, "inline"])
def test_a_chain_that_raises_after_a_training_layer_leaves_its_state_as_in_stock(mode, kind, how, where,
                                                                                 raising_first, failing_flag):
    # Stock's forward reads the spectral_norm layer first (its power iteration runs), then the
    # later read raises. Until 2026-12-05 hoist and auto computed every value at the call's start,
    # where the later chain raised, and put the first layer's _u/_v back as never read: every
    # later output differed. The failing chain is now computed where it is read, for that call.
    stock, prepared = _twins(lambda: TrainsThenRaises(kind, raising_first), mode)
    set_flag = _set_flag(where)
    records = [_steps_raising(m, _runner(m, how), set_flag) for m in (stock, prepared)]
    assert records[0][2][0] == "chain failed"
    assert_same_nested(*records)


class RaisesAfterNorm(nn.Sequential):
    """Two training spectral_norm layers, the second's chain with a member after the norm that
    raises: its power iteration runs before the error. Wider than 4: a 4x4 iteration converges
    within a few steps, and one more would leave the same bits."""

    def __init__(self):
        super().__init__(spectral_norm(nn.Linear(16, 16)), nn.Tanh(), spectral_norm(nn.Linear(16, 16)))
        parametrize.register_parametrization(self[2], "weight", RaisesOnFlag())


@pytest.mark.parametrize("how", ["eager", "torch.compile"])
@pytest.mark.parametrize("mode", MODES)
def test_a_chain_raising_after_its_power_iteration_runs_it_once_per_read_as_in_stock(mode, how, failing_flag):
    # The steady plan computed it at the call's start (the iteration ran, then the member
    # raised); its state is put back before the general path computes it where it is read.
    stock, prepared = _twins(RaisesAfterNorm, mode)
    records = [_steps_raising(m, _runner(m, how), _set_flag("global"), width=16) for m in (stock, prepared)]
    assert records[0][2][0] == "chain failed"
    assert_same_nested(*records)


@pytest.mark.parametrize("mode", MODES)
def test_a_site_whose_computation_raised_is_served_as_before_once_it_stops(mode, failing_flag, monkeypatch):
    from paramfold import scope
    general = []
    open_general = scope._open_general
    monkeypatch.setattr(scope, "_open_general", lambda *args: general.append(1) or open_general(*args))
    torch.manual_seed(0)
    model = paramfold.prepare(TrainsThenRaises("parametrization"), mode)
    x = torch.randn(3, 4)
    opened = []
    for step in range(6):
        _FAILING[0] = step in (2, 3)
        general.clear()
        try:
            model(x)
        except RuntimeError:
            pass
        opened.append(len(general))
    # The first call plans; a call whose chain raises goes the general way, its site computed
    # where read, and drops the plans built without that; the next call plans again, and the
    # calls after it are steady, the site computed at the call's start as before.
    assert opened == [1, 0, 1, 1, 1, 0]
    assert not model.b.__dict__[paramfold.state.STATE_ATTR].sites["weight"].at_read


class CountsThenRaises(nn.Module):
    """A layer whose forward has a side effect (counts its calls, as a cache or a logger does),
    then a layer whose parametrization raises."""

    def __init__(self, hook: bool = False):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.utils.weight_norm(nn.Linear(4, 4)) if hook else nn.Linear(4, 4)
        if not hook:
            parametrize.register_parametrization(self.b, "weight", RaisesOnFlag())
        self.calls = 0

    def forward(self, x):
        y = self.a(x)
        self.calls += 1
        return self.b(y)


@pytest.mark.parametrize("how", ["eager", "torch.compile"])
@pytest.mark.parametrize("mode", ["freeze", "auto", "hoist"])
def test_a_frozen_value_whose_computation_raises_raises_at_its_read_as_in_stock(mode, how):
    # Stock runs the forward up to the read, which raises; the value computed at the call's
    # start raised before the forward ran (the count stayed behind) until 2026-12-05.
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(CountsThenRaises().eval().requires_grad_(False))
    stock, prepared = models[0], paramfold.prepare(models[1], mode)
    records = [_steps_raising(m, _runner(m, how), _set_flag("attribute"), grad=False) + [m.calls]
               for m in (stock, prepared)]
    assert records[0][2][0] == "chain failed"
    assert_same_nested(*records)


def _raises_where_g_is_negative(weight_norm):
    def raising(v, g, dim):
        if bool((g < 0).any()):
            raise RuntimeError("chain failed")
        return weight_norm(v, g, dim)
    return raising


def _negative_g(model: nn.Module, on: bool) -> None:
    g = model.b.weight_g
    if bool((g < 0).any()) != on:
        with torch.no_grad():
            g.neg_()


@pytest.mark.parametrize("how", ["eager", "torch.compile"])
@pytest.mark.parametrize("mode", [*MODES, "inline"])
def test_a_hook_based_norm_whose_hook_raises_after_a_training_layer_leaves_its_state_as_in_stock(mode, how,
                                                                                                  monkeypatch):
    # torch's hook-based weight_norm raising for some inputs (its op, patched to raise on a
    # negative g): the training spectral_norm read before it advances, as in stock.
    torch_weight_norm = sys.modules["torch.nn.utils.weight_norm"]
    monkeypatch.setattr(torch_weight_norm, "_weight_norm", _raises_where_g_is_negative(torch_weight_norm._weight_norm))

    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(TrainsThenRaises("parametrization"))
        models[-1].b = nn.utils.weight_norm(nn.Linear(4, 4))
    stock, prepared = models[0], paramfold.prepare(models[1], mode)
    records = [_steps_raising(m, _runner(m, how), _negative_g) for m in (stock, prepared)]
    assert records[0][2][0] == "chain failed"
    assert_same_nested(*records)


@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_a_frozen_hook_based_norm_whose_hook_raises_raises_at_its_read_as_in_stock(mode, monkeypatch):
    torch_weight_norm = sys.modules["torch.nn.utils.weight_norm"]
    monkeypatch.setattr(torch_weight_norm, "_weight_norm", _raises_where_g_is_negative(torch_weight_norm._weight_norm))
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(CountsThenRaises(hook=True).eval().requires_grad_(False))
    stock, prepared = models[0], paramfold.prepare(models[1], mode)
    records = [_steps_raising(m, m, _negative_g, grad=False) + [m.calls] for m in (stock, prepared)]
    assert records[0][2][0] == "chain failed"
    assert_same_nested(*records)


class EditsThenCalls(nn.Module):
    """Edits the raising layer's original in place inside the forward, then calls the block
    holding it (a momentum update): the call nested in the scope computes its value again."""

    def __init__(self):
        super().__init__()
        self.block = TrainsThenRaises("parametrization")

    def forward(self, x):
        with torch.no_grad():
            self.block.b.parametrizations.weight.original.mul_(0.99)
        return self.block(x)


@pytest.mark.parametrize("mode", MODES)
def test_a_call_after_one_whose_chain_raised_sees_its_originals_edited_inside_the_forward(mode, failing_flag):
    # The failing call built the block's nested check without the raising site (computed where
    # read); the next call, whose value of it was computed at its start, must not reuse that check.
    stock, prepared = _twins(EditsThenCalls, mode)
    records = [_steps_raising(m, m, _set_flag("global")) for m in (stock, prepared)]
    assert records[0][2][0] == "chain failed"
    assert_same_nested(*records)


@pytest.mark.parametrize("mode", [*MODES, "inline"])
def test_a_stateful_chain_raising_inside_parametrize_cached_raises_its_error_as_in_stock(mode, failing_flag):
    # Regression: inside parametrize.cached(), the put-back of a training stateful chain whose
    # later member raised (no value computed, nothing cached) deleted a cache entry that was not
    # there: KeyError((id(module), 'weight')) instead of the chain's error, and the buffer as
    # before the call where stock's read had updated it.
    records = []
    for prepare in (False, True):
        torch.manual_seed(0)
        layer = nn.Linear(4, 4)
        parametrize.register_parametrization(layer, "weight", RunningScale())
        parametrize.register_parametrization(layer, "weight", RaisesOnFlag())
        model = nn.Sequential(layer, nn.Linear(4, 4)).train()
        if prepare:
            paramfold.prepare(model, mode)
        record = [model(torch.randn(2, 4))]
        _FAILING[0] = True
        with pytest.raises(RuntimeError, match="chain failed"), parametrize.cached():
            model(torch.randn(2, 4))
        _FAILING[0] = False
        with parametrize.cached():
            record.append(model(torch.randn(2, 4)))
        record.append(_buffers(model))
        records.append(record)
    assert_same_nested(*records)


class WritesStateOfB(Branches):
    """Writes the skipped layer's state itself (loads another), then calls the other layer."""

    def forward(self, x):
        for buffer in self.b.buffers():
            buffer.fill_(0.5)
        return self.a(x)


@pytest.mark.filterwarnings("ignore:.*torch.nn.utils.weight_norm.*is deprecated")
@pytest.mark.parametrize("make", [Branches, MomentumInside, WritesStateOfB])
@pytest.mark.parametrize("kind", [*KINDS, "custom"])
@pytest.mark.parametrize("mode", [*MODES, "inline"])
def test_a_training_stateful_chain_of_inference_tensors_keeps_its_state_as_in_stock(mode, kind, make):
    # Regression: built inside torch.inference_mode(), its state tensors have no version counter;
    # hoist and auto raised "RuntimeError: Inference tensors do not track version counter" where
    # stock ran. Outside inference mode stock's power iteration raises torch's own error.
    def build() -> nn.Module:
        torch.manual_seed(0)
        with torch.inference_mode():
            return make(kind)

    stock, prepared = build(), paramfold.prepare(build(), mode)
    assert all(b.is_inference() for b in prepared.buffers())
    x = torch.randn(3, 4)
    with torch.inference_mode():
        for step in range(4):
            _use_b_every_other_step(stock, step), _use_b_every_other_step(prepared, step)
            assert torch.equal(stock(x), prepared(x)), step
            assert_same_tensors(stock.state_dict(), prepared.state_dict(), step)
    with torch.no_grad():
        for model in (stock, prepared):
            with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
                model(x)
    assert_same_tensors(stock.state_dict(), prepared.state_dict())


class _Rounding(torch.utils._python_dispatch.TorchDispatchMode):
    """A user's mode that changes results: every new float tensor rounded to 1/64."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.is_floating_point() and not func._schema.is_mutable and not out._is_view():
            return (out * 64).round() / 64
        return out


class _RoundingFunctions(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.is_floating_point() and func is not torch.Tensor.copy_:
            return (out * 64).round() / 64
        return out


@pytest.mark.parametrize("user_mode", [_Rounding, _RoundingFunctions], ids=["dispatch-mode", "function-mode"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES)
def test_a_layer_skipped_in_a_call_under_a_users_mode_keeps_its_state_as_in_stock(mode, kind, user_mode):
    # Regression: the copy of the skipped layer's _u/_v taken before the scope computed its
    # value ran under the user's mode, which rounded it, and the rounded copy was put back.
    stock, prepared = _twins(lambda: Branches(kind), mode)
    x = torch.randn(3, 4)
    for model in (stock, prepared):
        model.use_b = True
        model(x)
        model.use_b = False
        with user_mode():
            model(x)  # b's value unread
        model.use_b = True
    assert_same_tensors(_buffers(stock), _buffers(prepared))
    assert torch.equal(stock(x), prepared(x))
