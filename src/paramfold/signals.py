"""Signals that unwind instead of killing: while :func:`signals_raise` is active (the CLI activates
it), SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted`, so every ``finally`` and cleanup block
runs (an output's temporary file is removed, see :mod:`paramfold.output`), and a signal whose
exception something caught and dropped is raised again at the next safe point
(:func:`raise_if_interrupted`). User code that the CLI runs as ``python`` would
(``paramfold recompiles``' script) gets python's own handling back meanwhile
(:func:`signals_as_python`).

This module imports nothing heavy (no torch).
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["HANDLED_SIGNALS", "Interrupted", "from_signal", "on_signal_instead", "python_exit_steps",
           "raise_if_interrupted", "signal_arrived", "signals_as_python", "signals_deferred", "signals_raise"]

# The signals the CLI turns into an exception, so that cleanup runs; exit code 128 + number.
HANDLED_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)


class Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP arrived (see :func:`signals_raise`); ``signum`` says which.

    A ``KeyboardInterrupt`` so that code which handles Ctrl-C handles the others the same way,
    and ``except Exception`` blocks let it through.
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class _SignalState:
    """What :func:`signals_raise`'s handler has seen and does (one per process: signals are)."""

    def __init__(self) -> None:
        #: The handled signals that arrived while it was active, in order.
        self.arrived: list[int] = []
        #: Called with the signal number instead of raising, once set (:func:`on_signal_instead`).
        self.instead: Callable[[int], None] | None = None
        #: How many :func:`signals_deferred` blocks are open: a signal is then recorded, not raised.
        self.deferred = 0
        #: The handler :func:`signals_raise` installed (None while it is not active).
        self.handler: Callable[[int, object], None] | None = None
        #: The handlers it replaced, by signal (what the process was started with), and the
        #: ``sys.unraisablehook`` it replaced: what :func:`signals_as_python` gives user code back.
        self.given: dict[int, Any] = {}
        self.given_hook: Callable[[Any], object] | None = None


_signals = _SignalState()


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """While active (main thread only), SIGINT/SIGTERM/SIGHUP raise :class:`Interrupted`.

    The default action of SIGTERM and SIGHUP kills the process on the spot, leaving temporary
    files behind; raised as exceptions they unwind through every ``finally`` and cleanup block.

    A signal is also recorded, so that it cannot be lost where code catches every exception (an
    import inside a C extension, say, swallows the :class:`Interrupted` raised there):
    :func:`raise_if_interrupted` raises it again at a safe point, and :func:`atomic_output` never
    puts an output in place after one.
    """
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    import sys

    def handler(signum: int, frame: object) -> None:
        _signals.arrived.append(signum)
        if _signals.instead is not None:
            _signals.instead(signum)
        if not _signals.deferred:
            raise Interrupted(signum)

    given_hook = sys.unraisablehook

    def unraisable(info: object) -> None:
        # Raised where Python cannot propagate it (a weakref or GC callback, a __del__): Python
        # prints "Exception ignored in ..." with a traceback and goes on. It is recorded: the
        # next raise_if_interrupted raises it again.
        if not isinstance(getattr(info, "exc_value", None), Interrupted):
            given_hook(info)

    saved = (_signals.arrived, _signals.instead, _signals.deferred, _signals.handler, _signals.given,
             _signals.given_hook)
    old: dict[int, Any] = {}
    _signals.arrived, _signals.instead, _signals.deferred, _signals.handler = [], None, 0, handler
    _signals.given, _signals.given_hook = old, given_hook
    sys.unraisablehook = unraisable
    for sig in HANDLED_SIGNALS:
        with contextlib.suppress(OSError, ValueError):
            previous = signal.getsignal(sig)
            if previous is signal.SIG_IGN:
                # Ignored by whoever started us (nohup's SIGHUP, a background job's SIGINT in a
                # non-interactive shell): kept ignored, as Python itself keeps an ignored SIGINT.
                continue
            old[sig] = previous
            signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, previous in old.items():
            signal.signal(sig, previous)
        sys.unraisablehook = given_hook
        (_signals.arrived, _signals.instead, _signals.deferred, _signals.handler, _signals.given,
         _signals.given_hook) = saved


