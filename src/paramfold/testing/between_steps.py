"""What changes the models between the checker's steps: :func:`update`, the same in-place step
on stock and its copies, as an optimizer or ``load_state_dict`` would take it.

Why a module of its own: with one step no forward runs after a change of the originals, so a
stale hoisted or frozen value shows only from the second step on, and only where the change
reaches every input a value is computed from. What is changed, and how, is one decision made
here: every floating parameter, parametrized buffer and floating buffer of a chain's members,
by an SGD step with stock's gradient or, where there is none, a shrink by a factor of each
element's own (a uniform one leaves scale-invariant chains, spectral_norm's, as they were); on
a site computed from several of these, one of them is held out in turn (:func:`_held_out`), so
a value kept fresh by watching only some of its inputs shows. :func:`update` is the checker's
internal (imported by :mod:`~paramfold.testing.check`), not part of :mod:`paramfold.testing`'s API.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from paramfold import hooknorms
from paramfold.compute import members, original_names
from paramfold.sites import parametrization_paths
from paramfold.testing.walks import hook_norms, parametrized

__all__ = ["update"]


#: Seeds the checker's own generator of the between-step shrink factors.
_SHRINK_SEED = 0x5EED


def update(stock: nn.Module, others: list[nn.Module], lr: float, step: int) -> None:
    """The same in-place step on ``stock`` and ``others``, driven by ``stock``'s gradients, before
    step ``step`` (1 for the second step).

    Updated: every floating parameter, every parametrized buffer, and every floating buffer of a
    chain's members (a custom member's scale, spectral_norm's ``_u``/``_v``), except, on a site
    computed from several of these, one of them in turn (its first original before the second
    step, the next before the third, ...): a value kept fresh by watching only some of its inputs
    (weight_norm's ``g`` but not ``v``, the originals but not a member's buffer) shows.
    """
    held = _held_out(stock, step)

    def tensors(model: nn.Module) -> list[torch.Tensor]:
        inside = parametrization_paths(model)
        buffers = [b for n, b in model.named_buffers()
                   if n.rsplit(".", 1)[-1].startswith("original") or n.rpartition(".")[0] in inside]
        state = [d[key] for _, module, hook, kind in hook_norms(model)
                 for _, d, key in hooknorms.state_tensors(module, hook, kind)]
        return [*model.parameters(), *buffers, *state]

    # Where there is no gradient, each element shrinks by its own factor in (0.98, 1]: a uniform
    # shrink leaves scale-invariant chains (spectral_norm's W/sigma(W), a direction v/|v|) as they
    # were, so a stale value of theirs would pass within any tolerance.
    shrink = torch.Generator().manual_seed(_SHRINK_SEED)
    with torch.no_grad():
        for reference, *copies in zip(tensors(stock), *map(tensors, others)):
            # (A tensor subclass made of others, a torchao quantized base weight, may have no
            # in-place arithmetic: left as it is, as an optimizer leaves a frozen base.)
            if (not reference.is_floating_point() or id(reference) in held
                    or (reference.grad is None and is_traceable_wrapper_subclass(reference))):
                continue
            grad = reference.grad
            factors = None
            if grad is None:
                factors = (1 - 0.02 * torch.rand(reference.shape, generator=shrink)).to(reference.device, reference.dtype)
            for tensor in (reference, *copies):
                if grad is not None:
                    tensor.add_(grad, alpha=-lr)
                else:
                    tensor.mul_(factors)
    # Then zero_grad(set_to_none=True), as a training loop does: each step's gradients are its
    # own. (Accumulated into the last step's, a compiled candidate and stock compiled afresh from
    # the same state, the reference where eager stock differs, round them differently: two
    # compilations of stock itself do.)
    for model in (stock, *others):
        for param in model.parameters():
            param.grad = None


def _held_out(model: nn.Module, step: int) -> set[int]:
    """The tensors :func:`update` leaves as they are before step ``step``: of each site's inputs
    (its originals, then its members' floating parameters and buffers), where it has several, the
    ``(step - 1) % n``-th (one another site shares and updates is updated)."""
    held: set[int] = set()
    updated: set[int] = set()
    sites = [[getattr(plist, name) for name in original_names(plist)]
             + [t for member in members(plist) for t in (*member.parameters(), *member.buffers()) if t.is_floating_point()]
             for _, module in parametrized(model) for plist in module.parametrizations.values()]
    sites += [[d[key] for _, d, key in (*hooknorms.originals(module, hook, kind), *hooknorms.state_tensors(module, hook, kind))]
              for _, module, hook, kind in hook_norms(model)]
    for originals in sites:
        if len(originals) > 1:
            keep = originals[(step - 1) % len(originals)]
            held.add(id(keep))
            updated.update(id(t) for t in originals if t is not keep)
        else:
            updated.update(map(id, originals))
    return held - updated
