"""An entry compiled on its own (``block.compile()``) called inside a non-reentrant
``torch.utils.checkpoint`` region of a prepared model's call: the region's recomputation replays
the values the call served.

In the forward, the block's call runs nested in the model's call scope: its compiled code reads
the values that scope computed before the region (plain ``__dict__`` entries, torch's hooks of
hook-based norms out), and the region saves what that code saves. The recomputation runs during
backward, after the scope closed: the block's call would open a scope of its own and compute its
values with autograd inside the region, saving tensors its forward never saved (torch's
``CheckpointError`` about recomputed metadata).

So the forward notes on the region's frame each such call, with the values its compiled code
found (:func:`noting`), and the recomputation opens the block's scope for a noted call as a
*replay* (:func:`replay`, :func:`replayed_value`): a value the scope served in the forward is
computed again without autograd, outside the region's dispatch modes (selective checkpointing's
cache refuses ops its forward never ran), a leaf that requires grad where the forward's value did;
one computed for the call inside the region (the call's inputs, grad mode or modes changed since
the scope opened) is computed there again, with autograd where it had it; and a tensor the forward
computed where it was read (in the compiled code) is computed where it is read again. The recomputation only
refills the region's saved tensors; the gradient flows through the graph the forward's values
recorded, as for an eager read (``site_reads.read_outside_scope``) and a hook-based norm's eager call
(:mod:`paramfold.hooknorm_regions`). A training stateful chain (spectral_norm) served there is
refused: stock runs its power iteration again in the recomputation, which a value computed once
per call cannot reproduce.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paramfold import hooknorms
from paramfold.compute import checkpoint_frame, compute, computed_for_recomputation, computed_in_region, replay_index
from paramfold.errors import FoldError
from paramfold.frames import run_module_eagerly_as_frames
from paramfold.scope_nested import Installs, hook_in
from paramfold.state import STATE_ATTR, ModuleState, SiteState, tensor_label

#: The attribute of a ``torch.utils.checkpoint`` frame that holds, per ``id(entry)``, one entry per
#: call of the entry in the region's forward: ``{(id(holder), name): (computed, requires_grad)}``
#: of the values its compiled code found in ``__dict__``: served by the scope (``computed`` False),
#: or computed for the call inside the region (True: inputs, grad mode or modes changed since the
#: scope opened, ``scope_nested.call_changed``). A site not there was computed where it was read.
_CALLS = "_paramfold_entry_calls"
#: ... and ``(pack hook, {id(entry): calls replayed})`` of the recomputation under way.
_REPLAYED = "_paramfold_entry_replayed"


def values_now(state: ModuleState) -> dict[tuple[int, str], torch.Tensor]:
    """The values in the ``__dict__`` of the holders below an entry (see :func:`noting`)."""
    found = {}
    for holder in state.holders:
        values = holder.__dict__
        hs = values[STATE_ATTR]
        for name, site in hs.sites.items():
            value = values.get(name)
            # (A hook-based norm's hook back in: its module's call computes the value, as stock's.)
            if site.mode != "inline" and not site.at_read and isinstance(value, torch.Tensor) and not (
                    site.hook is not None and hook_in(hs, site)):
                found[(id(holder), name)] = value
    return found


def noting(entry: nn.Module, state: ModuleState, call: Callable) -> Callable:
    """``call`` of ``entry`` nested in an open call scope, inside a saved-tensors hook: where that
    is a non-reentrant region's forward, one that first notes what its compiled code is served,
    as it is when it starts (after the nested check computed what changed); else ``call``."""
    region = checkpoint_frame()
    if region is None or region[0] is None or region[1]:
        return call
    return functools.partial(_noted_call, region[0], entry, state, values_now(state), call)


def _noted_call(frame: object, entry: nn.Module, state: ModuleState, before: dict, call: Callable,
                *args: Any, **kwargs: Any) -> Any:
    """:func:`noting`'s call (``before``: the values when the call began, :func:`values_now`)."""
    noted = {key: (value is not before.get(key) or value in computed_in_region, value.requires_grad)
             for key, value in values_now(state).items()}
    frame.__dict__.setdefault(_CALLS, {}).setdefault(id(entry), []).append(noted)
    return call(*args, **kwargs)


def replay(entry: nn.Module) -> dict[tuple[int, str], tuple[bool, bool]] | None:
    """At a call of ``entry`` that opens a scope of its own (where a saved-tensors hook is set):
    in a non-reentrant region's recomputation, what the matching call of its forward was served
    (see :func:`noting`), for the scope to replay; else None (the scope opens as any other)."""
    region = checkpoint_frame()
    if region is None or region[0] is None or not region[1]:
        return None
    notes = region[0].__dict__
    calls = notes.get(_CALLS, {}).get(id(entry))
    if not calls:
        return None
    i = replay_index(notes, _REPLAYED, id(entry))
    return calls[i] if i < len(calls) else None


def at_read_flags(state: ModuleState) -> list[tuple[SiteState, bool]]:
    """Which sites below an entry are computed where read, before a replay of its call sets
    them as its forward had them: the region's later reads (outside the replayed call,
    ``site_reads.read_outside_scope``) replay their forward, where the scope's flags held."""
    return [(site, site.at_read) for holder in state.holders for site in holder.__dict__[STATE_ATTR].sites.values()]


def put_flags_back(flags: list[tuple[SiteState, bool]]) -> None:
    """Put back :func:`at_read_flags` after the replay (the nested checks made since are built again)."""
    changed = False
    for site, at_read in flags:
        changed |= site.at_read != at_read
        site.at_read = at_read
    if changed:
        Installs.count += 1


def replayed_value(holder: nn.Module, name: str, site: SiteState, noted: tuple[bool, bool]) -> torch.Tensor:
    """The value of a site for the recomputation of a call its forward served it in (see the
    module's docstring): ``noted``, as :func:`noting` noted it."""
    computed, requires_grad = noted
    if site.training_stateful:
        raise FoldError(
            f"{tensor_label(holder, name)}: a stateful parametrization (spectral_norm) in training mode "
            "is read again while torch.utils.checkpoint(use_reentrant=False) recomputes its forward, "
            "in a module compiled on its own; stock would run the power iteration inside the "
            "checkpointed region, which a value computed once per call cannot reproduce. Prepare this "
            "module with mode='inline' (filter_fn), checkpoint with use_reentrant=True, or call model.eval()."
        )
    value = (functools.partial(compute, holder, name) if site.hook is None
             else functools.partial(hooknorms.compute, holder, site.hook, site.hook_kind))
    if computed:  # computed for the call inside the region in the forward: the same again
        with torch.set_grad_enabled(requires_grad):
            return value()
    return computed_for_recomputation(value, requires_grad)


# paramfold's own work: dynamo runs it eagerly when it meets it as a frame (paramfold.frames).
run_module_eagerly_as_frames(globals())
