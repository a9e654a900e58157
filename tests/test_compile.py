"""Deterministic proxies under torch.compile: graphs, graph breaks, recompiles, captured ops.

Compiled results are compared with stock eager: bitwise with backend="eager" (the captured graph
runs the same ops one by one), within float32 round-off (atol=rtol=1e-6) with "aot_eager",
whose decompositions may reorder arithmetic.
"""

from __future__ import annotations

import copy
import functools
import inspect
import sys
import threading
import time
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from helpers import ALL_MODES, _inference, build, grads, seed_model, small_net
from torch import nn
from torch._dynamo.testing import CompileCounter
from torch.func import functional_call, jacfwd, jvp
from torch.nn.utils.parametrizations import weight_norm

import paramfold


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


class GraphCapture(CompileCounter):
    """A CompileCounter that also keeps each captured FX graph's ops."""

    def __init__(self):
        super().__init__()
        self.ops: list[list[tuple[str, str]]] = []

    def __call__(self, gm, example_inputs):
        self.ops.append(
            [(n.op, str(n.target)) for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
        )
        return super().__call__(gm, example_inputs)


def _compile(model, entry, backend):
    if entry == "model":
        return torch.compile(model, backend=backend, fullgraph=True)
    if entry == "method":
        model.compile(backend=backend, fullgraph=True)
        return model
    for layer in model.layers:
        layer.compile(backend=backend, fullgraph=True)
    return model


def _run(model, x, train):
    if train:
        out = model(x)
        out.sum().backward()
        return out
    with torch.no_grad():
        return model(x)


def _x():
    return torch.randn(4, 32, generator=torch.Generator().manual_seed(123))


def _graphs(kind, mode, entry, train, calls=2):
    model = build(kind, blocks=True)
    if mode == "freeze":
        model.eval().requires_grad_(False)
    if mode is not None:
        paramfold.prepare(model, mode)
    counter = GraphCapture()
    compiled = _compile(model, entry, counter)
    x = _x()
    for _ in range(calls):
        out = _run(compiled, x, train)
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    return counter, breaks, out


@pytest.mark.parametrize("entry", ["model", "method", "layers"])
@pytest.mark.parametrize("mode", ["hoist", "inline", "auto", "freeze"])
def test_same_graph_count_and_no_breaks_as_unparametrized(entry, mode):
    train = mode != "freeze"
    plain, plain_breaks, _ = _graphs("plain", None, entry, train)
    ours, our_breaks, out = _graphs("weight_norm", mode, entry, train)
    assert (ours.frame_count, our_breaks) == (plain.frame_count, plain_breaks) == (plain.frame_count, 0)
    stock = build("weight_norm", blocks=True)
    if mode == "freeze":
        stock.eval().requires_grad_(False)
    assert torch.equal(out, _run(stock, _x(), train))


def _reader(model, x):
    # A frame dynamo runs eagerly (as it does a user's frame it falls back on), reading a
    # parametrized tensor outside any call scope too: the frames it calls are compiled one by one.
    return model(x) + model.layers[0].proj.weight.sum()


torch._dynamo.eval_frame.skip_code(_reader.__code__)


def _frames_traced(kind, mode, entry):
    model = build(kind, blocks=True)
    if mode is not None:
        paramfold.prepare(model, mode)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    if entry == "reader":
        run = functools.partial(torch.compile(_reader, backend="eager"), model)
    elif entry == "model":
        run = torch.compile(model, backend="eager")  # without fullgraph, as most users call it
    else:
        run = _compile(model, entry, "eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for train in (True, True, False, False):
            _run(run, _x(), train)
    frames = torch._dynamo.utils.counters["frames"]["total"]
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    return frames, breaks, [str(w.message)[:120] for w in caught]


class _Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.s = 1.5

    def forward(self, b):
        return b * self.s


class _Raises(nn.Module):
    """Calls a prepared child, then a layer with a training spectral_norm and a custom chain,
    then raises: the scope's nested checks and the error path run from frames dynamo met."""

    def __init__(self):
        super().__init__()
        self.inner = build("weight_norm", blocks=True)
        self.sn = torch.nn.utils.parametrizations.spectral_norm(nn.Linear(32, 32))
        torch.nn.utils.parametrize.register_parametrization(self.sn, "bias", _Scale())

    def forward(self, x):
        y = self.sn(self.inner(x))
        if self.training or not self.training:
            raise ValueError("boom")
        return y


@pytest.mark.parametrize("mode", ["hoist", "auto", "inline"])
def test_a_compiled_forward_that_raises_traces_no_frame_of_paramfold_s_own(mode):
    # Regression: paramfold.held (the nested checks' listing of what a member holds) was not
    # registered to run eagerly: dynamo traced it as a frame and warned about its lru_cache.
    def frames(prepared):
        torch.manual_seed(0)
        model = _Raises()
        if prepared:
            paramfold.prepare(model, mode)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        run = torch.compile(model, backend="eager")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for train in (True, False, False):
                model.train(train)
                with pytest.raises(ValueError, match="boom"), torch.set_grad_enabled(train):
                    run(_x())
        return torch._dynamo.utils.counters["frames"]["total"], [str(w.message)[:120] for w in caught]

    plain_frames, plain_warnings = frames(False)
    ours, warned = frames(True)
    assert warned == plain_warnings == []
    assert ours <= plain_frames  # 11 against 5 before: paramfold.held's functions traced one by one


@pytest.mark.parametrize("entry", ["model", "method", "layers", "reader"])
@pytest.mark.parametrize("mode", ["hoist", "auto", "inline"])
def test_dynamo_traces_no_frame_of_paramfold_s_own(entry, mode):
    # Regression: frames of paramfold's helpers called from an eagerly run frame (the scope's
    # cache check, the descriptor's checkpoint test, compute's comprehension) were traced one by
    # one on the first call, compile time the plain model does not pay; the checkpoint test's
    # builtin broke its graph with a UserWarning.
    plain = _frames_traced("plain", None, entry)
    assert _frames_traced("weight_norm", mode, entry) == plain == (plain[0], 0, [])


def test_stock_per_layer_compile_recompiles_per_layer_but_prepared_does_not():
    stock, _, _ = _graphs("weight_norm", None, "layers", train=False, calls=1)
    ours, _, _ = _graphs("weight_norm", "hoist", "layers", train=False, calls=1)
    plain, _, _ = _graphs("plain", None, "layers", train=False, calls=1)
    assert stock.frame_count == 3  # one per-instance Parametrized class per layer
    assert ours.frame_count == plain.frame_count == 1


@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm", "orthogonal:householder", "chain"])
def test_freeze_captures_exactly_the_baseline_ops(kind):
    plain, _, _ = _graphs("plain", None, "model", train=False, calls=1)
    frozen, _, _ = _graphs(kind, "freeze", "model", train=False, calls=1)
    hoisted, _, _ = _graphs(kind, "hoist", "model", train=False, calls=1)
    stock, _, _ = _graphs(kind, None, "model", train=False, calls=1)
    assert frozen.ops == plain.ops == hoisted.ops
    assert len(stock.ops[0]) > len(plain.ops[0])  # stock traces the parametrization math


@pytest.mark.parametrize("entry", ["model", "method", "layers"])
@pytest.mark.parametrize("mode", ["hoist", "inline"])
def test_compiled_spectral_norm_training_matches_stock(entry, mode):
    stock = build("spectral_norm", blocks=True)
    ours = copy.deepcopy(stock)
    paramfold.prepare(ours, mode)
    compiled = _compile(ours, entry, "aot_eager")
    opt_s = torch.optim.SGD(stock.parameters(), lr=0.05)
    opt_o = torch.optim.SGD(ours.parameters(), lr=0.05)
    x = torch.randn(6, 32)
    for _ in range(3):
        out_s, out_o = _run(stock, x, True), _run(compiled, x, True)
        assert torch.equal(out_o, out_s)  # aot_eager runs the same ATen ops: bitwise
        _assert_same_tensors(grads(ours), grads(stock))
        _assert_same_tensors(dict(ours.named_buffers()), dict(stock.named_buffers()))
        opt_s.step(), opt_o.step()
        opt_s.zero_grad(), opt_o.zero_grad()


@pytest.mark.parametrize("mode", ["hoist", "freeze", "inline"])
def test_seed_model_compiled_eager_backend_is_bitwise(mode):
    stock = seed_model()
    ours = copy.deepcopy(stock)
    if mode == "freeze":
        ours.requires_grad_(False)
    paramfold.prepare(ours, mode)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(torch.compile(ours, backend="eager", fullgraph=True)(x), stock(x))


def test_prepared_root_inside_a_bigger_compiled_model_is_still_correct():
    # The prepared model is only a submodule of what gets compiled: no scope opens, values are
    # computed in-graph by the descriptor, so results stay right (at stock-like compile cost).
    inner = build("spectral_norm")
    stock_inner = copy.deepcopy(inner)
    paramfold.prepare(inner, "hoist")
    outer = torch.nn.Sequential(inner, torch.nn.ReLU())
    stock = torch.nn.Sequential(stock_inner, torch.nn.ReLU())
    compiled = torch.compile(outer, backend="aot_eager")
    x = torch.randn(3, 32)
    for _ in range(2):
        assert torch.equal(compiled(x), stock(x))
    _assert_same_tensors(dict(inner.named_buffers()), dict(stock_inner.named_buffers()))


@pytest.mark.parametrize("mode", ["auto", "hoist", "freeze", "inline"])
def test_copies_of_a_prepared_model_share_the_graph_of_a_function_compiled_around_them_like_stock(mode):
    # Regression: in a compiled function taking the model as an argument (TRL's scoring of a
    # reward ensemble), dynamo traced the entries' _compiled_call_impl, whose check of this
    # thread's open scopes guarded on each module's identity: a graph per copy (4 for 4 copies,
    # 8 and dynamo's recompile limit for 10), where stock's copies share one.
    torch.manual_seed(0)
    base = nn.Sequential(nn.Sequential(weight_norm(nn.Linear(4, 4)), nn.Tanh()), weight_norm(nn.Linear(4, 2)))
    base.eval().requires_grad_(False)
    counts = []
    for prepared in (False, True):
        models = [copy.deepcopy(base) for _ in range(4)]
        if prepared:
            for model in models:
                paramfold.prepare(model, mode)
        torch._dynamo.reset()
        counter = CompileCounter()
        score = torch.compile(lambda model, x: model(x).sum(-1), backend=counter)
        x = torch.randn(3, 4)
        with torch.no_grad():
            for _ in range(2):
                for model in models:
                    assert torch.equal(score(model, x), base(x).sum(-1))
        counts.append(counter.frame_count)
    assert counts == [1, 1]


class _CountingRuns:
    """A backend that counts the graphs it compiles and each run of them."""

    def __init__(self) -> None:
        self.compiles = self.runs = 0

    def __call__(self, gm, example_inputs):
        self.compiles += 1

        def run(*args):
            self.runs += 1
            return gm.forward(*args)

        return run


@pytest.mark.parametrize("change", ["restore", "remove"])
def test_a_wrapper_made_while_prepared_runs_compiled_code_once_the_root_is_plain_again(change):
    # Regression: torch.compile(model) of a root whose forward is torch's (nn.Sequential,
    # nn.Linear) made while prepared binds the root's call; once restored (or its last
    # parametrization removed, unwrapping its class) every frame of its calls was one dynamo
    # skips, so they ran uncompiled, where stock's wrapper runs its graph.
    torch.manual_seed(0)
    layer = weight_norm(nn.Linear(4, 6))
    stock = (nn.Sequential(layer, nn.Tanh()) if change == "restore" else layer).eval()  # removed: the root's own
    ours = paramfold.prepare(copy.deepcopy(stock), "auto")
    x = torch.randn(3, 4)
    backends = _CountingRuns(), _CountingRuns()
    theirs, mine = (torch.compile(m, backend=b) for m, b in zip((stock, ours), backends))
    with torch.no_grad():
        assert torch.equal(mine(x), theirs(x))
        if change == "restore":
            paramfold.restore(ours)
        else:
            for model in (stock, ours):
                torch.nn.utils.parametrize.remove_parametrizations(model, "weight")
        runs = [b.runs for b in backends]
        for _ in range(3):
            assert torch.equal(mine(x), theirs(x))
    assert [b.runs - r for b, r in zip(backends, runs)] == [3, 3]


def _assert_same_tensors(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name, e in expected.items():
        a = actual[name]
        assert (a is None and e is None) or torch.equal(a, e), name


def test_hoisted_values_never_leak_outside_a_call():
    model = paramfold.prepare(build("weight_norm"), "hoist")
    model(torch.randn(2, 32))
    assert all("weight" not in layer.__dict__ for layer in model.layers)
    assert model.layers[0].weight.grad_fn is not None  # read outside a call: computed fresh, like stock


def test_detach_params_under_no_grad_lets_frozen_and_trainable_copies_share_graphs():
    def run(detach):
        torch._dynamo.reset()
        trainable = build("plain", blocks=True)
        frozen = build("plain", blocks=True).requires_grad_(False)
        counter = CompileCounter()
        for model in (trainable, frozen):
            paramfold.prepare(model, detach_params_under_no_grad=detach)
            for layer in model.layers:
                layer.compile(backend=counter)
        x = torch.randn(4, 32)
        with torch.no_grad():
            outs = [trainable(x), frozen(x)]
        return counter.frame_count, outs

    stock_frames, _ = run(False)
    frames, (a, b) = run(True)
    assert stock_frames == 2  # requires_grad mismatch on the layer's parameters
    assert frames == 1
    assert torch.equal(a, b)


class GradStepInside(nn.Module):
    """A forward that re-enables grad around a plain submodule (a test-time adaptation step inside
    an inference call): ``autograd.grad`` w.r.t. its weight, and a ``backward()`` that accumulates
    its gradients; or that calls it through ``functional_call`` with another weight."""

    def __init__(self, swap: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.a = weight_norm(nn.Linear(4, 4))
        self.lin = nn.Linear(4, 2)  # plain: presented detached under no_grad
        self.swap = swap

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.swap:
            return functional_call(self.lin, {"weight": self.lin.weight * 2}, (h,)), self.lin(h)
        with torch.enable_grad():
            y = self.lin(h)
            g = torch.autograd.grad(y.pow(2).sum(), self.lin.weight)[0]
            self.lin(h.detach().requires_grad_()).pow(2).sum().backward()
        return self.lin(h), y, g


def _grad_step_twins(mode, swap=False):
    stock = GradStepInside(swap).eval()
    if mode == "freeze":
        stock.a.requires_grad_(False)
    return stock, paramfold.prepare(copy.deepcopy(stock), mode, detach_params_under_no_grad=True)


@pytest.mark.parametrize("swap", [False, True], ids=["enable_grad", "functional_call"])
@pytest.mark.parametrize("mode", ["hoist", "inline", "auto", "freeze"])
def test_detach_params_under_no_grad_a_module_called_in_the_forward_reads_stocks_parameters(mode, swap):
    # Regression: the option's detached parameters stayed in __dict__ for the whole no_grad call:
    # a module called in an enable_grad region of its forward read them (autograd.grad raised
    # "element 0 of tensors does not require grad", backward() left lin.weight.grad None), and one
    # called through functional_call read them instead of the weight it was given.
    stock, ours = _grad_step_twins(mode, swap)
    x = torch.randn(3, 4)
    for _ in range(2):
        with torch.no_grad():
            expected, actual = stock(x), ours(x)
        assert all(map(torch.equal, actual, expected))
        for (name, a), b in zip(stock.named_parameters(), ours.parameters()):
            assert (a.grad is None) == (b.grad is None), name
            assert a.grad is None or torch.equal(a.grad, b.grad), name


@pytest.mark.parametrize("mode", [
    pytest.param(m, marks=pytest.mark.xfail(strict=True, raises=RuntimeError, reason=(
        "documented limit (README, Notes and limits, detach_params_under_no_grad): inside compiled "
        "code a module called in an enable_grad region of a no_grad call reads the detached "
        "parameters of the call's start")))
    for m in ("hoist", "inline", "auto", "freeze")
])
def test_compiled_detach_params_under_no_grad_enable_grad_region(mode):
    stock, ours = _grad_step_twins(mode)
    x = torch.randn(3, 4)
    with torch.no_grad():
        expected = stock(x)
        actual = torch.compile(ours, backend="eager")(x)
    assert all(map(torch.equal, actual, expected))


@pytest.mark.parametrize("how", ["make_dual", "jvp", "jacfwd"])
@pytest.mark.parametrize("mode", ["hoist", "inline", "auto", "freeze"])
def test_detach_params_under_no_grad_keeps_forward_mode_derivatives_of_plain_parameters(mode, how):
    # Regression: the option presented a dual parameter (or torch.func's jvp wrapper) that
    # functional_call swapped in as param.detach(), which drops its tangent: None or zero.
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), weight_norm(nn.Linear(4, 2))).eval().requires_grad_(False)

    stock, ours = build(), paramfold.prepare(build(), mode, detach_params_under_no_grad=True)
    x = torch.randn(3, 4)
    outs = []
    for model in (stock, ours):
        p = model[0].weight.detach().clone()
        f = lambda q, m=model: functional_call(m, {"0.weight": q}, (x,))  # noqa: E731
        with torch.no_grad():
            if how == "make_dual":
                with fwAD.dual_level():
                    outs.append(list(fwAD.unpack_dual(f(fwAD.make_dual(p, torch.ones_like(p))))))
            elif how == "jvp":
                outs.append(list(jvp(f, (p,), (torch.ones_like(p),))))
            else:
                outs.append([jacfwd(f)(p)])
    assert all(map(torch.equal, *outs))


@pytest.mark.parametrize("mode", ["auto", "hoist"])
def test_frozen_and_trainable_parametrized_copies_share_graphs_under_no_grad(mode):
    # Every tensor of these layers is parametrized: hoisted (or frozen) values computed under
    # no_grad have requires_grad=False whichever model they come from.
    def frames(prepare):
        torch._dynamo.reset()
        counter = CompileCounter()
        trainable, frozen = build("chain", blocks=True), build("chain", blocks=True).requires_grad_(False)
        for model in (trainable, frozen):
            if prepare:
                paramfold.prepare(model, mode)
            for layer in model.layers:
                layer.compile(backend=counter)
        with torch.no_grad():
            out = [trainable(_x()), frozen(_x())]
        return counter.frame_count, out

    stock_frames, _ = frames(False)
    ours, (a, b) = frames(True)
    assert stock_frames > 1
    assert ours == 1
    assert torch.equal(a, b)


@pytest.mark.parametrize("entry", ["model", "layers"])
def test_inline_sees_originals_replaced_by_load_state_dict_assign(entry):
    stock = build("weight_norm", blocks=True)
    ours = paramfold.prepare(build("weight_norm", seed=5, blocks=True), "inline")
    compiled = _compile(ours, entry, "eager")
    with torch.no_grad():
        compiled(_x())
        ours.load_state_dict(stock.state_dict(), assign=True)  # new Parameter objects
        assert torch.equal(compiled(_x()), stock(_x()))
        assert torch.equal(ours.layers[1].proj.weight, stock.layers[1].proj.weight)


def _hooked_pair(mode: str, hook: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    from torch.nn.utils.parametrizations import weight_norm

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(weight_norm(torch.nn.Linear(8, 16)), torch.nn.ReLU(),
                                    weight_norm(torch.nn.Linear(16, 4))).eval()
        if hook != "global":
            register = model[2].register_forward_hook if hook == "forward" else model[2].register_forward_pre_hook
            register(lambda *args: None)  # an activation logger, accelerate's or PEFT's hooks
        return model.requires_grad_(mode != "freeze")

    return make(), paramfold.prepare(make(), mode)


@pytest.mark.parametrize("hook", ["forward", "forward_pre", "global"])
@pytest.mark.parametrize("mode", ["hoist", "inline", "freeze", "auto"])
def test_a_hooked_prepared_submodule_compiles_as_often_as_stock(mode, hook):
    # Regression: dynamo traces a hooked submodule's call through _wrapped_call_impl, which read
    # paramfold's _compiled_call_impl property on, putting guards on the scope's bookkeeping: one
    # more graph than stock, then one per load_state_dict(assign=True) or functional_call with
    # new tensors (in any prepared model), up to the recompile limit.
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *args: None) if hook == "global" else None
    try:
        counts = []
        for model in _hooked_pair(mode, hook):
            torch._dynamo.reset()
            counter = CompileCounter()
            compiled = torch.compile(model, backend=counter)
            outs = []
            with torch.no_grad():
                for i in range(6):
                    model.load_state_dict({k: v * (1 + 0.01 * i) for k, v in model.state_dict().items()}, assign=True)
                    outs.append(compiled(torch.randn(3, 8, generator=torch.Generator().manual_seed(i))))
                    params = {k: v + 1 for k, v in model.named_parameters()}
                    outs.append(torch.func.functional_call(compiled, params, (torch.ones(3, 8),)))
            counts.append((counter.frame_count, outs))
    finally:
        if handle is not None:
            handle.remove()
    (stock_frames, stock_outs), (frames, outs) = counts
    assert frames == stock_frames  # 2: functional_call of a compiled module compiles once more, in stock too
    assert all(torch.equal(a, b) for a, b in zip(outs, stock_outs))


class _Doubled(torch.nn.Module):
    def forward(self, x):  # never reads self
        return x * 2


class _Scaled(torch.nn.Module):
    def __init__(self, k):
        super().__init__()
        self.k = k

    def forward(self, x):
        return x * self.k


def _member_guards(model, x):
    names = {guard.name for guard in torch._dynamo.explain(model)(x).out_guards}
    return {n for n in names if "_paramfold_weight_m0" in n}


def test_inline_getter_leaves_out_a_member_whose_forward_never_reads_it():
    # The compile-time proxy of inline's getter: a member whose forward never reads `self` is
    # given None in its place, so dynamo neither wraps nor guards it (a seed-model cast read costs
    # about 1/3 less to trace); a member that reads its state is passed, wrapped and guarded.
    from torch.nn.utils import parametrize

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    stock = copy.deepcopy(model)
    for m in (model, stock):
        parametrize.register_parametrization(m[0], "weight", _Doubled())
        parametrize.register_parametrization(m[1], "weight", _Scaled(3.0))
    paramfold.prepare(model, "inline")
    x = torch.randn(2, 4)
    guards = _member_guards(model, x)
    assert guards and all(n.startswith("L['self']._modules['1']") for n in guards)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    for k in (3.0, 5.0):  # the guarded member's state still recompiles when it changes
        model[1].parametrizations.weight[0].k = k
        stock[1].parametrizations.weight[0].k = k
        assert torch.equal(compiled(x), stock(x))


def test_reads_first_argument_is_conservative():
    from paramfold.inline import reads_first_argument

    def plain(self, x):
        return x + 1

    def direct(self, x):
        return x * self.k

    def closure(self, x):
        return (lambda: self.k)() * x

    def comprehension(self, xs):
        return [x * self.k for x in xs]

    def zero_arg_super(self, x):
        return super().forward(x)  # noqa: F821 (never called)

    def frame(self, x):
        return locals()["self"]

    def rebinds(self, x):
        self = x
        return self

    def star(*args):
        return args[1]

    assert not reads_first_argument(plain)
    assert not reads_first_argument(_Doubled.forward)
    assert not reads_first_argument(torch.nn.Identity.forward)
    for fn in (direct, closure, comprehension, zero_arg_super, frame, rebinds, star, _Scaled.forward, len,
               functools.partial(plain, None), torch.no_grad()(plain)):
        assert reads_first_argument(fn), fn


def _off_by_one(gm, example_inputs):
    """A backend whose results differ from eager, so whether compiled code ran shows."""
    return lambda *args: [out + 1 for out in gm(*args)]


class _Halved(torch.nn.Module):  # a class of this test's own: dynamo's marks are per code object
    def forward(self, w):
        return w / 2


@pytest.mark.parametrize("action", ["find", "hoist", "freeze", "auto"])
def test_probing_a_compiled_chain_member_leaves_dynamo_compiling_it_everywhere(action):
    # Regression: find()'s probe and freeze's watch for random draws ran the chain under a
    # TorchDispatchMode; dynamo skips a frame it meets under one and marks its code object to be
    # skipped for good, so a member compiled with member.compile() ran eagerly from then on, in
    # the prepared model and in every other model of the process (here a stock one). paramfold
    # now runs its watched computations with torch.compile'd code run eagerly, meeting no frame.
    def build_():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        for layer in model:
            torch.nn.utils.parametrize.register_parametrization(layer, "weight", _Halved())
        return model.eval().requires_grad_(False)

    stock, ours = build_(), build_()
    x = torch.randn(2, 4)
    eager = stock(x)
    for model in (stock, ours):
        model[0].parametrizations.weight[0].compile(backend=_off_by_one)
    want = stock(x)
    assert not torch.equal(want, eager)  # the compiled member ran
    if action == "find":
        paramfold.find(ours)
        got = ours(x)
    else:
        paramfold.prepare(ours, action)
        with torch.no_grad():
            got = ours(x)
    assert torch.equal(got, want)
    assert torch.equal(stock(x), want)


@pytest.mark.parametrize("root", ["user", "sequential"])
@pytest.mark.parametrize("mode", ["hoist", "auto", "freeze", "inline"])
def test_torch_compile_wrapper_made_while_prepared_calls_the_restored_model_like_stock(mode, root):
    # torch.compile(model) binds model.__call__ when it is made: the prepared root's. After
    # paramfold.restore(model) that call raised KeyError('_paramfold'); it now runs the restored
    # module as stock's wrapper would, and again prepared after a second prepare (found by the
    # event-sequence fuzzer).
    from torch.nn.utils.parametrizations import weight_norm

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = weight_norm(torch.nn.Linear(4, 4))

        def forward(self, x):
            return self.a(x).tanh()

    torch.manual_seed(0)
    stock = Net() if root == "user" else torch.nn.Sequential(weight_norm(torch.nn.Linear(4, 4)))
    stock.eval().requires_grad_(False)
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    compiled = torch.compile(ours, backend="eager")
    x = torch.randn(2, 4)
    assert torch.equal(compiled(x), stock(x))
    paramfold.restore(ours)
    assert torch.equal(compiled(x), stock(x))
    with torch.no_grad():
        for m in (stock, ours):
            m.get_submodule("a" if root == "user" else "0").parametrizations.weight.original1.add_(0.5)
    assert torch.equal(compiled(x), stock(x))
    paramfold.prepare(ours, mode)
    assert torch.equal(compiled(x), stock(x))


class _ScaledByAttribute(nn.Linear):
    def forward(self, x):  # a quantizer's scale kept on the Parameter object
        return nn.functional.linear(x, self.weight * getattr(self.weight, "qscale", 1.0), self.bias)


class _SetsItsWeight(nn.Linear):
    def forward(self, x):
        self.weight.set_(self.weight.detach() * 0.5)
        return super().forward(x)


def _halve_weight_data(module, args):
    module.weight.data = module.weight.data * 0.5  # a pre-hook masking the weight, mask/requant style


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("mode", ["auto", "hoist", "inline", "freeze"])
@pytest.mark.parametrize("case", ["data_in_pre_hook", "set_in_forward", "attribute_on_the_parameter"])
def test_detach_params_under_no_grad_gives_the_parameter_what_the_call_does_to_it(case, mode, compiled):
    # Regression (2026-12-05 hunt): the detached alias standing for a plain Parameter in the call
    # took `.data =` and `set_` for itself (stock's Parameter keeps them: halved at every call, so
    # outputs differed from the second call on), and had none of the Parameter's attributes.
    def build_one():
        torch.manual_seed(0)
        lin = {"data_in_pre_hook": nn.Linear, "set_in_forward": _SetsItsWeight,
               "attribute_on_the_parameter": _ScaledByAttribute}[case](8, 8)
        # (set_ on a leaf that requires grad raises, no_grad or not: stock's model is frozen there.)
        trainable = mode != "freeze" and case != "set_in_forward"
        model = nn.Sequential(weight_norm(nn.Linear(8, 8)), lin).eval().requires_grad_(trainable)
        if case == "data_in_pre_hook":
            lin.register_forward_pre_hook(_halve_weight_data)
        lin.weight.qscale = 3.0
        return model

    stock = build_one()
    ours = paramfold.prepare(build_one(), mode, detach_params_under_no_grad=True)
    run_stock, run_ours = ((torch.compile(stock, backend="eager"), torch.compile(ours, backend="eager"))
                           if compiled else (stock, ours))
    x = torch.randn(2, 8)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(run_ours(x), run_stock(x))
            assert torch.equal(ours[1].weight, stock[1].weight) and ours[1].weight._version == stock[1].weight._version
    assert type(ours[1].weight) is nn.Parameter and ours[1].weight.qscale == 3.0
    paramfold.restore(ours)
    assert torch.equal(ours(x), stock(x))


def _write_the_parameter_itself(module, args):
    module._parameters["weight"].data = torch.full((4, 4), 9.0)


def _half_through_the_alias(module, args):
    module.weight.data = module.weight.data.half()


def _zero_then_replace(module, args):
    module.weight.data = torch.zeros(4, 4)
    module.weight = nn.Parameter(torch.ones(4, 4))


@pytest.mark.parametrize("case", ["parameter_written_itself", "shared_parameter", "alias_then_replaced"])
def test_detach_params_under_no_grad_settles_only_what_the_call_did_to_the_alias(case):
    # Regression (2026-12-05 review of 8061400): the alias was compared with its Parameter as it
    # is at the call's end, so a write made on the Parameter itself (through _parameters, or
    # through another module sharing it) looked like the alias having moved, and was undone; and
    # an alias replaced after a write through it gave its Parameter nothing.
    hook = {"parameter_written_itself": _write_the_parameter_itself, "shared_parameter": _half_through_the_alias,
            "alias_then_replaced": _zero_then_replace}[case]

    def build_one():
        torch.manual_seed(0)
        model = nn.Sequential(weight_norm(nn.Linear(4, 4)), nn.Linear(4, 4), nn.Linear(4, 4)).eval()
        if case == "shared_parameter":
            model[2].weight = model[1].weight
        return model

    finals = []
    for prepare in (False, True):
        model = build_one()
        if prepare:
            paramfold.prepare(model, "auto", detach_params_under_no_grad=True)
        old = model[1]._parameters["weight"]
        model[1].register_forward_pre_hook(hook)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                model(torch.ones(1, 4))
            except RuntimeError:
                pass  # (the shared case's second layer computes in float32 with float16 weights)
        finals.append((old.dtype, old.shape, old.detach().clone().float()))
    (dtype, shape, data), (dtype2, shape2, data2) = finals
    assert (dtype, shape) == (dtype2, shape2) and torch.equal(data, data2)


def test_compiled_call_impl_read_by_no_python_frame_answers_like_stock():
    # Regression (2026-12-05 review of 4d2e1c4): read from a thread whose target is a C function,
    # the getter looked two frames up for _wrapped_call_impl and raised ValueError.
    import _thread
    import operator
    import threading

    model = paramfold.prepare(nn.Sequential(weight_norm(nn.Linear(2, 2))), "hoist")
    model.compile()  # a compiled call impl set: the getter answers with a callable
    failures, finished = [], threading.Event()
    saved = sys.unraisablehook
    sys.unraisablehook = lambda info: failures.append(info.exc_type)
    try:
        _thread.start_new_thread(operator.attrgetter("_compiled_call_impl"), (model,))  # no Python frame
        _thread.start_new_thread(finished.set, ())
        assert finished.wait(30)
        time.sleep(0.2)
    finally:
        sys.unraisablehook = saved
    assert failures == []


class _ScoredLayer(nn.Module):
    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x).square().sum()


@pytest.mark.parametrize("norm", ["parametrize", "hook"])
@pytest.mark.parametrize("mode", ["hoist", "auto"])
def test_a_training_spectral_norm_under_inductor_gets_eagers_gradient_from_hoist_and_auto(norm, mode):
    # torch 2.13's min-cut partitioner recomputes the power iteration's new u in the backward from
    # the _v buffer the forward overwrote (pytorch/pytorch#197039): stock compiled with inductor
    # is off by 0.29 of 9.1 here (README "Notes and limits"). hoist and auto run the chain
    # eagerly, outside the graph the partitioner splits, so their gradient is eager stock's.
    from torch.nn.utils import spectral_norm as hook_spectral_norm
    from torch.nn.utils.parametrizations import spectral_norm

    torch.manual_seed(0)
    wrap = spectral_norm if norm == "parametrize" else hook_spectral_norm
    stock = _ScoredLayer(wrap(nn.Linear(4, 4))).train()
    ours = copy.deepcopy(stock)
    x = torch.randn(3, 4)
    stock(x).backward()
    paramfold.prepare(ours, mode)
    torch._dynamo.reset()
    torch.compile(ours, backend="inductor")(x).backward()
    paramfold.restore(ours)
    for name, expected in grads(stock).items():
        # inductor may reorder the graph's own arithmetic (linear, square, sum): float32 rounding
        torch.testing.assert_close(grads(ours)[name], expected, rtol=1e-5, atol=1e-5)
    _assert_same_tensors(dict(ours.named_buffers()), dict(stock.named_buffers()))


#: What dynamo reads of a module with ``inspect.getattr_static`` as it takes it into a trace
#: (torch 2.15: ``VariableBuilder.wrap_module``, ``mutation_guard.is_dynamic_nn_module``).
_STATIC_READS = ("_is_fsdp_managed_module", "_fsdp_use_orig_params", "torchdynamo_force_dynamic")


@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm", "hook_spectral_norm"])
@pytest.mark.parametrize("mode", ["hoist", "inline", "auto", "freeze"])
def test_a_prepared_module_answers_dynamos_static_reads_as_stocks_between_and_inside_calls(mode, kind):
    # Regression: every prepared class held a descriptor under _is_fsdp_managed_module (its hook
    # for "dynamo takes this module into a trace"). torch 2.15 reads that with getattr_static,
    # found the descriptor itself (truthy) and graph-broke at each prepared module as one FSDP
    # manages with use_orig_params=False: no prepared model compiled at all on torch 2.15.
    stock, ours = small_net(kind), small_net(kind)
    if mode == "freeze":
        stock.eval().requires_grad_(False)
        ours.eval().requires_grad_(False)
    paramfold.prepare(ours, mode)
    seen = {}

    def record(tag):
        for (name, s), o in zip(stock.named_modules(), ours.modules()):
            for attr in _STATIC_READS:
                seen[(tag, name, attr)] = (bool(inspect.getattr_static(s, attr, False)),
                                           bool(inspect.getattr_static(o, attr, False)))

    record("between")
    ours[0].register_forward_hook(lambda *_: record("inside"))
    with torch.set_grad_enabled(mode != "freeze"):
        ours(torch.randn(2, 4))
    assert {k for k in seen if k[0] == "inside"}
    assert {k: v for k, v in seen.items() if v[0] != v[1]} == {}


@pytest.mark.parametrize("mode", ["hoist", "inline", "auto"])
def test_a_compile_marks_each_prepared_module_it_takes_into_a_trace_and_drops_the_marks_after(mode):
    from paramfold import compile_reads
    from paramfold.state import STATE_ATTR

    model = paramfold.prepare(build("spectral_norm"), mode)
    marked = []

    def backend(gm, example_inputs):  # run by dynamo for real, once it has traced the frame
        marked.append(dict(compile_reads.MARKED))
        return gm.forward

    torch.compile(lambda m, x: m(x) * 2, backend=backend)(model, torch.randn(2, 32))
    assert len(marked) == 1
    prepared = {id(m) for m in model.modules() if STATE_ATTR in m.__dict__}
    assert prepared and prepared <= set(marked[0]) and set(marked[0].values()) == {threading.get_ident()}
    model(torch.randn(2, 32))  # a call after the compile ended drops this thread's marks
    assert not compile_reads.MARKED


def _hooked_root(kind, norm, hooks):
    torch.manual_seed(0)
    if norm == "weight_norm":
        wrap = weight_norm
    else:
        wrap = functools.partial(torch.nn.utils.spectral_norm, n_power_iterations=2)
    a, b = wrap(nn.Linear(8, 16)), wrap(nn.Linear(16, 8))
    if kind == "sequential":
        model = nn.Sequential(a, nn.ReLU(), b)
    elif kind == "linear":  # the parametrized layer is the root
        model = wrap(nn.Linear(8, 8))
    else:
        model = _UserRoot(a, b)
    if "pre" in hooks:
        model.register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    if "post" in hooks:
        model.register_forward_hook(lambda module, args, out: out + 1)
    return model


class _UserRoot(nn.Module):
    def __init__(self, a, b):
        super().__init__()
        self.a, self.b = a, b

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("hooks", ["pre", "post", "pre+post", "global"])
@pytest.mark.parametrize("kind", ["sequential", "linear", "user_root"])
@pytest.mark.parametrize("norm", ["weight_norm", "hook_spectral_norm"])
@pytest.mark.parametrize("mode", ["hoist", "inline", "auto"])
def test_hooks_on_the_compiled_root_compile_into_its_graph_like_stock(mode, norm, kind, hooks):
    # Regression: torch.compile(model) of a root whose forward is torch's (nn.Sequential) runs the
    # root's call in torch's wrap_inline frame, its hooks traced into the one graph; paramfold's
    # root call ran them as frames of their own: 2 graphs with one hook, 3 with two, where stock
    # and the plain model make 1. A root of the user's own class has its hooks run outside
    # dynamo, in stock too (3 graphs with two hooks): paramfold keeps that.
    global_hook = None
    if hooks == "global":
        global_hook = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: out * 1.5)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.compile(module) under global hooks warns, in stock too
            results = []
            for prepare in (None, mode):
                model = _hooked_root(kind, norm, hooks)
                if prepare is not None:
                    paramfold.prepare(model, prepare)
                torch._dynamo.reset()
                counter = CompileCounter()
                compiled = torch.compile(model, backend=counter)
                outs = []
                for i in range(3):
                    out = compiled(torch.randn(4, 8, generator=torch.Generator().manual_seed(i)))
                    out.sum().backward()
                    outs.append(out.detach())
                results.append((counter.frame_count, outs, grads(model), copy.deepcopy(model.state_dict())))
    finally:
        if global_hook is not None:
            global_hook.remove()
    (stock_frames, stock_outs, stock_grads, stock_state), (frames, outs, got_grads, state) = results
    assert frames == stock_frames
    assert all(torch.equal(a, b) for a, b in zip(outs, stock_outs))
    assert stock_grads.keys() == got_grads.keys()
    assert all(torch.equal(stock_grads[k], got_grads[k]) for k in stock_grads)
    assert all(torch.equal(stock_state[k], state[k]) for k in stock_state)


