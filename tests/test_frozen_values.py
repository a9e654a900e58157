"""A value kept across calls (freeze's and auto's frozen values) is never served stale.

Every kind of write to its inputs is seen (in place, ``.data``, numpy, ``load_state_dict``,
optimizer steps, dtype moves, a write to a wrapper subclass original's inner tensor), a read
between calls never gets the value kept for the next call, a tensor put in a module's ``__dict__``
under the parametrized name is ignored as stock ignores it, a kept view of an original does not
block swapping it, a value that is a view of its original requires grad as stock's read does, and
steady calls over a wrapper subclass original compute nothing. Compared with stock bitwise (eager
on CPU, and compiled with the eager backend).
"""

from __future__ import annotations

import pytest
import torch
from helpers import _inference, _Transposed, _wn_pair
from torch import nn
from torch._dynamo.testing import CompileCounter
from torch.nn.utils import parametrize as P
from torch.nn.utils.parametrizations import orthogonal

import paramfold


def _wn0(m):
    return m[0].parametrizations.weight


WRITES = {
    "data_mul": lambda m: _wn0(m).original0.data.mul_(0.5),
    "data_add": lambda m: m[2].parametrizations.weight.original.data.add_(0.25),
    "u_data_copy": lambda m: m[2].parametrizations.weight[0]._u.data.copy_(torch.ones(4) / 2),
    "copy_no_grad": lambda m: _no_grad(lambda: _wn0(m).original0.copy_(torch.full((4, 1), 0.3))),
    "init_uniform": lambda m: _seeded(lambda: nn.init.uniform_(_wn0(m).original1)),
    "init_on_data": lambda m: _seeded(lambda: nn.init.normal_(_wn0(m).original1.data)),
    "lerp": lambda m: _no_grad(lambda: _wn0(m).original1.lerp_(torch.ones(4, 4), 0.25)),
    "foreach_lerp": lambda m: _no_grad(
        lambda: torch._foreach_lerp_(list(_wn0(m).parameters()), [torch.ones_like(p) for p in _wn0(m).parameters()], 0.5)
    ),
    "numpy": lambda m: _wn0(m).original0.detach().numpy().__imul__(3.0),
    "load_state_dict": lambda m: m.load_state_dict({k: v * 1.5 for k, v in m.state_dict().items()}),
    "set_data": lambda m: setattr(_wn0(m).original1, "data", torch.full((4, 4), 0.7)),
}


def _no_grad(fn):
    with torch.no_grad():
        return fn()


def _seeded(fn):
    torch.manual_seed(7)
    return fn()


@pytest.mark.parametrize("mode", ["freeze", "auto"])
@pytest.mark.parametrize("write", sorted(WRITES))
def test_frozen_values_see_every_kind_of_write(mode, write):
    stock, ours = _wn_pair()
    paramfold.prepare(ours, mode)
    x = torch.randn(2, 4)
    assert torch.equal(ours(x), stock(x))  # materialised
    before = stock(x)
    WRITES[write](stock)
    WRITES[write](ours)
    assert not torch.equal(stock(x), before)  # the write matters
    assert torch.equal(ours(x), stock(x))
    assert torch.equal(ours[0].weight, stock[0].weight)
    compiled = torch.compile(ours, backend="eager")
    assert torch.equal(compiled(x), stock(x))


@pytest.mark.parametrize("mode", ["freeze", "auto"])
@pytest.mark.parametrize("write", ["data_mul", "numpy", "load_state_dict", "set_data", "u_data_copy"])
def test_reads_between_calls_never_see_the_value_kept_for_the_next_call(mode, write):
    # A frozen value stays in its module's __dict__ after a call; reads before the next call, eager
    # or compiled without a scope (dynamo inlining the model), must still give stock's value.
    stock, ours = _wn_pair()
    paramfold.prepare(ours, mode)
    x = torch.randn(2, 4)
    ours(x)
    assert "weight" in vars(ours[0])  # kept
    WRITES[write](stock)
    WRITES[write](ours)
    assert torch.equal(ours[0].weight, stock[0].weight)
    assert torch.equal(ours[2].weight, stock[2].weight)
    assert torch.equal(ours[0](x), stock[0](x))
    torch._dynamo.reset()
    inlined = torch.compile(lambda t: ours(t), backend="eager")
    assert torch.equal(inlined(x), stock(x))
    WRITES[write](stock)
    WRITES[write](ours)
    assert torch.equal(inlined(x), stock(x))
    assert torch.equal(ours(x), stock(x))


