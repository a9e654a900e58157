"""Calls of prepared models that overlap: threads calling at once, and models calling each other.

Stock computes each read in its own thread's grad mode and autocast state. A training thread
beside a ``no_grad`` thread never loses gradients silently, two training threads get stock's
results or a ``FoldError``, values are shared across threads only where they are the same, a call
begun after a write reads the new weights though an older call puts its values back, a layer
called directly beside another thread's call claims its values, two prepared models that call
each other in one thread run like stock, and another thread's call ending between the two reads
of ``_compiled_call_impl`` still calls the layer.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import threading

import pytest
import torch
from helpers import LoRA, PausedOffMain, assert_same_nested, assert_same_tensors, grads, _inference
from torch import nn
from torch.nn.utils import parametrize as P
from torch.nn.utils.parametrizations import spectral_norm, weight_norm

import paramfold


def _run_threads(*targets):
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(targets))

    def wrap(fn):
        def run():
            try:
                barrier.wait(timeout=30)
                fn()
            except BaseException as exc:  # collected and checked by the test
                errors.append(exc)
        return run

    threads = [threading.Thread(target=wrap(t)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive()
    return errors


@pytest.mark.parametrize("mode", ["hoist", "auto"])
def test_training_thread_beside_a_no_grad_thread_never_loses_gradients_silently(mode):
    torch.manual_seed(0)
    model = paramfold.prepare(nn.Sequential(*[weight_norm(nn.Linear(16, 16)) for _ in range(4)]), mode)
    x = torch.randn(4, 16)
    lost = []

    def train():
        for _ in range(60):
            model.zero_grad(set_to_none=True)
            try:
                model(x).sum().backward()
            except paramfold.FoldError:
                continue
            if any(p.grad is None for p in model.parameters()):
                lost.append(1)

    def infer():
        for _ in range(60):
            with torch.no_grad():
                try:
                    model(x)
                except paramfold.FoldError:
                    pass

    errors = _run_threads(train, infer)
    assert not errors
    assert not lost


def test_two_training_threads_get_stock_results_or_a_fold_error():
    torch.manual_seed(0)
    stock = nn.Sequential(*[weight_norm(nn.Linear(16, 16)) for _ in range(3)])
    model = paramfold.prepare(copy.deepcopy(stock), "hoist")
    x = torch.randn(4, 16)
    expected = stock(x)
    outcomes = []

    def train():
        for _ in range(40):
            try:
                out = model(x)
                out.sum().backward()
            except paramfold.FoldError as exc:
                assert "thread" in str(exc)
                outcomes.append("refused")
                continue
            outcomes.append(torch.equal(out, expected))

    errors = _run_threads(train, train)
    assert not errors, errors
    assert outcomes and all(o in (True, "refused") for o in outcomes)


@pytest.mark.parametrize("norm", [weight_norm, torch.nn.utils.weight_norm], ids=["parametrize", "hook-based"])
@pytest.mark.parametrize("mode", ["freeze", "auto", "hoist"])
def test_multithreaded_same_grad_mode_inference_keeps_working(mode, norm):
    # Regression (hook-based, found by the 2026-12-02 entry-point hunt): a scope open in one
    # thread has the norms' hooks out, which another thread's call took for a removed norm
    # (FoldError "parametrizations ... changed").
    def build():
        torch.manual_seed(0)  # not deepcopy: torch refuses it for hook-based weight_norm
        return _inference(nn.Sequential(*[norm(nn.Linear(16, 16)) for _ in range(4)]))

    stock = build()
    model = paramfold.prepare(build(), mode)
    x = torch.randn(4, 16)
    expected = stock(x)
    results = []

    def infer():
        for _ in range(50):
            with torch.no_grad():
                results.append(torch.equal(model(x), expected))

    errors = _run_threads(infer, infer, infer)
    assert not errors, errors
    assert len(results) == 150 and all(results)


@pytest.mark.parametrize("mode", ["hoist", "auto"])
def test_a_stateful_chain_put_in_training_between_calls_is_no_longer_shared_across_threads(mode):
    # A call's values may be shared with another thread's overlapping no_grad call only while no
    # stateful chain trains; the steady-state fast path must see model.train() between calls.
    scope = importlib.import_module("paramfold.scope")
    torch.manual_seed(0)
    model = paramfold.prepare(nn.Sequential(spectral_norm(nn.Linear(4, 4))).eval(), mode)
    layer = model[0]
    x = torch.randn(2, 4)
    with torch.no_grad():
        model(x), model(x)  # steady
        previous, claimed = scope._open(model)
        assert layer.__dict__["_paramfold"].shareable == ()  # under no autocast
        scope._close(previous, claimed)
        model.train()
        previous, claimed = scope._open(model)
        try:
            assert layer.__dict__["_paramfold"].shareable is None
        finally:
            scope._close(previous, claimed)


def _lora_linear() -> nn.Linear:
    """A LoRA-style chain (a matmul: autocast computes it in bf16)."""
    lin = nn.Linear(8, 8)
    P.register_parametrization(lin, "weight", LoRA(8, 8))
    return lin


@pytest.mark.parametrize("mode", ["hoist", "freeze", "auto"])
@pytest.mark.parametrize("other", ["autocast", "same"])
def test_overlapping_no_grad_calls_share_values_only_under_the_same_autocast_state(mode, other):
    # Regression: a no_grad call overlapping another thread's no_grad call shared that call's
    # values whatever autocast state each ran under (autocast is thread-local): a call inside
    # torch.autocast got values computed outside it, or the other way round. Now it shares them
    # under the same state only, and is refused with a FoldError otherwise.
    stock, ours = (PausedOffMain(_lora_linear()).eval().requires_grad_(False) for _ in range(2))
    ours.load_state_dict(stock.state_dict())
    paramfold.prepare(ours, mode)
    x = torch.randn(2, 8)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = stock.inner(x)
    results = {}

    def first():
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            results["first"] = ours(x)

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert ours.inside.wait(30)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=other == "same"):
            if other == "same":
                assert torch.equal(ours(x), expected)
            else:
                with pytest.raises(paramfold.FoldError, match="another thread"):
                    ours(x)
    finally:
        ours.go.set()
        thread.join(30)
    assert torch.equal(results["first"], expected)


class _ScaledBy(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = 1.5

    def forward(self, w):
        return w * self.scale


def _pause(events: dict | None, at: str) -> None:
    """Hold threads ``A`` and ``B`` where ``events`` says: signal arrival, wait to go on."""
    name = threading.current_thread().name
    if events is not None and (at, name) in events:
        arrived, go = events[(at, name)]
        arrived.set()
        assert go.wait(30)


class _Gate(nn.Module):
    def __init__(self, events: dict | None):
        super().__init__()
        self._events = events

    def forward(self, x):
        _pause(self._events, "gate")
        return x


class _PausedLinear(nn.Linear):
    """Holds a thread inside its own call: after the call's check of what changed."""

    events: dict | None = None

    def forward(self, x):
        _pause(self.events, "layer")
        return super().forward(x)