_FSDP2_ROOT = r'''
import json, os, socket, sys, warnings
warnings.simplefilter("ignore")
import torch, torch.distributed as dist
from torch import nn
from torch.nn.utils.parametrizations import weight_norm
from torch._dynamo.utils import counters
from torch.distributed.fsdp import fully_shard
import paramfold
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
dist.init_process_group("gloo", rank=0, world_size=1)
torch.set_num_threads(1)
out = {}
for mode in (None, "hoist", "auto", "inline"):
    torch.manual_seed(0)
    model = nn.Sequential(weight_norm(nn.Linear(8, 8)), nn.ReLU(), weight_norm(nn.Linear(8, 4)))
    if mode:
        paramfold.prepare(model, mode)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch._dynamo.reset(); counters.clear()
    fn = torch.compile(model, backend="aot_eager")
    losses = []
    for i in range(3):
        loss = fn(torch.randn(4, 8, generator=torch.Generator().manual_seed(i))).square().sum()
        loss.backward(); opt.step(); opt.zero_grad(); losses.append(loss.item())
    out[str(mode)] = [counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()), losses]
dist.destroy_process_group()
print(json.dumps(out))
'''


def test_a_prepared_fsdp2_root_of_torchs_class_compiles_its_forward_without_a_break():
    # FSDP2's root hooks (its all-gather) break a frame that traces the root's whole call, in
    # stock too (0 graphs, 1 break: nothing compiled). A prepared root's call opens its scope and
    # compiles the forward alone (1 graph, no break); the hooked-root frame that compiles a torch-
    # forward root's hooks into its graph is not used for it (it added that break).
    import json
    import subprocess

    run = subprocess.run([sys.executable, "-c", _FSDP2_ROOT], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    stock_losses = out.pop("None")[2]
    for mode, (graphs, breaks, losses) in out.items():
        assert (graphs, breaks) == (1, 0), mode
        assert losses == stock_losses, mode


@pytest.mark.parametrize("mode", ["hoist", "auto", "inline"])
def test_a_hooked_rnn_root_breaks_its_graph_as_often_as_stock(mode):
    # Regression (helper-212): dynamo does not trace an nn.LSTM's forward (allow_rnn off), so a
    # frame of the hooked root's whole call breaks, in stock too; paramfold's forward frame was
    # then traced again and broke a second time (2 breaks where stock has 1).
    def build():
        torch.manual_seed(0)
        lstm = nn.LSTM(8, 8, batch_first=True)
        weight_norm(lstm, "weight_hh_l0")
        lstm.register_forward_hook(lambda module, args, out: out[0] * 2)
        return lstm

    runs = []
    for prepare in (None, mode):
        model = build()
        if prepare is not None:
            paramfold.prepare(model, prepare)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        counter = CompileCounter()
        compiled = torch.compile(model, backend=counter)
        outs = [compiled(torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(i))) for i in range(3)]
        runs.append((counter.frame_count, sum(torch._dynamo.utils.counters["graph_break"].values()), outs))
    (stock_frames, stock_breaks, stock_outs), (frames, breaks, outs) = runs
    assert (frames, breaks) == (stock_frames, stock_breaks)
    assert all(torch.equal(a, b) for a, b in zip(outs, stock_outs))


class BreakInLoop(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(weight_norm(nn.Linear(4, 4 + i)) for i in range(10))

    def forward(self, x):
        out = 0
        for layer in self.layers:
            out = out + layer(x).sum() * x.sum().item()
        return out


@pytest.mark.parametrize("mode", ALL_MODES)
def test_no_more_graphs_than_stock_when_dynamo_falls_back_to_eager(mode, recwarn):
    from torch._dynamo.testing import CompileCounter

    def graphs(model):
        torch._dynamo.reset()
        counter = CompileCounter()
        torch.compile(model, backend=counter)(torch.randn(2, 4))
        return counter.frame_count

    torch.manual_seed(0)
    stock = BreakInLoop()
    if mode == "freeze":
        _inference(stock)
    expected = graphs(stock)
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    assert graphs(ours) <= expected
    assert not [w for w in recwarn if "paramfold" in str(w.message) or "paramfold" in str(w.filename)]
