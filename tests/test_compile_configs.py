"""torch.compile / torch.func configurations a demanding user sets, against a stock twin.

Each test builds the stock model and the prepared one identically (same seed) and compares
outputs, gradients and state_dict bitwise with the eager backend; with "aot_eager", whose
decompositions may reorder arithmetic, within float32 round-off (atol=rtol=1e-6).
"""

from __future__ import annotations

import pytest
import torch
from helpers import build, grads
from torch._dynamo.testing import CompileCounter
from torch import nn
from torch.func import functional_call
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

import paramfold

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _twins(kind: str, mode: str, **kw):
    stock = build(kind, width=8, depth=2, **kw)
    prepared = paramfold.prepare(build(kind, width=8, depth=2, **kw), mode)
    return stock, prepared


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("mode", ["hoist", "auto", "inline"])
def test_func_grad_over_a_compiled_prepared_model(mode, backend):
    # Regression: torch.func.grad of functional_call(torch.compile(model)) raised with hoist and
    # auto: InternalTorchDynamoError (requires_grad_() inside a functorch transform: the
    # compile-time leaf stand-ins of compile_leaves.py), and, with backend="eager", an
    # AssertionError in dynamo's fake-tensor conversion of a functorch-wrapped non-leaf input (a
    # hoisted value). Stock computes the gradients (torch 2.13's dynamo skips such a frame, or
    # with "eager" runs its ops as they are), and so does paramfold now: a call of a compiled
    # prepared model inside a transform runs eagerly. The prepared model runs first: once
    # stock's frame is skipped, dynamo would skip the prepared one too.
    stock, prepared = _twins("chain", mode)
    x = torch.randn(3, 8)
    results = []
    for model in (prepared, stock):
        torch._dynamo.reset()
        params = {k: v.detach() + 0.05 for k, v in model.named_parameters()}
        compiled = torch.compile(model, backend=backend)
        results.append(torch.func.grad(lambda p, x: functional_call(compiled, p, (x,)).sum())(params, x))
    assert results[0].keys() == results[1].keys()
    for name in results[0]:
        if backend == "eager":
            assert torch.equal(results[0][name], results[1][name]), name
        else:
            torch.testing.assert_close(results[0][name], results[1][name], atol=1e-6, rtol=1e-6, msg=name)
    assert_same_state(stock, prepared)


def assert_same_state(stock, prepared):
    expected, actual = stock.state_dict(), prepared.state_dict()
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name


@pytest.mark.parametrize("mode", ["hoist", "auto", "inline", "freeze"])
@pytest.mark.parametrize("kind", ["weight_norm", "chain"])
def test_vmap_ensemble_of_prepared_models_in_eval_mode_trains_like_stock(kind, mode):
    # Regression: torch.func.stack_module_state + vmap(functional_call(base, ...)) over eval-mode
    # models, gradients wanted for the stacked parameters (an ensemble trained with dropout off):
    # auto froze the values under no_grad, as vmap's BatchedTensor wrappers report
    # requires_grad=False over the stacked tensors that require it, so the originals got no
    # gradient (None; stock's are there). Freeze, which cannot serve that, refuses the call.
    def ensemble(prepare_mode):
        models = [build(kind, width=8, depth=2, seed=s).eval() for s in range(3)]
        for model in models:
            if prepare_mode == "freeze":
                model.requires_grad_(False)
            if prepare_mode is not None:
                paramfold.prepare(model, prepare_mode)
        params, buffers = torch.func.stack_module_state(models)
        params = {k: v.detach().requires_grad_() for k, v in params.items()}
        return models[0], params, buffers

    x = torch.randn(2, 8)
    results = []
    for prepare_mode in (None, mode):
        base, params, buffers = ensemble(prepare_mode)
        call = torch.func.vmap(lambda p, b: functional_call(base, (p, b), (x,)), in_dims=(0, 0))
        if prepare_mode == "freeze":
            with pytest.raises(paramfold.FoldError, match="requires grad"):
                call(params, buffers)
            return
        out = call(params, buffers)
        out.sum().backward()
        results.append({"out": out.detach(), **{k: v.grad for k, v in params.items()}})
    stock, ours = results
    assert stock.keys() == ours.keys()
    for name in stock:
        assert ours[name] is not None and torch.equal(stock[name], ours[name]), name


