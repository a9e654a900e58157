"""torchao 0.18: quantize_ + unwrap_tensor_subclass, and the sparsifier's FakeSparsity masks.

Skipped as a whole when torchao is missing or cannot be imported with this torch (see conftest)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.nn.utils import parametrize

import paramfold
import paramfold.testing as pt

warnings.filterwarnings("ignore", module="torchao")
# conftest turns a torchao that is installed but fails at import (one built for a newer torch
# raises ImportError or AttributeError) into ModuleNotFoundError with the real error as reason.
torchao = pytest.importorskip("torchao")
from torchao.prototype.sparsity.sparsifier.utils import FakeSparsity  # noqa: E402
from torchao.quantization import Int8WeightOnlyConfig, quantize_  # noqa: E402
from torchao.utils import unwrap_tensor_subclass  # noqa: E402


def _int8_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    quantize_(model, Int8WeightOnlyConfig())
    return unwrap_tensor_subclass(model)


def _sparse_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
    for layer in (model[0], model[2]):
        mask = (torch.rand_like(layer.weight) > 0.5).to(layer.weight.dtype)
        parametrize.register_parametrization(layer, "weight", FakeSparsity(mask))
    return model


def test_find_recognises_torchao_sites():
    int8 = paramfold.find(_int8_model())
    assert [s.kind for s in int8] == ["torchao_subclass", "torchao_subclass"]
    assert list(int8[0].originals) == ["original0", "original1", "original2"]
    assert [s.kind for s in paramfold.find(_sparse_model())] == ["fake_sparsity", "fake_sparsity"]


@pytest.mark.parametrize("mode", ["hoist", "inline", "freeze", "auto"])
def test_int8_weight_only_matches_stock_eager_and_compiled(mode):
    stock = _int8_model()
    ours = paramfold.prepare(copy.deepcopy(stock), mode)
    x = torch.randn(4, 64)
    with torch.no_grad():
        expected = stock(x)
        assert torch.equal(ours(x), expected)
        torch._dynamo.reset()
        assert torch.equal(torch.compile(ours, backend="eager", fullgraph=True)(x), expected)
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["hoist", "inline", "auto"])
def test_fake_sparsity_training_is_bitwise_equal_to_stock(mode):
    pt.assert_equivalent(_sparse_model(), torch.randn(8, 64), mode, steps=3)


def test_fake_sparsity_freeze_follows_mask_updates():
    stock = _sparse_model().requires_grad_(False)
    ours = paramfold.prepare(copy.deepcopy(stock), "freeze")
    x = torch.randn(2, 64)
    assert torch.equal(stock(x), ours(x))
    for model in (stock, ours):  # a pruner tightening the mask in place
        model[0].parametrizations.weight[0].mask[:8].zero_()
    assert torch.equal(stock(x), ours(x))


class _LoRA(torch.nn.Module):
    """QLoRA: a frozen quantized base plus a low-rank delta."""

    def __init__(self):
        super().__init__()
        self.A = torch.nn.Parameter(torch.randn(4, 64) * 0.1)
        self.B = torch.nn.Parameter(torch.randn(64, 4) * 0.1)

    def forward(self, w):
        return w.dequantize() + self.B @ self.A


def _qlora_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    quantize_(model, Int8WeightOnlyConfig())  # weight: an Int8Tensor wrapper (qdata, scale)
    parametrize.register_parametrization(model[0], "weight", _LoRA(), unsafe=True)
    return model.eval().requires_grad_(False)


@pytest.mark.parametrize("edit", ["scale.mul_", "qdata.add_"])
@pytest.mark.parametrize("mode", ["freeze", "auto"])
def test_an_in_place_edit_inside_an_int8_original_is_seen(mode, edit):
    # Regression: freeze and auto kept serving the value from before the edit (up to 0.89 off).
    stock, ours = _qlora_model(), paramfold.prepare(_qlora_model(), mode)
    compiled = torch.compile(ours, backend="eager")
    x = torch.randn(2, 64)
    with torch.no_grad():
        for step in range(2):
            assert torch.equal(ours(x), stock(x)) and torch.equal(compiled(x), stock(x)), step
            for model in (stock, ours):
                original = model[0].parametrizations.weight.original
                original.scale.mul_(2) if edit == "scale.mul_" else original.qdata.add_(1)
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["hoist", "inline", "auto"])
def test_assert_equivalent_checks_a_lora_on_a_quantized_base(mode):
    # Regression: paramfold.testing's weight-update step called mul_ on every floating tensor
    # without a gradient, and torchao's Int8Tensor has none (NotImplementedError from its
    # dispatch), so the check crashed on a model paramfold serves bitwise. A quantized base is
    # left as it is, as an optimizer leaves a frozen one.
    model = _qlora_model().train()
    model[0].parametrizations.weight[0].requires_grad_(True)  # the adapters train, the base stays frozen
    pt.assert_equivalent(model, torch.randn(2, 64), mode, steps=2)
