"""torch.func transforms and model surgery around a prepared model, bitwise against stock.

Real code does more to a model than call it: it takes ``torch.func`` transforms of it (Hessians
of a loss w.r.t. the input, ``functional_call`` with dicts naming the originals, the computed
weight or spectral_norm's power-iteration buffers), and it edits the model after ``prepare``
(a layer replaced, added or deleted, a parametrized layer swapped in). Each test runs the same
steps on a stock twin and compares outputs, gradients and ``state_dict`` bitwise (CPU; compiled
with the eager backend), or checks that paramfold refuses with a ``FoldError``.
"""

from __future__ import annotations

import copy
import functools
import gc
import weakref

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from helpers import RowScale
from torch import nn
from torch.func import functional_call, hessian, jacfwd, jacrev, jvp, stack_module_state, vmap
from torch.nn.utils.parametrizations import orthogonal, spectral_norm, weight_norm

import paramfold

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

MODES = ["hoist", "inline", "auto"]


def _inference(model: nn.Module) -> nn.Module:
    return model.eval().requires_grad_(False)


def wn_head() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(weight_norm(nn.Linear(4, 4)), nn.Tanh(), nn.Linear(4, 1))


# --- torch.func transforms -----------------------------------------------------------------


@pytest.mark.parametrize("transform", ["hessian", "jacrev_jacrev"])
@pytest.mark.parametrize("mode", ["auto", "freeze"])
def test_nested_transform_of_an_inference_model_twice_equals_stock(mode, transform):
    # Regression: freeze (and auto, whose values of a model that needs no grad are frozen)
    # computed the frozen value inside the transforms, where torch.func wraps every result for
    # its levels, and kept that wrapper: the next call of the same nested transform met a
    # wrapper of dead levels and raised torch's INTERNAL ASSERT "level.has_value() && level <=
    # current_level" (stock computes the Hessian again). A value computed from plain tensors
    # is now computed outside the transforms: a plain tensor, as frozen outside them.
    stock = _inference(wn_head())
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    make = hessian if transform == "hessian" else (lambda f: jacrev(jacrev(f)))
    x = torch.randn(4)
    for _ in range(3):
        expected = make(lambda t: stock(t).sum())(x)
        assert torch.equal(make(lambda t: ours(t).sum())(x), expected)
        assert torch.equal(ours(x), stock(x))


@pytest.mark.parametrize("mode", ["auto", "freeze"])
def test_hessian_through_functional_call_with_the_same_dict_twice_equals_stock(mode):
    # The same bug through functional_call with a dict of detached originals (a Hessian w.r.t.
    # the input at fixed weights, as in curvature or influence computations).
    stock = _inference(wn_head())
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    x = torch.randn(4)
    params = {m: {k: v.detach() + 0.01 for k, v in m.named_parameters()} for m in (stock, ours)}
    for _ in range(2):
        got = hessian(lambda t: functional_call(ours, params[ours], (t,)).sum())(x)
        assert torch.equal(got, hessian(lambda t: functional_call(stock, params[stock], (t,)).sum())(x))


class Transposed(nn.Module):
    """A custom parametrization whose value is a view of its original."""

    def forward(self, w):
        return w.T


def view_valued(kind: str) -> nn.Module:
    """A chain whose value is a view of what it computes from: orthogonal on a non-square Linear
    (householder: ``Q.mT``), or a custom ``w.T`` whose view is of the original itself."""
    torch.manual_seed(0)
    if kind == "orthogonal":
        layer = orthogonal(nn.Linear(4, 3))
    else:
        layer = nn.Linear(4, 4)
        torch.nn.utils.parametrize.register_parametrization(layer, "weight", Transposed())
    return nn.Sequential(layer, nn.Tanh())


def _forward_mode(model: nn.Module, how: str, x: torch.Tensor) -> list[torch.Tensor]:
    """Derivatives of ``model(x)`` w.r.t. its original (and ``x``, for ``dual_input``), in
    forward mode, the way ``how`` takes them; the original is a copy of the model's."""
    name = "0.parametrizations.weight.original"
    p = model.state_dict()[name].clone()
    ones = torch.ones_like(p)
    f = lambda q: functional_call(model, {name: q}, (x,))  # noqa: E731
    if how == "make_dual":
        with fwAD.dual_level():
            return list(fwAD.unpack_dual(f(fwAD.make_dual(p, ones))))
    if how == "dual_input":
        with fwAD.dual_level():
            dual_x = fwAD.make_dual(x, torch.full_like(x, 0.5))
            return list(fwAD.unpack_dual(functional_call(model, {name: fwAD.make_dual(p, ones)}, (dual_x,))))
    if how == "jvp":
        return list(jvp(f, (p,), (ones,)))
    if how == "jacfwd":
        return [jacfwd(f)(p)]
    if how == "forward_jacobian":
        return [torch.autograd.functional.jacobian(f, p, strategy="forward-mode", vectorize=True)]
    stacked = torch.stack([p, 2 * p])  # vmap_jvp
    return list(vmap(lambda q, t: jvp(f, (q,), (t,)))(stacked, torch.ones_like(stacked)))


@pytest.mark.parametrize("how", ["make_dual", "dual_input", "jvp", "jacfwd", "forward_jacobian", "vmap_jvp"])
@pytest.mark.parametrize("kind", ["orthogonal", "transposed"])
@pytest.mark.parametrize("mode", ["auto", "freeze"])
def test_forward_mode_derivatives_of_a_view_valued_chain_equal_stock(mode, kind, how):
    # Regression: freeze kept a value that is a view (of the original, or of what the chain
    # computed) as value.detach(), which drops forward-AD tangents and jvp's duals: the tangent
    # w.r.t. the original came out None (make_dual), zero (jvp, jacfwd), or without its part (a
    # dual input too), in auto (the default) and freeze alike, at the calls the value was frozen.
    stock = _inference(view_valued(kind))
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    x = torch.randn(2, 4)
    for grad in (False, True, False):  # dual inputs do not require grad: frozen under grad too
        for _ in range(3):  # frozen or computed at every call (auto's, freeze's misses) alike
            with torch.set_grad_enabled(grad):
                expected, actual = _forward_mode(stock, how, x), _forward_mode(ours, how, x)
            assert len(actual) == len(expected)
            assert all(map(torch.equal, actual, expected))
    assert torch.equal(ours(x), stock(x))


