"""prepare / restore against stock PyTorch on real parametrizations (eager, bitwise)."""

from __future__ import annotations

import abc
import copy
import types
import typing

import pytest
import torch
from torch import nn
from helpers import LoRA, RunningScale, build, classes, grads, seed_model
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import spectral_norm, weight_norm

import paramfold
import paramfold.testing as pt
from paramfold.state import STATE_ATTR

KINDS = ["weight_norm", "spectral_norm", "orthogonal:matrix_exp", "orthogonal:cayley",
         "orthogonal:householder", "split", "chain", "buffer", "lora"]
MODES = ["hoist", "inline", "auto"]


def _step(model, x, opt=None):
    out = model(x)
    out.float().square().mean().backward()
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=False)
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES)
def test_training_steps_bitwise_equal_to_stock(kind, mode):
    # Outputs, gradients of every original, buffers (spectral_norm's _u/_v), state dicts and
    # attribute reads over three update steps, then an exact restore: see paramfold.testing.
    pt.assert_equivalent(build(kind), torch.randn(5, 32), mode, steps=3)


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "lora"])  # LoRA: see test_lora_adapters_*
def test_freeze_matches_stock_in_inference(kind):
    stock = build(kind).eval().requires_grad_(False)
    ours = paramfold.prepare(copy.deepcopy(stock), "freeze")
    x = torch.randn(4, 32)
    with torch.no_grad():
        assert torch.equal(stock(x), ours(x))
        computed = _count_computes(lambda: ours(x), "paramfold.freeze")
        assert computed.result is not None and torch.equal(stock(x), computed.result)
        assert computed.calls == 0  # the second call is served from the frozen values


def test_freeze_refuses_trainable_and_training_stateful_and_changes_nothing():
    model = build("weight_norm")
    before = pt.structure(model)
    with pytest.raises(paramfold.FoldError, match=r"layers\.0\.weight.*requires grad.*mode='auto'"):
        paramfold.prepare(model, "freeze")
    pt.assert_same_structure(before, pt.structure(model))

    sn = build("spectral_norm").requires_grad_(False)  # train mode: power iteration mutates _u/_v
    with pytest.raises(paramfold.FoldError, match="stateful chain in training mode"):
        paramfold.prepare(sn, "freeze")
    paramfold.prepare(sn.eval(), "freeze")  # eval form is stateless: allowed
    sn.train()
    # Named by its path below the model called, so the user can tell which layer it means.
    with pytest.raises(paramfold.FoldError, match=r"^layers\.0\.weight \(ParametrizedLinear\) was prepared with mode='freeze' but now"):
        sn(torch.randn(2, 32))


def test_freeze_rematerialises_after_load_state_dict_and_inplace_edits():
    stock = build("weight_norm").eval().requires_grad_(False)
    ours = paramfold.prepare(copy.deepcopy(stock), "freeze")
    x = torch.randn(3, 32)
    ours(x)  # materialise once
    other = build("weight_norm", seed=1).state_dict()
    stock.load_state_dict(other)
    ours.load_state_dict(other)
    assert torch.equal(stock(x), ours(x))
    with torch.no_grad():
        stock.layers[1].parametrizations.weight.original1.mul_(3)
        ours.layers[1].parametrizations.weight.original1.mul_(3)
    assert torch.equal(stock(x), ours(x))
    # Reading the attribute outside a call is never stale either.
    assert torch.equal(stock.layers[1].weight, ours.layers[1].weight)


def test_auto_switches_between_freeze_and_hoist_as_requires_grad_changes():
    stock = build("weight_norm").requires_grad_(False)
    ours = paramfold.prepare(copy.deepcopy(stock), "auto")
    x = torch.randn(3, 32)
    assert torch.equal(stock(x), ours(x))
    frozen = _count_computes(lambda: ours(x), "paramfold.freeze")
    hoisted = _count_computes(lambda: ours(x), "paramfold.site_values", "eager_value")
    assert frozen.calls == 0 and hoisted.calls == 0  # frozen: served without computing
    stock.requires_grad_(True)
    ours.requires_grad_(True)
    out_s = stock(x)
    hoisted = _count_computes(lambda: ours(x), "paramfold.site_values", "eager_value")
    assert hoisted.calls == 3  # now hoisted: computed once per site per call, with autograd
    out_o = hoisted.result
    assert out_o.requires_grad
    out_s.sum().backward()
    out_o.sum().backward()
    assert grads(stock).keys() == grads(ours).keys()
    for name, gs in grads(stock).items():
        assert torch.equal(gs, grads(ours)[name]), name
    stock.requires_grad_(False)
    ours.requires_grad_(False)
    refrozen = _count_computes(lambda: ours(x), "paramfold.freeze")
    assert refrozen.calls == 3 and torch.equal(refrozen.result, stock(x))  # frozen again, fresh


class _Counted:
    def __init__(self):
        self.calls = 0
        self.result = None


def _count_computes(call, module_name, attr="compute"):
    """Run ``call`` counting the value computations that ``module_name`` makes (through ``attr``)."""
    import importlib
    from unittest import mock

    module = importlib.import_module(module_name)
    counted = _Counted()
    real = getattr(module, attr)

    def counting(*args):
        counted.calls += 1
        return real(*args)

    with mock.patch.object(module, attr, counting):
        counted.result = call()
    return counted


def test_restore_is_exact_and_optimizer_survives():
    model = build("chain")
    before = pt.structure(model, values=False)  # the step changes values
    params = list(model.parameters())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    paramfold.prepare(model, "hoist")
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    _step(model, torch.randn(2, 32), opt)
    paramfold.restore(model)
    pt.assert_same_structure(before, pt.structure(model, values=False))
    before_step = [p.detach().clone() for p in params]
    _step(model, torch.randn(2, 32), opt)  # optimizer built before prepare still drives the model
    assert all(not torch.equal(p, b) for p, b in zip(params, before_step, strict=True))
    assert paramfold.restore(model) is model  # restoring an unprepared model is a no-op