def _train_steps(model, run, steps=3, batches=(3, 3, 3)):
    """Outputs and gradients of ``steps`` SGD steps; ``run(x)`` runs the forward and backward."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    record = []
    for step in range(steps):
        x = torch.randn(batches[step % len(batches)], 8, generator=torch.Generator().manual_seed(step))
        out = run(x)
        record.append((out.detach(), grads(model)))
        opt.step()
        opt.zero_grad()
    return record


def _assert_same_steps(expected, actual):
    for (e_out, e_grads), (a_out, a_grads) in zip(expected, actual, strict=True):
        assert torch.equal(e_out, a_out)
        assert e_grads.keys() == a_grads.keys()
        for name in e_grads:
            assert torch.equal(e_grads[name], a_grads[name]), name


@pytest.mark.parametrize("mode", ["hoist", "inline"])  # auto in training hoists, as hoist
def test_compiled_autograd_trains_a_spectral_norm_model_like_stock(mode):
    # Pins (worked before): torch._dynamo.config.compiled_autograd with the backward inside the
    # compiled step (FSDP2 recipes): the hoisted values' chains backward through the compiled
    # autograd graph, spectral_norm's buffers advance as in stock, one capture each.
    stock, prepared = _twins("spectral_norm", mode)
    records, captures = [], []
    for model in (stock, prepared):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()

        def step(x, model=model):
            out = model(x)
            out.sum().backward()
            return out

        with torch._dynamo.config.patch(compiled_autograd=True):
            records.append(_train_steps(model, torch.compile(step, backend="eager"), steps=2))
        captures.append(torch._dynamo.utils.counters["compiled_autograd"]["captures"])
    _assert_same_steps(*records)
    assert captures[0] == captures[1] > 0
    assert_same_state(stock, prepared)


class _MomentumInside(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(4, 4))
        self.k = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(4, 4))

    def forward(self, x):
        with torch.no_grad():
            for pk, pq in zip(self.k.parameters(), self.q.parameters()):
                pk.mul_(0.5).add_(pq, alpha=0.5)
        return self.q(x) + self.k(x)


@pytest.mark.parametrize("mode", ["hoist", "freeze", "auto"])
def test_force_eager_stance_sees_originals_changed_inside_the_forward(mode):
    # Pins (worked before): under set_stance("force_eager") a torch.compile'd prepared model runs
    # eagerly although dynamo's callback is set, so its nested calls must still check originals
    # changed inside the forward (MoCo's momentum update), as eager calls do; compiled calls
    # cannot (README's documented limit), so the stance switches back and forth.
    stock = _MomentumInside().eval().requires_grad_(False)
    prepared = paramfold.prepare(_MomentumInside().eval().requires_grad_(False), mode)
    compiled_stock = torch.compile(stock, backend="eager")
    compiled = torch.compile(prepared, backend="eager")
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            with torch.compiler.set_stance("force_eager"):
                assert torch.equal(compiled(x), compiled_stock(x))
    assert_same_state(stock, prepared)


@pytest.mark.parametrize("mode", ["hoist", "auto", "inline"])
@pytest.mark.parametrize("how", ["dynamic=True", "mark_dynamic", "automatic"])
def test_dynamic_batch_sizes_compile_like_stock(mode, how):
    # Pins (worked before): changing batch sizes under dynamic=True, mark_dynamic or dynamo's
    # automatic dynamic shapes, in training (spectral_norm's buffers advance): stock's outputs,
    # gradients and state, and as many graphs as stock; then fail_on_recompile holds for both.
    stock, prepared = _twins("spectral_norm", mode)
    records, frames = [], []
    for model in (stock, prepared):
        torch._dynamo.reset()
        counter = CompileCounter()
        compiled = torch.compile(model, backend=counter, dynamic=True if how == "dynamic=True" else None)

        def run(x, compiled=compiled):
            if how == "mark_dynamic":
                torch._dynamo.mark_dynamic(x, 0)
            out = compiled(x)
            out.sum().backward()
            return out

        records.append(_train_steps(model, run, steps=4, batches=(2, 3, 4, 5)))
        with torch.compiler.set_stance("fail_on_recompile"):
            records[-1] += _train_steps(model, run, steps=2, batches=(6, 7))
        frames.append(counter.frame_count)
    _assert_same_steps(*records)
    assert frames[0] == frames[1]
    assert_same_state(stock, prepared)


class _UserLinear(nn.Module):
    """A layer of the user's own class (transformers' GPT-2 ``Conv1D`` is one): dynamo keeps a
    Parameter of it static under dynamic=True, not a plain tensor in its ``__dict__``."""

    def __init__(self, i: int, o: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(o, i) * 0.3)
        self.bias = nn.Parameter(torch.zeros(o))

    def forward(self, x):
        return x @ self.weight.T + self.bias


class _Scale(nn.Module):
    def forward(self, w):
        return w * 1.25


class _UserLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = weight_norm(_UserLinear(8, 8))
        self.b = _UserLinear(8, 5)
        parametrize.register_parametrization(self.b, "weight", _Scale())

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("mode", ["hoist", "auto", "freeze", "inline+detach"])
def test_values_of_user_layers_stay_static_under_dynamic_true_as_stocks_parameters(mode):
    # Regression (helper-223): hoist, auto and freeze put plain tensors in the user layers'
    # __dict__ (inline with detach_params_under_no_grad, its plain parameters' aliases), which
    # dynamo gave symbolic sizes under dynamic=True: a first sequence length equal to a weight
    # dim (5) was tied to it, the graph was made for that length, and the next one recompiled
    # (fail_on_recompile raised), where stock's static Parameters left one graph for all lengths.
    name, _, detach = mode.partition("+")
    frames, outputs = [], []
    for prepared in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _UserLayers().eval().requires_grad_(False)
        if prepared:
            paramfold.prepare(model, name, detach_params_under_no_grad=bool(detach))
        counter = CompileCounter()
        compiled = torch.compile(model, backend=counter, dynamic=True)
        got = []
        with torch.no_grad():
            got.append(compiled(torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(5))))
            with torch.compiler.set_stance("fail_on_recompile"):
                for t in (6, 7, 9):
                    got.append(compiled(torch.randn(2, t, 8, generator=torch.Generator().manual_seed(t))))
        frames.append(counter.frame_count)
        outputs.append(got)
    assert frames == [1, 1]
    for ours, theirs in zip(*outputs):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


class _UserPositions(nn.Module):
    """A user-class module with a parametrized buffer (a positional table): stock's dynamo keeps
    the buffer static, as a module's buffer, under dynamic=True."""

    def __init__(self):
        super().__init__()
        self.register_buffer("pos", torch.randn(5, 8))
        parametrize.register_parametrization(self, "pos", _Scale())

    def forward(self, x):
        return x + self.pos.sum(0)


