"""torch's hook-based ``weight_norm`` / ``spectral_norm`` through find, every mode and entry point.

Stock and prepared copies are built twice from one seed (a hook-based module holds a non-leaf
tensor that ``copy.deepcopy`` refuses, in stock too); everything is compared bitwise in eager and
under aot_eager: outputs, gradients, spectral_norm's ``weight_u``/``weight_v``, state dicts.
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from helpers import calls_like_stock_or_refused
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch.nn.utils import parametrize

import paramfold

LAYERS = {
    "linear": (lambda: nn.Linear(6, 6), (3, 6)),
    "conv1d": (lambda: nn.Conv1d(6, 6, 3, padding=1), (2, 6, 5)),
    "convtranspose1d": (lambda: nn.ConvTranspose1d(6, 6, 3, padding=1), (2, 6, 5)),
    "conv2d": (lambda: nn.Conv2d(6, 6, 3, padding=1), (2, 6, 4, 4)),
}


def _norm(kind):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch deprecates the hook-based API
        if kind == "weight_norm":
            return lambda m: torch.nn.utils.weight_norm(m, dim=1 if isinstance(m, nn.ConvTranspose1d) else 0)
        return lambda m: torch.nn.utils.spectral_norm(m, dim=1 if isinstance(m, nn.ConvTranspose1d) else None)


class Pair(nn.Sequential):
    """A user-defined container (dynamo compiles its forward as a frame of the user's)."""

    def forward(self, x):
        return self[2](self[1](self[0](x)))


def build(kind, layer, container=Pair):
    make, shape = LAYERS[layer]
    torch.manual_seed(0)
    norm = _norm(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model = container(norm(make()), nn.Tanh(), norm(make()))
    return model, torch.randn(*shape, generator=torch.Generator().manual_seed(1))


def _hooks(model):
    return [(path, list(m._forward_pre_hooks.items())) for path, m in model.named_modules()]


def _check_equal(stock, ours, what):
    for (n, a), (_, b) in zip(sorted(stock.items()), sorted(ours.items()), strict=True):
        assert (a is None and b is None) or torch.equal(a, b), f"{what} {n}"


def _backward_and_step(stock: nn.Module, ours: nn.Module, out_s: torch.Tensor, out_o: torch.Tensor) -> None:
    """A backward of each output (stock's first), gradients bitwise equal, the same SGD step on both."""
    out_s.square().sum().backward()
    out_o.square().sum().backward()
    _check_equal({n: p.grad for n, p in stock.named_parameters()}, {n: p.grad for n, p in ours.named_parameters()}, "grad")
    with torch.no_grad():
        for p in (*stock.parameters(), *ours.parameters()):
            p.sub_(0.1 * p.grad)
            p.grad = None


def _stock_and_prepared(build, mode: str, backend: str | None) -> tuple[nn.Module, nn.Module, nn.Module]:
    """Two models from one seed, the second prepared in ``mode``, and what runs it (compiled with
    ``backend`` after a dynamo reset, or itself)."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(build())
    stock, ours = models
    paramfold.prepare(ours, mode)
    if backend:
        torch._dynamo.reset()
    return stock, ours, torch.compile(ours, backend=backend) if backend else ours


def _steps_like_stock(stock: nn.Module, ours: nn.Module, run: nn.Module, x: torch.Tensor, grad: bool,
                      steps: int) -> None:
    """``steps`` calls of ``stock`` and of ``run`` (``ours``, compiled or not), each followed, with
    ``grad``, by a backward and an SGD step of both: outputs, gradients, buffers and state_dicts
    bitwise equal at each."""
    for _ in range(steps):
        with torch.set_grad_enabled(grad):
            out_s, out_o = stock(x), run(x)
        assert torch.equal(out_s, out_o)
        if grad:
            _backward_and_step(stock, ours, out_s, out_o)
        _same_state(stock, ours)


def _same_state(stock: nn.Module, ours: nn.Module) -> None:
    _check_equal(dict(stock.named_buffers()), dict(ours.named_buffers()), "buffer")
    _check_equal(stock.state_dict(), ours.state_dict(), "state_dict")


def _run(kind, layer, mode, train, compile_backend=None, steps=3, container=Pair):
    stock, x = build(kind, layer, container)
    ours, _ = build(kind, layer, container)
    stock.train(train), ours.train(train)
    if mode == "freeze":
        stock.requires_grad_(False), ours.requires_grad_(False)
    hooks = _hooks(ours)
    keys = sorted(ours.state_dict())
    paramfold.prepare(ours, mode)
    assert sorted(ours.state_dict()) == keys
    run = torch.compile(ours, backend=compile_backend) if compile_backend else ours
    grad = mode != "freeze"
    _steps_like_stock(stock, ours, run, x, grad, steps)
    paramfold.restore(ours)
    after = _hooks(ours)
    assert [(p, [(k, id(h)) for k, h in hs]) for p, hs in after] == [(p, [(k, id(h)) for k, h in hs]) for p, hs in hooks]
    with torch.set_grad_enabled(grad):
        assert torch.equal(stock(x), ours(x))


@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
def test_find_reports_hook_based_norms(kind):
    model, _ = build(kind, "conv1d")
    sites = paramfold.find(model)
    assert [(s.fqn, s.kind, s.hook_based) for s in sites] == [("0.weight", kind, True), ("2.weight", kind, True)]
    expected = {"weight_g", "weight_v"} if kind == "weight_norm" else {"weight_orig"}
    assert all(set(s.originals) == expected for s in sites)
    assert all(s.stateful == (kind == "spectral_norm") and s.requires_grad for s in sites)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("mode", ["hoist", "auto", "inline"])
@pytest.mark.parametrize("layer", sorted(LAYERS))
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
def test_every_mode_bitwise_equal_to_stock(kind, layer, mode, train):
    _run(kind, layer, mode, train)


@pytest.mark.parametrize("layer", sorted(LAYERS))
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
def test_freeze_bitwise_equal_to_stock(kind, layer):
    _run(kind, layer, "freeze", train=False)


@pytest.mark.parametrize("mode", ["hoist", "auto", "freeze"])
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
def test_compiled_bitwise_equal_to_stock(kind, mode):
    torch._dynamo.reset()
    _run(kind, "conv1d", mode, train=mode != "freeze", compile_backend="aot_eager", steps=2)


class Parametrizations(nn.Module):
    """A user's model that keeps its layers in a ModuleList it names ``parametrizations``."""

    def __init__(self, *layers):
        super().__init__()
        self.parametrizations = nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.parametrizations:
            x = layer(x)
        return x


@pytest.mark.parametrize("mode", ["hoist", "auto", "inline", "freeze"])
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
def test_a_users_container_named_parametrizations_is_not_inside_a_parametrization(kind, mode):
    # Regression: a module was taken to live inside a parametrization where any part of its path
    # was "parametrizations", so find() did not list these norms and prepare left them stock.
    model, _ = build(kind, "linear", Parametrizations)
    sites = paramfold.find(model)
    assert [(s.fqn, s.hook_based) for s in sites] == [("parametrizations.0.weight", True), ("parametrizations.2.weight", True)]
    if mode == "freeze":
        model.eval().requires_grad_(False)
    paramfold.prepare(model, mode)
    assert ("_paramfold" in vars(model.parametrizations[0])) == (mode != "inline")  # inline leaves hooks as they are
    _run(kind, "linear", mode, train=mode != "freeze", container=Parametrizations)


class _Hyper(nn.Module):
    """A parametrization whose own submodule has a hook-based norm."""

    def __init__(self, kind):
        super().__init__()
        self.net = _norm(kind)(nn.Linear(3, 3))

    def forward(self, w):
        return w + self.net(w)


@pytest.mark.parametrize("mode", ["auto", "inline"])
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
def test_a_hook_based_norm_on_a_submodule_of_a_parametrization_member_is_found(kind, mode):
    # Regression: find() listed a parametrize-based site on a member's submodule but not a
    # hook-based one there.
    def model():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
        parametrize.register_parametrization(m[0], "weight", _Hyper(kind))
        return m

    stock, ours = model(), model()
    found = [(s.fqn, s.hook_based) for s in paramfold.find(ours)]
    assert found == [("0.weight", False), ("0.parametrizations.weight.0.net.weight", True)]
    paramfold.prepare(ours, mode)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (stock, ours)]
    x = torch.randn(2, 3)
    for step in range(3):
        outputs = []
        for m, opt in zip((stock, ours), optimizers):
            opt.zero_grad()
            outputs.append(m(x))
            outputs[-1].square().sum().backward()
            opt.step()
        assert torch.equal(*outputs), step
        _check_equal(stock.state_dict(), ours.state_dict(), f"state_dict {step}")


def test_freeze_refuses_spectral_norm_in_training():
    model, _ = build("spectral_norm", "linear")
    model.requires_grad_(False)
    hooks = _hooks(model)
    with pytest.raises(paramfold.FoldError, match="stateful chain in training mode"):
        paramfold.prepare(model, "freeze")
    assert _hooks(model) == hooks


@pytest.mark.parametrize("entry", ["model", "method", "layers"])
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
def test_compiled_graph_holds_only_the_plain_ops(kind, entry):
    # The deterministic proxy of compile cost: hoisted, the norm is not traced at all.
    def ops(model, x):
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("eager")
        if entry == "model":
            torch.compile(model, backend=counter)(x)
        elif entry == "method":
            model.compile(backend=counter)
            model(x)
        else:
            for layer in (model[0], model[2]):
                layer.compile(backend=counter)
            model(x)
        return [n.target for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"]

    stock, x = build(kind, "conv1d")
    ours, _ = build(kind, "conv1d")
    paramfold.prepare(ours, "hoist")
    plain = Pair(nn.Conv1d(6, 6, 3, padding=1), nn.Tanh(), nn.Conv1d(6, 6, 3, padding=1))
    assert ops(ours, x) == ops(plain, x)
    assert len(ops(stock, x)) > len(ops(plain, x))
    if entry != "model":  # compiled in place: the next calls run compiled, and equal stock's
        for _ in range(2):
            assert torch.equal(ours(x), stock(x))
        _check_equal(dict(stock.named_buffers()), dict(ours.named_buffers()), "buffer")


@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
def test_torch_compile_of_a_prepared_nn_sequential_opens_the_scope(kind):
    # torch.compile wraps torch's own modules (nn.Sequential) in an extra frame that inlines their
    # __call__; the prepared root gives dynamo a forward frame of paramfold's own instead.
    ours, x = build(kind, "conv1d", container=nn.Sequential)
    stock, _ = build(kind, "conv1d", container=nn.Sequential)
    paramfold.prepare(ours, "hoist")
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    out = torch.compile(ours, backend=counter)(x)
    assert torch.equal(out, stock(x))
    names = [n.target.__name__ for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert names == ["conv1d", "tanh", "conv1d"]


def test_module_called_outside_a_scope_still_runs_the_norm_like_stock():
    stock, x = build("weight_norm", "linear")
    ours, _ = build("weight_norm", "linear")
    paramfold.prepare(ours, "hoist")
    with torch.no_grad():
        for m in (stock[0], ours[0]):
            m.weight_g.mul_(2.0)
    assert torch.equal(ours[0](x), stock[0](x))  # the layer alone: its own hook, as stock
    assert torch.equal(ours(x), stock(x))


def test_export_of_a_prepared_model_with_hook_based_norms_is_the_plain_program():
    stock, x = build("weight_norm", "conv1d")
    ours, _ = build("weight_norm", "conv1d")
    paramfold.prepare(ours.eval(), "auto")
    stock.eval()
    with torch.no_grad():
        program = paramfold.export(ours, (x,))
        assert torch.equal(program.module()(x), stock(x))
    targets = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten._weight_norm_interface.default not in targets


def _legacy_spectral_stack(norm: bool) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Conv1d(6, 4, 3, padding=1), nn.Tanh(), nn.ConvTranspose1d(4, 5, 3, padding=1), nn.Tanh(), nn.Conv1d(5, 5, 1)]
    if norm:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            for i in (0, 2, 4):
                torch.nn.utils.spectral_norm(layers[i], dim=1 if i == 2 else None)
    return nn.Sequential(*layers)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_audit_folds_legacy_spectral_norm_checkpoints_bitwise(tmp_path, suffix):
    stock = _legacy_spectral_stack(norm=True)
    x = torch.randn(2, 6, 7)
    for _ in range(3):
        stock(x)  # training forwards move weight_u / weight_v
    stock.eval()
    src = tmp_path / "legacy.pt"
    torch.save(stock.state_dict(), src)
    report = paramfold.audit_checkpoint(src)
    assert [(s.key, s.kind, s.foldable) for s in report.sites] == [
        (f"{i}.weight", "spectral_norm", True) for i in (0, 2, 4)
    ]
    out = tmp_path / f"plain{suffix}"
    paramfold.fold_checkpoint(src, out)
    if suffix == ".pt":
        folded = torch.load(out, weights_only=True)
    else:
        from safetensors.torch import load_file

        folded = load_file(out)
    plain = _legacy_spectral_stack(norm=False)
    plain.load_state_dict(folded, strict=True)
    with torch.no_grad():
        assert torch.equal(plain(x), stock(x))


def test_a_call_where_no_hook_is_detached_opens_and_closes_cleanly(monkeypatch):
    # Where a hook-based norm's value is computed where it is read (DTensor originals), its hook
    # stays in place: the module then has no value of paramfold's at all, and the call scope's
    # steady-state plan must not assume a parametrizations ModuleDict (it raised KeyError).
    import importlib

    scope = importlib.import_module("paramfold.scope")
    site_values = importlib.import_module("paramfold.site_values")

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(torch.nn.utils.weight_norm(nn.Linear(4, 4))).eval()

    stock, ours = build(), paramfold.prepare(build(), "auto")
    monkeypatch.setattr(scope, "distributed", lambda site: True)
    monkeypatch.setattr(site_values, "distributed", lambda site: True)
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(ours(x), stock(x))
    assert ours[0].__dict__["_paramfold"].users == 0


@pytest.mark.parametrize("mode", ["hoist", "auto", "freeze", "inline"])
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
def test_parametrize_cached_does_not_cache_a_hook_based_norm(kind, mode):
    # parametrize.cached() caches parametrizations only: a hook-based norm's hook computes its
    # weight at every call inside the block too (spectral_norm's power iteration runs each time,
    # weight_norm follows an edit of weight_g). auto and freeze used to serve the block's first
    # value from stock's cache (found by the event-sequence fuzzer).
    train = kind == "spectral_norm" and mode != "freeze"
    stock, x = build(kind, "linear")
    ours, _ = build(kind, "linear")
    for m in (stock, ours):
        m.train(train).requires_grad_(False)
    paramfold.prepare(ours, mode)
    outs = []
    with torch.no_grad():
        for m in (stock, ours):
            with torch.nn.utils.parametrize.cached():
                first, second = m(x), m(2 * x)
                (m[0].weight_g if kind == "weight_norm" else m[0].weight_orig).add_(0.5)
                outs.append((first, second, m(x)))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
    _check_equal(dict(stock.named_buffers()), dict(ours.named_buffers()), "buffer")


@pytest.mark.parametrize("mode", ["hoist", "auto", "freeze", "inline"])
def test_a_hook_reading_unregistered_tensors_stays_stock(mode):
    # FSDP1 with use_orig_params=False leaves weight_g/weight_v as plain attributes, which torch's
    # hook reads as well: find() and prepare() raised a bare KeyError('weight_g').
    import warnings

    def build():
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model = nn.Sequential(torch.nn.utils.weight_norm(nn.Linear(4, 6)), nn.Tanh(), nn.Linear(6, 3))
        for name in ("weight_g", "weight_v"):
            setattr(model[0], name, model[0]._parameters.pop(name).detach().clone())
        return model.eval().requires_grad_(mode != "freeze")

    stock, ours = build(), build()
    assert paramfold.find(ours) == []
    paramfold.prepare(ours, mode)
    x = torch.randn(3, 4)
    assert torch.equal(ours(x), stock(x))
    assert len(ours[0]._forward_pre_hooks) == 1


def _tied_after_norm(kind, train):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), _norm(kind)(nn.Linear(4, 6, bias=False)))
    return model.train(train).requires_grad_(train)


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("mode", ["hoist", "freeze", "auto", "inline"])
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
def test_a_parameter_registered_over_a_hook_normed_weight_is_refused(kind, mode, train):
    # transformers' tie_weights() on a hook-normed lm_head: `head.weight = embed.weight`. Stock's
    # hook then raises at every call; hoist/freeze/auto served g*v/|v| instead, from a value
    # written into __dict__ over the tied Parameter, which stayed there after restore.
    if mode == "freeze" and train:
        pytest.skip("freeze refuses a training spectral_norm, and parameters that require grad")
    stock, ours = _tied_after_norm(kind, train), _tied_after_norm(kind, train)
    paramfold.prepare(ours, mode)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    assert torch.equal(stock(x), ours(x))
    shared = nn.Parameter(torch.randn(6, 4, generator=torch.Generator().manual_seed(2)))
    stock[2].weight = shared
    ours[2].weight = shared
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    for _ in range(2):  # refused at every call, as stock's hook raises at every call
        with pytest.raises(TypeError, match="cannot assign"):
            stock(x)
        with pytest.raises(TypeError if mode == "inline" else paramfold.FoldError) as refused:
            ours(x)
    if mode == "inline":  # the hook stays: stock's (a training spectral_norm's power iteration ran)
        _check_equal(stock.state_dict(), ours.state_dict(), "state_dict")
    else:
        assert "'2'" in str(refused.value) and f"remove_{kind}" in str(refused.value)
        _check_equal(before, ours.state_dict(), "state_dict")  # left as it was
    assert ours[2].weight is shared and "weight" not in vars(ours[2])
    paramfold.restore(ours)
    assert ours[2].weight is shared and "weight" not in vars(ours[2])
    assert [(p, [type(h) for _, h in hs]) for p, hs in _hooks(ours)] == [(p, [type(h) for _, h in hs]) for p, hs in _hooks(stock)]
    with pytest.raises(TypeError, match="cannot assign"):
        ours(x)


