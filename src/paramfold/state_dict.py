"""``plain_state_dict``: the state dict the same model would have without parametrizations."""

from __future__ import annotations

import torch
from torch import nn

from paramfold.inline import compute
from paramfold.sites import find


def plain_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Return ``model``'s state dict with every parametrized tensor materialised.

    Keys are those of the unparametrized model (``<module>.<tensor>`` instead of
    ``<module>.parametrizations.<tensor>.original``, parametrization buffers dropped), values
    are computed under ``no_grad`` exactly as stock PyTorch computes them (stateful chains are
    evaluated in their current mode, so put the model in ``eval()`` first for spectral_norm).
    The result loads with ``strict=True`` into the model class without parametrizations.

    Example::

        >>> import torch, paramfold
        >>> from torch.nn.utils.parametrizations import weight_norm
        >>> sd = paramfold.plain_state_dict(weight_norm(torch.nn.Linear(4, 3)))
        >>> sorted(sd)
        ['bias', 'weight']
    """
    sites = [s for s in find(model) if "parametrizations" not in s.module_path.split(".")]
    by_prefix = {}
    for site in sites:
        prefix = f"{site.module_path}.parametrizations." if site.module_path else "parametrizations."
        by_prefix.setdefault(prefix, []).append(site)
    plain: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, value in model.state_dict().items():
            prefix = next((p for p in by_prefix if key.startswith(p)), None)
            if prefix is None:
                plain[key] = value
                continue
            for site in by_prefix[prefix]:
                if site.fqn not in plain:
                    value = compute(site.module, site.tensor_name)
                    # Under no_grad only an identity chain hands back the original itself.
                    plain[site.fqn] = value.detach() if value.requires_grad else value
    return plain