@pytest.mark.parametrize("how", ["bound", "instance_wrapper", "compiled"])
@pytest.mark.parametrize("mode", ["hoist", "inline", "auto", "freeze"])
def test_a_forward_bound_while_prepared_runs_after_restore(mode, how):
    # Regression: a root whose forward is torch's own (nn.Sequential) gets a forward frame of
    # paramfold's while prepared; one bound then (f = model.forward; Accelerate's mixed-precision
    # wrapper, model.forward = MethodType(autocast(model.forward.__func__), model); torch.compile
    # of model.forward) raised AttributeError "'_paramfold_forward'" after restore. Stock runs.
    outs = []
    for prepare in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(weight_norm(nn.Linear(4, 3)), nn.Tanh()).eval().requires_grad_(False)
        if prepare:
            paramfold.prepare(model, mode)
        if how == "bound":
            call = model.forward
        elif how == "compiled":
            call = torch.compile(model.forward, backend="eager")
        else:
            model.forward = types.MethodType(torch.autocast("cpu", dtype=torch.bfloat16)(model.forward.__func__), model)
            call = model
        x = torch.ones(2, 4)
        with torch.no_grad():
            call(x)
            if prepare:
                paramfold.restore(model)
            outs.append(call(x))
    assert torch.equal(outs[1], outs[0])


def test_prepared_context_manager_restores_on_error():
    model = build("weight_norm")
    before = pt.structure(model)
    classes_before = classes(model)
    with pytest.raises(ZeroDivisionError):
        with paramfold.prepared(model, "hoist"):
            assert type(model.layers[0]) is not classes_before["layers.0"]
            1 / 0
    pt.assert_same_structure(before, pt.structure(model))


def test_prepare_is_atomic_on_bad_filter_fn_and_unsupported_class():
    model = build("weight_norm")
    before = pt.structure(model)
    classes_before = classes(model)
    calls = []

    def bad_filter(module, fqn):
        calls.append(fqn)
        if len(calls) == 2:
            raise KeyError("boom")
        return True

    with pytest.raises(paramfold.FoldError, match="filter_fn raised KeyError"):
        paramfold.prepare(model, "hoist", filter_fn=bad_filter)
    pt.assert_same_structure(before, pt.structure(model))

    type(model.layers[2]).extra = 1  # someone patched the per-instance parametrized class
    with pytest.raises(paramfold.FoldError, match=r"layers\.2\.weight.*Exclude this module with filter_fn"):
        paramfold.prepare(model, "hoist")
    pt.assert_same_structure(before, pt.structure(model))
    paramfold.prepare(model, "hoist", filter_fn=lambda m, fqn: fqn != "layers.2")
    assert type(model.layers[2]) is classes_before["layers.2"]  # excluded module untouched
    paramfold.restore(model)
    pt.assert_same_structure(before, pt.structure(model))


def test_prepare_refuses_twice_and_unknown_mode():
    model = build("weight_norm")
    with pytest.raises(paramfold.FoldError, match="unknown mode 'fold'"):
        paramfold.prepare(model, "fold")
    paramfold.prepare(model)
    with pytest.raises(paramfold.FoldError, match="already prepared"):
        paramfold.prepare(model)
    with pytest.raises(paramfold.FoldError, match=r"paramfold\.restore\(model\.get_submodule\('0'\)\)"):
        paramfold.restore(torch.nn.Sequential(model))


def test_a_prepared_submodule_is_refused_with_the_way_out_that_fits():
    # Regression: every prepared submodule got "Call paramfold.restore() on the model that was
    # prepared first", which does not help an AveragedModel/EMA of a prepared model (its copy is
    # prepared on its own) nor a module shared by two models.
    from torch.optim.swa_utils import AveragedModel

    model = paramfold.prepare(build("weight_norm"), "hoist")
    ema = AveragedModel(model)
    with pytest.raises(paramfold.FoldError, match=r"submodule 'module' is already prepared by paramfold, as a "
                       r"model of its own.*paramfold\.restore\(model\.get_submodule\('module'\)\)"):
        paramfold.prepare(ema, "auto")
    paramfold.restore(ema.module)
    paramfold.prepare(ema, "auto")  # the way out the message gives
    torch.manual_seed(0)
    shared = torch.nn.Sequential(weight_norm(torch.nn.Linear(4, 4)))
    a, b = torch.nn.Sequential(shared, torch.nn.Linear(4, 2)), torch.nn.Sequential(shared, torch.nn.Linear(4, 3))
    stock_b = copy.deepcopy(b)
    paramfold.prepare(a, "hoist")
    before = pt.structure(b)
    with pytest.raises(paramfold.FoldError, match=r"submodule '0' \(Sequential\) is already prepared by paramfold, "
                       r"as part of another model \(a Sequential\).*shared by two models"):
        paramfold.prepare(b, "hoist")
    pt.assert_same_structure(before, pt.structure(b))
    x = torch.randn(2, 4)
    assert torch.equal(b(x), stock_b(x))  # as the message says: the other model still runs it exactly


class _Named(torch.nn.Module):
    def __init__(self, shared: torch.nn.Module) -> None:
        super().__init__()
        self.s, self.o = shared, torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.o(self.s(x))


def test_a_refusal_about_a_part_of_a_prepared_model_names_the_model_to_restore():
    # Regression: prepare(parent[0]) after prepare(parent) said to restore parent[0] first, which
    # restore refuses (only restore(parent) does); restore(b) of a model never prepared that
    # shares a layer with a prepared one said to restore the layer, refused too, and neither
    # named the model to restore.
    parent = paramfold.prepare(torch.nn.Sequential(build("weight_norm"), torch.nn.Tanh()), "hoist")
    with pytest.raises(paramfold.FoldError, match=r"part of a model prepared by paramfold \(a Sequential\).*"
                       r"paramfold\.restore\(\) on that model first"):
        paramfold.prepare(parent[0], "auto")
    with pytest.raises(paramfold.FoldError, match=r"part of a model passed to paramfold\.prepare \(a Sequential\)"):
        paramfold.restore(parent[0])
    paramfold.restore(parent)
    paramfold.prepare(parent[0], "auto")  # the way out the first message gives
    torch.manual_seed(0)
    shared = weight_norm(torch.nn.Linear(4, 4))
    a, b = _Named(shared), torch.nn.Sequential(shared)
    paramfold.prepare(a, "hoist")
    with pytest.raises(paramfold.FoldError, match=r"submodule '0' is part of another model passed to it \(a _Named\)"):
        paramfold.restore(b)
    paramfold.restore(a)
    assert paramfold.restore(b) is b  # nothing prepared left: does nothing


