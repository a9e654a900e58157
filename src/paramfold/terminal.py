"""What the CLI prints, made safe for a terminal and for a reader that goes away: control
characters shown as escapes (:func:`printable`), and a stdout closed early (``| head``) that drops
what is printed instead of failing the command (:func:`stdout_quiet_when_closed`,
:func:`quiet_when_stdout_closes`); user code's prints kept off a stdout that holds a JSON document
(:func:`stdout_to_stderr`).

This module imports nothing heavy (no torch).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Iterator
from typing import IO

__all__ = ["given_stdout", "printable", "quiet_when_stdout_closes", "stdout_quiet_when_closed", "stdout_to_stderr"]


def printable(text: str) -> str:
    """``text`` with its control characters written out as escapes (``\\x1b``): a checkpoint's
    key or path may hold a terminal escape sequence, which must be shown, not sent."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


class _QuietWhenClosed(io.RawIOBase):
    """File descriptor ``fd`` for writing, where a reader that has gone (``EPIPE``) points ``fd`` at
    ``os.devnull`` and the write counts as done: what is left to print is dropped, nothing raises."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self._fd = fd

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        return os.isatty(self._fd)

    def write(self, data: bytes) -> int:  # type: ignore[override]
        try:
            return os.write(self._fd, data)
        except BrokenPipeError:
            _discard(self._fd)
            return len(memoryview(data))


def _discard(fd: int) -> None:
    """Point ``fd`` at ``os.devnull``: later writes to it, and Python's flush at exit, succeed."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)


def _flush_quietly(stream: IO[str]) -> None:
    """Flush ``stream``; where its reader has gone, drop what it holds (see :class:`_QuietWhenClosed`)."""
    for _ in range(2):
        try:
            stream.flush()
            return
        except BrokenPipeError:
            _discard(stream.fileno())  # the buffer keeps the bytes; the second flush sends them nowhere
        except (AttributeError, OSError, ValueError):  # closed, or failing otherwise: for its writer to say
            return


_given_stdout: list[IO[str]] = []


@contextlib.contextmanager
def stdout_quiet_when_closed() -> Iterator[None]:
    """While active, a stdout whose reader has gone (``paramfold audit big.pt | head``) drops what is
    printed instead of raising: the command runs to its end, writes its output whole and exits with
    its own code. (The stream ``sys.stdout`` was is put back at the end; it is flushed first, so
    that nothing printed before comes after.) A stdout without a file descriptor (a test's) is left
    as it is."""
    given = sys.stdout
    try:
        fd = given.fileno()
    except (AttributeError, OSError, ValueError):
        yield
        return
    _flush_quietly(given)
    sys.stdout = io.TextIOWrapper(
        io.BufferedWriter(_QuietWhenClosed(fd)), encoding=given.encoding, errors=given.errors,
        line_buffering=given.line_buffering,
    )
    _given_stdout.append(given)
    try:
        yield
    finally:
        _given_stdout.pop()
        _flush_quietly(sys.stdout)
        sys.stdout = given


@contextlib.contextmanager
def given_stdout() -> Iterator[None]:
    """Inside :func:`stdout_quiet_when_closed`, the stream ``sys.stdout`` was before it, for code that
    must meet a closed stdout as ``python`` would (``paramfold recompiles``' script, whose
    ``BrokenPipeError`` is its own)."""
    if not _given_stdout:
        yield
        return
    quiet = sys.stdout
    _flush_quietly(quiet)
    sys.stdout = _given_stdout[-1]
    try:
        yield
    finally:
        _flush_quietly(sys.stdout)  # what the script left buffered comes before what follows it
        sys.stdout = quiet


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """While active, send what user code (``recompiles``' script, ``--model``'s factory) writes to
    stdout to stderr: ``sys.stdout``, and file descriptor 1 too (child processes, ``os.system``,
    ``sys.__stdout__``), so that stdout holds a JSON document alone. A stdout closed from the start
    (``>&-``: ``sys.stdout`` is ``None``) is no failure: descriptor 1, where closed, is pointed at
    stderr meanwhile and closed again after, so that no file opened in the block lands on it and
    takes a child's output; where it is open but not stdout (a file opened since), it is left alone."""
    for stream in (sys.stdout, sys.__stdout__):
        with contextlib.suppress(AttributeError, OSError, ValueError):  # None, closed or failing
            stream.flush()
    saved: int | None = None
    taken = False  # descriptor 1 was closed and is stderr's meanwhile
    try:
        if sys.__stdout__ is not None:
            saved = os.dup(1)
            os.dup2(2, 1)
        elif not _is_open(1):
            os.dup2(2, 1)
            taken = True
    except OSError:  # descriptor 1 closed since the start, or 2 closed: Python's stdout only
        if saved is not None:
            os.close(saved)
            saved = None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if saved is not None or taken:
            for stream in (sys.__stdout__, sys.stderr):
                with contextlib.suppress(OSError, ValueError, AttributeError):
                    stream.flush()  # buffered writes made meanwhile belong to stderr
            if saved is not None:
                os.dup2(saved, 1)
                os.close(saved)
            else:
                os.close(1)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def quiet_when_stdout_closes(console: object) -> object:
    """``console`` (a ``rich.console.Console`` on stdout), made to end the command quietly when
    stdout closes early (``| head``): rich's own handler exits with ``SystemExit(1)``, which the
    CLI would report as an error. Here stdout is pointed at ``os.devnull`` (nothing left to flush
    at exit) and a ``BrokenPipeError`` ends the command, as a closed stdout does elsewhere."""

    def on_broken_pipe() -> None:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise BrokenPipeError

    console.on_broken_pipe = on_broken_pipe  # type: ignore[attr-defined]
    return console


def stdout_console(piped_width: int) -> object:
    """A ``rich.console.Console`` on stdout (:func:`quiet_when_stdout_closes`), ``piped_width``
    columns wide where stdout is a file or a pipe (colours forced or not) and ``COLUMNS`` sets no
    width (unset, or not a positive number, which rich ignores): rich's 80 there would squeeze a
    table and split module paths and file names in a CI log, where a grep for them then finds
    nothing."""
    from rich.console import Console

    columns = os.environ.get("COLUMNS", "")
    if (columns.isdigit() and int(columns) > 0) or _stdout_is_tty():
        return quiet_when_stdout_closes(Console())
    return quiet_when_stdout_closes(Console(width=piped_width))


def _stdout_is_tty() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):  # replaced, or closed
        return False