@pytest.mark.parametrize("mode", ["inline", "hoist", "auto", "freeze"])
def test_a_parametrized_buffer_of_a_user_module_stays_static_under_dynamic_true(mode):
    # Regression (helper-225): inline's getter reads the buffer original from its dict, where
    # dynamo took it for a plain tensor and gave it symbolic sizes: a first sequence length equal
    # to its dim (5) was tied to it, and the next length recompiled (fail_on_recompile raised).
    frames, outputs = [], []
    for prepared in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _UserPositions().eval()
        if prepared:
            paramfold.prepare(model, mode)
        counter = CompileCounter()
        compiled = torch.compile(model, backend=counter, dynamic=True)
        with torch.no_grad():
            got = [compiled(torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(5)))]
            with torch.compiler.set_stance("fail_on_recompile"):
                got += [compiled(torch.randn(2, t, 8, generator=torch.Generator().manual_seed(t))) for t in (6, 7)]
        assert not hasattr(model.parametrizations.pos.original, "_dynamo_static_indices")
        frames.append(counter.frame_count)
        outputs.append(got)
    assert frames == [1, 1]
    for ours, theirs in zip(*outputs):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("dynamic", [None, True], ids=["dynamic=None", "dynamic=True"])
def test_a_users_dim_mark_on_a_detached_parameter_is_ignored_as_stock_ignores_it_and_kept(dynamic):
    # Regression (helper-225): detach_params_under_no_grad's alias shares its parameter's dim
    # marks; a user's mark_dynamic on a plain parameter, which stock ignores (a Parameter stays
    # static under force_parameter_static_shapes), made the alias's dim dynamic, and the weight's
    # static dim beside it raised ConstraintViolationError.
    outputs = []
    for prepared in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.Sequential(weight_norm(nn.Linear(8, 5)), nn.Tanh(), _UserLinear(5, 3)).eval().requires_grad_(False)
        torch._dynamo.mark_dynamic(model[2].bias, 0)
        if prepared:
            paramfold.prepare(model, "auto", detach_params_under_no_grad=True)
        compiled = torch.compile(model, backend="eager", dynamic=dynamic)
        with torch.no_grad():
            outputs.append([compiled(torch.randn(b, 8, generator=torch.Generator().manual_seed(b))) for b in (2, 3, 4)])
        assert model[2].bias._dynamo_dynamic_indices == {0}  # the user's mark, kept
        assert not hasattr(model[2].bias, "_dynamo_static_indices")
    for ours, theirs in zip(*outputs):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["hoist", "auto", "freeze", "inline+detach"])
