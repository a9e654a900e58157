"""Output files that appear whole or not at all, signals that unwind instead of killing, and a
stdout closed early (``| head``) that drops what is printed instead of failing the command.

Every file paramfold writes (folded checkpoints, bench plots) goes through :func:`atomic_output`:
the data goes to a hidden temporary file beside the target, which is flushed, fsynced, given
the permissions a plain ``open(path, "w")`` would give (the target's mode when it exists, else
``0o666`` less the umask) and renamed over the target only when complete. On any error, and on
SIGINT, SIGTERM or SIGHUP while :func:`signals_raise` is active (the CLI activates it), the
temporary file is removed and a pre-existing target is left byte-identical.

This module imports nothing heavy (no torch), so the CLI can validate an output path before it
imports anything else.

Example::

    >>> import os, tempfile
    >>> target = os.path.join(tempfile.mkdtemp(), "out.txt")
    >>> with atomic_output(target) as f:
    ...     _ = f.write(b"complete")
    >>> open(target, "rb").read(), os.listdir(os.path.dirname(target))
    (b'complete', ['out.txt'])
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import signal
import stat
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO

from paramfold.errors import FoldError

__all__ = [
    "Interrupted", "OutputError", "atomic_output", "check_output", "describe_os_error", "on_signal_instead",
    "given_stdout", "raise_if_interrupted", "signal_arrived", "signals_raise", "stdout_quiet_when_closed",
    "stdout_to_stderr",
]

# The signals the CLI turns into an exception, so that cleanup runs; exit code 128 + number.
HANDLED_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)


class OutputError(FoldError):
    """An output path cannot be written as asked. ``exit_code`` 2: fix the command line."""

    def __init__(self, message: str, *, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


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

    def handler(signum: int, frame: object) -> None:
        _signals.arrived.append(signum)
        if _signals.instead is not None:
            _signals.instead(signum)
        raise Interrupted(signum)

    saved = (_signals.arrived, _signals.instead)
    _signals.arrived, _signals.instead = [], None
    old = {}
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
        _signals.arrived, _signals.instead = saved


def signal_arrived() -> int | None:
    """The first handled signal that arrived while :func:`signals_raise` is active, if any."""
    return _signals.arrived[0] if _signals.arrived else None


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
def _signals_blocked() -> Iterator[None]:
    """Hold back the handled signals for a few system calls (they are delivered afterwards)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _pending_signal() -> int | None:
    if not hasattr(signal, "sigpending"):
        return None
    pending = signal.sigpending() & set(HANDLED_SIGNALS)
    return min(pending) if pending else None


def check_output(
    path: str | os.PathLike[str],
    *,
    suffixes: Iterable[str] | None = None,
    inputs: Iterable[str | os.PathLike[str]] = (),
) -> Path:
    """Refuse, before any work, an output path that cannot be written or would overwrite an input.

    ``suffixes`` (lower case, e.g. ``(".safetensors", ".pt")``) are the accepted file endings;
    ``inputs`` are the files the command reads (output over an input is refused: the input would
    be lost if anything went wrong, and it is still being read). Raises :class:`OutputError`.

    Example::

        >>> import tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> check_output(os.path.join(d, "x.gguf"), suffixes=(".pt",))
        Traceback (most recent call last):
        ...
        paramfold.output.OutputError: ...x.gguf: unsupported output format '.gguf': use .pt
    """
    if not str(path).strip():  # Path("") is the current folder
        raise OutputError("no output path given (an empty string)")
    out = Path(path)
    if str(path).endswith(("/", os.sep)):  # Path() drops the slash: "out.pt/" would be written as a file
        raise OutputError(f"{path}: names a folder (it ends with a slash); give a file name" + (
            f" ending in {_alternatives(tuple(suffixes))}" if suffixes is not None else ""))
    if suffixes is not None:
        suffixes = tuple(suffixes)
        if not out.name.lower().endswith(suffixes):
            raise OutputError(
                f"{out}: unsupported output format '{out.suffix or out.name}': use {_alternatives(suffixes)}"
            )
    dest = destination(out)
    parent = dest.parent if str(dest.parent) else Path(".")
    try:
        mode = os.stat(out).st_mode  # through links: the file the rename would replace
    except (FileNotFoundError, NotADirectoryError):  # the folder checks below say which
        mode = None
    except OSError as e:  # a name too long, a loop of links
        raise OutputError(f"{out}: cannot be used as an output path: {e.strerror}") from None
    if out.is_dir():
        raise OutputError(f"{out}: is a folder; give a file name" + (
            f" ending in {_alternatives(suffixes)}" if suffixes else ""))
    if mode is not None and not stat.S_ISREG(mode):
        # open() would write into a FIFO or a device; the rename would replace the node itself.
        where = f"{out}: links to {dest}, which" if dest != out else f"{out}:"
        raise OutputError(
            f"{where} is not a regular file (a FIFO, a device or a socket): refusing to replace it; "
            "give the name of a regular file"
        )
    if not parent.is_dir():
        raise OutputError(f"{out}: the output folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{out}: cannot write in {parent}: permission denied")
    if out.exists() and not os.access(out, os.W_OK):  # as open() for writing would refuse it
        raise OutputError(f"{out}: is read-only: make it writable (chmod u+w) or write to another file name")
    for src in inputs:
        src = Path(src)
        if _same_file(out, src):
            raise OutputError(
                f"{out}: is the input {src}; refusing to overwrite it (the original would be "
                "lost): write to another file name, then rename it yourself"
            )
    return out