@pytest.mark.parametrize("mode", ["auto", "freeze"])
def test_a_dual_original_used_again_after_its_tangent_changed_in_place_equals_stock(mode):
    # A frozen value is keyed on its inputs' identity, versions and bytes, none of which shows a
    # tangent: a value with tangents serves its own call only, as stock's read is computed at each.
    torch.manual_seed(0)
    scaled = nn.Linear(4, 4)
    torch.nn.utils.parametrize.register_parametrization(scaled, "weight", RowScale())
    stock = _inference(nn.Sequential(scaled, nn.Tanh(), orthogonal(nn.Linear(4, 3))))  # a value and a view
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    x = torch.randn(2, 4)
    names = ["0.parametrizations.weight.original", "2.parametrizations.weight.original"]
    results = []
    for model in (stock, ours):
        out = []
        with fwAD.dual_level():
            duals = {n: fwAD.make_dual(model.state_dict()[n].clone(), torch.ones_like(model.state_dict()[n]))
                     for n in names}
            for _ in range(3):
                out.append(fwAD.unpack_dual(functional_call(model, duals, (x,))).tangent)
                for dual in duals.values():
                    fwAD.unpack_dual(dual).tangent.mul_(2)
        out.append(functional_call(model, duals, (x,)))  # the level ended: no tangent left
        results.append(out)
    assert all(map(torch.equal, *results))


def test_jvp_over_every_parameter_of_a_training_model_equals_stock():
    # The same bug in the default mode with grad enabled: torch.func's usual
    # jvp(functional_call(model, detached params)) of a training model; the detached parameters
    # require no grad, so auto froze the view-valued chain (4.035 where stock gives 2.362).
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), orthogonal(nn.Linear(4, 3)))

    stock, ours = build(), paramfold.prepare(build(), "auto")
    x = torch.randn(2, 4)
    for _ in range(3):
        outs = []
        for model in (stock, ours):
            params = {k: v.detach() for k, v in model.named_parameters()}
            tangents = {k: torch.ones_like(v) for k, v in params.items()}
            outs.append(jvp(lambda p, m=model: functional_call(m, p, (x,)), (params,), (tangents,)))
        assert all(map(torch.equal, *outs))


def test_vmap_of_jvp_over_stacked_module_states_equals_stock():
    def build():
        torch.manual_seed(0)
        return _inference(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), orthogonal(nn.Linear(4, 3))))

    x = torch.randn(2, 4)
    outs = []
    for prepare in (False, True):
        models = [build() for _ in range(3)]
        for k, model in enumerate(models):
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1 + 0.1 * k)
        params, buffers = stack_module_state(models)
        base = paramfold.prepare(build(), "auto") if prepare else build()
        tangents = {k: torch.ones_like(v) for k, v in params.items()}
        call = lambda p, b: functional_call(base, (p, b), (x,))  # noqa: E731
        with torch.no_grad():
            outs.append(vmap(lambda p, t, b: jvp(lambda q: call(q, b), (p,), (t,)))(params, tangents, buffers))
    assert all(map(torch.equal, *outs))


def three_kinds() -> nn.Module:
    """weight_norm (original0/original1), spectral_norm (stateful: _u/_v buffers), orthogonal."""
    torch.manual_seed(0)
    return nn.Sequential(weight_norm(nn.Linear(4, 4)), nn.Tanh(), spectral_norm(nn.Linear(4, 4)), nn.Tanh(),
                         orthogonal(nn.Linear(4, 3)))


def _dict(model: nn.Module, what: str, seed: int) -> dict[str, torch.Tensor]:
    """What functional_call is given: the originals, the computed weight (stock's setattr runs
    right_inverse), spectral_norm's buffers only, or every entry of the state_dict."""
    g = torch.Generator().manual_seed(seed)
    names = {
        "originals": ["0.parametrizations.weight.original0", "0.parametrizations.weight.original1",
                      "2.parametrizations.weight.original", "4.parametrizations.weight.original"],
        "computed": ["0.weight", "2.weight"],
        "sn_buffers": ["2.parametrizations.weight.0._u", "2.parametrizations.weight.0._v"],
        "state_dict": list(model.state_dict()),
    }[what]
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {n: torch.randn((tensors[n] if n in tensors else model.get_submodule(n[0]).weight).shape, generator=g)
            for n in names}


def _assert_same_state(stock: nn.Module, ours: nn.Module) -> None:
    expected, actual = stock.state_dict(), ours.state_dict()
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name


def _callers(stock: nn.Module, ours: nn.Module, compiled: bool, strict: bool = False) -> dict:
    """``functional_call`` of each model, in a function compiled with the eager backend or not."""
    calls = {}
    for model in (stock, ours):
        def call(d, t, model=model):
            return functional_call(model, d, (t,), strict=strict)
        calls[model] = torch.compile(call, backend="eager") if compiled else call
    return calls


