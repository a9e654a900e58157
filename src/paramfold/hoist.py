"""The hoist strategy: compute a parametrized tensor eagerly, before compiled code runs.

The value is computed once per call scope under the caller's grad mode, so autograd links it
to the originals and stateful chains (spectral_norm's power iteration) advance exactly once,
as they do in stock PyTorch when the tensor is read once per forward. Compiled code then reads
a plain tensor from the module's instance ``__dict__``.
"""

from __future__ import annotations

import torch
from torch import nn

from paramfold.inline import compute


def hoisted_value(module: nn.Module, name: str) -> torch.Tensor:
    """The value stock PyTorch would produce for ``module.<name>`` at this moment."""
    return compute(module, name)