def destination(out: Path) -> Path:
    """Where writing ``out`` puts the bytes: the file a symbolic link points to (resolved from the
    link's folder, through further links), as ``open()``, ``torch.save`` and safetensors' writers
    follow it; ``out`` itself otherwise. The link is kept."""
    try:
        return Path(os.path.realpath(out)) if out.is_symlink() else out
    except OSError:  # a name too long, say: check_output says why in one line
        return out


def _alternatives(items: tuple[str, ...]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _new_file_mode(target: Path) -> int:
    """The mode ``open(target, "w")`` would leave: the existing file's, else 0o666 less the umask."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        pass
    umask = _umask()
    return 0o666 & ~umask


def _umask() -> int:
    try:  # Linux: read it without changing it (os.umask has no getter, and is process-wide)
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike[str]) -> Iterator[IO[bytes]]:
    """A binary file that replaces ``path`` (a link's target: :func:`destination`) only if the block
    completes; nothing is left otherwise.

    Checks ``path`` with :func:`check_output` first (without suffix or input checks). The
    temporary file is ``.<name>.<random>.partial`` in the same folder (so the rename is atomic).
    A handled signal that arrives while the file is being committed is delivered after the
    rename if the rename already happened, else the file is discarded; so is the file after a
    handled signal whose :class:`Interrupted` was caught and dropped (:func:`signals_raise`).
    """
    raise_if_interrupted()  # no output is begun after a signal, even one whose exception was dropped
    out = check_output(path)
    dest = destination(out)  # the temporary file goes beside it, so that the rename is atomic
    parent = dest.parent if str(dest.parent) else Path(".")
    mode = _new_file_mode(dest)
    try:
        fd, tmp_name = tempfile.mkstemp(dir=parent, prefix=_temporary_prefix(out.name, parent), suffix=".partial")
        os.close(fd)
    except OSError as e:
        raise OutputError(f"{out}: cannot create a file in {parent}: {e.strerror}", exit_code=1) from None
    tmp = Path(tmp_name)
    try:
        with open(tmp, "wb") as f:  # f.name is the temporary path: a writer may close f, use it
            yield f
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)  # the data is on disk before the rename makes it the output
        finally:
            os.close(fd)
        os.chmod(tmp, mode)
        with _signals_blocked():
            pending = _pending_signal() or signal_arrived()  # also one whose exception was dropped
            if pending is None:
                os.replace(tmp, dest)
        if pending is not None:  # unblocking delivered it already; this is the fallback
            raise Interrupted(pending)
    except OSError as e:
        with _signals_blocked():
            tmp.unlink(missing_ok=True)
        if e.filename in (None, str(tmp)):  # name the output, not the temporary file (gone now)
            hint = ": free some space or write the output elsewhere" if e.errno in _FULL else ""
            raise OutputError(f"{out}: cannot write: {e.strerror or e}{hint}; nothing was written", exit_code=1) from None
        raise
    except BaseException:
        with _signals_blocked():
            tmp.unlink(missing_ok=True)
        raise


def _temporary_prefix(name: str, parent: Path) -> str:
    """``.<name>.``, with ``name`` shortened where the whole temporary name would exceed the
    folder's limit on a name's bytes (an output named near that limit is a valid output)."""
    try:
        name_max = os.pathconf(parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    room = name_max - len("..") - 8 - len(".partial")  # 8: the length of mkstemp's random part
    while name and len(os.fsencode(name)) > room:
        name = name[:-1]
    return f".{name}."


_FULL = {getattr(errno, n) for n in ("ENOSPC", "EDQUOT", "EFBIG") if hasattr(errno, n)}


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
    ``sys.__stdout__``), so that stdout holds a JSON document alone. Where descriptor 1 cannot be
    duplicated (closed), Python's only."""
    try:
        sys.stdout.flush()
        if sys.__stdout__ is not None:
            sys.__stdout__.flush()
        saved = os.dup(1)
        os.dup2(2, 1)
    except (OSError, ValueError):
        saved = None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if saved is not None:
            for stream in (sys.__stdout__, sys.stderr):
                with contextlib.suppress(OSError, ValueError, AttributeError):
                    stream.flush()  # buffered writes made meanwhile belong to stderr
            os.dup2(saved, 1)
            os.close(saved)


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


def describe_os_error(e: OSError) -> str:
    """One line for an ``OSError``: the file, what went wrong, and for a full disk what to do."""
    where = f"{e.filename}: " if e.filename else ""
    what = e.strerror or str(e) or type(e).__name__
    if e.errno == errno.ENOSPC:
        return f"{where}{what}: free some space or write the output elsewhere; nothing was written"
    return f"{where}{what}"