@pytest.mark.parametrize(("mode", "what", "compiled"), [
    *((mode, what, False) for mode in MODES for what in ("originals", "sn_buffers", "state_dict")),
    ("hoist", "originals", True), ("inline", "sn_buffers", True),
])
def test_functional_call_in_training_equals_stock(mode, what, compiled):
    # functional_call with each kind of dict (strict where it names every entry), then a plain
    # call: outputs, the originals' gradients and the buffers the power iteration moved.
    stock = three_kinds().train()
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    calls = _callers(stock, ours, compiled, strict=what == "state_dict")
    x = torch.randn(3, 4)
    for step in range(2):
        outs = []
        for model in (stock, ours):
            y = calls[model](_dict(model, what, seed=step), x) + model(x)
            y.sum().backward()
            outs.append(y)
        assert torch.equal(outs[1], outs[0])
    for (name, p), q in zip(stock.named_parameters(), ours.parameters()):
        assert torch.equal(q.grad, p.grad), name
    _assert_same_state(stock, ours)


@pytest.mark.parametrize("mode", MODES)
def test_deepcopy_after_a_functional_call_with_tensors_that_have_a_history_equals_stock(mode):
    # functional_call with p + delta in a grad call leaves nothing in stock's model; paramfold
    # remembered the swapped-in tensors (what the last call's value was computed from), and
    # copy.deepcopy of the model then raised "Only Tensors created explicitly by the user (graph
    # leaves) support the deepcopy protocol" (found by the event-sequence fuzzer).
    stock = three_kinds().train()
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    x = torch.randn(3, 4)
    models = []
    for model in (stock, ours):
        swapped = {name: p + 0.1 for name, p in model.named_parameters() if "original" in name}
        functional_call(model, swapped, (x,)).sum().backward()
        models.append(copy.deepcopy(model))
    for model in (*models, stock, ours):
        model.out = model(x)
        model.out.sum().backward()
    assert torch.equal(models[1].out, models[0].out) and torch.equal(ours.out, stock.out)
    for a, b in ((stock, ours), (models[0], models[1])):
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(q.grad, p.grad), name
        _assert_same_state(a, b)


@pytest.mark.parametrize(("mode", "kind", "train"), [
    *((mode, kind, True) for mode in MODES for kind in ("view", "history")),
    ("auto", "view", False), ("freeze", "view", False),
])
def test_tensors_functional_call_put_in_are_let_go_when_the_call_ends(mode, kind, train):
    # Regression: paramfold kept the tensors a call's values were computed from until the next
    # call (what nested calls compare with, the steady plan built on them, a frozen value's
    # inputs). A view of an original (p[:], as fwAD.make_dual's) holds its base, and a later
    # module.to() with swap_module_params_on_conversion raised "Couldn't swap"; a MAML step's
    # adapted weights (p * 0.9, with their history) outlived the call. Stock keeps neither.
    stock = three_kinds() if train else _inference(three_kinds())
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    x = torch.randn(3, 4)
    outs, kept = [], []
    for model in (stock, ours):
        put_in = {n: p[:] if kind == "view" else p * 0.9 for n, p in model.named_parameters() if "original" in n}
        probe = weakref.ref(put_in["0.parametrizations.weight.original1"])
        with torch.set_grad_enabled(train):
            out = functional_call(model, put_in, (x,))
        del put_in, out
        gc.collect()
        kept.append(probe() is not None)
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            model.to(torch.float64)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(False)
        with torch.set_grad_enabled(train):
            outs.append((model(x.double()), model(x.double())))
    assert kept == [False, False]
    assert all(map(torch.equal, outs[1], outs[0]))
    _assert_same_state(stock, ours)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("mode", ["inline", "freeze"])
def test_functional_call_naming_the_computed_weight_equals_stock(mode, compiled):
    # A dict naming "0.weight" (the parametrized tensor, not an original): stock's setattr runs
    # the chain's right_inverse into the originals for the call and back after it (in place, so
    # under no_grad: with grad, backward raises for stock as for paramfold). The originals after
    # the round trip, and the values served after it, must be stock's.
    stock = _inference(three_kinds())
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    calls = _callers(stock, ours, compiled)
    x = torch.randn(3, 4)
    with torch.no_grad():
        for step in range(2):
            for model in (stock, ours):
                model.out = calls[model](_dict(model, "computed", seed=step), x), model(x)
            assert all(map(torch.equal, ours.out, stock.out))
    _assert_same_state(stock, ours)


@pytest.mark.parametrize(("mode", "compiled"), [("auto", False), ("freeze", False), ("freeze", True)])
def test_functional_call_with_other_dicts_under_no_grad_never_serves_a_frozen_value(mode, compiled):
    # A frozen value must follow the dict of each call: a new dict at every call, the model's
    # own originals between them, and one kept dict edited in place between calls.
    stock = _inference(three_kinds())
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    calls = _callers(stock, ours, compiled)
    kept = {model: _dict(model, "originals", seed=9) for model in (stock, ours)}
    x = torch.randn(3, 4)
    with torch.no_grad():
        for seed in range(3):
            for model in (stock, ours):
                model.out = (calls[model](_dict(model, "originals", seed), x), model(x), calls[model](kept[model], x))
                kept[model]["0.parametrizations.weight.original1"].mul_(1.5)
            assert all(map(torch.equal, ours.out, stock.out))
    _assert_same_state(stock, ours)



