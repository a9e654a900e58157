"""Parametrized models for tests/test_audit.py.

The same factories serve ``paramfold audit --model tests/audit_models.py:<name>``: each builds the
parametrized model with fresh weights (the checkpoint then overwrites them).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize


def _conv_stack() -> nn.Sequential:
    return nn.Sequential(nn.Conv1d(4, 16, 3), nn.ReLU(), nn.Conv1d(16, 8, 3), nn.Flatten(), nn.Linear(128, 10))


def _deconv_stack() -> nn.Sequential:
    # ConvTranspose1d(16, 16): spectral_norm's dim=1 cannot be told from shapes alone.
    return nn.Sequential(nn.Conv1d(4, 16, 3), nn.ConvTranspose1d(16, 16, 3), nn.Flatten(), nn.Linear(288, 10))


def _mlp(widths: tuple[int, ...]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(widths) - 2 else [])
    return nn.Sequential(*layers)


def weight_norm_net() -> nn.Module:
    net = _conv_stack()
    parametrizations.weight_norm(net[0])  # dim=0
    parametrizations.weight_norm(net[2], dim=None)
    parametrizations.weight_norm(net[4], dim=1)
    return net


def legacy_weight_norm_net() -> nn.Module:
    net = _conv_stack()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nn.utils.weight_norm(net[0])
        nn.utils.weight_norm(net[2], dim=None)
        nn.utils.weight_norm(net[4], dim=1)
    return net


def spectral_norm_net() -> nn.Module:
    net = _deconv_stack()
    for i in (0, 1, 3):
        parametrizations.spectral_norm(net[i])
    return net


def fake_sparsity_net() -> nn.Module:
    from torchao.prototype.sparsity.sparsifier.weight_norm_sparsifier import WeightNormSparsifier

    net = _mlp((32, 64, 16))
    sparsifier = WeightNormSparsifier(sparsity_level=0.5, sparse_block_shape=(1, 4), zeros_per_block=2)
    sparsifier.prepare(net, [{"tensor_fqn": "0.weight"}, {"tensor_fqn": "2.weight"}])
    sparsifier.step()
    return net


def orthogonal_net() -> nn.Module:
    net = _mlp((8, 8, 6))
    parametrizations.orthogonal(net[0])  # matrix_exp
    parametrizations.orthogonal(net[2], orthogonal_map="cayley")
    return net


def torchao_net(unwrap: bool = True) -> nn.Module:
    from torchao.quantization import Int8WeightOnlyConfig, quantize_
    from torchao.utils import unwrap_tensor_subclass

    net = _mlp((64, 32, 16))
    quantize_(net, Int8WeightOnlyConfig())
    return unwrap_tensor_subclass(net) if unwrap else net


class SplitScale(nn.Module):
    """A custom parametrization: two originals and a buffer of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a + b) * self.scale

    def right_inverse(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return 0.5 * w, 1.5 * w


def custom_net() -> nn.Module:
    net = _mlp((16, 16, 8))
    parametrize.register_parametrization(net[0], "weight", SplitScale())
    return net


# kind -> (parametrized factory name, unparametrized twin, input shape)
CASES = {
    "weight_norm": ("weight_norm_net", _conv_stack, (3, 4, 20)),
    "legacy_weight_norm": ("legacy_weight_norm_net", _conv_stack, (3, 4, 20)),
    "spectral_norm": ("spectral_norm_net", _deconv_stack, (3, 4, 18)),
    "fake_sparsity": ("fake_sparsity_net", lambda: _mlp((32, 64, 16)), (5, 32)),
    "orthogonal": ("orthogonal_net", lambda: _mlp((8, 8, 6)), (5, 8)),
    "torchao_subclass": ("torchao_net", lambda: torchao_net(unwrap=False), (5, 64)),
    "custom": ("custom_net", lambda: _mlp((16, 16, 8)), (5, 16)),
}
