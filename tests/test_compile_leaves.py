"""Hoisted values are leaves to dynamo while it compiles, and the values themselves when code runs
(``paramfold/compile_leaves.py``).

The proxy for the first compiled call's cost in grad mode: how many graph inputs dynamo fakes an
autograd history for (``MetaConverter._backward_error``, about 0.5 ms each). The plain model has
none; before stand-ins, hoist and auto had one per hoisted value. Everything else here checks that
the stand-ins never reach running code: outputs, gradients and buffers equal stock's bitwise
(``backend="eager"`` runs stock's ops), no recompiles, nothing left behind.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch._dynamo
from helpers import build, grads, seed_model
from torch import nn
from torch._dynamo.utils import counters
from torch._subclasses.meta_utils import MetaConverter
from torch.nn.utils import parametrize

import paramfold
from paramfold import compile_leaves


@pytest.fixture
def faked_histories(monkeypatch):
    """The shapes of the graph inputs dynamo fakes an autograd history for, in order."""
    shapes: list[tuple[int, ...]] = []
    original = MetaConverter._backward_error.__func__

    def counting(cls, t):
        shapes.append(tuple(t.shape))
        return original(cls, t)

    monkeypatch.setattr(MetaConverter, "_backward_error", classmethod(counting))
    return shapes


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _stand_ins_left(model: nn.Module) -> list[str]:
    """Leaf tensors requiring grad in a module's ``__dict__`` that are not its parameters."""
    return [
        f"{path}.{name}"
        for path, module in model.named_modules()
        for name, value in vars(module).items()
        if isinstance(value, torch.Tensor) and value.is_leaf and value.requires_grad
        and not isinstance(value, nn.Parameter)
    ]


def _step(call, model, x):
    out = call(x)
    out.float().pow(2).sum().backward()
    return out.detach()


@pytest.mark.parametrize("mode", ["hoist", "auto"])
@pytest.mark.parametrize("entry", ["torch.compile", "model.compile"])
def test_a_grad_mode_compile_fakes_no_autograd_history_for_hoisted_values(mode, entry, faked_histories):
    stock = seed_model(n=3, width=16)
    model = paramfold.prepare(seed_model(n=3, width=16), mode)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    compiled_stock = torch.compile(stock, backend="eager")
    if entry == "torch.compile":
        compiled = torch.compile(model, backend="eager")
    else:
        model.compile(backend="eager")
        compiled = model
    for i in range(3):
        expected = _step(compiled_stock, stock, x)
        faked_before = len(faked_histories)
        assert torch.equal(_step(compiled, model, x), expected), i
        assert len(faked_histories) == faked_before, (i, faked_histories)  # 6 (128, 128)-like inputs before
        for (name, a), b in zip(grads(model).items(), grads(stock).values()):
            assert torch.equal(a, b), (i, name)
        assert _stand_ins_left(model) == []
    assert counters["stats"]["unique_graphs"] == 2  # stock's and the prepared model's: no recompile


