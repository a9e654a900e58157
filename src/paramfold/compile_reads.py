"""A compile on one thread and another thread's call of the same prepared modules take turns.

A call scope puts its values in the modules' ``__dict__`` and switches their classes, which every
thread sees. Dynamo reads modules as they are while it compiles. So a function compiled around a
prepared model (``torch.compile(lambda m, x: m(x) * 2)``), compiled on a thread with no scope of
that model open, would trace the values another thread's open call put there: no gradient
reaches the originals, another call's autocast is baked in, or, where that call ends meanwhile,
dynamo fails with its own "Guard failed on the same frame it was created".

Dynamo reads ``_is_fsdp_managed_module`` of every module it takes into a trace, for real
(``VariableBuilder.wrap_module``); every prepared class answers it through :class:`ReadByCompile`,
which marks the module as read by this thread's compile, under the scope lock:

* a call of another thread that would claim a marked module while the compile runs (dynamo
  holds its ``compile_lock`` through each frame's compile) installs nothing: it runs with no
  scope, each value computed where it is read, as stock's (at stock's cost, for that call);
* a module already holding values of another thread's open call: the compile waits (up to
  ``WAIT_S``) for that call to end, and is refused with a :class:`FoldError` if it does not
  (it may be waiting for dynamo's compile lock itself: a compiled call recompiling).

The compile never waits for the scope lock without a bound, and no call waits for a compile,
so neither can hang the other. Marks stand until the compile ends (dynamo's end callback, after
it checked the new code's guards on the frame); where that callback ran elsewhere (overlapping
compiles), the next call that finds them drops them: its own thread's where that thread compiles
no more, the others' where it can take the compile lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

import torch
from torch import nn

from paramfold import compile_leaves as leaves
from paramfold.compute import inspected_by_dynamo
from paramfold.errors import FoldError
from paramfold.state import STATE_ATTR, ModuleState

#: The attribute dynamo reads of each module it takes into a trace (torch 2.13-2.15).
ATTRIBUTE = "_is_fsdp_managed_module"
#: How long a compile waits for another thread's open call of a module it reads to end.
WAIT_S = 2.0
#: id(module) -> the ident of the thread whose compile read it. Read without the lock on every
#: call (empty: nothing to check); written under the scope lock.
MARKED: dict[int, int] = {}

_compile_lock = torch._dynamo.convert_frame.compile_lock


class RefusedWhileCompiling(FoldError, AssertionError):
    """A :class:`FoldError` raised from code dynamo runs for real while it compiles: dynamo passes
    an ``AssertionError`` on as it is, where it re-raises any other exception as an
    ``InternalTorchDynamoError`` that keeps only its message."""


class ReadByCompile:
    """Class attribute ``_is_fsdp_managed_module`` of every prepared class: ``False``, as
    ``getattr(module, "_is_fsdp_managed_module", False)`` finds on a module of stock's (FSDP
    sets it on its modules' instances, where it takes precedence), and, read by dynamo as it
    takes the module into a trace, :func:`read_by_this_compile`."""

    def __get__(self, module: nn.Module | None, owner: type | None = None):
        if module is None:
            return self
        if inspected_by_dynamo():
            state = module.__dict__.get(STATE_ATTR)
            if state is not None:
                read_by_this_compile(module, state)
        return False


def read_by_this_compile(module: nn.Module, state: ModuleState) -> None:
    """Mark ``module`` read by this thread's compile; where another thread's open call holds
    values in it, wait for that call to end (calls opened meanwhile by other threads install
    nothing, :func:`read_elsewhere`, unless they share a call still open: that can outlast the
    wait, which then refuses the compile)."""
    if leaves.on_compile_start not in leaves.START_CALLBACKS:  # (torch._dynamo.reset() clears them)
        leaves.ensure_registered()  # its end callback drops the marks
    me = threading.get_ident()
    lock = leaves.scope_lock()
    deadline = time.monotonic() + WAIT_S
    while True:
        # (Bounded: a thread holding the lock may be waiting for this compile to end.)
        if lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            try:
                MARKED[id(module)] = me
                if not _values_of_another_call(module, state):
                    return
            finally:
                lock.release()
        if time.monotonic() >= deadline:
            raise RefusedWhileCompiling(
                f"torch.compile is tracing a {type(module).__name__} of a prepared model on this thread "
                "while a call of that model from another thread holds its values in the module: the "
                f"compiled code would be traced on that call's values, and that call did not end in "
                f"{WAIT_S:g} s. Call again once the other thread's call has ended, compile the model "
                "itself (torch.compile(model) or model.compile(): its calls open their own scope), or "
                "give each thread its own copy.deepcopy(model)."
            )
        time.sleep(0.001)


def _values_of_another_call(module: nn.Module, state: ModuleState) -> bool:
    """Whether a call scope of another thread claims ``module``, and with it what dynamo sees of
    it: values in its ``__dict__``, its class. A claim of inline sites only changes nothing."""
    if not state.users or all(site.mode == "inline" for site in state.sites.values()):
        return False
    # (This thread's own scope: its values are the ones to trace.)
    return not any(holder is module for holder in leaves.claimed_holders(leaves.local.claims))


def read_elsewhere(holders: Iterable[nn.Module]) -> bool:
    """Whether a call that claims ``holders`` must run with no scope (asked under the scope lock,
    where :data:`MARKED` is not empty): another thread compiles now, and its compile read one of
    them while no call scope held any (where one does, the call is claimed as any overlapping call
    is: shared or refused, :mod:`paramfold.scope`). Drops the marks of compiles that ended."""
    me = threading.get_ident()
    if torch._guards.CompileContext.try_get() is None:  # this thread's own: ended
        for key in [key for key, ident in MARKED.items() if ident == me]:
            del MARKED[key]
    if not any(MARKED.get(id(holder), me) != me for holder in holders):
        return False
    if _compile_lock.acquire(blocking=False):  # no other thread compiles: their marks are old
        try:
            for key in [key for key, ident in MARKED.items() if ident != me]:
                del MARKED[key]
        finally:
            _compile_lock.release()
        return False
    return not any(holder.__dict__[STATE_ATTR].users for holder in holders)


def _drop_own_marks() -> None:
    """Dynamo's compile ended on this thread (its end callback): what it read is read."""
    if MARKED:
        lock = leaves.scope_lock()
        if lock.acquire(blocking=False):  # (else the next call that finds them drops them)
            try:
                me = threading.get_ident()
                for key in [key for key, ident in MARKED.items() if ident == me]:
                    del MARKED[key]
            finally:
                lock.release()


leaves.END_HOOKS.append(_drop_own_marks)