@pytest.mark.parametrize("entry", ["region", "functional_call"])
@pytest.mark.parametrize("mode", [*MODES, "freeze"])
def test_compiled_function_calling_the_model_inside_parametrize_cached_reads_the_blocks_value(mode, entry):
    # Regression: inside parametrize.cached(), stock's first read in the block computes each
    # value and every later read gets that one, eager or in a compiled function that calls the
    # model (dynamo traces parametrize's cache lookup), even after the originals changed in
    # place or were swapped by functional_call. A prepared model called from a compiled function
    # (traced into the function's graph, no call scope) computed its values afresh in the graph
    # instead, in every mode: other outputs, and the cache left unfilled for the block's eager
    # reads after. The in-graph reads now go through the cache like stock's property.
    stock = _inference(wn_head())
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    x = torch.randn(2, 4)
    runs = {}
    for model in (stock, ours):
        if entry == "region":
            runs[model] = torch.compile(lambda t, d, model=model: model(t) * 2, backend="eager")
        else:
            runs[model] = torch.compile(lambda t, d, model=model: functional_call(model, d, (t,)), backend="eager")
    with torch.no_grad():
        for model in (stock, ours):
            model(x)
        with torch.nn.utils.parametrize.cached():
            for step in range(3):
                d = {"0.parametrizations.weight.original1": torch.full((4, 4), 0.5 + step)}
                for model in (stock, ours):
                    model.out = model(x), runs[model](x, d), model(x)
                    model[0].parametrizations.weight.original1.add_(0.25)
                assert all(map(torch.equal, ours.out, stock.out)), step
            assert torch.equal(ours[0].weight, stock[0].weight)
        assert torch.equal(ours(x), stock(x))
    _assert_same_state(stock, ours)


# --- model surgery after prepare -----------------------------------------------------------


def _new_layer(kind: str) -> nn.Module:
    torch.manual_seed(1)
    if kind == "plain":
        return nn.Linear(4, 4)
    if kind == "weight_norm":
        return weight_norm(nn.Linear(4, 4))
    if kind == "spectral_norm":
        return spectral_norm(nn.Linear(4, 4))
    return torch.nn.utils.weight_norm(nn.Linear(4, 4))  # the deprecated hook-based one


SURGERIES = {
    # a parametrized layer replaced (item assignment, set_submodule), a plain one replaced,
    # a layer added (add_module, append), a layer deleted
    "replace_parametrized": lambda m, new: m.__setitem__(0, new),
    "set_submodule_stateful": lambda m, new: m.set_submodule("2", new),
    "replace_plain": lambda m, new: m.__setitem__(4, new),
    "add_module": lambda m, new: m.add_module("5", new),
    "delete_parametrized": lambda m, new: m.__delitem__(2),
}


@pytest.mark.parametrize(("surgery", "kind", "compiled"), [
    ("replace_parametrized", "weight_norm", False),
    ("replace_parametrized", "hook_weight_norm", True),
    ("set_submodule_stateful", "spectral_norm", True),
    ("replace_plain", "weight_norm", False),
    ("add_module", "spectral_norm", False),
    ("delete_parametrized", None, True),
])
@pytest.mark.parametrize("mode", MODES)
def test_surgery_after_prepare_trains_like_stock_and_restores_to_stock(mode, surgery, kind, compiled):
    # A layer of a prepared (and already called) model replaced, added or deleted, the new one
    # parametrized or not: the calls after it, eager or compiled, train like stock's, and
    # restore leaves stock's modules.
    torch.manual_seed(0)
    stock = nn.Sequential(weight_norm(nn.Linear(4, 4)), nn.Tanh(), spectral_norm(nn.Linear(4, 4)), nn.Tanh(),
                          nn.Linear(4, 4))
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    x = torch.randn(3, 4)
    for model in (stock, ours):
        model(x).sum().backward()
        SURGERIES[surgery](model, kind and _new_layer(kind))
    calls = {model: torch.compile(model, backend="eager") if compiled else model for model in (stock, ours)}
    _two_calls_alike(calls, x)
    _assert_same_state(stock, ours)
    paramfold.restore(ours)
    assert [type(m).__name__ for m in ours.modules()] == [type(m).__name__ for m in stock.modules()]
    assert all(type(m).__mro__[1:] == type(s).__mro__[1:] for m, s in zip(ours.modules(), stock.modules()))
    assert torch.equal(ours(x), stock(x))


def _two_calls_alike(calls: dict, x: torch.Tensor) -> None:
    """Two calls and backwards of each model (stock's first) through ``calls[model]``: outputs and
    accumulated gradients bitwise equal to stock's."""
    stock, ours = calls
    for _ in range(2):
        outs = [call(x) for call in calls.values()]
        assert torch.equal(outs[1], outs[0])
        for y in outs:
            y.sum().backward()
    for (name, p), q in zip(stock.named_parameters(), ours.parameters()):
        assert torch.equal(q.grad, p.grad), name


