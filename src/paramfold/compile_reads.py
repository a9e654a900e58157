"""A compile on one thread and another thread's call of the same prepared modules take turns.

A call scope puts its values in the modules' ``__dict__`` and switches their classes, which every
thread sees. Dynamo reads modules as they are while it compiles. So a function compiled around a
prepared model (``torch.compile(lambda m, x: m(x) * 2)``), compiled on a thread with no scope of
that model open, would trace the values another thread's open call put there: no gradient
reaches the originals, another call's autocast is baked in, or, where that call ends meanwhile,
dynamo fails with its own "Guard failed on the same frame it was created".

Dynamo takes each module into a trace through ``VariableBuilder.wrap_module``, which
:func:`install` wraps: a prepared module is marked as read by this thread's compile, under the
scope lock, before dynamo reads anything of it:

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

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from paramfold import compile_leaves as leaves
from paramfold.errors import FoldError, with_article
from paramfold.state import STATE_ATTR, ModuleState

#: How long a compile waits for another thread's open call of a module it reads to end, and a
#: call for another thread's call that runs with no scope on its modules.
WAIT_S = 2.0
#: How long a compile waits for the scope lock (``paramfold.calls_lock()``, a writer may hold it).
LOCK_WAIT_S = 30.0
#: id(module) -> the ident of the thread whose compile read it. Read without the lock on every
#: call (empty: nothing to check); written under the scope lock.
MARKED: dict[int, int] = {}

_compile_lock = torch._dynamo.convert_frame.compile_lock


class RefusedWhileCompiling(FoldError, AssertionError):
    """A :class:`FoldError` raised from code dynamo runs for real while it compiles: dynamo passes
    an ``AssertionError`` on as it is, where it re-raises any other exception as an
    ``InternalTorchDynamoError`` that keeps only its message."""


def install() -> None:
    """Wrap dynamo's ``VariableBuilder.wrap_module`` (once per process) so that a prepared module
    taken into a trace is :func:`read_by_this_compile` first.

    Until 2026-12-06 each prepared class answered dynamo's read of ``_is_fsdp_managed_module``
    instead, which torch 2.13 makes with ``getattr`` as it wraps a module. torch 2.15 reads it
    with ``inspect.getattr_static``: it found that class attribute itself (truthy), took every
    prepared module for one FSDP manages with ``use_orig_params=False`` and broke the graph
    there, so that no prepared model compiled at all, each call running eagerly."""
    from torch._dynamo.variables.builder import VariableBuilder as builder

    wrap = getattr(builder, "wrap_module", None)
    if wrap is None or getattr(wrap, "_paramfold", False):
        return

    def wrap_module(self, value, *args, **kwargs):
        state = getattr(value, "__dict__", {}).get(STATE_ATTR)
        if state is not None:
            read_by_this_compile(value, state)
        return wrap(self, value, *args, **kwargs)

    wrap_module._paramfold = True
    builder.wrap_module = wrap_module


def read_by_this_compile(module: nn.Module, state: ModuleState) -> None:
    """Mark ``module`` read by this thread's compile; where another thread's open call holds
    values in it, wait for that call to end (calls opened meanwhile by other threads install
    nothing, :func:`unscoped`, unless they share a call still open: that can outlast the
    wait, which then refuses the compile)."""
    leaves.ensure_registered()  # its end callback drops the marks (torch._dynamo.reset() clears it)
    me = threading.get_ident()
    lock = leaves.scope_lock()
    start = time.monotonic()
    while True:
        # Bounded: a thread holding the lock may be waiting for this compile to end (a writer
        # holding paramfold.calls_lock() that calls a compiled model needing a compile).
        if not lock.acquire(timeout=max(0.0, start + LOCK_WAIT_S - time.monotonic())):
            raise RefusedWhileCompiling(
                f"torch.compile is tracing {with_article(type(module).__name__)} of a prepared model, and another "
                f"thread has held paramfold.calls_lock() for {LOCK_WAIT_S:g} s (a writer, or a call "
                "that waits for this compile): call again once it is let go."
            )
        try:
            MARKED[id(module)] = me
            if not _values_of_another_call(module, state):
                return
        finally:
            lock.release()
        if time.monotonic() >= start + WAIT_S:
            raise RefusedWhileCompiling(
                f"torch.compile is tracing {with_article(type(module).__name__)} of a prepared model on this thread "
                "while calls of that model from other threads hold their values in the module: the "
                "compiled code would be traced on those values, and for "
                f"{WAIT_S:g} s there was no moment without one (calls of other threads that share them "
                "overlap). Compile while no other thread calls the model (a warm-up call first), "
                "compile the model itself (torch.compile(model) or model.compile(): its calls open "
                "their own scope), or give each thread its own copy.deepcopy(model)."
            )
        time.sleep(0.001)


def _values_of_another_call(module: nn.Module, state: ModuleState) -> bool:
    """Whether a call scope of another thread claims ``module``, and with it what dynamo sees of
    it: values in its ``__dict__``, its class. A claim of inline sites only changes nothing."""
    if not state.users or all(site.mode == "inline" for site in state.sites.values()):
        return False
    # (This thread's own scope: its values are the ones to trace.)
    return not any(holder is module for holder in leaves.claimed_holders(leaves.local.claims))


class _Local(threading.local):
    #: The calls with no scope open on this thread (its own nested calls wait for none of them).
    bare: int = 0


local = _Local()
#: How many calls with no scope run now, in all threads (read without the lock on every call).
BARE = [0]


class Bare:
    """What :func:`paramfold.scope._open` answers where a call must run with no scope (falsy, as
    no scope is): the call counts on each holder's ``bare`` until :meth:`end`, so that no other
    call installs values under it while it runs, wherever its forward reads them (a tied weight
    read directly: ``F.linear(x, self.layer.weight)``)."""

    __slots__ = ("holders",)

    def __init__(self, holders: Iterable[nn.Module]) -> None:  # (under the scope lock)
        self.holders = tuple(holders)
        for holder in self.holders:
            holder.__dict__[STATE_ATTR].bare += 1
        BARE[0] += 1
        local.bare += 1

    def __bool__(self) -> bool:
        return False

    def end(self) -> None:
        with leaves.scope_lock():
            for holder in self.holders:
                state = holder.__dict__.get(STATE_ATTR)
                if state is not None and state.bare:  # (gone: restored meanwhile)
                    state.bare -= 1
            BARE[0] -= 1
        local.bare -= 1


def wait_for_bare(holders: list[nn.Module]) -> None:
    """Before a call claims ``holders`` (without the scope lock): let the calls of other threads
    that run with no scope on them end first (up to ``WAIT_S``; past that the call runs with no
    scope too), unless another thread's compile reads them now (the call runs with none then)."""
    if local.bare:
        return
    deadline = time.monotonic() + WAIT_S
    while any(getattr(holder.__dict__.get(STATE_ATTR), "bare", 0) for holder in holders) and time.monotonic() < deadline:
        if MARKED and any(id(holder) in MARKED for holder in holders) and _compiling_elsewhere():
            return
        time.sleep(0.001)


