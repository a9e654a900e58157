"""A hook-based norm's layer called inside a non-reentrant ``torch.utils.checkpoint`` region of a
prepared model's call: the region's recomputation replays the value the call served.

Inside a call scope, the layer of a hook-based ``weight_norm``/``spectral_norm`` is served the
value the scope computed before the call, with torch's hook taken out (:mod:`paramfold.hooknorms`).
A non-reentrant region recomputes its forward during backward, after the call ended and the hook
went back in: torch's hook would then compute the weight inside the region, with autograd, saving
tensors its forward never saved (torch's ``CheckpointError`` about recomputed metadata).

So the forward notes on the region's frame each eager call of such a layer and whether its value
was served (:func:`note`), and in the recomputation the call of a served one (:func:`replay`) runs
with the hook out and the value computed again without autograd, outside the region's dispatch
modes (selective checkpointing's cache refuses ops its forward never ran), a leaf that requires
grad where the forward's value did: the recomputation only refills the region's saved tensors,
and the gradient flows through the graph the forward's value recorded, as for a parametrization
(``site_reads.read_outside_scope``). A training spectral_norm is refused there: stock's hook runs
its power iteration again in the recomputation, which a value computed once per call cannot
reproduce.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

from paramfold import hooknorms
from paramfold.compute import checkpoint_frame, computed_for_recomputation, computed_in_region, replay_index
from paramfold.errors import FoldError
from paramfold.frames import run_module_eagerly_as_frames
from paramfold.freeze import chain_needs_grad
from paramfold.state import ModuleState, SiteState, tensor_label

#: The attribute of a ``torch.utils.checkpoint`` frame that holds, per ``(id(layer), name)``, one
#: entry per call of the layer in the region's forward: whether the value was served.
_CALLS = "_paramfold_hook_calls"
#: ... and ``(pack hook, {key: calls replayed})`` of the recomputation under way (each backward
#: runs one of its own, under a pack hook of its own).
_REPLAYED = "_paramfold_hook_replayed"

_MISSING = object()
#: How many regions whose forward noted a call are alive (their recomputation may replay it).
#: Read where dynamo traces a call with no scope over it (a function compiled around the model):
#: while none is, no recomputation can need a replay, and dynamo is spared the saved-tensors query
#: it cannot trace (a graph break at every hook-based norm's layer); dynamo guards the count.
live = 0
_live_lock = threading.RLock()  # (a finalizer may run in the thread that holds it)


def _noted(region: object) -> None:
    """Count ``region`` live until torch's frame of it goes."""
    global live
    with _live_lock:
        live += 1
    weakref.finalize(region, _gone)


def _gone() -> None:
    global live
    with _live_lock:
        live -= 1


def note(module: nn.Module, state: ModuleState, served: bool) -> None:
    """At an eager call of ``module`` inside a call scope (where a saved-tensors hook is set):
    where that is a non-reentrant region's forward, note for each hook-based norm of ``module``
    whether this call is served the scope's value (``served``: the nested check found nothing
    changed, and its hook is out) or computes it in the region."""
    region = checkpoint_frame()
    if region is None or region[0] is None or region[1]:
        return
    pre_hooks = module._forward_pre_hooks.values()
    calls = None
    for name, site in state.sites.items():
        if site.hook is not None:
            if calls is None:
                calls = region[0].__dict__.get(_CALLS)
                if calls is None:
                    calls = region[0].__dict__[_CALLS] = {}
                    _noted(region[0])
            calls.setdefault((id(module), name), []).append(
                served and not any(h is site.hook for h in pre_hooks) and module.__dict__.get(name) not in computed_in_region)


def replay(module: nn.Module, state: ModuleState) -> Callable[..., Any] | None:
    """At an eager call of ``module`` with no call scope over it (where a saved-tensors hook is
    set): in a non-reentrant region's recomputation, where the matching call of its forward was
    served, the call that replays it; else None (the call runs as stock's)."""
    region = checkpoint_frame()
    if region is None or region[0] is None or not region[1]:
        return None
    notes = region[0].__dict__
    calls = notes.get(_CALLS)
    if not calls:
        return None
    served = []
    for name, site in state.sites.items():
        key = (id(module), name)
        if site.hook is None or key not in calls:
            continue
        i = replay_index(notes, _REPLAYED, key)
        if i < len(calls[key]) and calls[key][i]:
            served.append((name, site))
    return functools.partial(_replayed_call, module, served) if served else None


def _replayed_call(module: nn.Module, served: list[tuple[str, SiteState]], *args: Any, **kwargs: Any) -> Any:
    """The call of ``module`` with the values of ``served`` computed again (no autograd) and
    their hooks out, each put back as it was after."""
    for name, site in served:
        if site.hook_kind == "spectral_norm" and module.training:
            raise FoldError(
                f"{tensor_label(module, name)}: a hook-based spectral_norm in training mode is called again "
                "while torch.utils.checkpoint(use_reentrant=False) recomputes its forward; stock's hook would "
                "run the power iteration again inside the checkpointed region, which a value computed once per "
                "call cannot reproduce. Prepare this module with mode='inline' (filter_fn), checkpoint with "
                "use_reentrant=True, or call model.eval()."
            )
    values = {name: computed_for_recomputation(functools.partial(hooknorms.compute, module, site.hook, site.hook_kind),
                                               chain_needs_grad(site)) for name, site in served}
    hooks = [site.hook for _, site in served]
    taken = hooknorms.detach(module, [k for k, h in module._forward_pre_hooks.items() if any(h is x for x in hooks)])
    before = {name: module.__dict__.get(name, _MISSING) for name in values}
    try:
        module.__dict__.update(values)
        return module._call_impl(*args, **kwargs)
    finally:
        for name, value in before.items():
            if value is _MISSING:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = value
        hooknorms.attach(module, *taken)


# paramfold's own work: dynamo runs it eagerly when it meets it as a frame (paramfold.frames).
run_module_eagerly_as_frames(globals())
