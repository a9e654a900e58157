"""A nested call whose values are computed inside a non-reentrant ``torch.utils.checkpoint``
region: the region's recomputation tells the reads made inside that call from the reads made
outside it.

Where a call nested in the scope runs under another grad mode, autocast state or dispatch mode
than the scope's (selective checkpointing's mode, a ``torch.autocast`` entered in the region),
its values are taken out of ``__dict__`` for the call (``scope_nested.call_changed``): each read
inside it computes its value through the descriptor, with autograd, in the region, as stock's
does, and is noted on the region's frame for the recomputation (``site_reads.read_outside_scope``).
A read of the same tensor outside that call (``self.lin(x) @ self.lin.weight``) is a plain
``__dict__`` read, served the value the scope computed before the region. The recomputation
runs with no scope open, so both reads reach the descriptor: not told apart, the second would
be computed in the region too, saving tensors its forward never saved (torch's
``CheckpointError``; under selective checkpointing, "invocation index ... not found in storage").

So the forward notes on the region's frame each entry whose call was changed there
(:func:`marking`), and a read's key says whether it is made inside such a call
(:func:`inside`): in the recomputation, inside a call of a noted entry, found on the stack (only
there, a rare path: no module's call pays for it). (An entry
called in the region both changed and not counts as changed in every call of the recomputation; a read
inside its unchanged call reaches the descriptor only where it has no value in ``__dict__``,
which is computed where read in both.)
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from typing import Any

from torch import nn

from paramfold.compute import checkpoint_frame
from paramfold.frames import run_module_eagerly_as_frames

#: The attribute of a ``torch.utils.checkpoint`` frame that holds the ``id`` of every entry whose
#: call its forward changed (:func:`marking`).
_CHANGED = "_paramfold_changed_calls"


class _Local(threading.local):
    #: How many calls this thread runs that are changed inside a region (:func:`marking`).
    depth = 0


_local = _Local()


def inside() -> bool:
    """Whether this read is made inside a call changed in a checkpoint region: in the forward,
    inside :func:`marking`'s call; in the recomputation (no scope open, so nothing is marked),
    inside a call of an entry whose call its forward changed, found on the Python stack."""
    if _local.depth > 0:
        return True
    region = checkpoint_frame()
    if region is None or region[0] is None or not region[1]:
        return False
    changed = region[0].__dict__.get(_CHANGED)
    if not changed:
        return False
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in _CALL_CODES and id(frame.f_locals.get("self")) in changed:
            return True
        frame = frame.f_back
    return False


#: The frames of a module's call (its ``self`` the module).
_CALL_CODES = frozenset((nn.Module._call_impl.__code__, nn.Module._wrapped_call_impl.__code__))


def _marked(call: Callable, *args: Any, **kwargs: Any) -> Any:
    _local.depth += 1
    try:
        return call(*args, **kwargs)
    finally:
        _local.depth -= 1


def marking(entry: nn.Module, call: Callable) -> Callable:
    """``call``, a changed call of ``entry`` (``scope_nested.call_changed``): inside a
    non-reentrant region, one that runs marked, its entry noted on the region's frame where this
    is the forward; else ``call``."""
    region = checkpoint_frame()
    if region is None:
        return call
    frame, recomputing = region
    if frame is not None and not recomputing:
        frame.__dict__.setdefault(_CHANGED, set()).add(id(entry))
    return functools.partial(_marked, call)


# paramfold's own work: dynamo runs it eagerly when it meets it as a frame (paramfold.frames).
run_module_eagerly_as_frames(globals())