class _Double(nn.Module):
    def forward(self, X):
        return X * 2


@pytest.mark.parametrize("when", ["before prepare", "after prepare"])
@pytest.mark.parametrize("mode", ["hoist", "freeze", "auto", "inline"])
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
def test_a_parametrization_registered_over_a_hook_normed_weight_runs_or_is_refused_as_stock(kind, mode, when):
    # Regression: `layer.weight = p` then register_parametrization(layer, "weight", ...) on a
    # hook-normed layer (torchao's unwrap_tensor_subclass after quantize_ does this): stock's hook
    # cannot assign its value through the parametrization and raises at every call; hoist, freeze
    # and auto ran, serving the parametrization's value and ignoring the norm. Before prepare the
    # hook is now left as stock's; after it the call is refused, the model left as it was.
    models = []
    for _ in range(2):
        model = _tied_after_norm(kind, False)
        models.append(model)
    stock, ours = models

    def parametrize_weight(model):
        model[2].weight = nn.Parameter(torch.ones(6, 4), requires_grad=False)
        parametrize.register_parametrization(model[2], "weight", _Double())

    for model in models if when == "before prepare" else [stock]:
        parametrize_weight(model)
    paramfold.prepare(ours, mode)
    if when == "after prepare":
        parametrize_weight(ours)
    x = torch.randn(3, 4)
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    with pytest.raises(RuntimeError, match="right_inverse"):
        stock(x)
    refused = paramfold.FoldError if when == "after prepare" and mode != "inline" else RuntimeError
    with pytest.raises(refused, match="parametrized tensor" if refused is paramfold.FoldError else "right_inverse"):
        ours(x)
    _check_equal(before, ours.state_dict(), "state_dict")
    paramfold.restore(ours)
    with pytest.raises(RuntimeError, match="right_inverse"):
        ours(x)
    _check_equal(stock.state_dict(), ours.state_dict(), "state_dict")