class _Tied(nn.Module):
    """One parametrized tensor read by two modules (a tied embedding and output projection)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)
        parametrize.register_parametrization(self.inp, "weight", nn.Tanh())
        parametrize.register_parametrization(self.out, "weight", nn.Tanh())
        self.out.parametrizations.weight = self.inp.parametrizations.weight  # one chain, two modules

    def forward(self, x):
        return self.out(torch.relu(self.inp(x)))


class _Broken(nn.Module):
    """A graph break between two parametrized layers: the rest is compiled as a resume frame."""

    def __init__(self, kind):
        super().__init__()
        self.a = build(kind, width=8, depth=2, seed=1)
        self.b = build(kind, width=8, depth=2, seed=2)

    def forward(self, x):
        x = self.a(x)
        torch._dynamo.graph_break()
        return self.b(x)


def _hook_weight_norm(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    for layer in (model[0], model[2]):
        torch.nn.utils.weight_norm(layer)  # the deprecated hook-based one: its value stays in the dict
    return model


_MODELS = {
    "weight_norm": lambda: build("weight_norm", width=8),
    "spectral_norm (training)": lambda: build("spectral_norm", width=8),
    "lora": lambda: build("lora", width=8),
    "graph break": lambda: _Broken("weight_norm"),
    "hook weight_norm": _hook_weight_norm,
}


@pytest.mark.filterwarnings("ignore:torch.nn.utils.weight_norm is deprecated")
@pytest.mark.parametrize("mode", ["hoist", "auto"])
@pytest.mark.parametrize("kind", sorted(_MODELS))
def test_compiled_training_with_stand_ins_equals_stock(kind, mode, faked_histories):
    """Several steps, a new input shape (a recompile, stand-ins again), ``torch._dynamo.reset()``
    (which drops the compile callbacks: registered again at the next call), buffers too. Faked
    histories: as many as stock's (the activations a graph break's resume frame takes in)."""
    stock, model = _MODELS[kind](), _MODELS[kind]()
    paramfold.prepare(model, mode)
    compiled_stock = torch.compile(stock, backend="eager", dynamic=False)
    compiled = torch.compile(model, backend="eager", dynamic=False)
    for i, batch in enumerate([3, 3, 5, 5, "reset", 3, 3]):
        if batch == "reset":
            torch._dynamo.reset()
            continue
        x = torch.randn(batch, 8, generator=torch.Generator().manual_seed(i))
        before = len(faked_histories)
        expected = _step(compiled_stock, stock, x)
        by_stock = len(faked_histories) - before  # the activations a resume frame takes in
        assert torch.equal(_step(compiled, model, x), expected), i
        assert len(faked_histories) - before == 2 * by_stock, (i, kind)
        for (name, a), b in zip(grads(model).items(), grads(stock).values()):
            assert (a is None and b is None) or torch.equal(a, b), (i, name)
        for (name, a), b in zip(model.named_buffers(), stock.buffers()):
            assert torch.equal(a, b), (i, name)
        assert _stand_ins_left(model) == [], i


def test_a_chain_shared_by_two_modules(faked_histories):
    """One ``ParametrizationList`` under two modules (a tied projection): each module's value gets
    its stand-in, gradients from both reads reach the one original, no recompile."""
    stock, model = _Tied(), paramfold.prepare(_Tied(), "hoist")
    model.load_state_dict(stock.state_dict())
    compiled_stock, compiled = torch.compile(stock, backend="eager"), torch.compile(model, backend="eager")
    for i in range(3):
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(i))
        assert torch.equal(_step(compiled, model, x), _step(compiled_stock, stock, x))
        for (name, a), b in zip(grads(model).items(), grads(stock).values()):
            assert torch.equal(a, b), (i, name)
    assert faked_histories == []
    assert counters["stats"]["unique_graphs"] == 2


def test_double_backward_through_compiled_stand_ins():
    """A gradient penalty (``create_graph=True``, WGAN-GP on a spectral_norm critic) differentiates
    the compiled call's gradient again: it reaches the originals through the values' histories."""
    results = []
    for prepare in (False, True):
        model = build("spectral_norm", width=8)
        if prepare:
            paramfold.prepare(model, "hoist")
        compiled = torch.compile(model, backend="eager")
        for i in range(2):
            x = torch.randn(3, 8, generator=torch.Generator().manual_seed(i), requires_grad=True)
            (gx,) = torch.autograd.grad(compiled(x).sum(), x, create_graph=True)
            gx.pow(2).sum().backward()
        results.append((grads(model), dict(model.named_buffers())))
        torch._dynamo.reset()
    (stock_grads, stock_buffers), (model_grads, model_buffers) = results
    for name, g in stock_grads.items():
        assert torch.equal(model_grads[name], g), name
    for name, b in stock_buffers.items():
        assert torch.equal(model_buffers[name], b), name


def test_a_compile_on_another_thread_leaves_this_threads_values_alone():
    """Stand-ins are for the compiling thread's own scopes: a thread in the middle of a grad-mode
    call keeps its values (with their histories) while another thread compiles."""
    inside, compiled_elsewhere = threading.Event(), threading.Event()
    seen = {}

    class Waits(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = build("weight_norm", width=8)

        def forward(self, x):
            inside.set()
            assert compiled_elsewhere.wait(60)
            seen["grad_fn"] = [layer.__dict__["weight"].grad_fn is not None for layer in self.net.layers]
            return self.net(x)

    model = paramfold.prepare(Waits(), "hoist")
    other = torch.compile(paramfold.prepare(build("weight_norm", width=8, seed=3), "hoist"), backend="eager")

    def compile_other():
        assert inside.wait(60)
        other(torch.randn(2, 8)).sum().backward()
        compiled_elsewhere.set()

    thread = threading.Thread(target=compile_other)
    thread.start()
    out = model(torch.randn(2, 8))  # eager: its values are installed and read on this thread
    thread.join(60)
    assert seen["grad_fn"] == [True, True, True]
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_a_call_whose_stand_ins_were_stranded_is_refused_and_the_model_is_left_whole():
    """Dynamo runs its compile callbacks only for the first of overlapping compiles in the process:
    here another thread starts a compile (as a lazily compiled backward does) while this one's
    fails, so this one's end callback runs on that thread, and this frame falls back to eager on
    the stand-ins. The call is refused (its gradients would have stopped at them), nothing stays
    behind, and the next call equals stock."""
    from torch._dynamo.callback import CallbackTrigger, callback_handler

    entered, leave = threading.Event(), threading.Event()

    def other_compile():
        with callback_handler.install_callbacks(CallbackTrigger.LAZY_BACKWARD, "other"):
            entered.set()
            assert leave.wait(60)

    def failing_backend(gm, example_inputs):
        thread = threading.Thread(target=other_compile)
        thread.start()
        assert entered.wait(60)
        raise RuntimeError("this backend fails")

    stock, model = build("weight_norm", width=8), paramfold.prepare(build("weight_norm", width=8), "hoist")
    x = torch.randn(2, 8)
    compiled = torch.compile(model, backend=failing_backend)
    try:
        with torch._dynamo.config.patch(suppress_errors=True):
            with pytest.raises(paramfold.FoldError, match="another thread was compiling"):
                compiled(x)
    finally:
        leave.set()
    assert _stand_ins_left(model) == []
    assert compile_leaves.local.swapped == []
    assert torch.equal(_step(model, model, x), _step(stock, stock, x))
    for (name, a), b in zip(grads(model).items(), grads(stock).values()):
        assert torch.equal(a, b), name


class _Gated(nn.Module):
    """A frame whose first graph fails to compile (dynamo then runs it eagerly), which reads a
    parametrized weight itself and then calls a submodule that dynamo compiles on its own."""

    def __init__(self, between):
        super().__init__()
        self.lin = torch.nn.utils.parametrizations.weight_norm(nn.Linear(4, 4))
        self.gate = _Gate()
        self.between = torch.compiler.disable(between)

    def forward(self, x):
        x = x * 2
        self.between()
        x = x @ self.lin.weight.t()
        return self.gate(x)


class _Gate(nn.Module):
    def forward(self, x):
        return x + 1


@pytest.mark.parametrize("other_ends", ["before the next compile", "after the call"])
def test_stand_ins_that_outlived_their_compile_refuse_the_call_even_after_later_compiles(other_ends):
    """As above, but this thread compiles another frame before the call ends: stand-ins another
    compile installed are found stranded when that compile starts (its start callback runs: the
    other thread's compile ended meanwhile) or ends (its bytecode hook), not put back as if
    nothing had run on them (the eager fallback read one here)."""
    from torch._dynamo.callback import CallbackTrigger, callback_handler

    entered, leave = threading.Event(), threading.Event()
    backend_calls = []

    def other_compile():
        with callback_handler.install_callbacks(CallbackTrigger.LAZY_BACKWARD, "other"):
            entered.set()
            assert leave.wait(60)

    thread = threading.Thread(target=other_compile)

    def first_fails(gm, example_inputs):
        backend_calls.append(gm)
        if len(backend_calls) == 1:
            thread.start()
            assert entered.wait(60)
            raise RuntimeError("this backend fails once")
        return gm.forward

    def between():
        if other_ends == "before the next compile":
            leave.set()
            thread.join(60)

    model = paramfold.prepare(_Gated(between), "hoist")
    compiled = torch.compile(model, backend=first_fails)
    try:
        with torch._dynamo.config.patch(suppress_errors=True):
            with pytest.raises(paramfold.FoldError, match="another thread was compiling"):
                compiled(torch.randn(2, 4))
    finally:
        leave.set()
        thread.join(60)
    assert len(backend_calls) >= 2  # the later compile ran inside the refused call
    assert _stand_ins_left(model) == [] and not compile_leaves.local.stranded


@pytest.mark.parametrize("option", ["install_free_tensors", "prepare_freezing"])
@pytest.mark.parametrize("mode", ["hoist", "freeze", "auto"])
def test_options_that_bake_module_tensors_into_the_graph_are_refused(mode, option):
    """With these dynamo options a module's tensor attributes are copied into the graph: a
    prepared model's values (stand-ins in grad mode) would stay there at every later call."""
    grad = mode != "freeze"
    stock, model = build("weight_norm", width=8), build("weight_norm", width=8)
    if not grad:
        stock.requires_grad_(False), model.requires_grad_(False)
    paramfold.prepare(model, mode)
    x = torch.randn(2, 8)
    with torch.set_grad_enabled(grad), torch._dynamo.config.patch(**{option: True}):
        with pytest.raises(Exception, match="install_free_tensors .or prepare_freezing"):
            torch.compile(model, backend="eager")(x)
    torch._dynamo.reset()
    with torch.set_grad_enabled(grad):  # the option off: as stock
        assert torch.equal(torch.compile(model, backend="eager")(x), stock(x))
    assert _stand_ins_left(model) == []