@pytest.mark.parametrize("kind, switch", [("weight_norm", "train"), ("hook_weight_norm", "train"), ("custom", "setting")])
@pytest.mark.parametrize("mode", ["hoist", "freeze", "auto"])
def test_a_call_begun_after_a_write_reads_the_new_weights_though_an_older_call_puts_its_values_back(mode, kind, switch):
    # Regression (helper-219): thread A's no_grad call, its values installed, met a changed setting
    # (model.train(), a member's attribute) at a layer's call and computed that layer's value again,
    # to be put back after; a writer updated the weights; thread B's call, begun after the write,
    # renewed the shared values from the new weights; A's call ended and put its old value back, and
    # B read it: stock's output for the old weights. The put-back now leaves another thread's value.
    events = {key: (threading.Event(), threading.Event()) for key in (("gate", "A"), ("layer", "A"), ("gate", "B"))}

    def make(events):
        torch.manual_seed(0)
        layer = _PausedLinear(4, 3)
        layer.events = events
        if kind == "weight_norm":
            layer = weight_norm(layer)
        elif kind == "hook_weight_norm":
            layer = nn.utils.weight_norm(layer)
        else:
            P.register_parametrization(layer, "weight", _ScaledBy())
        return nn.Sequential(_Gate(events), nn.Sequential(layer)).eval().requires_grad_(False)

    stock, model = make(None), make(events)
    paramfold.prepare(model, mode)
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x), stock(x))  # the steady state
    out = {}

    def call_as(name):
        def run():
            with torch.no_grad():
                out[name] = model(x)
        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        return thread

    def reach(key):
        assert events[key][0].wait(30), key

    def release(key):
        events[key][1].set()

    a = call_as("A")
    reach(("gate", "A"))
    for m in (model, stock):
        if switch == "train":
            m.train()
        else:
            m[1][0].parametrizations.weight[0].scale = 2.0
    release(("gate", "A"))
    reach(("layer", "A"))  # A is inside the layer's call, its value computed again
    with paramfold.calls_lock(), torch.no_grad():  # a writer's update
        for m in (model, stock):
            for name, p in m.named_parameters():
                if "bias" not in name:
                    p.mul_(3.0).add_(0.5)
    b = call_as("B")
    reach(("gate", "B"))  # B's call is open, sharing A's values renewed from the new weights
    release(("layer", "A"))
    a.join(30)
    release(("gate", "B"))
    b.join(30)
    assert not a.is_alive() and not b.is_alive()
    with torch.no_grad():
        want = stock(x)
        assert torch.equal(out["B"], want)
        assert torch.equal(model(x), want)