#: Ways to put a tensor in a module's instance ``__dict__`` under its parametrized name.
PUTS = {"item": lambda m, t: m.__dict__.__setitem__("weight", t), "update": lambda m, t: vars(m).update(weight=t)}


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("put", sorted(PUTS))
@pytest.mark.parametrize("mode", ["hoist", "freeze", "auto"])
def test_a_tensor_put_in_a_module_dict_under_its_parametrized_name_is_ignored_like_stock(mode, put, compiled):
    # Regression: stock's class property hides such an entry from every read and its __dict__
    # keeps it. Once the model had its steady plan, freeze and auto served it at every later call
    # (the plan checked the kept value's identity once, when it was built); under hoist a read
    # between calls returned it; and restore dropped it from __dict__.
    stock, ours = _wn_pair()
    paramfold.prepare(ours, mode)
    run = torch.compile(ours, backend="eager") if compiled else ours
    x = torch.randn(2, 4)
    planted = [torch.zeros(4, 4), torch.zeros(4, 4)]
    with torch.no_grad():
        for _ in range(5):  # its steady state
            assert torch.equal(run(x), stock(x))
        for step in range(3):
            for model, t in zip((stock, ours), planted):
                PUTS[put](model[0], t)
            assert torch.equal(run(x), stock(x)), step
            assert torch.equal(run(x), stock(x)), step
        for model, t in zip((stock, ours), planted):
            PUTS[put](model[0], t)
        assert torch.equal(ours[0].weight, stock[0].weight)  # read between calls
        assert torch.equal(ours[2].weight, stock[2].weight)
        assert torch.equal(run(x), stock(x))
    paramfold.restore(ours)
    assert vars(ours[0])["weight"] is planted[1] and vars(stock[0])["weight"] is planted[0]
    assert "weight" not in vars(ours[2]) and "weight" not in vars(stock[2])
    assert torch.equal(ours(x), stock(x))


def test_frozen_values_see_optimizer_steps_and_dtype_moves():
    stock, ours = _wn_pair()
    paramfold.prepare(ours, "auto")
    x = torch.randn(2, 4)
    ours(x)
    for model in (stock, ours):
        model.requires_grad_(True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (stock, ours)]
    for model, opt in zip((stock, ours), opts):
        model(x).sum().backward()
        opt.step()
        model.requires_grad_(False)
    assert torch.equal(ours(x), stock(x))
    stock.double(), ours.double()
    assert torch.equal(ours(x.double()), stock(x.double()))
    stock.half(), ours.half()
    assert torch.equal(ours(x.half()), stock(x.half()))


@pytest.mark.parametrize("mode", ["freeze", "auto"])
@pytest.mark.parametrize("event", ["to", "load_state_dict", "assign"])
def test_a_kept_view_of_an_original_does_not_block_swapping_it(mode, event):
    # Regression: a frozen value kept between calls that was a view of its original held that
    # original (as a view's base), so torch.utils.swap_tensors refused to swap it: with
    # torch.__future__.set_swap_module_params_on_conversion(True), module.to(), load_state_dict
    # and an assignment through the parametrization raised RuntimeError where stock works.
    models = []
    for prepare in (False, True):
        torch.manual_seed(0)
        layer = nn.Linear(3, 2)
        P.register_parametrization(layer, "weight", _Transposed(), unsafe=True)
        layer.eval().requires_grad_(False)
        models.append(paramfold.prepare(layer, mode) if prepare else layer)
    x = torch.randn(2, 3)
    new_state = {k: v + 1 for k, v in models[0].state_dict().items()}
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(models[1](x), models[0](x))
            for layer in models:
                if event == "to":
                    layer.to(torch.float64)
                elif event == "load_state_dict":
                    layer.load_state_dict(new_state)
                else:
                    layer.weight = torch.full((2, 3), 0.5)
            x = x.to(models[0].bias.dtype)
            for _ in range(2):
                assert torch.equal(models[1](x), models[0](x))
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


class _Sliced(nn.Module):
    def forward(self, w):
        return w[:]


class _SeesItsWeight(nn.Module):
    """Notes what its forward finds ``lin.weight`` to be: what dynamo specialises on."""

    def __init__(self, chain: nn.Module | None) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3) if chain is None else nn.Linear(3, 4)
        if chain is None:
            orthogonal(self.lin)  # householder on the non-square weight: its value is a view (Q.mT)
        else:
            P.register_parametrization(self.lin, "weight", chain, unsafe=True)
        self.seen = []

    def forward(self, x):
        w = self.lin.weight
        if not torch.compiler.is_compiling():
            self.seen.append((w.requires_grad, w.is_leaf, w.grad_fn is None))
        return torch.tanh(x @ w.T + self.lin.bias)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("chain", ["transposed", "sliced", "orthogonal"])