def test_values_take_sizes_as_stocks_parameters_with_force_parameter_static_shapes_off(mode):
    # Regression (helper-225): the values were marked static while dynamo compiled whatever the
    # setting; with force_parameter_static_shapes off, stock's parameters get symbolic sizes under
    # dynamic=True and a head resized between calls runs on one graph, where the marked values
    # made a graph per size (fail_on_recompile raised).
    name, _, detach = mode.partition("+")
    frames, outputs = [], []
    for prepared in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _UserLinear(8, 5).eval().requires_grad_(False)
        parametrize.register_parametrization(model, "weight", _Scale())
        if prepared:
            paramfold.prepare(model, name, detach_params_under_no_grad=bool(detach))
        counter = CompileCounter()
        compiled = torch.compile(model, backend=counter, dynamic=True)
        x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1))
        got = []
        with torch._dynamo.config.patch(force_parameter_static_shapes=False), torch.no_grad():
            got.append(compiled(x))
            with torch.compiler.set_stance("fail_on_recompile"):
                for n in (6, 7):
                    model.bias = nn.Parameter(torch.randn(n), requires_grad=False)
                    model.parametrizations.weight.original = nn.Parameter(torch.randn(n, 8), requires_grad=False)
                    got.append(compiled(x))
        frames.append(counter.frame_count)
        outputs.append(got)
    assert frames == [1, 1]
    for ours, theirs in zip(*outputs):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["hoist", "auto", "freeze", "inline"])
