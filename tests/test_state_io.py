"""Saving, loading and moving a prepared model's state, and threads around it, as training and
serving code does.

Each test builds a stock model and a prepared one identically (same seed), runs the same sequence
on both (``torch.distributed.checkpoint`` save/load and its ``get_state_dict``/``set_state_dict``
helpers with an Adam optimizer, state_dict hooks public and private, ``load_state_dict`` with
``strict=False`` and ``assign=True``, safetensors' ``save_model``/``load_model``, ``model.to``
with ``swap_module_params_on_conversion``, ``bfloat16`` under autocast, ``to_empty`` and
re-initialisation, ``share_memory`` written by a spawned process, a writer thread beside
overlapping calls) and compares outputs, gradients, state_dict and hook call logs bitwise,
eagerly and with ``torch.compile(backend="eager")``. Eval calls under ``no_grad`` after each load
or write are where freeze and auto serve cached values: a stale one would show there. The models
are tiny ``nn.Sequential`` stacks with ``weight_norm``, ``spectral_norm`` (stateful: ``_u``/``_v``
must evolve like stock's), ``orthogonal``, a custom two-member chain and the deprecated
hook-based norms.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import orthogonal, spectral_norm, weight_norm

import paramfold

pytestmark = [pytest.mark.usefixtures("fresh_dynamo"), pytest.mark.filterwarnings("ignore::FutureWarning")]

TRAIN_MODES = ["hoist", "inline", "auto"]


class _Scale(nn.Module):
    def forward(self, w):
        return w * 1.5


class _Shift(nn.Module):
    def forward(self, w):
        return w + 0.25


def _net(kind: str) -> nn.Sequential:
    torch.manual_seed(0)
    if kind == "weight_norm":
        return nn.Sequential(weight_norm(nn.Linear(4, 6)), nn.Tanh(), weight_norm(nn.Linear(6, 3)))
    if kind == "spectral_norm":
        return nn.Sequential(spectral_norm(nn.Linear(4, 6)), nn.Tanh(), nn.Linear(6, 3))
    if kind == "orthogonal":
        return nn.Sequential(orthogonal(nn.Linear(4, 4)), nn.Tanh(), nn.Linear(4, 3))
    if kind == "custom":
        layer = nn.Linear(4, 6)
        parametrize.register_parametrization(layer, "weight", _Scale())
        parametrize.register_parametrization(layer, "weight", _Shift())
        return nn.Sequential(layer, nn.Tanh(), nn.Linear(6, 3))
    if kind == "hook_weight_norm":
        return nn.Sequential(nn.utils.weight_norm(nn.Linear(4, 6)), nn.Tanh(), nn.Linear(6, 3))
    if kind == "hook_spectral_norm":
        return nn.Sequential(nn.utils.spectral_norm(nn.Linear(4, 6)), nn.Tanh(), nn.Linear(6, 3))
    raise ValueError(kind)


def _input() -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(1))


def _twins(kind: str, mode: str, eval_only: bool = False) -> tuple[nn.Module, nn.Module]:
    stock, ours = _net(kind), _net(kind)
    if eval_only:
        stock.eval().requires_grad_(False), ours.eval().requires_grad_(False)
    return stock, paramfold.prepare(ours, mode)


def assert_same(expected, actual, path="result"):
    """Bitwise equality of nested lists, tuples and dicts of tensors (and plain values)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), path
        assert (expected.dtype, expected.shape) == (actual.dtype, actual.shape), path
        assert torch.equal(expected, actual), path
    elif isinstance(expected, dict):
        assert list(expected) == list(actual), path
        for key in expected:
            assert_same(expected[key], actual[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(expected) == len(actual), path
        for i, (e, a) in enumerate(zip(expected, actual)):
            assert_same(e, a, f"{path}[{i}]")
    else:
        assert expected == actual, path


def _grads(model: nn.Module) -> dict:
    return {k: None if p.grad is None else p.grad.clone() for k, p in model.named_parameters()}


# --- threads ---------------------------------------------------------------------------------


class _Paused(nn.Module):
    """A model whose forward, run off the main thread, waits for a signal before reading anything."""

    def __init__(self, kind: str):
        super().__init__()
        self.seq = _net(kind)
        self.inside, self.go = threading.Event(), threading.Event()

    def forward(self, x):
        if threading.current_thread() is not threading.main_thread():
            self.inside.set()
            assert self.go.wait(30)
        return self.seq(x)


def _write(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5).add_(0.125)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("kind", ["weight_norm", "hook_weight_norm"])
@pytest.mark.parametrize("mode", ["freeze", "auto", "hoist", "inline"])
def test_a_call_after_a_writer_thread_sees_the_write_while_another_threads_call_is_open(mode, kind, compiled):
    # Regression: a no_grad call overlapping another thread's no_grad call shared the values that
    # call had computed when it began, even when a writer (`p.mul_` under no_grad, an optimizer or
    # EMA thread, hot-swapped weights) had changed the originals since: the later call, which
    # began after the write, computed with the old weights (freeze, auto and hoist, eager and
    # compiled). Stock computes each read from the weights as they are. Now the shared values are
    # computed again where their inputs changed, for both calls.
    results = []
    for prepare in (False, True):
        model = _Paused(kind).eval().requires_grad_(False)
        if prepare:
            paramfold.prepare(model, mode)
        call = torch.compile(model, backend="eager") if compiled else model
        x = _input()
        record, first = [], {}
        with torch.no_grad():
            record += [call(x), call(x)]  # steady: frozen values kept, a plan built
        thread = threading.Thread(target=lambda: first.setdefault("y", torch.no_grad()(call)(x)))
        thread.start()
        try:
            assert model.inside.wait(30)  # the other thread's call is open, its values installed
            _write(model)
            with torch.no_grad():
                record.append(call(x))
        finally:
            model.go.set()
            thread.join(30)
        assert not thread.is_alive()
        # The call open across the write reads every weight after it, in stock too: here its
        # nested calls (eager) or the frames dynamo resumes after the pause (compiled) see it.
        record.append(first["y"])
        model.inside.clear(), model.go.clear()
        with torch.no_grad():
            record += [call(x), call(x)]
        record.append(model.state_dict())
        results.append(record)
    assert_same(*results)


@pytest.mark.parametrize("mode", ["freeze", "auto", "hoist"])
def test_a_call_while_another_thread_compiles_claims_the_values_like_any_overlapping_call(mode):
    # Regression: torch.compiler.is_compiling() read in eager code is process-wide in torch 2.13
    # (True while *any* thread is in a compile session), and a prepared model took it for "this
    # call is being traced": an eager call made while another thread's call of the model was
    # compiling opened no call scope and read the values that call had installed as they were.
    # A grad call got values computed under the other call's no_grad (no gradient reached the
    # originals: silently), a no_grad call after a write got the values from before it. Now only
    # this thread's compile counts: the call claims the values as any overlapping call does
    # (refused for a grad call, README "Threads"; shared, computed again where written, under
    # no_grad).
    entered, leave = threading.Event(), threading.Event()

    def pausing_backend(gm, example_inputs):
        if threading.current_thread() is not threading.main_thread():
            entered.set()  # the other thread's call scope is open and it is compiling now
            assert leave.wait(30)
        return gm.forward

    stock, ours = _twins("weight_norm", mode, eval_only=mode == "freeze")
    stock.eval(), ours.eval()
    x = _input()
    compiled = torch.compile(ours, backend=pausing_backend)
    thread = threading.Thread(target=lambda: torch.no_grad()(compiled)(x))
    thread.start()
    try:
        assert entered.wait(30)
        assert torch.compiler.is_compiling()  # what the eager call below sees
        if mode != "freeze":
            with pytest.raises(paramfold.FoldError, match="another thread"):
                ours(x)
        for model in (stock, ours):
            _write(model)
        with torch.no_grad():
            assert torch.equal(ours(x), stock(x))
    finally:
        leave.set()
        thread.join(30)
    assert not thread.is_alive()
    if mode != "freeze":  # alone again: a grad call trains like stock
        for model in (stock, ours):
            model(x).square().sum().backward()
        assert_same(_grads(stock), _grads(ours))
    with torch.no_grad():
        assert torch.equal(compiled(x), stock(x))