class _TiesInside(nn.Sequential):
    def forward(self, x):
        if getattr(self, "tie", None) is not None:
            self[2].weight = self.tie
        return self[2](self[1](self[0](x)))


@pytest.mark.parametrize("mode", ["hoist", "auto"])
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
def test_a_parameter_registered_over_a_hook_normed_weight_inside_the_forward_is_not_hidden_after(kind, mode):
    # The layer below another forward pre-hook: its norm's hook stays in, and the call's scope takes
    # the last value out of its __dict__ meanwhile, to put back after; not over the tied parameter.
    stock, ours = (_TiesInside(*_tied_after_norm(kind, False)) for _ in range(2))
    for model in (stock, ours):
        model[2].register_forward_pre_hook(lambda m, args: None)
    paramfold.prepare(ours, mode)
    x = torch.randn(3, 4)
    assert torch.equal(stock(x), ours(x))
    shared = nn.Parameter(torch.ones(6, 4))
    for model in (stock, ours):
        model.tie = shared
        with pytest.raises(TypeError, match="cannot assign"):
            model(x)
    assert ours[2].weight is shared and "weight" not in vars(ours[2]) and "weight" not in vars(stock[2])


@pytest.mark.parametrize("mode", ["hoist", "freeze", "auto"])
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
def test_a_parameter_registered_over_a_hook_normed_weight_before_prepare_stays_stock(kind, mode):
    stock, ours = _tied_after_norm(kind, False), _tied_after_norm(kind, False)
    for model in (stock, ours):
        model[2].weight = nn.Parameter(torch.ones(6, 4), requires_grad=False)
    assert paramfold.find(ours) == []
    paramfold.prepare(ours, mode)
    x = torch.randn(3, 4)
    for model in (stock, ours):
        with pytest.raises(TypeError, match="cannot assign"):
            model(x)
    assert "weight" not in vars(ours[2])


