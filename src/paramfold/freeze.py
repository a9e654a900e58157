"""The freeze strategy: materialise a parametrized tensor once and reuse it until its inputs change.

A frozen value is keyed on a fingerprint of every tensor the chain reads (originals and the
parametrization modules' own parameters and buffers): object identity, storage address and
version counter. ``load_state_dict`` (``copy_``), optimizer steps, in-place edits, ``assign=True``
loads and ``.to()`` all change the fingerprint, so the next call re-materialises by itself.
"""

from __future__ import annotations

import torch
from torch import nn

from paramfold.errors import FoldError, first_few
from paramfold.inline import compute
from paramfold.runtime import FrozenValue, SiteState, site_state
from paramfold.sites import Site


def fingerprint(site: SiteState) -> tuple[tuple[int, int, int], ...]:
    return tuple((id(t), _address(t), t._version) for d in site.tensor_dicts for t in d.values() if t is not None)


def frozen_value(module: nn.Module, name: str, site: SiteState) -> torch.Tensor:
    """Return the materialised ``module.<name>``, recomputing it if its inputs changed."""
    current = fingerprint(site)
    if site.frozen is None or site.frozen.fingerprint != current:
        with torch.no_grad():
            value = compute(module, name)
        # Stateful chains may bump their own buffers while computing; key on the state after.
        site.frozen = FrozenValue(fingerprint(site), value)
    return site.frozen.value


def can_freeze(site: SiteState) -> bool:
    """A site may be frozen when nothing in its chain needs grad and no stateful chain is training."""
    if chain_needs_grad(site):
        return False
    return not (site.stateful and any(m.training for m in site.chain))


def chain_needs_grad(site: SiteState) -> bool:
    """Whether any original, or any parameter a parametrization owns, requires grad."""
    return any(p is not None and p.requires_grad for d in site.param_dicts for p in d.values()) or any(
        d[key].requires_grad for d, key in site.originals
    )


def refuse_unfreezable(sites: list[Site], when: str) -> None:
    """Raise :class:`FoldError` naming every site in ``sites`` that cannot be frozen."""
    states = [(s, site_state(s.module, s.tensor_name, "freeze", s.stateful)) for s in sites]
    bad = [(s, st) for s, st in states if not can_freeze(st)]
    if not bad:
        return
    reasons = []
    for s, st in bad:
        why = "a parameter of the chain requires grad" if chain_needs_grad(st) else "stateful chain in training mode"
        reasons.append(f"{s.fqn} ({s.kind}: {why})")
    raise FoldError(
        f"cannot freeze {len(bad)} site(s) {when}: {first_few(reasons, 4)}. Freeze is for inference: "
        "call model.eval() and model.requires_grad_(False) first, or use mode='auto' "
        "(freezes what it can, hoists the rest) or mode='hoist'."
    )


def _address(t: torch.Tensor) -> int:
    try:
        return t.data_ptr()
    except RuntimeError:  # tensor subclasses without storage
        return 0