def _sn_block() -> nn.Module:
    """A spectral_norm layer inside a block (its parent is not the root), a weight_norm layer
    that stays, and a plain head."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(spectral_norm(nn.Linear(4, 4)), nn.ReLU()),
                         weight_norm(nn.Linear(4, 4)), nn.Tanh(), nn.Linear(4, 2)).train()


def _swap_in_a_layer_sharing_the_member(model: nn.Module, how: str) -> None:
    """``model[0][0]`` replaced by a new Linear that takes over its spectral_norm member object:
    torch.ao's ``prepare_qat`` (a qat.Linear, through ``transfer_parametrizations_and_params``),
    the same by hand, or the member registered on the new layer (put in the block with an item
    assignment, or in a new ``_modules`` dict)."""
    old = model[0][0]
    torch.manual_seed(1)
    if how == "prepare_qat":
        model[0].qconfig = torch.ao.quantization.get_default_qat_qconfig("x86")
        torch.ao.quantization.prepare_qat(model[0], inplace=True)
        return
    new = nn.Linear(4, 4)
    if how == "transfer":
        torch.nn.utils.parametrize.transfer_parametrizations_and_params(old, new, "weight")
    else:
        torch.nn.utils.parametrize.register_parametrization(new, "weight", old.parametrizations.weight[0])
    if how == "new_modules_dict":
        model[0]._modules = {**model[0]._modules, "0": new}
    else:
        model[0][0] = new


def _sn_twins(mode: str, backend: str | None) -> tuple:
    """Stock's ``_sn_block`` and a prepared copy, each called through ``models[model]`` (compiled
    with ``backend``), with an SGD optimizer each."""
    stock = _sn_block()
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    models = {m: torch.compile(m, backend=backend) if backend else m for m in (stock, ours)}
    optimizers = {m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (stock, ours)}
    return stock, ours, models, optimizers


def _eval_alike(models: dict) -> None:
    """Both models in eval mode, one no_grad call each: outputs bitwise equal (stock's first)."""
    stock, ours = models
    stock.eval()
    ours.eval()
    with torch.no_grad():
        assert torch.equal(models[ours](torch.ones(2, 4)), models[stock](torch.ones(2, 4)))


def _sgd_steps(models: dict, optimizers: dict, steps: int) -> None:
    """``steps`` training steps of each model (a call of ``models[model]``, backward, SGD),
    outputs bitwise equal to stock's (the first key)."""
    for step in range(steps):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        outs = []
        for model, call in models.items():
            optimizers[model].zero_grad()
            y = call(x)
            y.square().sum().backward()
            optimizers[model].step()
            outs.append(y)
        assert torch.equal(outs[1], outs[0]), step


@pytest.mark.filterwarnings("ignore:Please use quant_min and quant_max")  # torch.ao's default qconfig
@pytest.mark.parametrize(("how", "backend"), [
    ("prepare_qat", None), ("prepare_qat", "aot_eager"), ("transfer", "eager"), ("share_member", None),
    ("share_member", "aot_eager"), ("new_modules_dict", None),
])
@pytest.mark.parametrize("mode", MODES)
def test_a_layer_swapped_for_one_sharing_its_stateful_member_is_no_longer_computed(mode, how, backend):
    # Regression: a scope computed every holder listed at prepare, also one swapped out of the
    # model since. With the new layer sharing the old one's spectral_norm member (prepare_qat's
    # swap), the member ran two power iterations per call (output off by 0.1 at the first call,
    # _u, gradients and state_dict after). The swap comes after steady calls (a plan built on
    # the block's _modules): the calls after it, eager or compiled, train like stock's.
    stock, ours, models, optimizers = _sn_twins(mode, backend)
    _sgd_steps(models, optimizers, 3)
    for model in (stock, ours):
        _swap_in_a_layer_sharing_the_member(model, how)
        optimizers[model] = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _sgd_steps(models, optimizers, 3)
    _assert_same_state(stock, ours)
    _eval_alike(models)
    paramfold.restore(ours)
    assert [type(m).__name__ for m in ours.modules()] == [type(m).__name__ for m in stock.modules()]


@pytest.mark.parametrize(("where", "calls_before"), [("before", 3), ("after", 3), ("before", 0)])
@pytest.mark.parametrize("backend", [None, "eager"])
@pytest.mark.parametrize("mode", MODES)
def test_a_layer_added_after_prepare_sharing_a_stateful_member_is_read_in_forward_order(mode, backend, where,
                                                                                       calls_before):
    # Regression: which sites share changing state was decided at prepare only. A layer added
    # since (computed where read, as stock's) registering a prepared layer's spectral_norm member
    # and read before it: hoist and auto computed the prepared layer's value at the call's start,
    # advancing the shared _u before the new layer's read (stock: at each read, in forward order).
    stock, ours, models, optimizers = _sn_twins(mode, backend)
    _sgd_steps(models, optimizers, calls_before)
    for model in (stock, ours):
        torch.manual_seed(1)
        new = nn.Linear(4, 4)
        torch.nn.utils.parametrize.register_parametrization(new, "weight", model[0][0].parametrizations.weight[0])
        if where == "before":
            model[0].insert(0, new)
        else:
            model[0].append(new)
        optimizers[model] = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _sgd_steps(models, optimizers, 3)
    _assert_same_state(stock, ours)
    _eval_alike(models)
    stock.train()
    ours.train()
    _sgd_steps(models, optimizers, 2)
    _assert_same_state(stock, ours)
    paramfold.restore(ours)


def _wn_sn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(weight_norm(nn.Linear(4, 4)), nn.Tanh(), spectral_norm(nn.Linear(4, 4)), nn.Linear(4, 2))


@pytest.mark.parametrize("call_after_swap", [False, True])
@pytest.mark.parametrize("norm", ["hook_weight_norm", "hook_spectral_norm"])
@pytest.mark.parametrize("mode", MODES)
def test_a_deep_copy_after_a_hook_normed_layer_was_swapped_out_copies_what_stock_copies(mode, norm, call_after_swap):
    # Regression: the model's state still listed the layer swapped out (for its restore), and a
    # deep copy copied it: a hook-based norm's weight is not a leaf, and copy.deepcopy raised
    # "Only Tensors created explicitly by the user ... support the deepcopy protocol". Stock's
    # model no longer holds the layer; nor does the copy now.
    def make():
        torch.manual_seed(0)
        norm_fn = nn.utils.weight_norm if norm == "hook_weight_norm" else nn.utils.spectral_norm
        return nn.Sequential(norm_fn(nn.Linear(4, 4)), nn.Tanh(), nn.Linear(4, 2))

    stock, ours = make(), paramfold.prepare(make(), mode)
    x = torch.randn(3, 4)
    copies = []
    for model in (stock, ours):
        model(x).sum().backward()
        torch.manual_seed(1)
        model[0] = nn.Linear(4, 4)
        if call_after_swap:
            model(x)
        copies.append(copy.deepcopy(model))
    stock_copy, our_copy = copies
    _two_calls_alike({stock_copy: stock_copy, our_copy: our_copy}, x)
    _assert_same_state(stock_copy, our_copy)
    paramfold.restore(our_copy)
    assert [type(m).__mro__[1:] for m in our_copy.modules()] == [type(m).__mro__[1:] for m in stock_copy.modules()]


@pytest.mark.parametrize("called", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_a_deep_copy_of_a_model_keeping_a_swapped_out_layer_in_an_attribute_restores_it(mode, called):
    # Regression: the copy's state listed only the modules copied before it (the module's
    # _modules); a layer taken out of the model but kept in an attribute set later (`m.spare =
    # [m[2]]`) was copied after it, prepared, yet left out of the copy's lists: restore(copy)
    # left it with paramfold's state and class.
    stock, ours = _wn_sn(), paramfold.prepare(_wn_sn(), mode)
    x = torch.randn(3, 4)
    for model in (stock, ours):
        if called:
            with torch.no_grad():
                model(x)
        model.spare = [model[2]]
        model[2] = nn.Identity()
    stock_copy, our_copy = copy.deepcopy(stock), copy.deepcopy(ours)
    paramfold.restore(our_copy)
    for module, expected in zip(our_copy.modules(), stock_copy.modules()):
        assert "_paramfold" not in vars(module) and type(module).__mro__[1:] == type(expected).__mro__[1:]
    spare, expected = our_copy.spare[0], stock_copy.spare[0]
    assert "_paramfold" not in vars(spare) and type(spare).__mro__[1:] == type(expected).__mro__[1:]
    with torch.no_grad():
        assert torch.equal(spare(x), expected(x)) and torch.equal(our_copy(x), stock_copy(x))


@pytest.mark.parametrize("mode", MODES)
def test_a_layer_swapped_out_and_changed_moved_or_put_back_is_its_own_or_stocks(mode):
    # Regression: after `model[0] = new`, remove_parametrizations on the old layer made every
    # later call of the model raise a FoldError about a module it no longer held; moving the
    # layer into another model had that model's prepare refused as "a module shared by two
    # models". A layer no longer in its model is dropped from it: the model's calls, its
    # restore, the layer's restore or another model's prepare each treat it as stock would.
    # (Twins are built, not copied: a copy of a stock parametrized module shares its class,
    # which remove_parametrizations edits.)
    stock, ours = _wn_sn(), paramfold.prepare(_wn_sn(), mode)
    x = torch.randn(3, 4)
    pairs = []
    for model in (stock, ours):
        model(x)
        old = model[0]
        torch.manual_seed(1)
        model[0] = nn.Linear(4, 4)
        torch.nn.utils.parametrize.remove_parametrizations(old, "weight")
        model(x).sum().backward()
        moved = model[2]
        model[2] = nn.Identity()
        pairs.append((old, moved, nn.Sequential(moved, nn.Tanh())))
    (old_s, moved_s, other_s), (old_o, moved_o, other_o) = pairs
    assert torch.equal(ours(x), stock(x))
    assert type(old_o).__mro__ == type(old_s).__mro__ and torch.equal(old_o.weight, old_s.weight)
    paramfold.prepare(other_o, mode)  # the moved layer's own model now
    paramfold.restore(ours)  # leaves the layer prepared for other_o as it is
    assert "_paramfold" in vars(moved_o)
    for _ in range(2):
        assert torch.equal(other_o(x), other_s(x))
    _assert_same_state(other_s, other_o)
    paramfold.restore(other_o)
    assert type(moved_o).__mro__[1:] == type(moved_s).__mro__[1:] and "_paramfold" not in vars(moved_o)
    # A layer put back after a call that found it gone is computed at its reads, like stock's.
    stock, ours = _wn_sn().train(), paramfold.prepare(_wn_sn().train(), mode)
    for model in (stock, ours):
        layer = model[2]
        model[2] = nn.Identity()
        model(x)
        model[2] = layer
    _two_calls_alike({stock: stock, ours: ours}, x)
    _assert_same_state(stock, ours)
    paramfold.restore(ours)
    assert [type(m).__mro__[1:] for m in ours.modules()] == [type(m).__mro__[1:] for m in stock.modules()]
    # And a layer swapped out is restored on its own.
    ours = paramfold.prepare(_wn_sn(), mode)
    layer = ours[2]
    ours[2] = nn.Identity()
    paramfold.restore(layer)
    assert "_paramfold" not in vars(layer) and type(layer).__mro__[1:] == type(_wn_sn()[2]).__mro__[1:]


# --- other entry points and whole-model tools ------------------------------------------------


@pytest.mark.parametrize(("mode", "entry"), [
    ("hoist", "two_models_fullgraph"), ("auto", "two_models_fullgraph"), ("inline", "one_layer"), ("auto", "one_layer"),
])
def test_other_compiled_entry_points_train_like_stock(mode, entry):
    # A compiled function (fullgraph=True) that calls two prepared models, and torch.compile of
    # one stateful layer of a prepared model called between the model's own calls, with
    # changing batch sizes and an SGD step after each backward.
    twins = []
    for seed in (0, 1):
        stock = three_kinds()
        torch.manual_seed(seed)
        stock[4] = orthogonal(nn.Linear(4, 4))
        twins.append((stock, paramfold.prepare(copy.deepcopy(stock), mode)))
    (stock_a, ours_a), (stock_b, ours_b) = twins
    if entry == "two_models_fullgraph":
        calls = [torch.compile(lambda t, a=a, b=b: b(a(t)), backend="eager", fullgraph=True)
                 for a, b in ((stock_a, stock_b), (ours_a, ours_b))]
    else:
        calls = [lambda t, a=a, layer=torch.compile(a[2], backend="eager"): a(layer(t))
                 for a in (stock_a, ours_a)]
    for batch in (3, 5):
        x = torch.randn(batch, 4)
        outs = [call(x) for call in calls]
        assert torch.equal(outs[1], outs[0])
        for y, models in zip(outs, ((stock_a, stock_b), (ours_a, ours_b))):
            y.sum().backward()
            with torch.no_grad():
                for model in models:
                    for p in model.parameters():
                        if p.grad is not None:
                            p.sub_(0.1 * p.grad)
                            p.grad = None
    _assert_same_state(stock_a, ours_a)
    _assert_same_state(stock_b, ours_b)


@pytest.mark.parametrize("mode", [*MODES, "freeze"])
def test_quantize_dynamic_and_jit_script_refuse_a_prepared_model_as_they_refuse_stock(mode):
    # Neither converts a parametrized model in stock: quantize_dynamic's Linear.from_float
    # refuses the ParametrizedLinear class, and TorchScript cannot compile parametrize's code
    # (nor paramfold's).
    # A prepared model must not be converted into something else: both raise for it too.
    stock = _inference(three_kinds())
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    with torch.no_grad():
        ours(torch.randn(2, 4))
    for model in (stock, ours):
        with pytest.raises(AssertionError, match="from_float only works for"):
            torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
        # (RuntimeError: a failed script leaves TorchScript's class cache half filled, and a
        # later attempt in the same process says "Can't redefine method", for stock as well.)
        with pytest.raises((torch.jit.frontend.NotSupportedError, RuntimeError)):
            torch.jit.script(model)
    _assert_same_state(stock, ours)


class _AddOwn(nn.Module):
    """A custom parametrization owning a parameter (a LoRA-like delta) and a setting."""

    def __init__(self):
        super().__init__()
        self.b = nn.Parameter(torch.randn(4, 4))
        self.k = 1.0

    def forward(self, w):
        return w + self.b * self.k


def _probed_chain(kind: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    if kind == "nested":  # a chain on the weight, and one on its original
        torch.nn.utils.parametrize.register_parametrization(model[0], "weight", RowScale())
        torch.nn.utils.parametrize.register_parametrization(model[0].parametrizations.weight, "original", RowScale())
    else:
        torch.nn.utils.parametrize.register_parametrization(model[0], "weight", _AddOwn())
    return model.eval().requires_grad_(False)


@pytest.mark.parametrize("mode", ["auto", "hoist", "freeze", "inline"])
@pytest.mark.parametrize("kind, swapped", [
    ("nested", "0.parametrizations.weight.parametrizations.original.original"),
    ("owns", "0.parametrizations.weight.0.b"),
])
def test_vmap_over_functional_call_after_a_setting_changed_like_stock(mode, kind, swapped):
    """A changed setting has the chain probed again at the next call; inside vmap the tensors
    functional_call swapped in are vmap's wrappers, which the probe cannot copy: the nested chain's
    call raised NotImplementedError ("Cannot access storage of BatchedTensorImpl"), and freeze
    refused the other as a chain that draws random numbers. The value is computed where it is
    read for that call, as stock's is, and the chain probed at a later call."""
    stock, ours = _probed_chain(kind), paramfold.prepare(_probed_chain(kind), mode)
    x = torch.randn(2, 4)
    for model in (stock, ours):
        with torch.no_grad():
            model(x)
        for member in model.modules():
            if isinstance(member, RowScale):
                member.alpha = 2.0
            elif isinstance(member, _AddOwn):
                member.k = 2.0
    base = stock.state_dict()[swapped]
    stacked = torch.stack([base * 0.5, base * 1.5])
    with torch.no_grad():
        outs = [torch.vmap(lambda p, m=m: functional_call(m, {swapped: p}, (x,)))(stacked.clone()) for m in (stock, ours)]
        assert torch.equal(outs[1], outs[0])
        assert torch.equal(ours(x), stock(x))


@pytest.mark.parametrize("mode", ["auto", "hoist", "freeze", "inline"])
def test_deepcopy_after_vmap_over_functional_call(mode):
    """A call scope keeps the tensors a value was last computed from (``SiteState.read_from``):
    after ``vmap(functional_call(...))`` those were vmap's wrappers, which ``copy.deepcopy``
    refused (NotImplementedError: "Cannot access storage of BatchedTensorImpl"), where stock's
    model copies. The copy starts without them."""
    torch.manual_seed(0)
    stock = _inference(nn.Sequential(weight_norm(nn.Linear(4, 4)), nn.Tanh()))
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    x = torch.randn(2, 4)
    name = "0.parametrizations.weight.original1"
    stacked = torch.stack([stock.state_dict()[name] * 0.5, stock.state_dict()[name] * 1.5])
    with torch.no_grad():
        for model in (stock, ours):
            torch.vmap(lambda p, m=model: functional_call(m, {name: p}, (x,)))(stacked.clone())
        stock_copy, our_copy = copy.deepcopy(stock), copy.deepcopy(ours)
        assert torch.equal(our_copy(x), stock_copy(x))
        assert torch.equal(ours(x), stock(x))


@pytest.mark.parametrize("mode", ["hoist", "auto", "inline"])
def test_originals_taken_out_of_their_dicts_are_refused_naming_the_fsdp1_order(mode):
    # FSDP1 with use_orig_params=False, applied after prepare, moves the originals out of
    # _parameters: the refusal says to prepare the wrapper instead.
    from torch.nn.utils.parametrizations import weight_norm

    torch.manual_seed(0)
    model = nn.Sequential(weight_norm(nn.Linear(4, 4)), nn.Tanh())
    paramfold.prepare(model, mode)
    plist = model[0].parametrizations.weight
    for name in ("original0", "original1"):
        setattr(plist, name, plist._parameters.pop(name).detach().clone())
    with pytest.raises(paramfold.FoldError, match=r"changed after paramfold\.prepare.*FSDP1 with use_orig_params=False.*prepare again"):
        model(torch.randn(2, 4))


@pytest.mark.parametrize("mode", ["hoist", "inline", "auto"])
def test_a_chain_probed_again_inside_vmap_after_a_settings_change(mode):
    # Regression (found by test_event_sequences): a chain whose settings changed is probed again
    # at its next read, here inside vmap(functional_call(...)); the probe with grad enabled made
    # clones that require grad, which torch.func refuses (RuntimeError from requires_grad_).
    def build():
        torch.manual_seed(0)
        layer = nn.Linear(4, 4)
        torch.nn.utils.parametrize.register_parametrization(layer, "weight", RowScale())
        return nn.Sequential(weight_norm(nn.Linear(4, 4)), nn.Tanh(), layer)

    stock, ours = build(), paramfold.prepare(build(), mode)
    x = torch.randn(2, 4)
    assert torch.equal(ours(x), stock(x))
    for m in (stock, ours):
        m[2].parametrizations.weight[0].alpha = 0.5
    base = stock[0].bias.detach()
    stacked = torch.stack([base * 0.5, base * 1.5])
    with torch.no_grad():
        outs = [torch.vmap(lambda p, m=m: functional_call(m, {"0.bias": p}, (x,)))(stacked) for m in (stock, ours)]
    assert torch.equal(*outs)


class _ParameterScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.tensor(1.5))

    def forward(self, w):
        return w * self.s


@pytest.mark.parametrize("tracing_mode", ["fake", "symbolic"])
@pytest.mark.parametrize("mode", ["freeze", "auto", "hoist", "inline"])
def test_make_fx_of_functional_call_with_fake_tensors_traces_like_stock(mode, tracing_mode):
    # Regression: functional_call swaps fakes in for a chain member's parameter, which the chain's
    # settings watch sees as a change; the chain was probed again on the fakes, under make_fx's
    # modes, its copies' writes taken for its own, and freeze refused the trace ("would draw
    # random numbers"). Under a dispatch mode a chain is not probed: computed where read, as stock.
    from torch.fx.experimental.proxy_tensor import make_fx

    torch.manual_seed(0)
    stock = nn.Linear(4, 3)
    torch.nn.utils.parametrize.register_parametrization(stock, "weight", _ParameterScale())
    stock.eval().requires_grad_(False)
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    x = torch.randn(2, 4)
    with torch.no_grad():
        ours(x)  # a call first: the settings watch is in place
    results = []
    for model in (stock, ours):
        params = {**dict(model.named_parameters()), **dict(model.named_buffers())}

        def call(p, x, model=model):
            return functional_call(model, p, (x,))

        graph = make_fx(functools.partial(call, model=model), tracing_mode=tracing_mode)(params, x)
        results.append(graph(params, x))
    assert torch.equal(results[1], results[0])
    with torch.no_grad():
        assert torch.equal(ours(x), stock(x))


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("mode", ["hoist", "inline", "freeze", "auto"])
def test_remove_parametrizations_inside_a_call_leaves_the_layer_plain_like_stocks(mode, train):
    # Regression: remove_parametrizations(layer, name) (leave_parametrized=True) from a hook of a
    # later layer, inside the call: torch registers the original under the name, whose check
    # found the value the call scope had put in the module's __dict__ ("attribute 'weight'
    # already exists", raised after the parametrization was gone: the layer lost its weight, and
    # restore left it without one). Stock's module has nothing there. The next call refuses the
    # changed model, as after a removal between calls.
    if mode == "freeze" and train:
        pytest.skip("freeze serves eval no_grad calls only")

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(weight_norm(nn.Linear(4, 6)), nn.Tanh(), nn.Linear(6, 2))
        model.train(train).requires_grad_(train)
        done = []

        def bake(module, args, out):
            if not done:
                done.append(1)
                torch.nn.utils.parametrize.remove_parametrizations(model[0], "weight")

        model[1].register_forward_hook(bake)
        return model

    stock, ours = build(), paramfold.prepare(build(), mode)
    x = torch.randn(5, 4)

    def same_step():
        with torch.set_grad_enabled(train):
            expected, out = stock(x), ours(x)
            assert torch.equal(out, expected)
            if train:
                expected.sum().backward()
                out.sum().backward()
                for a, b in zip(stock.parameters(), ours.parameters(), strict=True):
                    assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)

    same_step()
    assert type(ours[0]) is type(stock[0]) is nn.Linear
    assert ours.state_dict().keys() == stock.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), stock.state_dict().values()))
    with pytest.raises(paramfold.FoldError, match="changed after paramfold.prepare"):
        ours(x)  # as after a removal between calls: restore, then prepare again
    paramfold.restore(ours)
    for _ in range(2):
        same_step()