def test_old_nn_module_inlining_sees_weight_updates_without_recompiling(mode):
    # Pins (worked before): torch._dynamo.config.inline_inbuilt_nn_modules=False (dynamo's older
    # handling of torch.nn modules, which guards their attributes otherwise), per-layer compile,
    # weights updated in place and by load_state_dict(assign=True) between no_grad calls: the
    # values follow (freeze re-materialises), with no more graphs than stock.
    kind = "chain"
    stock, prepared = build(kind, width=8, depth=2, blocks=True), build(kind, width=8, depth=2, blocks=True)
    for model in (stock, prepared):
        model.eval().requires_grad_(False)
    paramfold.prepare(prepared, mode)
    outs, frames = [], []
    with torch._dynamo.config.patch(inline_inbuilt_nn_modules=False):
        for model in (stock, prepared):
            torch._dynamo.reset()
            counter = CompileCounter()
            for block in model.layers:
                block.compile(backend=counter)
            got = []
            with torch.no_grad():
                for step in range(4):
                    if step == 2:
                        model.load_state_dict({k: v + 0.25 for k, v in model.state_dict().items()}, assign=True)
                    else:
                        for p in model.parameters():
                            p.add_(0.01)
                    got.append(model(torch.randn(3, 8, generator=torch.Generator().manual_seed(step))))
            outs.append(got)
            frames.append(counter.frame_count)
    for expected, actual in zip(*outs, strict=True):
        assert torch.equal(expected, actual)
    assert frames[1] <= frames[0]
    assert_same_state(stock, prepared)


@pytest.mark.parametrize("mode", ["hoist", "auto", "inline"])
@pytest.mark.parametrize("kind", ["spectral_norm", "chain"])
def test_meta_device_init_then_to_empty_and_load_trains_like_stock(kind, mode):
    # Pins (worked before): built under torch.device("meta"), prepared there (and called once
    # on meta inputs, as shape inference does), then to_empty(device="cpu") and load_state_dict
    # from a CPU twin; compiled training steps match stock's doing the same.
    source = build(kind, width=8, depth=2)
    records = []
    models = []
    for prepare_mode in (None, mode):
        with torch.device("meta"):
            model = build(kind, width=8, depth=2)
        if prepare_mode is not None:
            paramfold.prepare(model, prepare_mode)
        with torch.no_grad():
            model(torch.randn(3, 8, device="meta"))
        model.to_empty(device="cpu")
        model.load_state_dict(source.state_dict())
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="eager")

        def run(x, compiled=compiled):
            out = compiled(x)
            out.sum().backward()
            return out

        records.append(_train_steps(model, run, steps=2))
        models.append(model)
    _assert_same_steps(*records)
    assert_same_state(*models)


@pytest.mark.parametrize("mode", ["hoist", "auto", "inline"])
def test_a_filter_of_torchs_own_modules_guards_keeps_a_spectral_norms_training_flag(mode):
    # Regression (inline): the prepared class took its base's module (torch.nn.modules.linear),
    # so dynamo took the layer for one of torch's own, and the filter dropped the guards reached
    # through it: the chain's training flag too. A train()/eval() switch reran the graph of the
    # first call, never the power iteration (stock's Parametrized* class is a user module to
    # dynamo, whose guards the filter keeps: it recompiles).
    from torch.nn.utils.parametrizations import spectral_norm

    def build_sn() -> torch.nn.Module:
        torch.manual_seed(0)
        model = torch.nn.Sequential(spectral_norm(torch.nn.Linear(8, 8)), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        with torch.no_grad():  # far from converged: each power iteration moves the value
            model[0].parametrizations.weight.original.mul_(3)
            model[0].parametrizations.weight[0]._u.copy_(torch.randn(8))
        return model

    found = []
    for model in (build_sn(), paramfold.prepare(build_sn(), mode)):
        compiled = torch.compile(model, backend="eager",
                                 options={"guard_filter_fn": torch.compiler.skip_guard_on_inbuilt_nn_modules_unsafe})
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            outputs = [compiled(x) for training in (False, True, False, True) if model.train(training) is model]
        found.append((outputs, model.state_dict()))
        torch._dynamo.reset()
    (expected, expected_state), (outputs, state) = found
    for e, a in zip(expected, outputs):
        assert torch.equal(e, a)
    assert all(torch.equal(expected_state[k], state[k]) for k in expected_state)
