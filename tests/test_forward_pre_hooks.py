"""Forward pre-hooks that edit a layer's originals before its forward reads them (found by the
2026-12-02 training-loop hunt): registered before the calls, added after steady calls, added to a
hook-based norm's layer after compiled calls, and same-architecture models that differ in such
hooks compiled in one process. A tensor below a module with forward pre-hooks is computed where
it is read, and a checkpoint's recomputation computes it again with autograd. Hooks registered
during a call: ``tests/test_midcall_pre_hooks.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_same_tensors, grads, _Scale
from torch import nn
from torch.nn.utils import parametrize as P
from torch.nn.utils.parametrizations import spectral_norm, weight_norm

import paramfold


def _max_norm(module, args):
    # A max-norm constraint as a forward pre-hook: it edits the originals in place before the
    # forward reads the parametrized weight (stock computes the weight after it).
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "original" in name or name.endswith(("weight_g", "weight_v", "weight_orig")):
                p.clamp_(-0.1, 0.1)


def _pre_hooked(kind: str, where: str, inference: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    if kind == "custom":
        P.register_parametrization(model[2], "weight", _Scale())
    elif kind == "weight_norm":
        weight_norm(model[2])
    elif kind == "spectral_norm":
        spectral_norm(model[2])
    else:  # torch's deprecated hook-based norms: a pre-hook of their own computes the weight
        getattr(torch.nn.utils, kind.removesuffix("_hooks"))(model[2])
    if where == "middle":  # the parametrized layer inside a container that has the hook
        model[2] = nn.Sequential(model[2])
    # prepend: before a hook-based norm's own hook (after it, stock's backward would fail)
    hooked = {"holder": model[2], "root": model, "middle": model[2]}[where]
    hooked.register_forward_pre_hook(_max_norm, prepend=True)
    return model.eval().requires_grad_(False) if inference else model


@pytest.mark.usefixtures("fresh_dynamo")  # see the test after this one
@pytest.mark.parametrize("backend", [None, "eager", "aot_eager"])
@pytest.mark.parametrize("where", ["holder", "root", "middle"])
@pytest.mark.parametrize("kind", ["custom", "weight_norm", "spectral_norm", "weight_norm_hooks", "spectral_norm_hooks"])
@pytest.mark.parametrize("mode", ["hoist", "auto", "freeze"])
def test_a_forward_pre_hook_that_edits_originals_is_seen(mode, kind, where, backend):
    # Regression: values were computed when the call began (root) or checked before the module's
    # own pre-hooks ran (holder): outputs one edit behind, or backward raised "modified by an
    # inplace operation". Sites under a module with forward pre-hooks are computed where read.
    inference = mode == "freeze"
    stock, ours = _pre_hooked(kind, where, inference), _pre_hooked(kind, where, inference)
    paramfold.prepare(ours, mode)
    run_stock = torch.compile(stock, backend=backend) if backend else stock
    run_ours = torch.compile(ours, backend=backend) if backend else ours
    for step in range(3):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        with torch.no_grad() if inference else torch.enable_grad():
            expected, actual = run_stock(x), run_ours(x)
        assert torch.equal(expected, actual), (step, (expected - actual).abs().max())
        if not inference:
            expected.sum().backward()
            actual.sum().backward()
            assert_same_tensors(grads(stock), grads(ours), step)
    assert_same_tensors(dict(stock.state_dict()), dict(ours.state_dict()))


@pytest.mark.parametrize("mode", ["auto", "freeze"])
def test_a_pre_hook_added_after_steady_calls_is_seen(mode):
    stock, ours = _pre_hooked("custom", "holder", True), _pre_hooked("custom", "holder", True)
    for m in (stock, ours):
        m[2]._forward_pre_hooks.clear()
    paramfold.prepare(ours, mode)
    x = torch.randn(3, 4)
    with torch.no_grad():
        for _ in range(3):  # steady: the values are kept and the call's plan is built
            assert torch.equal(stock(x), ours(x))
        for m in (stock, ours):
            m[2].register_forward_pre_hook(_max_norm)
        for _ in range(2):
            assert torch.equal(stock(x), ours(x))


def _halve_input(module, args):
    return (args[0] * 0.5,)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("kind", ["weight_norm_hooks", "spectral_norm_hooks"])
@pytest.mark.parametrize("mode", ["hoist", "auto", "freeze"])
def test_a_pre_hook_added_to_a_hook_based_norm_after_compiled_calls_is_seen(mode, kind, backend):
    # Regression (found by the 2026-12-02 entry-point hunt): code compiled while the norm's own
    # hook was out read the weight left in the module by the last call; with a pre-hook added,
    # the scope left the norm to its hook and dynamo (no guards on hooks) reused that code: the
    # output of the call before, or "backward through the graph a second time" with grad.
    inference = mode == "freeze"
    stock, ours = _pre_hooked(kind, "holder", inference), _pre_hooked(kind, "holder", inference)
    for m in (stock, ours):
        m[2]._forward_pre_hooks.pop(next(k for k, h in m[2]._forward_pre_hooks.items() if h is _max_norm))
    paramfold.prepare(ours, mode)
    run_stock, run_ours = torch.compile(stock, backend=backend), torch.compile(ours, backend=backend)
    for step in range(4):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        with torch.no_grad() if inference else torch.enable_grad():
            expected, actual = run_stock(x), run_ours(x)
            assert torch.equal(expected, stock(x) if kind == "weight_norm_hooks" else expected)
        assert torch.equal(expected, actual), (step, (expected - actual).abs().max())
        if not inference:
            expected.sum().backward()
            actual.sum().backward()
            assert_same_tensors(grads(stock), grads(ours), step)
        for m in (stock, ours):
            with torch.no_grad():
                for name, p in m[2].named_parameters():
                    p.mul_(1.25)  # an optimizer step, say
            if step == 1:
                m[2].register_forward_pre_hook(_halve_input)
    assert_same_tensors(dict(stock.state_dict()), dict(ours.state_dict()))


@pytest.mark.parametrize("guard_hooks", [
    pytest.param(False, marks=pytest.mark.xfail(strict=True, reason=(
        "documented limit (README, Notes and limits): dynamo does not guard on module hooks "
        "(torch._dynamo.config.skip_nnmodule_hook_guards), and prepared layers share a class"))),
    True,
])
def test_same_architecture_models_that_differ_in_hooks_compiled_in_one_process(guard_hooks):
    # Code compiled for a model without a hook on the layer is reused for a same-architecture
    # model with one there (both compute the layer's weight where it is read, because of a
    # pre-hook on the block above it), which then skips its hook, as unparametrized models do;
    # stock's per-instance classes made dynamo compile each instance. The setting torch offers
    # makes it exact.
    def build(hooked: bool) -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Sequential(nn.Linear(4, 2)))
        P.register_parametrization(model[2][0], "weight", _Scale())
        model[2].register_forward_pre_hook(_does_nothing)
        if hooked:
            model[2][0].register_forward_pre_hook(_max_norm, prepend=True)
        return model

    torch._dynamo.reset()
    x = torch.randn(3, 4)
    stock, ours = build(True), paramfold.prepare(build(True), "hoist")
    try:
        with torch._dynamo.config.patch(skip_nnmodule_hook_guards=not guard_hooks):
            torch.compile(paramfold.prepare(build(False), "hoist"), backend="eager")(x)
            assert torch.equal(stock(x), torch.compile(ours, backend="eager")(x))
    finally:
        torch._dynamo.reset()


def _does_nothing(module, args):
    return None


class _Checkpointing(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("backend", [None, "aot_eager"])
@pytest.mark.parametrize("kind", ["custom", "weight_norm"])
@pytest.mark.parametrize("mode", ["hoist", "auto"])
def test_a_tensor_computed_where_read_is_recomputed_with_autograd_by_a_checkpoint(mode, kind, backend):
    # Regression: below a forward pre-hook the tensor is computed where it is read, inside the
    # checkpointed region; its recomputation served it detached, as for a value computed before
    # the region: CheckpointError (weight_norm saved 7 tensors, then 4), or no gradient.
    torch.manual_seed(0)
    stock = _Checkpointing(_pre_hooked(kind, "holder", False))
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    run_stock = torch.compile(stock, backend=backend) if backend else stock
    run_ours = torch.compile(ours, backend=backend) if backend else ours
    for step in range(2):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        expected, actual = run_stock(x), run_ours(x)
        assert torch.equal(expected, actual)
        expected.sum().backward()
        actual.sum().backward()
        assert_same_tensors(grads(stock), grads(ours), step)