def test_a_model_built_under_fake_tensor_mode_is_refused_and_the_process_lives(tmp_path):
    # Regression: find() and prepare() copied the custom member (copy.deepcopy) to probe it;
    # torch cannot copy a 0-d fake Parameter, and a few failed copies corrupted the heap: the
    # process aborted ("corrupted double-linked list") or segfaulted. Stock builds and calls
    # such a model (memory estimators do). In a subprocess: the bug killed the interpreter.
    import subprocess
    import sys

    script = tmp_path / "fake_model.py"
    script.write_text(
        "import torch, paramfold\n"
        "from torch import nn\n"
        "from torch.nn.utils import parametrize\n"
        "from torch._subclasses.fake_tensor import FakeTensorMode\n"
        "class Scale(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.s = nn.Parameter(torch.tensor(1.5))\n"
        "    def forward(self, w):\n"
        "        return w * self.s\n"
        "with FakeTensorMode():\n"
        "    model = nn.Linear(8, 8)\n"
        "    parametrize.register_parametrization(model, 'weight', Scale())\n"
        "    before = type(model)\n"
        "    for act in (paramfold.find, lambda m: paramfold.prepare(m, 'hoist'), lambda m: paramfold.prepare(m, 'auto')):\n"
        "        try:\n"
        "            act(model)\n"
        "        except paramfold.FoldError as e:\n"
        "            assert 'FakeTensorMode' in str(e), e\n"
        "        else:\n"
        "            raise AssertionError('not refused')\n"
        "        assert type(model) is before\n"
        "    assert model(torch.randn(2, 8)).shape == (2, 8)\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (done.returncode, done.stderr[-2000:])
