"""An entry compiled on its own (``block.compile()``) called inside a non-reentrant
``torch.utils.checkpoint`` region of a prepared model's call: the region's recomputation replays
the values the call served.

In the forward, the block's call runs nested in the model's call scope: its compiled code reads
the values that scope computed before the region (plain ``__dict__`` entries, torch's hooks of
hook-based norms out), and the region saves what that code saves. The recomputation runs during
backward, after the scope closed: the block's call would open a scope of its own and compute its
values with autograd inside the region, saving tensors its forward never saved (torch's
``CheckpointError`` about recomputed metadata).

So the forward notes on the region's frame each such call, with the values it was served
(:func:`note`), and the recomputation opens the block's scope for a noted call as a *replay*
(:func:`replay`): each value served in the forward is computed again without autograd, outside the
region's dispatch modes (selective checkpointing's cache refuses ops its forward never ran), a
leaf that requires grad where the forward's value did (:func:`replayed_value`), and a tensor the
forward computed where it was read is computed where it is read again. The recomputation only
refills the region's saved tensors; the gradient flows through the graph the forward's values
recorded, as for an eager read (``classes.read_outside_scope``) and a hook-based norm's eager call
(:mod:`paramfold.hooknorm_regions`). A training stateful chain (spectral_norm) served there is
refused: stock runs its power iteration again in the recomputation, which a value computed once
per call cannot reproduce.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from paramfold import hooknorms
from paramfold.compute import checkpoint_frame, compute, replay_index
from paramfold.errors import FoldError
from paramfold.frames import run_module_eagerly_as_frames
from paramfold.state import STATE_ATTR, ModuleState, SiteState, tensor_label

#: The attribute of a ``torch.utils.checkpoint`` frame that holds, per ``id(entry)``, one entry per
#: call of the entry in the region's forward: ``{(id(holder), name): requires_grad}`` of the values
#: it was served, or None where it computed values in the region (inputs changed since the scope
#: opened: ``scope_nested.call_changed``).
_CALLS = "_paramfold_entry_calls"
#: ... and ``(pack hook, {id(entry): calls replayed})`` of the recomputation under way (each
#: backward runs one of its own, under a pack hook of its own).
_REPLAYED = "_paramfold_entry_replayed"


def note(entry: nn.Module, state: ModuleState, served: bool) -> None:
    """At a call of ``entry`` nested in an open call scope (where a saved-tensors hook is set):
    where that is a non-reentrant region's forward, note the values its holders were served
    (``served``: nothing changed since the scope opened), or that it computed them (not served)."""
    region = checkpoint_frame()
    if region is None or region[0] is None or region[1]:
        return
    values = None
    if served:
        values = {}
        for holder in state.holders:
            found = holder.__dict__
            for name, site in found[STATE_ATTR].sites.items():
                value = found.get(name)
                if site.mode != "inline" and not site.at_read and isinstance(value, torch.Tensor):
                    values[(id(holder), name)] = value.requires_grad
    region[0].__dict__.setdefault(_CALLS, {}).setdefault(id(entry), []).append(values)


def replay(entry: nn.Module) -> dict[tuple[int, str], bool] | None:
    """At a call of ``entry`` that opens a scope of its own (where a saved-tensors hook is set):
    in a non-reentrant region's recomputation, what the matching call of its forward was served
    (see :func:`note`), for the scope to replay; else None (the scope opens as any other)."""
    region = checkpoint_frame()
    if region is None or region[0] is None or not region[1]:
        return None
    notes = region[0].__dict__
    calls = notes.get(_CALLS, {}).get(id(entry))
    if not calls:
        return None
    i = replay_index(notes, _REPLAYED, id(entry))
    return calls[i] if i < len(calls) else None


def replayed_value(holder: nn.Module, name: str, site: SiteState, requires_grad: bool) -> torch.Tensor:
    """The value of a site its forward was served, for the recomputation (see the module's docstring)."""
    if site.training_stateful:
        raise FoldError(
            f"{tensor_label(holder, name)}: a stateful parametrization (spectral_norm) in training mode "
            "is read again while torch.utils.checkpoint(use_reentrant=False) recomputes its forward, "
            "in a module compiled on its own; stock would run the power iteration inside the "
            "checkpointed region, which a value computed once per call cannot reproduce. Prepare this "
            "module with mode='inline' (filter_fn), checkpoint with use_reentrant=True, or call model.eval()."
        )
    with torch.no_grad(), _disable_current_modes():
        value = compute(holder, name) if site.hook is None else hooknorms.compute(holder, site.hook, site.hook_kind)
    return value.detach().requires_grad_(requires_grad)


# paramfold's own work: dynamo runs it eagerly when it meets it as a frame (paramfold.frames).
run_module_eagerly_as_frames(globals())