@pytest.mark.parametrize("mode", ["hoist", "auto"])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_a_layer_called_directly_beside_another_threads_call_claims_its_values(mode, grad):
    # Regression: a layer of the model called directly (not through the model) while another
    # thread's no_grad call of the model ran read that call's values from its __dict__: a
    # training step on the layer got no gradient for its originals, silently. The layer's call
    # now claims the values as the model's call does: shared under no_grad, else refused.
    stock, ours = (PausedOffMain(nn.Sequential(*[weight_norm(nn.Linear(4, 4)) for _ in range(3)])) for _ in range(2))
    ours.load_state_dict(stock.state_dict())
    paramfold.prepare(ours, mode)
    x = torch.randn(2, 4)
    thread = threading.Thread(target=lambda: torch.no_grad()(ours)(x))
    thread.start()
    try:
        assert ours.inside.wait(30)
        with torch.set_grad_enabled(grad):
            if grad:
                with pytest.raises(paramfold.FoldError, match="another thread"):
                    ours.inner[1](x)
            else:
                assert torch.equal(ours.inner[1](x), stock.inner[1](x))
    finally:
        ours.go.set()
        thread.join(30)
    ours.inner[1](x).sum().backward()  # alone again: trains like stock
    stock.inner[1](x).sum().backward()
    assert_same_tensors(grads(stock), grads(ours))


class _CallsItsPeer(nn.Module):
    """A model whose forward calls another model, which calls this one back (once: a depth guard)."""

    def __init__(self, norm):
        super().__init__()
        self.a = norm(nn.Linear(4, 4))
        self.peer: list[nn.Module] = []  # a plain list: the other model is no submodule
        self.depth = 0

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.peer and self.depth == 0:
            self.depth += 1
            try:
                h = h + self.peer[0](h)
            finally:
                self.depth -= 1
        return h + torch.tanh(self.a(h))


def _peers(norm, mode: str | None) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    a, b = _CallsItsPeer(norm), _CallsItsPeer(norm)
    a.peer.append(b)
    b.peer.append(a)
    if mode is not None:
        paramfold.prepare(a, mode)
        paramfold.prepare(b, mode)
    return a, b


