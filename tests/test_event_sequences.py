"""Random sequences of events between and around calls, stock against prepared, bitwise.

The companion of ``tests/test_stateful.py`` (a fixed model; the weight writes freshness depends
on): here the chains vary, and the events are those around calls that it does not drive.

A Hypothesis state machine builds one small parametrized model twice (stock, and prepared in one
mode), then applies the same random events to both: calls (eager under ``no_grad`` or with grad,
``torch.compile(backend="eager")``, inside ``inference_mode``), optimizer steps, in-place and
``.data`` edits of originals, a member's setting, train/eval, ``requires_grad_``,
``functional_call`` (also under ``vmap``), ``copy.deepcopy``, calls under a dispatch mode or
another default dtype. After every event the outputs, the
``state_dict`` and every gradient must be stock's, bitwise; at the end ``restore`` gives stock's
model back. A refusal (:class:`~paramfold.FoldError`) ends the sequence, and so does an error
both models raise alike. A longer differential fuzzer of the same kind found the bugs fixed on
2026-12-04, each with a test of its own; with the fixes reverted, this test's CI examples
(derandomized) fail for two of them: the probe of a chain inside ``inference_mode`` and inside
``vmap``; with random exploration (``HYPOTHESIS_PROFILE=dev``) ``call_under`` finds the frozen
value served inside a dispatch mode (fixed the same day: ``tests/test_computed_under.py``). Settings: 60 sequences of up to 15 events, about 11 s.

Not compared: a compiled call after a hook is registered (stock's compiled code does not see it,
dynamo's documented limit) and a module called twice (gradients differ in the last bit: README,
Notes and limits); neither is generated.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import HalveProducts, LoRA, RowScale, default_dtype
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import spectral_norm, weight_norm

import paramfold

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

MODES = ["auto", "hoist", "freeze", "inline"]
CHAINS = ["weight_norm", "spectral_norm", "row_scale", "nested", "lora"]


def _layer(chain: str) -> nn.Linear:
    layer = nn.Linear(4, 4)
    if chain == "weight_norm":
        weight_norm(layer)
    elif chain == "spectral_norm":
        spectral_norm(layer)
    elif chain == "row_scale":
        parametrize.register_parametrization(layer, "weight", RowScale())
    elif chain == "nested":  # a chain on the weight, and one on its original
        parametrize.register_parametrization(layer, "weight", RowScale())
        parametrize.register_parametrization(layer.parametrizations.weight, "original", RowScale())
    else:
        parametrize.register_parametrization(layer, "weight", LoRA(4, 4))
    return layer


def _model(chains: tuple[str, str], seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(_layer(chains[0]), nn.Tanh(), _layer(chains[1]), nn.Tanh())


class _Ended(Exception):
    """Both models raised alike, or the prepared one refused: the sequence ends here."""


class EventSequences(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.live = False

    @initialize(chains=st.tuples(st.sampled_from(CHAINS), st.sampled_from(CHAINS)), mode=st.sampled_from(MODES),
                inference=st.booleans(), seed=st.integers(0, 3))
    def build(self, chains, mode, inference, seed):
        torch._dynamo.reset()
        self.models = [_model(chains, seed), _model(chains, seed)]
        if inference or mode == "freeze":  # freeze is for inference (refused on trainable chains)
            for model in self.models:
                model.eval().requires_grad_(False)
        try:
            paramfold.prepare(self.models[1], mode)
        except paramfold.FoldError:
            return  # freeze on a trainable or stateful chain: refused, nothing to compare
        self.x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
        self.compiled = [None, None]
        self._optimizers()
        self.live = True

    def _optimizers(self) -> None:
        self.optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in self.models]

    def _both(self, act) -> list:
        """``act(i, model)`` on stock (0), then on the prepared model (1), from one RNG state."""
        outs, errors = [], []
        for i, model in enumerate(self.models):
            torch.manual_seed(7)
            try:
                outs.append(act(i, model))
                errors.append(None)
            except paramfold.FoldError:
                assert i == 1, "stock raised a FoldError"
                event("refused")
                self.live = False
                raise _Ended from None
            except Exception as error:  # noqa: BLE001 - compared with stock's below
                outs.append(None)
                errors.append(error)
        if errors[0] is not None or errors[1] is not None:
            assert type(errors[0]) is type(errors[1]), f"stock raised {errors[0]!r}, prepared {errors[1]!r}"
            event(f"both raised {type(errors[0]).__name__}")
            self.live = False
            raise _Ended
        return outs

    def _same(self, act) -> None:
        try:
            expected, got = self._both(act)
        except _Ended:
            return
        assert torch.equal(got, expected), (got - expected).abs().max()

    def _do(self, act) -> None:
        try:
            self._both(act)
        except _Ended:
            pass

    @precondition(lambda self: self.live)
    @rule(grad=st.booleans())
    def call(self, grad):
        def run(i, m):
            with torch.set_grad_enabled(grad):
                return m(self.x).detach()
        self._same(run)

    @precondition(lambda self: self.live)
    @rule(grad=st.booleans())
    def compiled_call(self, grad):
        def run(i, m):
            if self.compiled[i] is None:
                self.compiled[i] = torch.compile(m, backend="eager")
            with torch.set_grad_enabled(grad):
                return self.compiled[i](self.x).detach()
        self._same(run)

    @precondition(lambda self: self.live)
    @rule()
    def inference_mode_call(self):
        def run(i, m):
            with torch.inference_mode():
                return m(self.x).clone()
        self._same(run)

    @precondition(lambda self: self.live)
    @rule(around=st.sampled_from(["dispatch_mode", "float64_default"]), grad=st.booleans())
    def call_under(self, around, grad):
        # What stock computes a value under at its read: a mode the caller entered, torch's settings.
        def run(i, m):
            context = HalveProducts() if around == "dispatch_mode" else default_dtype(torch.float64)
            with context, torch.set_grad_enabled(grad):
                return m(self.x).detach()
        self._same(run)

    @precondition(lambda self: self.live)
    @rule()
    def step(self):
        def run(i, m):
            self.optimizers[i].zero_grad()
            out = m(self.x)
            if out.requires_grad:
                out.square().sum().backward()
                self.optimizers[i].step()
            return out.detach()
        self._same(run)

    @precondition(lambda self: self.live)
    @rule(which=st.integers(0, 99), data=st.booleans())
    def edit_original(self, which, data):
        def run(i, m):
            params = list(m.parameters())
            p = params[which % len(params)]
            if data:
                p.data = p.data * 1.1
            else:
                with torch.no_grad():
                    p.mul_(0.9).add_(0.01)
        self._do(run)

    @precondition(lambda self: self.live)
    @rule(alpha=st.sampled_from([0.5, 2.0]))
    def change_setting(self, alpha):
        def run(i, m):
            for member in m.modules():
                if isinstance(member, RowScale):
                    member.alpha = alpha
        self._do(run)

    @precondition(lambda self: self.live)
    @rule(training=st.booleans())
    def train_or_eval(self, training):
        self._do(lambda i, m: m.train(training))

    @precondition(lambda self: self.live)
    @rule(flag=st.booleans())
    def requires_grad(self, flag):
        self._do(lambda i, m: m.requires_grad_(flag))

    @precondition(lambda self: self.live)
    @rule(which=st.integers(0, 99), batched=st.booleans())
    def functional_call(self, which, batched):
        names = [n for n, _ in self.models[0].named_parameters()]
        name = names[which % len(names)]
        base = self.models[0].get_parameter(name).detach()

        def run(i, m):
            with torch.no_grad():
                if batched:
                    stacked = torch.stack([base * 0.5, base * 1.5])
                    return torch.vmap(lambda p: torch.func.functional_call(m, {name: p}, (self.x,)))(stacked)
                return torch.func.functional_call(m, {name: base * 0.7}, (self.x,))
        self._same(run)

    @precondition(lambda self: self.live)
    @rule()
    def deepcopy(self):
        try:
            self.models = self._both(lambda i, m: copy.deepcopy(m))
        except _Ended:
            return
        self.compiled = [None, None]
        self._optimizers()

    @precondition(lambda self: not self.live)
    @rule()
    def ended(self):
        """Nothing left to compare (a refusal, or an error both raised): the sequence idles."""

    @invariant()
    def same_state(self):
        if not self.live:
            return
        stock, ours = self.models
        expected, got = stock.state_dict(), ours.state_dict()
        assert list(got) == list(expected)
        for key in expected:
            assert torch.equal(got[key], expected[key]), key
        for (name, p), q in zip(stock.named_parameters(), ours.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            assert p.grad is None or torch.equal(q.grad, p.grad), name

    def teardown(self):
        if self.live:
            paramfold.restore(self.models[1])
            with torch.no_grad():
                assert torch.equal(self.models[1](self.x), self.models[0](self.x))


TestEventSequences = EventSequences.TestCase
TestEventSequences.settings = settings(max_examples=60, stateful_step_count=15)