class _TiedHead(nn.Module):
    """A forward that reads the head's ``weight`` before calling the head (a tied embedding)."""

    def __init__(self, hook_based: bool):
        super().__init__()
        head = nn.Linear(6, 11, bias=False)
        if hook_based:
            self.head = _norm("weight_norm")(head)
        else:
            self.head = torch.nn.utils.parametrizations.weight_norm(head)

    def forward(self, idx):
        return self.head(torch.tanh(nn.functional.embedding(idx, self.head.weight)))


@pytest.mark.parametrize("mode", ["hoist", "inline", "freeze", "auto"])
def test_a_read_before_the_layers_call_is_this_calls_value_documented(mode):
    # README, Hook-based norms: read before the layer's call, stock's hook-based norm gives the
    # value its hook left at the previous call (stale after load_state_dict); hoist, freeze and
    # auto give this call's, as the parametrization version does in stock; inline is stock's.
    idx = torch.tensor([[1, 2, 3]])
    torch.manual_seed(1)
    checkpoint = _TiedHead(True).state_dict()
    outputs = {}
    for name, hook_based in (("stock", True), ("ours", True), ("parametrization", False)):
        torch.manual_seed(0)
        model = _TiedHead(hook_based).eval().requires_grad_(False)
        if name == "ours":
            paramfold.prepare(model, mode)
        with torch.no_grad():
            model(idx)
            if hook_based:
                model.load_state_dict(checkpoint)
            else:
                g, v = checkpoint["head.weight_g"], checkpoint["head.weight_v"]
                model.head.parametrizations.weight.original0.copy_(g)
                model.head.parametrizations.weight.original1.copy_(v)
            outputs[name] = model(idx)
    assert not torch.equal(outputs["stock"], outputs["parametrization"])  # stock's stale read
    expected = outputs["stock"] if mode == "inline" else outputs["parametrization"]
    assert torch.equal(outputs["ours"], expected)