@pytest.mark.parametrize("step", ["train", "no_grad", "eval"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("norm", [weight_norm, spectral_norm], ids=["weight_norm", "spectral_norm"])
@pytest.mark.parametrize("mode", ["hoist", "inline", "auto"])
def test_two_prepared_models_that_call_each_other_in_one_thread_run_like_stock(mode, norm, compiled, step):
    # Regression: model A's forward calls model B, whose forward calls A again: the nested call
    # of A, entering through B's call scope, found A's values claimed by A's own call and was
    # refused as a call from another thread. It runs nested in A's scope, as a model's
    # re-entrant call of itself does.
    runs = []
    for prepared in (None, mode):
        a, b = _peers(norm, prepared)
        if step == "eval":
            a.eval(), b.eval()
        torch._dynamo.reset()
        call = torch.compile(a, backend="eager") if compiled and prepared else a
        opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
        # A tensor read several times in one call is computed once by hoist and auto, whose
        # gradients then sum in another order: compared with stock under parametrize.cached().
        cached = step == "train" and prepared is None and norm is weight_norm and mode != "inline"
        torch.manual_seed(1)
        record = []
        for _ in range(3):
            x = torch.randn(3, 4)
            opt.zero_grad()
            with torch.set_grad_enabled(step == "train"), P.cached() if cached else contextlib.nullcontext():
                out = call(x)
            if step == "train":
                out.sum().backward()
                opt.step()
            record.append([out.detach(), out.requires_grad,
                           *({k: v.clone() for k, v in m.state_dict().items()} for m in (a, b))])
        runs.append(record)
    assert_same_nested(*runs)


def test_a_claim_ending_between_the_two_reads_of_compiled_call_impl_still_calls_the_layer(monkeypatch):
    # Regression (2026-12-05 hunt): nn.Module._wrapped_call_impl reads _compiled_call_impl twice
    # (`is not None`, then the call); paramfold's answer depends on claims and changes other
    # threads make, so another thread's call ending in between turned the first read's wrapper
    # into None at the second: "TypeError: 'NoneType' object is not callable" in a serving thread.
    # The other thread's claim is simulated: set before the call, gone once the first read answered.
    from paramfold import scope_entry
    from paramfold.state import STATE_ATTR

    torch.manual_seed(0)
    stock = nn.Sequential(weight_norm(nn.Linear(4, 4)), nn.Tanh()).eval()
    ours = paramfold.prepare(copy.deepcopy(stock), "hoist")
    layer, x = ours[0], torch.randn(2, 4)
    hs = vars(layer)[STATE_ATTR]

    class EndsTheOtherClaim:
        @staticmethod
        def partial(*args, **kwargs):
            made = functools.partial(*args, **kwargs)
            hs.users = 0  # the other thread's call released the layer meanwhile
            return made

    monkeypatch.setattr(scope_entry, "functools", EndsTheOtherClaim)
    with torch.no_grad():
        hs.users = 1
        out = layer(x)
    assert hs.users == 0 and torch.equal(out, stock[0](x))


@pytest.mark.parametrize("mode", ["auto", "inline", "hoist"])
def test_a_call_whose_planning_raises_leaves_the_model_usable_and_restorable(mode, monkeypatch):
    # Regression (helper-248): the general way of opening a call claimed the holders, then planned
    # the next call; an exception there (a held object torch could not read, a KeyboardInterrupt)
    # left them claimed for good: every later call raised "already being called from another
    # thread" and restore refused.
    from paramfold import scope

    torch.manual_seed(0)
    stock = nn.Sequential(weight_norm(nn.Linear(4, 4)), nn.Tanh()).eval()
    model = paramfold.prepare(copy.deepcopy(stock), mode)
    x = torch.randn(2, 4)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(scope, "_replan", interrupted)
    with pytest.raises(KeyboardInterrupt):
        model(x)
    monkeypatch.undo()
    for _ in range(2):
        assert torch.equal(model(x), stock(x))
    paramfold.restore(model)
    assert torch.equal(model(x), stock(x))