def test_checkpoints_cross_load_between_prepared_and_stock():
    stock = build("spectral_norm")
    stock(torch.randn(2, 32))  # move _u/_v away from their initial values
    ours = paramfold.prepare(build("spectral_norm", seed=3), "hoist")
    ours.load_state_dict(stock.state_dict())
    fresh = build("spectral_norm", seed=4)
    fresh.load_state_dict(ours.state_dict())
    x = torch.randn(2, 32)
    stock.eval(), ours.eval(), fresh.eval()
    assert torch.equal(stock(x), ours(x))
    assert torch.equal(stock(x), fresh(x))



@pytest.mark.parametrize("mode", MODES)
def test_legacy_weight_norm_checkpoint_loads_into_prepared_model(mode):
    # Vocoder checkpoints saved with the hook-based torch.nn.utils.weight_norm have weight_g and
    # weight_v keys; torch's parametrizations.weight_norm converts them in a load_state_dict
    # pre-hook, which must keep working on a prepared module (its class is swapped, not its hooks).
    def vocoder_block(legacy: bool) -> torch.nn.Module:
        wn = torch.nn.utils.weight_norm if legacy else torch.nn.utils.parametrizations.weight_norm
        return torch.nn.Sequential(
            wn(torch.nn.Conv1d(4, 8, 3)), torch.nn.LeakyReLU(0.1),
            wn(torch.nn.ConvTranspose1d(8, 4, 4, stride=2), dim=1),
        )

    torch.manual_seed(0)
    with pytest.warns(FutureWarning):  # torch deprecates the hook-based API
        legacy = vocoder_block(legacy=True)
    legacy_keys = legacy.state_dict().keys()
    assert {"0.weight_g", "0.weight_v", "2.weight_g", "2.weight_v"} <= legacy_keys
    hooks = [list(m._forward_pre_hooks.items()) for m in legacy.modules()]
    paramfold.prepare(legacy, mode)  # hook-based norms are served too (tests/test_hook_norms.py)
    paramfold.restore(legacy)
    assert [list(m._forward_pre_hooks.items()) for m in legacy.modules()] == hooks
    ours = paramfold.prepare(vocoder_block(legacy=False), mode)
    ours.load_state_dict(legacy.state_dict())
    x = torch.randn(2, 4, 20)
    assert torch.equal(ours(x), legacy(x))
    assert torch.equal(torch.compile(ours, backend="eager")(x), legacy(x))

def test_seed_cast_model_matches_and_setattr_goes_through_right_inverse():
    stock = seed_model()
    ours = paramfold.prepare(copy.deepcopy(stock), "hoist")
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    assert torch.equal(stock(x), ours(x))
    new = torch.randn(64, 64)
    stock.seq[0].weight = new
    ours.seq[0].weight = new
    assert ours.seq[0].weight.dtype == torch.bfloat16
    assert torch.equal(stock(x), ours(x))
    assert "weight" not in ours.seq[0].__dict__


@pytest.mark.parametrize("mode", ["hoist", "inline", "freeze", "auto"])
def test_assigning_a_parameter_to_a_parametrized_name_is_refused_like_stock(mode):
    # Regression (found by the 2026-12-02 entry-point hunt): a Parameter went through
    # right_inverse and overwrote the originals, where stock's register_parameter refuses the name.
    stock = build("weight_norm").eval().requires_grad_(False)
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    x = torch.randn(2, stock.layers[0].in_features)
    with torch.no_grad():
        ours(x)
    for model in (stock, ours):
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(KeyError, match="attribute 'weight' already exists"):
            model.layers[0].weight = torch.nn.Parameter(torch.ones_like(model.layers[0].weight))
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with torch.no_grad():
        assert torch.equal(stock(x), ours(x))


def test_parametrize_cached_is_honoured():
    model = paramfold.prepare(build("weight_norm"), "inline")
    with parametrize.cached():
        assert model.layers[0].weight is model.layers[0].weight
    assert model.layers[0].weight is not model.layers[0].weight


def test_find_reports_kinds_originals_tying_and_state():
    model = build("chain")
    model.layers[2].parametrizations.weight.original0 = model.layers[1].parametrizations.weight.original0
    model.layers[0].requires_grad_(False)
    sites = {s.fqn: s for s in paramfold.find(model)}
    assert sites["layers.0.weight"].kind == "weight_norm+custom"
    assert set(sites["layers.0.weight"].originals) == {"original0", "original1"}
    assert sites["layers.0.bias"].kind == "custom"
    assert not sites["layers.0.weight"].requires_grad and sites["layers.1.weight"].requires_grad
    assert sites["layers.1.weight"].tied_with == (("layers.2", "weight"),)
    assert sites["layers.0.weight"].tied_with == ()
    assert not any(s.stateful for s in sites.values())

    assert {s.kind for s in paramfold.find(build("spectral_norm"))} == {"spectral_norm"}
    assert all(s.stateful for s in paramfold.find(build("spectral_norm")))
    assert {s.kind for s in paramfold.find(seed_model())} == {"cast"}
    with_nan = seed_model()
    with torch.no_grad():
        with_nan.seq[0].parametrizations.weight.original[0, 0] = float("nan")
    assert {s.kind for s in paramfold.find(with_nan)} == {"cast"}
    assert {s.kind for s in paramfold.find(build("orthogonal:cayley"))} == {"orthogonal"}
    buffer_sites = paramfold.find(build("buffer"))
    assert [s.is_buffer for s in buffer_sites] == [True] * 3