def unscoped(holders: list[nn.Module]) -> bool:
    """Whether a call that claims ``holders`` must run with no scope (asked under the scope lock,
    where :data:`MARKED` is not empty or :data:`BARE` counts a call): another call runs with no
    scope on them (:func:`wait_for_bare` waited for it), or another thread compiles now and its
    compile read one of them while no call scope held any (where one does, the call is claimed
    as any overlapping call is: shared or refused, :mod:`paramfold.scope`). Drops the marks of
    compiles that ended."""
    if BARE[0] and any(holder.__dict__[STATE_ATTR].bare for holder in holders):
        return True
    if not MARKED:
        return False
    me = threading.get_ident()
    if torch._guards.CompileContext.try_get() is None:  # this thread's own: ended
        _drop_marks(mine=True)
    if not any(MARKED.get(id(holder), me) != me for holder in holders):
        return False
    if not _compiling_elsewhere():  # their marks are old
        _drop_marks(mine=False)
        return False
    return not any(holder.__dict__[STATE_ATTR].users for holder in holders)


def _compiling_elsewhere() -> bool:
    """Whether another thread holds dynamo's compile lock now (compiles a frame)."""
    if not _compile_lock.acquire(blocking=False):
        return True
    _compile_lock.release()
    return False


def _drop_marks(mine: bool) -> None:
    """Drop this thread's marks (``mine``) or every other thread's (under the scope lock)."""
    me = threading.get_ident()
    for key in [key for key, ident in MARKED.items() if (ident == me) is mine]:
        del MARKED[key]


def _drop_own_marks() -> None:
    """Dynamo's compile ended on this thread (its end callback): what it read is read."""
    if MARKED:
        lock = leaves.scope_lock()
        if lock.acquire(blocking=False):  # (else the next call that finds them drops them)
            try:
                _drop_marks(mine=True)
            finally:
                lock.release()


leaves.END_HOOKS.append(_drop_own_marks)


@contextlib.contextmanager
def switching(modules: list[nn.Module]) -> Iterator[None]:
    """The scope lock, held while ``restore`` switches ``modules`` back, taken once no compile of
    another thread reads them (dynamo would build that code's guards on modules whose state is
    gone: its ``KeyError: '_paramfold'``). Waits for such a compile to end, up to ``LOCK_WAIT_S``."""
    lock = leaves.scope_lock()
    start = time.monotonic()
    while True:
        lock.acquire()
        me = threading.get_ident()
        if not (MARKED and any(MARKED.get(id(m), me) != me for m in modules) and _compiling_elsewhere()):
            break
        lock.release()
        if not _compile_lock.acquire(timeout=max(0.0, start + LOCK_WAIT_S - time.monotonic())):
            raise FoldError(
                f"another thread has been compiling code that reads this model for {LOCK_WAIT_S:g} s: "
                "restore it once that compile has ended; the model was not changed."
            )
        _compile_lock.release()
    try:
        yield
    finally:
        lock.release()