def _decay_g(module, args):
    with torch.no_grad():
        module.weight_g.mul_(0.9)


class _RegistersAHookAtItsFirstCall(nn.Module):
    def __init__(self, prepend: bool):
        super().__init__()
        self.l = _norm("weight_norm")(nn.Linear(4, 4))
        self.prepend, self.registered = prepend, False

    def forward(self, x):
        if not self.registered:
            self.l.register_forward_pre_hook(_decay_g, prepend=self.prepend)
            self.registered = True
        return self.l(x)


@pytest.mark.parametrize("prepend", [True, False])
@pytest.mark.parametrize("mode", ["hoist", "freeze", "auto"])
def test_a_pre_hook_registered_inside_a_call_takes_stocks_place_among_the_norms(mode, prepend):
    # Regression: torch's norm hook is out of _forward_pre_hooks during a call; a hook registered
    # then with prepend=True went *after* it when the hook came back, for good (also after
    # restore): every later call ran the decay after the norm, not before (outputs off by 0.06-0.14).
    x = torch.randn(2, 4)
    models = []
    for prepared in (False, True):
        torch.manual_seed(0)
        model = _RegistersAHookAtItsFirstCall(prepend).eval().requires_grad_(False)
        models.append(paramfold.prepare(model, mode) if prepared else model)
    stock, ours = models
    with torch.no_grad():
        stock(x), ours(x)  # the call that registers it (seen from the next call: README)
        orders = [[type(h).__name__ for h in m.l._forward_pre_hooks.values()] for m in models]
        assert orders[0] == orders[1] == (["function", "WeightNorm"] if prepend else ["WeightNorm", "function"])
        for _ in range(2):
            assert torch.equal(ours(x), stock(x))
        paramfold.restore(ours)
        assert torch.equal(ours(x), stock(x))