def test_find_probe_does_not_mutate_custom_state():
    class Running(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("count", torch.zeros(()))

        def forward(self, x):
            if self.training:
                self.count.add_(1)
            return x * 2

    layer = torch.nn.Linear(4, 4)
    parametrize.register_parametrization(layer, "weight", Running())
    count = layer.parametrizations.weight[0].count
    before = (count.item(), count._version)
    (site,) = paramfold.find(layer)
    assert site.stateful and site.kind == "custom"
    assert (count.item(), count._version) == before


def test_plain_state_dict_loads_strict_into_unparametrized_model():
    model = build("chain").eval()
    plain = build("plain")
    plain.load_state_dict(paramfold.plain_state_dict(model), strict=True)
    x = torch.randn(3, 32)
    with torch.no_grad():
        assert torch.equal(model(x), plain(x))


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated")
@pytest.mark.parametrize("norm", ["weight_norm", "spectral_norm"])
@pytest.mark.parametrize("prepared", [False, True])
def test_plain_state_dict_folds_the_hook_based_norms(norm, prepared):
    # Regression: torch's deprecated hook-based norms (which find() reports) kept their
    # weight_g/weight_v (weight_orig/_u/_v) keys: no 'weight', so strict loading failed.
    def build_model():
        torch.manual_seed(0)
        layers = [torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3)]
        for i in (0, 2):
            layers[i] = getattr(torch.nn.utils, norm)(layers[i])
        return torch.nn.Sequential(*layers).eval()

    model = build_model()
    if prepared:
        paramfold.prepare(model, "auto")
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    folded = paramfold.plain_state_dict(model)
    assert list(folded) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    plain.load_state_dict(folded, strict=True)
    x = torch.randn(3, 4)
    with torch.no_grad():
        assert torch.equal(plain(x), build_model()(x))


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.spectral_norm` is deprecated")
@pytest.mark.parametrize("hooked", [False, True])
@pytest.mark.parametrize("mode", [None, "hoist", "auto", "inline"])
def test_plain_state_dict_of_a_training_model_leaves_its_state_as_it_was(hooked, mode):
    # Regression: a training spectral_norm ran its power iteration for the value and kept it, so a
    # checkpoint saved with plain_state_dict between steps moved a GAN's discriminator: the steps
    # after it differed from a run that saved nothing.
    def build_model():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
        (torch.nn.utils.spectral_norm if hooked else spectral_norm)(model[0])
        return model

    def train(model, save):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            model(torch.randn(2, 4, generator=torch.Generator().manual_seed(step))).square().sum().backward()
            opt.step()
            opt.zero_grad()
            if save:
                saved = paramfold.plain_state_dict(model)
        return model.state_dict(), saved if save else None

    stock, _ = train(build_model(), save=False)
    model = build_model()
    if mode is not None:
        paramfold.prepare(model, mode)
    after, saved = train(model, save=True)
    assert after.keys() == stock.keys() and all(torch.equal(after[k], stock[k]) for k in stock)
    # The saved value is what a read of the weight at that moment gives: one power iteration on.
    reference = build_model()
    reference.load_state_dict(stock)
    with torch.no_grad():
        if hooked:  # its pre-hook computes the weight at the layer's next call
            reference[0](torch.zeros(1, 4))
        assert torch.equal(saved["0.weight"], reference[0].weight)
    assert model.training and all(m.training for m in model.modules())


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.spectral_norm` is deprecated")
@pytest.mark.parametrize("where", [0, 1, 3])
@pytest.mark.parametrize("mode", ["hoist", "auto", "inline"])
def test_plain_state_dict_taken_inside_a_training_call_is_stocks_and_changes_nothing(mode, where):
    # Regression: taken from a forward pre-hook, it put back the state the call had advanced
    # over the one the call's state_dict() had just given back (the chain's next read moved it
    # once more), and missed the hook-based norm whose hook the call had taken off (its
    # weight_orig/_u/_v keys instead of weight).
    def build_model():
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(4)))
        spectral_norm(model[1])
        torch.nn.utils.spectral_norm(model[2])
        parametrize.register_parametrization(model[3], "weight", RunningScale())
        return model

    runs = []
    for prepared in (False, True):
        model = build_model()
        if prepared:
            paramfold.prepare(model, mode)
        saved = []
        model[where].register_forward_pre_hook(lambda module, args: saved.append(paramfold.plain_state_dict(model)))
        record = []
        for step in range(2):
            out = model(torch.randn(2, 4, generator=torch.Generator().manual_seed(step)))
            out.sum().backward()
            record.append([out, {k: g.clone() for k, g in grads(model).items()}, {k: v.clone() for k, v in model.state_dict().items()}])
        runs.append((record, saved))
    (stock, stock_saved), (ours, ours_saved) = runs
    for (a_out, a_grads, a_sd), (b_out, b_grads, b_sd) in zip(stock, ours):
        assert torch.equal(a_out, b_out)
        assert all(torch.equal(a_grads[k], b_grads[k]) for k in a_grads)
        assert a_sd.keys() == b_sd.keys() and all(torch.equal(a_sd[k], b_sd[k]) for k in a_sd)
    for a, b in zip(stock_saved, ours_saved):
        assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_lora_adapters_are_never_frozen():
    # The original is frozen but the parametrization owns trainable A and B: freezing the weight
    # would silently stop their gradients.
    model = build("lora")
    with pytest.raises(paramfold.FoldError, match="a tensor of the chain requires grad"):
        paramfold.prepare(model, "freeze")
    stock = build("lora")
    ours = paramfold.prepare(build("lora"), "auto")
    x = torch.randn(3, 32)
    stock(x).sum().backward()
    ours(x).sum().backward()
    adapters = [(n, p.grad) for n, p in ours.named_parameters() if n.endswith((".A", ".B"))]
    assert adapters and all(g is not None and g.abs().sum() > 0 for _, g in adapters)
    assert grads(stock).keys() == grads(ours).keys()
    for name, gs in grads(stock).items():
        go = grads(ours)[name]
        assert (gs is None and go is None) or torch.equal(gs, go), name


