"""A prepared model and its stock twin stay equal under any sequence of calls and weight events.

Hypothesis drives two copies of one parametrized model (weight_norm, a training spectral_norm,
a custom chain, a LoRA-style parametrization owning parameters, a plain layer; or the same with
torch's deprecated hook-based norms): the stock one and a prepared one (any mode and freeze
check). Each step is a call (eager, ``torch.compile``d with the eager backend, after
``model.compile()`` or ``layer.compile()``, or inside ``parametrize.cached()``; grad or
``no_grad``, with backward and an SGD step), a read of the parametrized tensors, or an event
between calls that stock PyTorch sees at its next read: in-place writes, storage swaps through
``.data =``, writes through ``.data`` or numpy that bump no version counter, ``load_state_dict``
(also ``assign=True``), ``train()``/``eval()``, ``requires_grad_`` flips, dtype conversions.
After every step the outputs, gradients, reads and the whole ``state_dict`` (spectral_norm's
``u``/``v`` included) must be bitwise equal: the same ops run on the same inputs, on CPU.

This is what pins the steady-call fast path (``paramfold.scope_plan.Plan``) and the frozen values
kept between calls: a check it forgets is an event sequence here that goes stale.
"""

from __future__ import annotations

import importlib
from contextlib import nullcontext

import pytest
import torch
from helpers import LoRA, Skew
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from torch import nn
from torch.nn.utils import parametrize as P
from torch.nn.utils.parametrizations import spectral_norm, weight_norm

import paramfold
import paramfold.testing as pt

WIDTH = 4


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return torch.tanh(self.proj(x))


class Twin(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(5))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x) + x
        return x


def twin(trainable: bool) -> nn.Module:
    """The same model every time (built twice, not deep-copied: stock shares classes on deepcopy)."""
    torch.manual_seed(0)
    model = Twin()
    wn, sn, chain, lora, _plain = (layer.proj for layer in model.layers)
    weight_norm(wn)
    spectral_norm(sn)
    P.register_parametrization(chain, "weight", Skew())
    P.register_parametrization(chain, "weight", pt.Scale(torch.tensor(1.5)))
    P.register_parametrization(chain, "bias", pt.Scale(torch.tensor(0.5)))
    lora.weight.requires_grad_(False)
    P.register_parametrization(lora, "weight", LoRA(WIDTH, WIDTH))
    if not trainable:
        model.requires_grad_(False)
    return model


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def hook_twin(trainable: bool) -> nn.Module:
    """The same model with torch's deprecated hook-based norms (served by ``paramfold.hooknorms``)."""
    torch.manual_seed(0)
    model = Twin()
    wn, sn, chain, _lora, _plain = (layer.proj for layer in model.layers)
    torch.nn.utils.weight_norm(wn)
    torch.nn.utils.spectral_norm(sn)
    torch.nn.utils.spectral_norm(chain, name="bias", dim=0)
    if not trainable:
        model.requires_grad_(False)
    return model


def parametrized_reads(model: nn.Module) -> list[torch.Tensor]:
    """Every parametrized tensor, read as a user would (a hook-based norm's is the last forward's)."""
    reads = []
    for m in model.modules():
        if P.is_parametrized(m):
            reads += [getattr(m, name) for name in m.parametrizations]
        reads += [getattr(m, hook.name) for hook in m._forward_pre_hooks.values() if hasattr(hook, "name")]
    return reads


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a is None and b is None


def _numpy_scale(t: torch.Tensor, c: float) -> None:
    arr = t.detach().numpy()
    arr *= c