class _TiedMaxNormEmbedding(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.e = _norm(kind)(nn.Embedding(10, 4, max_norm=0.5))

    def forward(self, i):
        h = self.e(i) + self.e((i + 3) % 10)  # each lookup renormalises its rows in place
        return nn.functional.linear(h, self.e.weight)  # a tied head, read after both


@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
@pytest.mark.parametrize("mode", ["hoist", "freeze", "auto"])
@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_a_max_norm_embedding_looked_up_twice_is_computed_at_each_call_like_stock(mode, kind, backend):
    # Regression: one value served for the call was renormalised by both lookups, and the tied
    # head saw the rows of both (off by up to 1.08); stock's hook computes a fresh weight at each
    # call. (The parametrization versions were already computed at every read.)
    i = torch.tensor([0, 1, 2])
    outs = []
    for prepared in (False, True):
        torch.manual_seed(0)
        model = _TiedMaxNormEmbedding(kind).eval().requires_grad_(False)
        if prepared:
            paramfold.prepare(model, mode)
        call = torch.compile(model, backend=backend) if backend else model
        with torch.no_grad():
            outs.append([call(i) for _ in range(2)])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def _monitored_calls(kind, mode, where, backend=None, steps=4):
    """Per model (stock, prepared): what a forward pre-hook reading ``m.weight`` of each normed
    layer saw before the norm's hook ran, and the outputs, over calls with an update between each
    (a hook on every module, or one on each layer registered with ``prepend=True``)."""
    train = mode != "freeze"
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
    results = []
    for prepared in (False, True):
        model, _ = build(kind, "linear")
        model.train(train).requires_grad_(train)
        seen = []

        def monitor(m, args):
            if isinstance(m, nn.Linear):
                seen.append(m.weight.detach().clone())

        if where == "prepend":
            for layer in (model[0], model[2]):
                layer.register_forward_pre_hook(monitor, prepend=True)
        if prepared:
            paramfold.prepare(model, mode)
        call = torch.compile(model, backend=backend) if backend else model
        handle = nn.modules.module.register_module_forward_pre_hook(monitor) if where == "global" else None
        outs = []
        try:
            for _ in range(steps):
                with torch.set_grad_enabled(train):
                    out = call(x)
                outs.append(out.detach())
                if train:
                    out.square().sum().backward()
                with torch.no_grad():
                    for p in model.parameters():
                        p.sub_(0.1 * p.grad) if p.grad is not None else p.mul_(0.9)
                        p.grad = None
        finally:
            if handle is not None:
                handle.remove()
        results.append((seen, outs, {n: b.clone() for n, b in model.named_buffers()}))
    return results


@pytest.mark.parametrize("where", ["global", "prepend"])
@pytest.mark.parametrize("mode", ["hoist", "freeze", "auto", "inline"])
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
def test_a_pre_hook_reading_the_weight_before_the_norms_hook_sees_the_last_calls_value(kind, mode, where):
    # Regression: a forward pre-hook that runs before the norm's own (a global one, a weight
    # monitor; one registered with prepend=True) and reads m.weight got an AttributeError under
    # hoist, freeze and auto (the value of the last call is out of __dict__ while the norm's hook
    # is in); stock gives it that value.
    (seen_s, outs_s, bufs_s), (seen_o, outs_o, bufs_o) = _monitored_calls(kind, mode, where)
    assert len(seen_s) == len(seen_o) == 8
    assert all(torch.equal(a, b) for a, b in zip(seen_s, seen_o))
    assert all(torch.equal(a, b) for a, b in zip(outs_s, outs_o))
    _check_equal(bufs_s, bufs_o, "buffer")


@pytest.mark.parametrize("mode", ["hoist", "freeze", "auto"])
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
def test_a_compiled_global_pre_hook_reading_the_weight_sees_the_last_calls_value(kind, mode):
    torch._dynamo.reset()
    (seen_s, outs_s, bufs_s), (seen_o, outs_o, bufs_o) = _monitored_calls(kind, mode, "global", "aot_eager", steps=3)
    assert len(seen_s) == len(seen_o) == 6
    assert all(torch.equal(a, b) for a, b in zip(seen_s, seen_o))
    assert all(torch.equal(a, b) for a, b in zip(outs_s, outs_o))
    _check_equal(bufs_s, bufs_o, "buffer")


class _ReplacesTheWeight(nn.Module):
    """Assigns (or deletes) ``layer.weight`` inside the forward, before or between the layer's two
    calls: stock's pre-hook computes the weight again at the layer's next call."""

    def __init__(self, kind, action, when):
        super().__init__()
        self.layer = _norm(kind)(nn.Linear(6, 6))
        self.action, self.when = action, when

    def replace(self):
        if self.action == "assign":
            # (Not read from layer.weight: a read before the layer's first call is documented to
            # get this call's value, not the last call's.)
            self.layer.weight = torch.full((6, 6), 0.5)
            return self.layer.weight.sum()  # the assigned tensor, until the layer's next call
        del self.layer.weight
        return 0.0

    def forward(self, x):
        read = self.replace() if self.when == "before" else 0.0
        y = self.layer(x)
        if self.when == "between":
            read = self.replace()
        return y + self.layer(x).tanh() + read


@pytest.mark.parametrize("backend", [None, "eager"])
@pytest.mark.parametrize("when", ["before", "between"])
@pytest.mark.parametrize("action", ["assign", "del"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("mode", ["hoist", "inline", "freeze", "auto"])
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
def test_the_weight_assigned_or_deleted_inside_the_forward_is_computed_again_at_the_next_call(
        kind, mode, train, action, when, backend):
    # Regression: hoist, freeze and auto served the layer's next call the assigned tensor (and
    # raised AttributeError after del), where stock's pre-hook computes the weight again.
    if mode == "freeze" and train and kind == "spectral_norm":
        pytest.skip("freeze refuses a training spectral_norm")
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
    grad = mode != "freeze"
    stock, ours, run = _stock_and_prepared(lambda: _ReplacesTheWeight(kind, action, when).train(train).requires_grad_(grad), mode, backend)
    _steps_like_stock(stock, ours, run, x, grad, 3)


class _AssignsThenSwitches(nn.Module):
    """Assigns ``layer.weight`` after the layer's call, then calls the layer again under other
    settings (its training mode flipped, its requires_grad flipped, an autocast region) and reads
    ``layer.weight`` after: stock's hook computed it again at that call and stored it."""

    def __init__(self, kind, how):
        super().__init__()
        self.layer = _norm(kind)(nn.Linear(6, 6))
        self.how = how

    def switch(self):
        if self.how == "flip":
            self.layer.train(not self.layer.training)
        elif self.how == "rg":
            self.layer.requires_grad_(not self.layer.bias.requires_grad)

    def forward(self, x):
        y = self.layer(x)
        self.layer.weight = torch.full((6, 6), 0.5)
        self.switch()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.how == "autocast"):
            z = self.layer(y).float()
        self.switch()
        return z + self.layer.weight.sum()


@pytest.mark.parametrize("backend", [None, "eager"])
@pytest.mark.parametrize("how", ["flip", "rg", "autocast"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("mode", ["hoist", "inline", "freeze", "auto"])
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
def test_the_weight_assigned_inside_the_forward_is_the_hooks_after_a_call_under_other_settings(
        kind, mode, train, how, backend):
    # Regression: hoist, freeze and auto computed the layer's second call's weight afresh for
    # the changed settings and put the assigned tensor back after it, over the value the norm's
    # hook (back in since the assignment) stored: the read after it, and the model after the
    # forward, got the assigned tensor, where stock's get the hook's value.
    if mode == "freeze" and train and kind == "spectral_norm":
        pytest.skip("freeze refuses a training spectral_norm")
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
    grad = mode != "freeze"
    stock, ours, run = _stock_and_prepared(lambda: _AssignsThenSwitches(kind, how).train(train).requires_grad_(grad), mode, backend)
    for _ in range(3):
        with torch.set_grad_enabled(grad):
            out_s, out_o = stock(x), run(x)
        assert torch.equal(out_s, out_o)
        assert torch.equal(stock.layer.weight, ours.layer.weight)
        if grad:
            try:
                _backward_and_step(stock, ours, out_s, out_o)
            except RuntimeError:  # an eval spectral_norm switched to training: its power iteration
                with pytest.raises(RuntimeError, match="inplace"):  # wrote a buffer the graph saved
                    out_o.square().sum().backward()
                grad = False  # the later calls without grad
        _same_state(stock, ours)


class _BackwardThenTrains(nn.Module):
    """A backward inside the forward that frees the graph of the layer's value, then the layer,
    in eval mode, switched to training and called again, and its weight read after."""

    def __init__(self, kind):
        super().__init__()
        self.layer = _norm(kind)(nn.Linear(6, 6))

    def forward(self, x):
        y = self.layer(x)
        y.square().sum().backward()
        self.layer.train()
        z = self.layer(y.detach())
        self.layer.eval()
        return z + self.layer.weight.sum()


@pytest.mark.parametrize("backend", [None, "eager"])
@pytest.mark.parametrize("mode", ["hoist", "inline", "auto"])
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
def test_a_layer_switched_to_training_after_a_backward_inside_the_forward_runs_like_stock(kind, mode, backend):
    # Regression (fixed with the put-back after an assignment, d52b61d): the backward freed the
    # value's graph, which puts the norm's hook back in for the rest of the call; the layer's next
    # call, in training, went through the nested check, which refused an eval spectral_norm
    # switched to training with a FoldError (eager hoist and auto), where stock's hook runs.
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
    stock, ours, run = _stock_and_prepared(lambda: _BackwardThenTrains(kind).eval(), mode, backend)
    for _ in range(3):
        out_s, out_o = stock(x), run(x)
        assert torch.equal(out_s, out_o)
        assert torch.equal(stock.layer.weight, ours.layer.weight)
        _check_equal({n: p.grad for n, p in stock.named_parameters()}, {n: p.grad for n, p in ours.named_parameters()}, "grad")
        _same_state(stock, ours)


class _NormRunsItsHook(nn.Module):
    """A forward where torch's norm hook itself runs, and assigns ``layer.weight``, inside the
    call: a training spectral_norm's layer called twice (its second call runs the hook), or a
    layer with another forward pre-hook (which keeps the norm's hook in: it runs at every call)."""

    def __init__(self, kind, path):
        super().__init__()
        self.layer = _norm(kind)(nn.Linear(6, 6))
        self.path = path
        if path == "kept_in":
            self.layer.register_forward_pre_hook(lambda m, args: None)

    def forward(self, x):
        y = self.layer(x)
        return y + self.layer(y.tanh()) if self.path == "twice" else y


@pytest.mark.parametrize("path", ["twice", "kept_in"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("mode", ["hoist", "freeze", "auto"])
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
def test_the_norms_own_assignment_of_its_weight_changes_nothing_and_compiles_as_one_frame(kind, mode, train, path):
    # Regression (the first fix of the in-forward assignment above, reverted): torch's hook sets
    # layer.weight itself whenever it runs, and that reached the path for a user's assignment,
    # whose lock broke the compiled forward (a second frame; the kept-in hook run eagerly).
    if mode == "freeze" and train and kind == "spectral_norm":
        pytest.skip("freeze refuses a training spectral_norm")
    if path == "twice" and not (train and kind == "spectral_norm"):
        pytest.skip("served both calls: the hook does not run")
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
    grad = mode != "freeze"
    frames, breaks, runs = [], [], []
    for prepared in (False, True):
        torch.manual_seed(0)
        model = _NormRunsItsHook(kind, path).train(train).requires_grad_(grad)
        if prepared:
            paramfold.prepare(model, mode)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        counter = CompileCounterWithBackend("eager")
        run = torch.compile(model, backend=counter)
        record = []
        for _ in range(3):
            with torch.set_grad_enabled(grad):
                out = run(x)
            if grad:
                out.square().sum().backward()
            record.append((out.detach(), {n: p.grad for n, p in model.named_parameters()},
                           {n: b.clone() for n, b in model.named_buffers()}, model.state_dict()))
            model.zero_grad(set_to_none=True)
        frames.append(counter.frame_count)
        breaks.append(sum(torch._dynamo.utils.counters["graph_break"].values()))
        runs.append(record)
    assert frames[1] == frames[0] == 1
    assert breaks[1] == breaks[0] == 0
    for (out_s, grads_s, bufs_s, sd_s), (out_o, grads_o, bufs_o, sd_o) in zip(*runs):
        assert torch.equal(out_s, out_o)
        _check_equal(grads_s, grads_o, "grad")
        _check_equal(bufs_s, bufs_o, "buffer")
        _check_equal(sd_s, sd_o, "state_dict")


class _WeightNormDoubled(torch.nn.utils.weight_norm.__globals__["WeightNorm"]):
    def compute_weight(self, module):
        return super().compute_weight(module) * 2


def _norm_hook(layer: nn.Module):
    return next(h for h in layer._forward_pre_hooks.values() if hasattr(h, "compute_weight"))


HOOK_OR_LAYER_REPLACED = {
    "hook's __dict__, another dim": ("weight_norm", lambda m: object.__setattr__(
        _norm_hook(m[0]), "__dict__", {**vars(_norm_hook(m[0])), "dim": 1})),
    "spectral hook's __dict__, another dim": ("spectral_norm", lambda m: object.__setattr__(
        _norm_hook(m[0]), "__dict__", {**vars(_norm_hook(m[0])), "dim": 1})),
    "hook's class": ("weight_norm", lambda m: setattr(_norm_hook(m[0]), "__class__", _WeightNormDoubled)),
    "layer's __dict__, other originals": ("weight_norm", lambda m: object.__setattr__(m[0], "__dict__", {
        **vars(m[0]), "_parameters": {k: nn.Parameter(v.detach() * 1.5, requires_grad=v.requires_grad)
                                      for k, v in m[0]._parameters.items()}})),
}


@pytest.mark.parametrize("backend", [None, "eager"])
@pytest.mark.parametrize("change", list(HOOK_OR_LAYER_REPLACED.values()), ids=list(HOOK_OR_LAYER_REPLACED))
@pytest.mark.parametrize("mode", ["hoist", "inline", "freeze", "auto"])
def test_a_norms_hook_or_layer_replaced_wholesale_is_never_served_stale(mode, change, backend):
    # Regression: freeze and auto checked the tag of the hook's __dict__ (`hook.dim = 1` was
    # seen) but not that it was still the hook's, nor the hook's class, and read the layer's
    # originals through the `_parameters` dict captured at prepare, which a layer's new __dict__
    # no longer holds: all three served the old value at every later call.
    kind, replace = change
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))

    def build():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return nn.Sequential(_norm(kind)(nn.Linear(16, 16)), nn.Tanh(), _norm(kind)(nn.Linear(16, 16))).eval()

    stock, ours, run = _stock_and_prepared(lambda: build().requires_grad_(False), mode, backend)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(run(x), stock(x))
        for model in (stock, ours):
            replace(model)
        calls_like_stock_or_refused(stock, run, x, 2)
        _same_state(stock, ours)


class _CallsAround(nn.Module):
    """Calls its spectral_norm layer without going through the layer's class's ``__call__``
    (some wrappers and old code do), which in stock runs its hooks all the same."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.a = _norm("spectral_norm")(nn.Linear(6, 8))
        self.b = nn.Linear(8, 2)

    def forward(self, x):
        if self.how == "nn.Module.__call__":
            h = nn.Module.__call__(self.a, x)
        elif self.how == "_call_impl":
            h = self.a._call_impl(x)
        else:
            h = self.a._wrapped_call_impl(x)
        return self.b(torch.tanh(h))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("how", ["nn.Module.__call__", "_call_impl", "_wrapped_call_impl"])
@pytest.mark.parametrize("mode", ["hoist", "auto"])
def test_a_training_spectral_norm_called_around_its_classes_call_runs_its_power_iteration_like_stock(mode, how, compiled):
    # Regression (helper hD, 2026-12-06): such a call skipped the read-once class's __call__,
    # which marks the call for the stand-ins; its forward then took it for a forward called
    # directly (no hook in stock), never marked the value served, and the power iteration was
    # put back at every call: weight_u never moved, off by 0.5 from the first call.
    torch.manual_seed(0)
    stock = _CallsAround(how)
    torch.manual_seed(0)
    ours = paramfold.prepare(_CallsAround(how), mode)
    calls = [torch.compile(m, backend="eager") if compiled else m for m in (stock, ours)]
    for step in range(6):
        x = torch.randn(3, 6)
        outs = [call(x) for call in calls]
        for out in outs:
            out.sum().backward()
        assert torch.equal(outs[1], outs[0]), step
        for name, tensor in stock.named_buffers():
            assert torch.equal(dict(ours.named_buffers())[name], tensor), (step, name)
        assert torch.equal(ours.a.weight, stock.a.weight), step
        assert torch.equal(ours.a.weight_orig.grad, stock.a.weight_orig.grad), step
    torch._dynamo.reset()


@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
@pytest.mark.parametrize("mode", ["hoist", "auto", "freeze"])
@pytest.mark.parametrize("train", [True, False])
def test_a_function_compiled_around_a_prepared_hook_norm_model_makes_stocks_graphs_and_steps_like_stock(kind, mode, train):
    # Regression: with no call scope over it (a function compiled around the model), a prepared
    # layer's traced call asked torch whether a checkpoint's recomputation was under way, a query
    # dynamo cannot trace: a graph break at each hook-based norm's layer (3 graphs, 1 break where
    # stock makes 1, 0), the model's call run eagerly.
    if mode == "freeze" and train:
        pytest.skip("freeze serves inference only")
    gc.collect()  # checkpoint regions of earlier tests, whose recomputation could still replay
    stock, x = build(kind, "linear")
    ours, _ = build(kind, "linear")
    for m in (stock, ours):
        m.train(train)
        if mode == "freeze":
            m.requires_grad_(False)
    paramfold.prepare(ours, mode)

    def step(model, x):
        return torch.tanh(model(x * 2)) + 1

    counts = []
    for model in (stock, ours):
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("eager")
        compiled = torch.compile(step, backend=counter)
        outs = []
        for _ in range(3):
            with torch.set_grad_enabled(train):
                out = compiled(model, x)
            if train:
                out.square().sum().backward()
                with torch.no_grad():
                    for p in model.parameters():
                        p.sub_(0.1 * p.grad)
                        p.grad = None
            outs.append(out.detach())
        counts.append((counter.frame_count, outs))
    (stock_frames, stock_outs), (our_frames, our_outs) = counts
    assert stock_frames == our_frames == 1
    for a, b in zip(stock_outs, our_outs):
        assert torch.equal(a, b)
    _same_state(stock, ours)