def test_prepared_model_deepcopies_but_refuses_pickle_with_advice(tmp_path):
    stock = build("weight_norm")
    ours = build("weight_norm")
    classes_before = classes(ours)
    paramfold.prepare(ours, "auto")
    with pytest.raises(RuntimeError, match=r"state_dict\(\).*paramfold\.restore"):
        torch.save(ours, tmp_path / "model.pt")
    with pytest.raises(RuntimeError, match=r"shallow-copied \(copy\.copy\).*copy\.deepcopy works"):
        copy.copy(ours)
    twin = copy.deepcopy(ours)  # prepared too, like the original
    x = torch.randn(2, 32)
    assert torch.equal(twin(x), stock(x))
    paramfold.restore(twin)
    assert classes(twin) == classes_before
    assert torch.equal(twin(x), stock(x))


@pytest.mark.parametrize("mode,grad", [(m, g) for m in ("hoist", "inline", "freeze", "auto") for g in (False, True)
                                       if not (m == "freeze" and g)])  # freeze is inference only
def test_prepared_model_deepcopies_after_steady_calls(mode, grad):
    # Regression: once calls had built the scope's steady-state plan, deepcopy raised "cannot
    # pickle 'RootGuardManager'" (the plan's watch, a cache copied with the module's state).
    stock = build("weight_norm")
    if mode == "freeze":
        stock.requires_grad_(False)
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    x = torch.randn(2, 32)
    with torch.set_grad_enabled(grad):
        for _ in range(3):
            ours(x)
        twin = copy.deepcopy(ours)
        for model in (twin, ours, twin):
            for _ in range(3):
                assert torch.equal(model(x), stock(x))
    with torch.no_grad():  # the copy's weights are its own: an edit there is seen there only
        next(iter(twin.parameters())).mul_(2)
    with torch.set_grad_enabled(grad):
        assert torch.equal(ours(x), stock(x))
        assert not torch.equal(twin(x), stock(x))
    paramfold.restore(twin)
    assert classes(twin) == classes(stock)


class _StaticScaled(nn.Module):
    """A member whose class holds a staticmethod (as geotorch's Sphere holds parse_radius)."""

    def __init__(self):
        super().__init__()
        self.radius = 1.0

    @staticmethod
    def factor():
        return 0.5

    def forward(self, w):
        return w * self.factor() * self.radius


class _ClassScaled(_StaticScaled):
    @classmethod
    def factor(cls):
        return 0.5


class _AbstractScaled(nn.Module, abc.ABC):
    @abc.abstractmethod
    def factor(self): ...


class _AbcScaled(_AbstractScaled):
    def __init__(self):
        super().__init__()
        self.radius = 1.0

    def factor(self):
        return 0.5

    def forward(self, w):
        return w * self.factor() * self.radius


def _sphere(layer):
    pytest.importorskip("geotorch").sphere(layer, "weight")


def _custom(member_class):
    return lambda layer: parametrize.register_parametrization(layer, "weight", member_class())


@pytest.mark.parametrize("freeze_check", ["content", "version"])
@pytest.mark.parametrize("mode", ["freeze", "auto"])
@pytest.mark.parametrize("register", [_custom(_StaticScaled), _custom(_ClassScaled), _custom(_AbcScaled), _sphere],
                         ids=["staticmethod", "classmethod", "abc", "geotorch.sphere"])
def test_a_deep_copy_after_a_frozen_call_freezes_its_own_values(register, mode, freeze_check):
    # Regression: copy.deepcopy (AveragedModel, an EMA) of a freeze/auto model after a frozen call
    # raised "cannot pickle 'staticmethod' object" (or 'classmethod', '_abc._abc_data'): the frozen
    # value's keys hold its members' classes' dicts, which deepcopy tried to copy entry by entry.
    def build_seq():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).eval()
        register(model[0]), register(model[2])
        return model.requires_grad_(False) if mode == "freeze" else model  # auto: frozen under no_grad

    stock, ours = build_seq(), build_seq()
    paramfold.prepare(ours, mode, freeze_check=freeze_check)
    x = torch.randn(3, 4)

    def originals(model):
        return [layer.parametrizations.weight.original for layer in (model[0], model[2])]

    def check(*pairs):
        with torch.no_grad():
            for _ in range(2):
                for model, reference in pairs:
                    assert torch.equal(model(x), reference(x))

    check((ours, stock))  # frozen from here
    stock_twin, twin = copy.deepcopy(stock), copy.deepcopy(ours)
    both = ((ours, stock), (twin, stock_twin))
    check(*both)
    for layer, original in zip((twin[0], twin[2]), originals(twin)):  # frozen again, on its own tensors
        frozen = vars(layer)[STATE_ATTR].sites["weight"].frozen
        assert frozen is not None and any(w[2] is original for w in frozen.watch)
    writes = [  # each on a model and its stock reference alike, then both pairs are checked
        (1, lambda m: originals(m)[0].mul_(2)),  # the copy's original, in place
        (0, lambda m: originals(m)[1].data.add_(0.5)),  # the original's, through .data (no version bump)
        (1, lambda m: originals(m)[1].data.mul_(-1)),  # the copy's, through .data
        (1, lambda m: setattr(m[0].parametrizations.weight[0], "radius", 2.0)),  # the copy's member
        (0, lambda m: originals(m)[0].add_(1)),  # the original's, in place
    ]
    for which, write in writes:
        with torch.no_grad():
            write(both[which][0]), write(both[which][1])
        check(*both)
    assert not torch.equal(stock_twin(x), stock(x))  # the writes told the copies apart
    with torch.no_grad():  # a copy of part of the model: a stock module
        assert torch.equal(copy.deepcopy(twin[2])(x), copy.deepcopy(stock_twin[2])(x))
    paramfold.restore(twin)
    check(*both)


class _CopiesItself(nn.Linear):
    """A layer whose class has a ``__deepcopy__`` of its own (which stock's copy, and paramfold's, call)."""

    def __deepcopy__(self, memo):
        replica = self.__class__.__new__(self.__class__)
        memo[id(self)] = replica
        object.__setattr__(replica, "__dict__", copy.deepcopy(self.__dict__, memo))
        return replica