def test_an_auto_value_that_is_a_view_of_its_original_requires_grad_as_stocks_no_grad_read(chain, compiled):
    # Regression (found by a probe, 2026-12-07): under no_grad, stock's read of a chain whose value
    # is a view of a leaf original that requires grad (w.T, w[:]) is a leaf that requires grad.
    # auto froze it detached (requires_grad=False), and once weights changing between calls
    # made it compute the value at every call, served stock's view: the forward saw
    # requires_grad flip, and a compiled model recompiled on it (2 graphs where stock makes 1).
    make = {"transposed": _Transposed, "sliced": _Sliced, "orthogonal": lambda: None}[chain]
    models = []
    for prepare in (False, True):
        torch.manual_seed(0)
        model = _SeesItsWeight(make()).eval()
        models.append(paramfold.prepare(model, "auto") if prepare else model)
    counters = [CompileCounter() for _ in models]
    calls = [torch.compile(m, backend=c) if compiled else m for m, c in zip(models, counters)]
    x = torch.randn(2, 3 if chain != "orthogonal" else 4)
    with torch.no_grad():
        for i in range(8):
            if 2 <= i <= 6:  # an EMA-like update before each of five calls in a row, then none
                for m in models:
                    for p in m.lin.parametrizations.weight.parameters():
                        p.add_(0.01)
            assert torch.equal(calls[1](x), calls[0](x)), i
    if compiled:
        assert counters[1].frame_count == counters[0].frame_count == 1
    else:
        assert models[1].seen == models[0].seen


class _TwoSum(nn.Module):
    """Reads a ``TwoTensor`` original's inner tensors (a QLoRA base's ``dequantize()`` does the like)."""

    def forward(self, w):
        a = w.a.a + w.a.b if isinstance(w.a, type(w)) else w.a
        return a + 2 * w.b


def _two_tensor_layer(kind: str) -> nn.Module:
    from torch.testing._internal.two_tensor import TwoTensor

    class SlotTwo(TwoTensor):
        __slots__ = ("b",)  # an inner tensor outside the wrapper's __dict__

    torch.manual_seed(0)
    layer = nn.Linear(4, 4)
    w = layer.weight.detach()
    if kind == "nested":
        base = TwoTensor(TwoTensor(w.clone(), w * 3), w * 5)
    else:
        base = (SlotTwo if kind == "slot" else TwoTensor)(w.clone(), w * 2)
    layer.weight = nn.Parameter(base, requires_grad=False)
    P.register_parametrization(layer, "weight", _TwoSum(), unsafe=True)
    return _inference(layer)


INNER_WRITES = {
    "in_place": lambda w, step: w.b.mul_(1.5),
    "reassigned": lambda w, step: setattr(w, "b", torch.full((4, 4), 0.25 * step)),
    "through_data": lambda w, step: w.b.data.add_(0.5),
    "data_set": lambda w, step: setattr(w.b, "data", torch.full((4, 4), -0.5 * step)),
    "nested_in_place": lambda w, step: w.a.b.add_(0.125),
    "slot_reassigned": lambda w, step: setattr(w, "b", torch.full((4, 4), 0.25 * step)),
}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("check", ["version", "content"])
@pytest.mark.parametrize("write", sorted(INNER_WRITES))
@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_a_write_to_a_wrapper_subclass_originals_inner_tensor_is_seen(mode, write, check, compiled):
    # Regression: a wrapper subclass original (torchao's Int8Tensor, NF4Tensor; TwoTensor here)
    # was watched by its own identity, version and description only: an in-place edit,
    # reassignment or .data write of one of its inner tensors left the old frozen value served.
    kind = write.split("_")[0] if write.startswith(("nested", "slot")) else "flat"
    stock, ours = _two_tensor_layer(kind), paramfold.prepare(_two_tensor_layer(kind), mode, freeze_check=check)
    run = torch.compile(ours, backend="eager") if compiled else ours
    x = torch.randn(3, 4)
    with torch.no_grad():
        for step in range(1, 4):
            assert torch.equal(run(x), stock(x)), step
            run(x)  # a steady call between the writes
            before = stock(x)
            for model in (stock, ours):
                INNER_WRITES[write](model.parametrizations.weight.original, step)
            assert not torch.equal(stock(x), before)  # the write matters
        assert torch.equal(run(x), stock(x))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_steady_calls_over_a_wrapper_subclass_original_compute_nothing(compiled, monkeypatch):
    # What watching the inner tensors must not cost: no write, no recomputation.
    from paramfold import freeze

    computed = []
    real = freeze.compute
    monkeypatch.setattr(freeze, "compute", lambda *a: computed.append(a) or real(*a))
    ours = paramfold.prepare(_two_tensor_layer("flat"), "freeze")
    run = torch.compile(ours, backend="eager") if compiled else ours
    x = torch.randn(3, 4)
    with torch.no_grad():
        for _ in range(4):
            run(x)
    assert len(computed) == 1
