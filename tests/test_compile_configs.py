"""torch.compile / torch.func configurations a demanding user sets, against a stock twin.

Each test builds the stock model and the prepared one identically (same seed) and compares
outputs, gradients and state_dict bitwise with the eager backend; with "aot_eager", whose
decompositions may reorder arithmetic, within float32 round-off (atol=rtol=1e-6).
"""

from __future__ import annotations

import pytest
import torch
from helpers import build, grads
from torch.func import functional_call

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