def _restored_like_stock(ours, stock, x, planted=False):
    """``ours`` restored: bitwise stock's outputs and state_dict, every module's class and
    ``vars()`` keys as stock's, and a tensor ``planted`` in a layer's ``__dict__`` kept there."""
    paramfold.restore(ours)
    with torch.no_grad():
        assert torch.equal(ours(x), stock(x))
    mine, theirs = ours.state_dict(), stock.state_dict()
    assert list(mine) == list(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)

    def described(m):  # (stock's parametrized classes are per instance)
        return type(m).__name__, parametrize.type_before_parametrizations(m), sorted(vars(m))

    pairs = list(zip(ours.modules(), stock.modules()))
    assert [described(a) for a, _ in pairs] == [described(b) for _, b in pairs]
    if planted:
        assert all(torch.equal(vars(a)["weight"], vars(b)["weight"]) for a, b in pairs if "weight" in vars(b))


@pytest.mark.parametrize("planted", [False, True], ids=["", "planted"])
@pytest.mark.parametrize("called", [False, True], ids=["restored", "called"])
@pytest.mark.parametrize("when", ["between_calls", "in_a_hook"])
@pytest.mark.parametrize("copied", ["model", "AveragedModel", "part", "a_copy"])
@pytest.mark.parametrize("mode", ["hoist", "inline", "freeze", "auto"])
def test_a_deep_copy_holds_none_of_the_originals_frozen_values(mode, copied, when, called, planted):
    # Regression: a deep copy (AveragedModel, an EMA) of a freeze/auto model after a frozen call
    # kept the original's frozen value in its layers' __dict__, which its state no longer knew as
    # paramfold's: its next call set it aside as the user's, restore put it back, and torch's
    # remove_parametrizations then raised KeyError "attribute 'weight' already exists" after
    # taking the property off (the layer read that stale tensor).
    from torch.optim.swa_utils import AveragedModel

    def build_seq():
        torch.manual_seed(0)
        model = nn.Sequential(weight_norm(nn.Linear(4, 4)), nn.Tanh(), _CopiesItself(4, 4)).eval()
        parametrize.register_parametrization(model[2], "weight", LoRA(4, 4))
        return model.requires_grad_(False) if mode == "freeze" else model  # auto: frozen under no_grad

    def copy_of(model):
        if copied == "AveragedModel":
            return AveragedModel(model).module
        if copied == "a_copy":
            return copy.deepcopy(copy.deepcopy(model))
        return copy.deepcopy(model[2] if copied == "part" else model)

    stock, ours = build_seq(), build_seq()
    paramfold.prepare(ours, mode)
    x = torch.randn(3, 4)
    with torch.no_grad():
        assert torch.equal(ours(x), stock(x))  # frozen from here
    if planted:  # the user's, hidden by stock's property: a copy and restore keep it
        for model in (ours, stock):
            vars(model[2])["weight"] = torch.full((4, 4), 7.0)
    taken = []
    for model in (ours, stock):
        if when == "between_calls":
            taken.append(copy_of(model))
        else:  # from a forward hook, after the first layer's call
            handle = model[1].register_forward_hook(  # (the copy holds it: copies once)
                lambda *_, m=model: None if len(taken) == 2 else taken.append(copy_of(m)))
            with torch.no_grad():
                model(x)
            handle.remove()
    mine, theirs = taken
    if called:
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(mine(x), theirs(x))
    _restored_like_stock(mine, theirs, x, planted)
    with torch.no_grad():
        assert torch.equal(ours(x), stock(x))
    _restored_like_stock(ours, stock, x, planted)
    # torch's removal works on the copy (not on both: stock's copy shares its original's class,
    # whose property the removal deletes).
    for a, b in zip(mine.modules(), theirs.modules()):
        if planted and "weight" in vars(b):  # (stock's removal refuses it: taken out of both)
            vars(a).pop("weight"), vars(b).pop("weight")
        for name in list(getattr(b, "parametrizations", {})):
            parametrize.remove_parametrizations(a, name)
            parametrize.remove_parametrizations(b, name)
    with torch.no_grad():
        assert torch.equal(mine(x), theirs(x))
    assert [sorted(vars(a)) for a in mine.modules()] == [sorted(vars(b)) for b in theirs.modules()]


@pytest.mark.parametrize("mode", ["hoist", "inline", "freeze", "auto"])
@pytest.mark.parametrize("part", [0, 2, "both"])
def test_a_deep_copy_of_part_of_a_prepared_model_is_a_stock_module(mode, part):
    # Regression: copy.deepcopy(model[0]) of a prepared model kept paramfold's class and state
    # without the model it was part of: restore(copy) and prepare(copy) were refused ("part of a
    # model passed to paramfold.prepare"), and once put back into the model (a cloned layer, a
    # layer's EMA) restore(model) left it prepared and prepare(model) refused it.
    def build_seq():
        torch.manual_seed(0)
        return torch.nn.Sequential(weight_norm(torch.nn.Linear(4, 4)), torch.nn.ReLU(),
                                   spectral_norm(torch.nn.Linear(4, 4)))

    stock, ours = build_seq(), build_seq()
    if mode == "freeze":
        stock.eval().requires_grad_(False), ours.eval().requires_grad_(False)
    classes_before = [type(m) for m in ours]
    paramfold.prepare(ours, mode)
    x = torch.randn(2, 4)
    ours(x)
    stock(x)
    picked = [0, 2] if part == "both" else [part]
    stock_copies = copy.deepcopy([stock[i] for i in picked])
    copies = copy.deepcopy([ours[i] for i in picked])
    for i, c, s in zip(picked, copies, stock_copies):
        assert type(c) is classes_before[i] and type(s) is type(stock[i])  # stock's copy shares its class
        assert STATE_ATTR not in vars(c) and torch.equal(c(x), s(x))
        paramfold.restore(paramfold.prepare(c, mode))  # a model of its own now
        ours[i], stock[i] = c, s
    assert torch.equal(ours(x), stock(x))
    paramfold.restore(ours)
    assert [type(m) for m in ours] == classes_before and all(STATE_ATTR not in vars(m) for m in ours.modules())
    paramfold.prepare(ours, mode)
    assert torch.equal(ours(x), stock(x))
    paramfold.restore(ours)