class PreparedMatchesStock(RuleBasedStateMachine):
    """The machine; each mode gets a subclass of its own (below), so every mode is explored."""

    MODE = "auto"
    BUILD = staticmethod(twin)

    @initialize(check=st.sampled_from(["content", "version"]), trainable=st.booleans())
    def build(self, check, trainable, mode=None):
        mode = mode or self.MODE
        torch._dynamo.reset()
        self.mode, self.check = mode, check
        self.trainable = trainable and mode != "freeze"  # freeze refuses trainable chains
        self.stock, self.model = self.BUILD(self.trainable), self.BUILD(self.trainable)
        if mode == "freeze":  # and a training spectral_norm
            self.stock.eval(), self.model.eval()
        paramfold.prepare(self.model, mode, freeze_check=check)
        self.compiled = None
        self.entry = None
        self.inputs = torch.Generator().manual_seed(1)

    # --- calls ------------------------------------------------------------------------------

    @rule(how=st.sampled_from(["eager", "compiled", "cached", "read"]), grad=st.booleans(), sgd=st.booleans())
    def call(self, how, grad, sgd):
        """A call of the model, or (``how="read"``) a read of every parametrized tensor outside one."""
        if how == "read":
            with torch.set_grad_enabled(grad):
                for got, expected in zip(parametrized_reads(self.model), parametrized_reads(self.stock), strict=True):
                    assert same(got, expected)
            return
        x = torch.randn(3, WIDTH, generator=self.inputs).to(next(self.stock.parameters()).dtype)
        if how == "compiled" and self.compiled is None:
            self.compiled = torch.compile(self.model, backend="eager")
        fn = self.compiled if how == "compiled" else self.model
        with torch.set_grad_enabled(grad), P.cached() if how == "cached" else nullcontext():
            expected, got = self.stock(x), fn(x)
        assert same(got, expected)
        if not (grad and expected.requires_grad):
            return
        expected.square().sum().backward()
        got.square().sum().backward()
        stock_params, params = dict(self.stock.named_parameters()), dict(self.model.named_parameters())
        assert stock_params.keys() == params.keys()
        for name, p in stock_params.items():
            assert same(params[name].grad, p.grad), name
        with torch.no_grad():
            for name, p in stock_params.items():
                if p.grad is not None:
                    if sgd:
                        p.sub_(0.1 * p.grad)
                        params[name].sub_(0.1 * params[name].grad)
                    p.grad, params[name].grad = None, None

    @precondition(lambda self: self.entry is None)
    @rule(entry=st.sampled_from(["method", "layers"]))
    def compile_in_place(self, entry):
        """``model.compile()`` or ``layer.compile()`` on every layer: later eager calls run compiled."""
        self.entry = entry
        for module in [self.model] if entry == "method" else list(self.model.layers):
            module.compile(backend="eager")

    # --- events between calls ---------------------------------------------------------------

    def _pair(self, name: str | int, parameters: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The tensor called ``name`` in both models; an int picks one by position (any model)."""
        stock = dict(self.stock.named_parameters()) if parameters else _tensors(self.stock)
        if isinstance(name, int):
            name = sorted(stock)[name % len(stock)]
        return stock[name], _tensors(self.model)[name]

    @rule(
        name=st.integers(0, 63),
        c=st.sampled_from([0.5, 1.25, -1.0]),
        via=st.sampled_from(["in_place", "set_data", "data", "numpy"]),
    )
    def write(self, name, c, via):
        a, b = self._pair(name)
        for t in (a, b):
            if via == "in_place":
                with torch.no_grad():
                    t.mul_(c)
            elif via == "set_data":  # new storage, same tensor object, no version bump
                t.data = t.data * c
            elif via == "data":
                t.data.mul_(c)
            else:
                _numpy_scale(t, c)

    @rule(c=st.sampled_from([0.75, 2.0]), assign=st.booleans())
    def load_state_dict(self, c, assign):
        state = {k: v * c if v.is_floating_point() else v.clone() for k, v in self.stock.state_dict().items()}
        for model in (self.stock, self.model):
            model.load_state_dict({k: v.clone() for k, v in state.items()}, assign=assign)

    @precondition(lambda self: self.mode != "freeze")  # freeze refuses a training spectral_norm
    @rule(training=st.booleans())
    def train_or_eval(self, training):
        self.stock.train(training), self.model.train(training)

    @precondition(lambda self: self.mode != "freeze")  # and trainable chains
    @rule(name=st.none() | st.integers(0, 63), flag=st.booleans())
    def requires_grad(self, name, flag):
        if name is None:
            self.stock.requires_grad_(flag), self.model.requires_grad_(flag)
            return
        a, b = self._pair(name, parameters=True)
        a.requires_grad_(flag), b.requires_grad_(flag)

    @rule(dtype=st.sampled_from([torch.float64, torch.float32]))
    def convert(self, dtype):
        # Module._apply: each original gets new storage (param.data = ...), buffers are replaced.
        self.stock.to(dtype), self.model.to(dtype)

    # --- after every step -------------------------------------------------------------------

    @invariant()
    def same_state_dict(self):
        if not hasattr(self, "model"):
            return
        expected, got = self.stock.state_dict(), self.model.state_dict()
        assert list(got) == list(expected)
        for k, v in expected.items():
            assert same(got[k], v), k

    def teardown(self):
        if hasattr(self, "model"):
            paramfold.restore(self.model)


def _machine_for(mode: str, build=twin, examples: int = 45) -> type[PreparedMatchesStock]:
    name = f"{mode.capitalize()}{'HookNorms' if build is hook_twin else ''}MatchesStock"
    machine = type(name, (PreparedMatchesStock,), {"MODE": mode, "BUILD": staticmethod(build)})
    machine.TestCase.settings = settings(max_examples=examples, stateful_step_count=25)
    return machine


HoistMatchesStock = _machine_for("hoist")
InlineMatchesStock = _machine_for("inline")
FreezeMatchesStock = _machine_for("freeze")
AutoMatchesStock = _machine_for("auto")
test_hoist_matches_stock_under_any_event_sequence = HoistMatchesStock.TestCase
test_inline_matches_stock_under_any_event_sequence = InlineMatchesStock.TestCase
test_freeze_matches_stock_under_any_event_sequence = FreezeMatchesStock.TestCase
test_auto_matches_stock_under_any_event_sequence = AutoMatchesStock.TestCase
# inline leaves hook-based norms as they are (stock's hooks compute in-graph already).
HoistHookNormsMatchesStock = _machine_for("hoist", hook_twin, examples=30)
AutoHookNormsMatchesStock = _machine_for("auto", hook_twin, examples=30)
FreezeHookNormsMatchesStock = _machine_for("freeze", hook_twin, examples=30)
test_hoist_matches_stock_with_hook_norms = HoistHookNormsMatchesStock.TestCase
test_auto_matches_stock_with_hook_norms = AutoHookNormsMatchesStock.TestCase
test_freeze_matches_stock_with_hook_norms = FreezeHookNormsMatchesStock.TestCase


# Sequences each of the plan's checks exists for, replayed as they are: a derandomized (CI) run of
# the machines above explores a fixed sample and need not reach every one of them.
CALL = ("call", {"how": "eager", "grad": False, "sgd": False})
LAYERS = ("compile_in_place", {"entry": "layers"})
GRAD_CALL = ("call", {"how": "eager", "grad": True, "sgd": True})
COMPILED_CALL = ("call", {"how": "compiled", "grad": True, "sgd": True})
WN_G = "layers.0.proj.parametrizations.weight.original0"
KNOWN_SEQUENCES = {
    "frozen spectral_norm back in training": ("auto", "content", False, [
        ("train_or_eval", {"training": False}), CALL, ("train_or_eval", {"training": True}), CALL]),
    "layer.compile(), then a write through .data": ("auto", "content", False, [
        LAYERS, CALL, ("write", {"name": WN_G, "c": 0.5, "via": "data"}), CALL]),
    "write through .data": ("freeze", "content", False, [CALL, ("write", {"name": WN_G, "c": 0.5, "via": "data"}), CALL]),
    "write through numpy": ("auto", "content", False, [CALL, ("write", {"name": WN_G, "c": 0.5, "via": "numpy"}), CALL]),
    "in-place write, version check": ("freeze", "version", False, [
        CALL, ("write", {"name": WN_G, "c": 0.5, "via": "in_place"}), CALL]),
    "storage swapped through .data =": ("freeze", "version", False, [
        CALL, ("write", {"name": WN_G, "c": 0.5, "via": "set_data"}), CALL]),
    "frozen originals replaced by load_state_dict(assign=True)": ("freeze", "version", False, [
        CALL, ("load_state_dict", {"c": 2.0, "assign": True}), CALL]),
    "dtype conversion": ("freeze", "version", False, [CALL, ("convert", {"dtype": torch.float64}), CALL]),
    "load_state_dict in place": ("auto", "version", False, [CALL, ("load_state_dict", {"c": 2.0, "assign": False}), CALL]),
    "frozen original starts to require grad": ("auto", "content", False, [
        CALL, ("requires_grad", {"name": WN_G, "flag": True}), GRAD_CALL, CALL]),
    "originals replaced by load_state_dict(assign=True)": ("hoist", "content", True, [
        GRAD_CALL, ("load_state_dict", {"c": 0.75, "assign": True}), GRAD_CALL]),
    "inline after load_state_dict(assign=True), compiled": ("inline", "content", True, [
        COMPILED_CALL, ("load_state_dict", {"c": 0.75, "assign": True}), COMPILED_CALL]),
}


def replay(mode: str, check: str, trainable: bool, steps: list) -> None:
    machine = PreparedMatchesStock()
    machine.build(check=check, trainable=trainable, mode=mode)
    try:
        for rule_name, kwargs in steps:
            getattr(machine, rule_name)(**kwargs)
            machine.same_state_dict()
    finally:
        machine.teardown()


@pytest.mark.parametrize("sequence", sorted(KNOWN_SEQUENCES))
def test_known_sequence_matches_stock(sequence):
    replay(*KNOWN_SEQUENCES[sequence])


@pytest.mark.parametrize("sequence", ["in-place write, version check", "frozen spectral_norm back in training"])
def test_replay_fails_when_frozen_values_ignore_changes(monkeypatch, sequence):
    """The checks must be able to fail: with every freshness check answering "unchanged", they do."""
    scope = importlib.import_module("paramfold.scope")
    monkeypatch.setattr(scope, "holds", lambda plan: True)
    monkeypatch.setattr(scope, "unchanged", lambda site, frozen: True)
    with pytest.raises(AssertionError):
        replay(*KNOWN_SEQUENCES[sequence])
