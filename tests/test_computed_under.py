"""What a value is computed under, besides its inputs: torch's settings and the modes around a call.

Stock computes a parametrized tensor at its read, under whatever is in force then: the default
dtype (a chain's ``torch.linspace``), the float32 matmul precision, deterministic algorithms, a
``torch.device`` context, a ``TorchFunctionMode`` or ``TorchDispatchMode`` the caller entered
(``FlopCounterMode`` counts the chain's flops at each call). A frozen value was computed under the
settings of an earlier call: it serves a call only under the same settings, and none at all under
a mode other than a ``torch.device`` context. Eagerly, a mode entered inside the forward, around a
submodule's call, is seen there too (``scope_nested``). Every test here failed before
(``compute.computed_under``); each compares with stock, bitwise, eager and compiled (against stock's eager code).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize as P
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

import paramfold
from helpers import HalveProducts, default_dtype
from paramfold.compute import computed_under

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # see conftest.py

ALL_MODES = ["hoist", "inline", "freeze", "auto"]


class Ramp(nn.Module):
    """Scales the columns by a ramp made at each computation in the default dtype."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return (w.double() * torch.linspace(0.9, 1.1, w.shape[-1])).to(w.dtype)


class Gram(nn.Module):
    """``w @ w.T @ w / n``: matmuls, whose flops a FlopCounterMode counts."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w @ w.T @ w / w.shape[0]


class Net(nn.Module):
    def __init__(self, member: type[nn.Module]) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        P.register_parametrization(self.a, "weight", member())
        P.register_parametrization(self.b, "weight", member())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def twins(member: type[nn.Module], mode: str, compiled: bool):
    """Stock, eager (the reference), and the prepared twin, compiled or not."""
    torch.manual_seed(0)
    stock = Net(member).eval().requires_grad_(False)
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    return stock, torch.compile(ours, backend="eager") if compiled else ours


class AddOneToProducts(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out + 1 if func in (torch.Tensor.div, torch.div) else out


def _same_calls(stock, ours, around, x):
    """The calls before, inside and after ``around``, compared bitwise."""
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(ours(x), stock(x))
        with around():
            expected = stock(x)
        with around():
            got = ours(x)
        assert torch.equal(got, expected)
        with around():
            assert torch.equal(ours(x), stock(x))  # again: a value computed under a mode serves no other call
        assert torch.equal(ours(x), stock(x))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("mode", ALL_MODES)
def test_a_default_dtype_set_between_calls_like_stock(mode, compiled):
    stock, ours = twins(Ramp, mode, compiled)
    x = torch.randn(3, 8)
    w = torch.randn(8, 8)
    with default_dtype(torch.float64):
        ramp64 = Ramp()(w)
    assert not torch.equal(ramp64, Ramp()(w))  # the setting decides this chain's value
    _same_calls(stock, ours, lambda: default_dtype(torch.float64), x)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("around", [AddOneToProducts, HalveProducts], ids=["function-mode", "dispatch-mode"])
def test_a_mode_entered_around_a_call_like_stock(around, mode, compiled):
    if compiled and around is AddOneToProducts:
        # Stock's compiled code does not compute what its eager code does under this mode (torch
        # 2.13: dynamo traces the mode); inline, computed in the graph, gives the compiled value.
        pytest.skip("stock's compiled and eager code differ under a TorchFunctionMode")
    stock, ours = twins(Gram, mode, compiled)
    x = torch.randn(3, 8)
    with torch.no_grad(), around():
        changed = stock(x)
    with torch.no_grad():
        assert not torch.equal(changed, stock(x))  # the mode changes the chain's value
    _same_calls(stock, ours, around, x)


def _flops(stock: nn.Module, ours: nn.Module) -> list[int]:
    """The flops a FlopCounterMode around a call counts for each model, after one call each."""
    x = torch.randn(3, 8)
    counts = []
    with torch.no_grad():
        ours(x), stock(x)
        for model in (stock, ours):
            with FlopCounterMode(display=False) as counter:
                model(x)
            counts.append(counter.get_total_flops())
    return counts


@pytest.mark.parametrize("mode", ALL_MODES)
def test_flop_counter_around_a_call_counts_the_chains_like_stock(mode):
    counts = _flops(*twins(Gram, mode, compiled=False))
    assert counts[0] == counts[1] > 2 * 3 * 8 * 8 * 2


def _attribute(owner, name: str, value: object):
    return lambda v: setattr(owner, name, v), getattr(owner, name), value


def test_computed_under_sees_each_setting():
    # The deterministic proxy: each setting that decides how a chain's ops compute changes what a
    # frozen value is keyed on, and setting it back restores it.
    backends = torch.backends
    settings = [
        (torch.set_default_dtype, torch.get_default_dtype(), torch.float64),
        (torch.use_deterministic_algorithms, torch.are_deterministic_algorithms_enabled(), True),
        (torch.set_num_threads, torch.get_num_threads(), torch.get_num_threads() + 1),
        _attribute(backends.mkldnn, "enabled", not backends.mkldnn.enabled),
    ]
    if backends.cuda.is_built():  # without CUDA its settings decide nothing, and are not read
        settings += [_attribute(backends.cudnn, "allow_tf32", not backends.cudnn.allow_tf32),
                     _attribute(backends.cudnn, "benchmark", not backends.cudnn.benchmark)]
    if hasattr(backends.mkldnn, "matmul"):  # torch >= 2.9's per-backend precisions
        settings.append(_attribute(backends.mkldnn.matmul, "fp32_precision", "bf16"))
        if backends.cuda.is_built():
            settings.append(_attribute(backends.cuda.matmul, "fp32_precision", "tf32"))
    before = computed_under()
    for set_, was, other in settings:
        set_(other)
        try:
            assert computed_under() != before, (set_, other)
        finally:
            set_(was)
        assert computed_under() == before


def test_computed_under_survives_mixed_precision_apis():
    # torch.get_float32_matmul_precision() raises once the legacy and the per-backend APIs were
    # mixed; what a value is computed under is still read (each call would raise otherwise).
    if not hasattr(torch.backends.mkldnn, "matmul"):
        pytest.skip("no per-backend precisions in this torch")
    before = computed_under()
    matmul = torch.backends.mkldnn.matmul
    was = matmul.fp32_precision
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    matmul.fp32_precision = "bf16"
    try:
        with pytest.raises(RuntimeError):
            torch.get_float32_matmul_precision()
        assert computed_under() != before
    finally:
        matmul.fp32_precision = was
        torch.backends.cuda.matmul.fp32_precision = "none"


def test_computed_under_a_device_context_is_keyed_on_its_device():
    # torch.set_default_device pushes a torch.device context for good: values computed under one
    # serve later calls under the same device (no cost for such a program), not under another.
    before = computed_under()
    with torch.device("cpu"):
        cpu = computed_under()
        assert cpu == computed_under() != before
    with torch.device("meta"):
        assert computed_under() != cpu
    with AddOneToProducts():
        assert computed_under() != computed_under()  # any other mode: never the same


@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_a_default_device_does_not_stop_freezing(mode):
    stock, ours = twins(Gram, mode, compiled=False)
    x = torch.randn(3, 8)
    torch.set_default_device("cpu")
    try:
        with torch.no_grad():
            ours(x)
            frozen = ours.a.__dict__["weight"]
            for _ in range(3):
                assert torch.equal(ours(x), stock(x))
            assert ours.a.__dict__["weight"] is frozen
    finally:
        torch.set_default_device(None)


class ModeInside(nn.Module):
    """Enters ``around`` inside its forward, around its second layer's call."""

    def __init__(self, member: type[nn.Module], around) -> None:
        super().__init__()
        self.net = Net(member)
        self.around = around

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.net.a(x))
        with self.around():
            return self.net.b(h)


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("around", [AddOneToProducts, HalveProducts], ids=["function-mode", "dispatch-mode"])
def test_a_mode_entered_inside_the_forward_like_stock_eagerly(around, mode):
    # Eagerly, a module call nested in the open scope compares the modes active with those its
    # values were computed under, as it compares the grad mode and autocast state: inside the
    # region its values are computed again, under the mode, as stock's reads are.
    torch.manual_seed(0)
    stock = ModeInside(Gram, around).eval().requires_grad_(False)
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    x = torch.randn(3, 8)
    with torch.no_grad():
        plain = copy.deepcopy(stock)
        plain.around = contextlib.nullcontext
        assert not torch.equal(plain(x), stock(x))  # the mode changes the second layer's value
        for _ in range(3):
            assert torch.equal(ours(x), stock(x))


@pytest.mark.parametrize("mode", ALL_MODES)
def test_flop_counter_inside_the_forward_counts_like_stock(mode):
    torch.manual_seed(0)
    stock = ModeInside(Gram, lambda: FlopCounterMode(display=False)).eval().requires_grad_(False)
    counts = _flops(stock, paramfold.prepare(copy.deepcopy(stock), mode))
    assert counts[0] == counts[1]