class _AutocastInside(torch.nn.Module):
    """A forward that enters torch.autocast itself (as Accelerate's wrapper does)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        parametrize.register_parametrization(self.lin, "weight", LoRA(8, 8))

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.lin(x).float()


@pytest.mark.parametrize("mode", ["hoist", "inline", "auto"])
def test_a_deep_copy_knows_its_own_entries(mode):
    # Regression: the copy kept the original's entries' ids as the ones its scope covers, so its
    # nested calls skipped their checks (the forward's autocast region was not seen: outputs off
    # by 0.125) and a layer.compile()d child of the copy opened a second scope on its claimed
    # holders ("already being called from another thread").
    torch.manual_seed(0)
    stock = _AutocastInside()
    twin = copy.deepcopy(paramfold.prepare(copy.deepcopy(stock), mode))
    x = torch.randn(3, 8)
    assert torch.equal(twin(x), stock(x))
    twin.lin.compile(backend="eager")
    stock.lin.compile(backend="eager")
    twin(x).sum().backward()
    stock(x).sum().backward()
    for (name, a), b in zip(grads(twin).items(), grads(stock).values()):
        assert torch.equal(a, b), name


def test_find_runs_an_unknown_chain_on_copies_of_the_originals_too():
    # Regression: the probe passed the real originals to the first member, so a member whose
    # pre-hook edits its input in place scaled the model's weights (twice: train and eval probe).
    class Custom(torch.nn.Module):
        def forward(self, w):
            return w + 1

    layer = torch.nn.Linear(4, 4)
    parametrize.register_parametrization(layer, "weight", Custom())
    member = layer.parametrizations.weight[0]
    member.register_forward_pre_hook(lambda module, args: args[0].mul_(0.9))
    original = layer.parametrizations.weight.original
    before = (original.detach().clone(), original._version)
    (site,) = paramfold.find(layer)
    assert site.kind == "custom"
    assert torch.equal(original, before[0]) and original._version == before[1]


@pytest.mark.parametrize("mode", ["hoist", "freeze", "auto"])
def test_restoring_part_of_a_prepared_model_is_refused_and_changes_nothing(mode):
    # Regression: restore(model.layers[0]) undid that layer's preparation and returned, and the
    # model's next call failed with KeyError('_paramfold').
    stock, ours = build("weight_norm"), build("weight_norm")
    if mode == "freeze":
        stock.requires_grad_(False), ours.requires_grad_(False)
    before = classes(ours)
    paramfold.prepare(ours, mode)
    prepared_classes = classes(ours)
    for part in (ours.layers[0], ours.layers):
        with pytest.raises(paramfold.FoldError, match="restore the model you prepared"):
            paramfold.restore(part)
    assert classes(ours) == prepared_classes
    x = torch.randn(2, 32)
    assert torch.equal(ours(x), stock(x))
    paramfold.restore(ours)
    assert classes(ours) == before


class _RestoresItself(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.utils.parametrizations.spectral_norm(torch.nn.Linear(4, 4))

    def forward(self, x):
        paramfold.restore(self)
        return self.lin(x)


@pytest.mark.parametrize("mode", ["hoist", "inline", "auto"])
def test_restore_during_a_call_is_refused_before_it_changes_anything(mode):
    # Regression: restore inside the model's own call (or from another thread during one) took
    # the model apart under the open call scope: the call ended in KeyError('_paramfold'), and
    # with hoist and auto spectral_norm ran its power iteration twice. The value computed as the
    # call opened went unread: its power iteration is undone (paramfold.unread; until 2026-12-03
    # it stayed, one step ahead of a model whose call never reached the layer).
    torch.manual_seed(0)
    stock = _RestoresItself()
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    prepared_classes = classes(ours)
    with pytest.raises(paramfold.FoldError, match="Restore it after the call returns"):
        ours(torch.randn(2, 4))
    assert classes(ours) == prepared_classes
    assert all(torch.equal(a, b) for a, b in zip(stock.state_dict().values(), ours.state_dict().values()))
    paramfold.restore(ours)
    assert classes(ours) == classes(stock)


class _OwnCall(torch.nn.Module):
    """A model class with its own ``__call__`` around ``nn.Module``'s."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(4, 4))

    def __call__(self, *args, **kwargs):
        return super().__call__(*args, **kwargs) * 2.0

    def forward(self, x):
        return self.a(x)


@pytest.mark.parametrize("entry", ["eager", "torch.compile", "model.compile"])
@pytest.mark.parametrize("mode", ["hoist", "inline", "auto"])
def test_a_models_own_call_runs_when_prepared(mode, entry):
    # Regression: the prepared root's __call__ opened the scope and then called nn.Module's
    # __call__, skipping the model class's own (outputs halved here, silently).
    torch._dynamo.reset()
    torch.manual_seed(0)
    stock = _OwnCall()
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    run_stock, run = stock, ours
    if entry == "torch.compile":
        run_stock, run = torch.compile(stock, backend="eager"), torch.compile(ours, backend="eager")
    elif entry == "model.compile":
        stock.compile(backend="eager"), ours.compile(backend="eager")
    _two_steps_alike(run_stock, run, stock, ours, torch.randn(2, 4))


def _two_steps_alike(run_stock, run, stock: nn.Module, ours: nn.Module, x: torch.Tensor) -> None:
    """Two forward and backward steps of ``run`` equal to ``run_stock``'s, and their gradients."""
    for _ in range(2):
        expected, got = run_stock(x), run(x)
        assert torch.equal(got, expected)
        expected.sum().backward(), got.sum().backward()
    for (name, a), b in zip(grads(ours).items(), grads(stock).values()):
        assert torch.equal(a, b), name


class _AbstractLayer(nn.Module, abc.ABC):
    @abc.abstractmethod
    def forward(self, x): ...


