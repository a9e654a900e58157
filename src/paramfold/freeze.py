"""The freeze strategy: materialise a parametrized tensor once and reuse it until its inputs change.

A frozen value is keyed on a fingerprint of every tensor the chain reads (originals and the
parametrization modules' own parameters and buffers): object identity, storage address and
version counter. ``load_state_dict`` (``copy_``), optimizer steps, in-place edits, ``assign=True``
loads and ``.to()`` all change the fingerprint, so the next call re-materialises by itself.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from paramfold.errors import FoldError
from paramfold.inline import compute
from paramfold.sites import Site

Fingerprint = tuple[tuple[int, int, int], ...]


@dataclasses.dataclass
class FrozenValue:
    fingerprint: Fingerprint
    value: torch.Tensor


def fingerprint(module: nn.Module, name: str) -> Fingerprint:
    plist = module._modules["parametrizations"]._modules[name]
    tensors = [*plist.parameters(), *plist.buffers()]
    return tuple((id(t), _address(t), t._version) for t in tensors)


def frozen_value(module: nn.Module, name: str, cache: dict[str, FrozenValue]) -> torch.Tensor:
    """Return the materialised ``module.<name>``, recomputing it if its inputs changed."""
    current = fingerprint(module, name)
    entry = cache.get(name)
    if entry is None or entry.fingerprint != current:
        with torch.no_grad():
            value = compute(module, name)
        # Stateful chains may bump their own buffers while computing; key on the state after.
        entry = cache[name] = FrozenValue(fingerprint(module, name), value)
    return entry.value


def can_freeze(module: nn.Module, name: str, stateful: bool) -> bool:
    """A site may be frozen when no original needs grad and no stateful chain is training."""
    if any(t.requires_grad for t in _originals(module, name)):
        return False
    plist = module._modules["parametrizations"]._modules[name]
    return not (stateful and any(m.training for m in plist))


def refuse_unfreezable(sites: list[Site], when: str) -> None:
    """Raise :class:`FoldError` naming every site in ``sites`` that cannot be frozen."""
    bad = [s for s in sites if not can_freeze(s.module, s.tensor_name, s.stateful)]
    if not bad:
        return
    reasons = []
    for s in bad:
        why = "an original requires grad" if _requires_grad(s) else "stateful chain in training mode"
        reasons.append(f"{s.fqn} ({s.kind}: {why})")
    shown = ", ".join(reasons[:4]) + (f" and {len(reasons) - 4} more" if len(reasons) > 4 else "")
    raise FoldError(
        f"cannot freeze {len(bad)} site(s) {when}: {shown}. Freeze is for inference: "
        "call model.eval() and model.requires_grad_(False) first, or use mode='auto' "
        "(freezes what it can, hoists the rest) or mode='hoist'."
    )


def _requires_grad(site: Site) -> bool:
    return any(t.requires_grad for t in _originals(site.module, site.tensor_name))


def _originals(module: nn.Module, name: str) -> list[torch.Tensor]:
    plist = module._modules["parametrizations"]._modules[name]
    named = [*plist.named_parameters(recurse=False), *plist.named_buffers(recurse=False)]
    return [t for n, t in named if n.startswith("original")]


def _address(t: torch.Tensor) -> int:
    try:
        return t.data_ptr()
    except RuntimeError:  # tensor subclasses without storage
        return 0