@contextlib.contextmanager
def signals_as_python() -> Iterator[Callable[[BaseException], bool]]:
    """While active, user code run in this process (``paramfold recompiles``' script) meets the
    signal handling of a plain ``python`` process, not :func:`signals_raise`'s: SIGTERM and SIGHUP
    get back the disposition the process was started with (their default action, which ends the
    process with exit 143 / 129, or ignored), and so do the children it forks; SIGINT raises a
    plain ``KeyboardInterrupt``, as Python's own handler does; ``sys.unraisablehook`` is the one
    that was there before. A signal here is not recorded for :func:`raise_if_interrupted`: what the
    code does with it is its own (a loop that catches Ctrl-C goes on, as under python).

    Yields a test, ``came_from_sigint(exc)``: whether a ``KeyboardInterrupt`` that escaped the
    code was raised by a SIGINT here (perhaps re-raised, or chained) rather than by the code
    itself. SIGINT keeps a handler of ours for that: ``signal.getsignal(SIGINT)`` is the one thing
    that differs from python's (``signal.default_int_handler``).

    Without :func:`signals_raise` active (or off the main thread) nothing changes: every
    ``KeyboardInterrupt`` then counts as a signal, as :func:`from_signal` says.
    """
    import sys
    import threading

    if _signals.handler is None or threading.current_thread() is not threading.main_thread():
        yield lambda exc: True
        return
    raised: list[BaseException] = []

    def interrupt(signum: int, frame: object) -> None:
        exc = KeyboardInterrupt()
        raised.append(exc)
        raise exc

    def came_from_sigint(exc: BaseException) -> bool:
        seen: BaseException | None = exc
        for _ in range(100):  # a chain can loop
            if seen is None:
                return False
            if any(seen is r for r in raised):
                return True
            seen = seen.__context__ or seen.__cause__
        return False

    ours, swapped = _signals.handler, []
    for sig, given in _signals.given.items():
        if signal.getsignal(sig) is ours:
            # (None: a handler not set from Python, which getsignal cannot name: the default's)
            signal.signal(sig, interrupt if sig == signal.SIGINT else given if given is not None else signal.SIG_DFL)
            swapped.append(sig)
    our_hook = sys.unraisablehook
    if _signals.given_hook is not None:
        sys.unraisablehook = _signals.given_hook
    try:
        yield came_from_sigint
    finally:
        for sig in swapped:
            signal.signal(sig, ours)
        sys.unraisablehook = our_hook


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """While active, a handled signal is recorded, not raised, and is raised when the block ends
    (:func:`raise_if_interrupted`): around imports of C extensions (torch's), where an exception
    raised inside a C++ call of Python code ends the process (``std::terminate``, exit 134)."""
    _signals.deferred += 1
    try:
        yield
    finally:
        _signals.deferred -= 1
    raise_if_interrupted()


def signal_arrived() -> int | None:
    """The first handled signal that arrived while :func:`signals_raise` is active, if any."""
    return _signals.arrived[0] if _signals.arrived else None


def from_signal(exc: KeyboardInterrupt) -> bool:
    """Whether ``exc`` stands for a signal, rather than being raised by code (``raise
    KeyboardInterrupt`` in a model factory or a script): an :class:`Interrupted`, or any
    ``KeyboardInterrupt`` once a handled signal has arrived. Without either, it is told apart only
    while :func:`signals_raise`'s handler (which records every SIGINT) or ``SIG_IGN`` is SIGINT's:
    under another handler (Python's default, one user code installed) a Ctrl-C raises it unrecorded,
    so it counts as a signal."""
    if isinstance(exc, Interrupted) or _signals.arrived or _signals.handler is None:
        return True
    return signal.getsignal(signal.SIGINT) not in (_signals.handler, signal.SIG_IGN)


def raise_if_interrupted() -> None:
    """Raise :class:`Interrupted` if a handled signal arrived while :func:`signals_raise` is active,
    even one whose exception something caught and dropped: call it at safe points (after imports,
    before committing an output)."""
    signum = signal_arrived()
    if signum is not None:
        raise Interrupted(signum)


def on_signal_instead(action: Callable[[int], None] | None) -> None:
    """From now until :func:`signals_raise` ends, a handled signal calls ``action(signum)`` instead
    of raising :class:`Interrupted` (where raising can no longer unwind anything, e.g. once a command
    has ended and the process is exiting: ``action`` should end the process itself)."""
    _signals.instead = action


@contextlib.contextmanager
def signals_blocked() -> Iterator[None]:
    """Hold back the handled signals for a few system calls (they are delivered afterwards)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def pending_signal() -> int | None:
    if not hasattr(signal, "sigpending"):
        return None
    pending = signal.sigpending() & set(HANDLED_SIGNALS)
    return min(pending) if pending else None


def python_exit_steps() -> None:
    """Python's own exit, step for step, run now: threading's exit hooks (concurrent.futures tells
    its idle executor workers, such as inductor leaves, to stop), every non-daemon thread joined,
    then the ``atexit`` functions (in reverse order of registration; an exception in one printed
    and the next run, by the function Python calls). Python's own exit then finds nothing left to
    do. The CLI ends its process so (a handled signal said until the very end), and runs them for
    ``paramfold recompiles``' script before its report (what its threads compile is counted)."""
    import atexit
    import threading

    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