class _ConcreteLayer(_AbstractLayer):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4))

    def forward(self, x):
        return x @ self.weight.T


_T = typing.TypeVar("_T")


class _GenericLinear(nn.Linear, typing.Generic[_T]):
    pass


class _Callable(typing.Protocol):
    def forward(self, x): ...


class _ProtocolLinear(nn.Linear, _Callable):
    pass


def _annotated_linear() -> nn.Module:
    layer = weight_norm(nn.Linear(4, 3))
    type(layer).__annotations__  # noqa: B018 (the read stores an empty dict in stock's class, as torch.jit.script does)
    return layer


_PYTHON_CLASS_MACHINERY = {
    "abc": lambda: weight_norm(_ConcreteLayer()),
    "generic": lambda: weight_norm(_GenericLinear(4, 3)),
    "annotations_read": _annotated_linear,
    "protocol": lambda: weight_norm(_ProtocolLinear(4, 3)),
}


@pytest.mark.parametrize("mode", [*MODES, "freeze"])
@pytest.mark.parametrize("kind", list(_PYTHON_CLASS_MACHINERY))
def test_classes_python_machinery_adds_to_are_prepared_like_stock(kind, mode):
    # Regression: ABCMeta (__abstractmethods__, _abc_impl), typing.Generic (__parameters__) and
    # an annotations read (__annotations__) add keys to the class parametrize makes; prepare
    # refused such modules as "not the one torch.nn.utils.parametrize made".
    torch.manual_seed(0)
    stock = nn.Sequential(_PYTHON_CLASS_MACHINERY[kind](), nn.Linear(3, 2))
    ours = copy.deepcopy(stock)
    stock_class, keys = type(ours[0]), set(vars(type(ours[0])))
    if mode == "freeze":
        stock.eval().requires_grad_(False), ours.eval().requires_grad_(False)
    paramfold.prepare(ours, mode)
    x = torch.randn(2, 4)
    if mode == "freeze":
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(ours(x), stock(x))
    else:
        _two_steps_alike(stock, ours, stock, ours, x)
    paramfold.restore(ours)
    assert type(ours[0]) is stock_class and set(vars(stock_class)) == keys


def _refused_and_left_as_it_was(model: nn.Module, mode: str, match: str) -> None:
    """``prepare`` raises a FoldError matching ``match`` and leaves ``model``'s classes and output as they were."""
    classes_before, x = [type(m) for m in model.modules()], torch.randn(2, 4)
    expected = model(x)
    with pytest.raises(paramfold.FoldError, match=match):
        paramfold.prepare(model, mode)
    assert [type(m) for m in model.modules()] == classes_before
    assert torch.equal(model(x), expected)


def _tripled(layer: nn.Module) -> None:
    type(layer).weight = property(lambda self: self.parametrizations.weight() * 3)


def _copied_as_itself(layer: nn.Module) -> None:
    type(layer).__deepcopy__ = lambda self, memo: self


@pytest.mark.parametrize("mode", [*MODES, "freeze"])
@pytest.mark.parametrize("change", [_tripled, _copied_as_itself], ids=["property", "deepcopy"])
def test_a_property_or_deepcopy_written_on_stocks_class_is_refused_and_the_model_left_as_it_was(change, mode):
    # Regression: a property (or __deepcopy__) written on the Parametrized* class torch made was
    # taken for torch's own by its name: prepare accepted it and paramfold's classes served the
    # parametrization's value (weight 2x, not the user's 6x) or copied the module.
    torch.manual_seed(0)
    model = nn.Sequential(weight_norm(nn.Linear(4, 3)), nn.Linear(3, 2)).eval().requires_grad_(False)
    change(model[0])
    _refused_and_left_as_it_was(model, mode, "attributes written on it since")


class _NeedsKind(nn.Module):
    def __init_subclass__(cls, *, kind: str, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.kind = kind


class _Block(_NeedsKind, nn.Sequential, kind="block"):
    pass


@pytest.mark.parametrize("mode", MODES)
def test_a_container_whose_init_subclass_refuses_paramfolds_subclass_is_refused_with_a_fold_error(mode):
    # Regression: paramfold makes a class of its own over the root (a subclass, as FSDP2's
    # fully_shard does), which runs the class's __init_subclass__: one that needs a keyword made
    # prepare raise its TypeError. Now a FoldError that says so; the model is left as it was.
    torch.manual_seed(0)
    model = _Block(weight_norm(nn.Linear(4, 3)), nn.Linear(3, 2))
    _refused_and_left_as_it_was(model, mode, "__init_subclass__")


def _made_per_model(kind: str) -> nn.Module:
    """A model whose class is made for it alone: a torch.fx GraphModule (a class per instance), or
    a class defined in a factory."""
    layer = weight_norm(nn.Linear(4, 4))
    if kind == "fx":
        return torch.fx.symbolic_trace(nn.Sequential(layer, nn.Tanh()))
    made = type("Made", (nn.Module,), {"forward": lambda self, x: torch.tanh(self.lin(x))})()
    made.lin = layer
    return made


@pytest.mark.parametrize("end", ["restore", "drop"])
@pytest.mark.parametrize("kind", ["fx", "factory"])
def test_dropped_models_whose_class_is_made_per_model_keep_no_classes_alive(kind, end):
    # Regression (helper-198, 2026-12-07): paramfold's registry of its classes held each class it
    # made strongly, and with it the user's class it derives from: a process that prepares and
    # drops such models grew by both at every model (10-35 KB each), restored or not.
    import gc
    import weakref

    from paramfold import classes as registry

    x = torch.randn(2, 4)
    gc.collect()
    before = len(registry._classes)
    users = []
    for _ in range(6):
        model = _made_per_model(kind)
        users.append(weakref.ref(type(model)))
        paramfold.prepare(model, "hoist")(x).sum().backward()
        if end == "restore":
            paramfold.restore(model)
        del model
    gc.collect()
    gc.collect()  # the registry lets a class go as the collection frees the subclass made of it
    assert [ref() for ref in users] == [None] * len(users)
    assert len(registry._classes) <= before
